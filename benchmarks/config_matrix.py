"""The matrix of monitor configs that every overhead benchmark measures (PyTorch,
MindSpore), kept in one place so that their tables stay comparable."""

from typing import Dict


def configs(n_layer: int, sinks: bool = False, incident: bool = False) -> Dict[str, dict]:
    """``sinks``: also the live-sink configs (the PyTorch benchmark; they need tensorboard,
    wandb and mlflow, run offline: see benchmarks/overhead.py). ``incident``: also
    ``weight_grad`` with each incident-mode field, against plain ``weight_grad`` (a config
    with ``dynamic`` must be a file: the benchmark writes it)."""
    two = [f"blocks.{n_layer // 2 - 1}.", f"blocks.{n_layer // 2}."] if n_layer > 1 else ["blocks.0."]
    every = {"enabled": True, "targets": []}
    all_on = {
        "module": every,
        "weight_grad": {"enabled": True, "monitor_mbs_grad": False},
        "optimizer": {"enabled": True},
        "param": {"enabled": True},
    }
    matrix = {
        "weight_grad": {"monitors": {"weight_grad": {"enabled": True}}},
        "optimizer": {"monitors": {"optimizer": {"enabled": True}}},
        "param": {"monitors": {"param": {"enabled": True}}},
        "module (2 layers)": {"monitors": {"module": {"enabled": True, "targets": two}}},
        "module (every module)": {"monitors": {"module": every}},
        "all monitors": {"monitors": all_on},
        "all, step outside window": {"start_step": 10 ** 9, "monitors": all_on},
        "all, step_interval 4": {"step_interval": 4, "monitors": all_on},
    }
    if incident:
        wg = {"weight_grad": {"enabled": True}}
        matrix["weight_grad + dynamic"] = {"dynamic": True, "monitors": wg}
        matrix["weight_grad + on_anomaly"] = {"monitors": wg, "alert": {"on_anomaly": {
            "steps": 5, "monitors": {"module": {"targets": "auto"}}}}}
        matrix["weight_grad + alert"] = {"monitors": wg, "alert": True}
        matrix["weight_grad + dump"] = {"monitors": wg, "alert": {"dump": True}}
    if sinks:
        # against "all monitors": the cost of the dashboards on top of the CSV writer
        matrix["all + tensorboard sink"] = {"monitors": all_on, "sinks": {"tensorboard": True}}
        matrix["all + wandb sink"] = {"monitors": all_on, "sinks": {"wandb": {"mode": "offline"}}}
        matrix["all + mlflow sink"] = {"monitors": all_on, "sinks": {"mlflow": True}}
        matrix["all + tensorboard, wandb, mlflow sinks"] = {
            "monitors": all_on, "sinks": {"tensorboard": True, "wandb": {"mode": "offline"}, "mlflow": True}}
    return matrix
