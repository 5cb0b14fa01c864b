"""The matrix of monitor configs that every overhead benchmark measures (PyTorch,
MindSpore), kept in one place so that their tables stay comparable."""

from typing import Dict


def configs(n_layer: int) -> Dict[str, dict]:
    two = [f"blocks.{n_layer // 2 - 1}.", f"blocks.{n_layer // 2}."] if n_layer > 1 else ["blocks.0."]
    every = {"enabled": True, "targets": []}
    all_on = {
        "module": every,
        "weight_grad": {"enabled": True, "monitor_mbs_grad": False},
        "optimizer": {"enabled": True},
        "param": {"enabled": True},
    }
    return {
        "weight_grad": {"monitors": {"weight_grad": {"enabled": True}}},
        "optimizer": {"monitors": {"optimizer": {"enabled": True}}},
        "param": {"monitors": {"param": {"enabled": True}}},
        "module (2 layers)": {"monitors": {"module": {"enabled": True, "targets": two}}},
        "module (every module)": {"monitors": {"module": every}},
        "all monitors": {"monitors": all_on},
        "all, step outside window": {"start_step": 10 ** 9, "monitors": all_on},
        "all, step_interval 4": {"step_interval": 4, "monitors": all_on},
    }
