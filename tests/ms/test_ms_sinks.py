"""Live sinks with the MindSpore back end (PyNative, CPU): the TensorBoard and MLflow sinks
get, at each step, the global gradient norm that NumPy computes from the gradients the
training passed to the optimizer; training is unchanged."""

import math
from collections import defaultdict

import numpy as np
import pytest

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")
require("tensorboard", "the MindSpore sink tests read back the TensorBoard sink's event files")
require("mlflow", "the MindSpore sink tests read back the MLflow sink's runs")

from support.ms_helpers import MLP, batches, grads_np, ms, mse, nn, weights_of  # noqa: E402

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

STEPS = 3


def train(out, sinks=None):
    net = MLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
    mon = None
    if sinks is not None:
        mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"weight_grad": {"enabled": True}},
                                "sinks": sinks}, fr="mindspore")
        mon.start(model=net, optimizer=opt)
    passed = []
    for x, y in batches(STEPS):
        _, g = grad_fn(ms.Tensor(x), ms.Tensor(y))
        passed.append(grads_np(g))
        opt(g)
    if mon is not None:
        mon.stop()
    return passed, weights_of(net)


def test_ms_sinks_get_the_global_norm_of_the_gradients(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = tmp_path / "out"
    uri = (out / "mlruns").as_uri()
    passed, weights = train(out, {"tensorboard": True, "mlflow": {"tracking_uri": uri}, "top_k": 1})
    want = [math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads)) for grads in passed]

    ea = EventAccumulator(str(out / "tensorboard" / "rank_0"), size_guidance={"tensors": 0})
    ea.Reload()
    tb = {ev.step: float(tensor_util.make_ndarray(ev.tensor_proto))
          for ev in ea.Tensors("weight_grad/reduced/global_norm")}
    assert sorted(tb) == list(range(STEPS))
    assert [tb[s] for s in range(STEPS)] == pytest.approx(want, rel=1e-5)

    client = MlflowClient(tracking_uri=uri)
    (exp,) = [e for e in client.search_experiments() if e.name == "msprobe-monitor"]
    (run,) = client.search_runs([exp.experiment_id])
    hist = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "weight_grad/reduced/global_norm")}
    assert [hist[s] for s in range(STEPS)] == pytest.approx(want, rel=1e-5)
    # top_k 1: the largest gradient, by NumPy, is the one sent
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    per_step = defaultdict(set)
    for t in ea.Tags()["tensors"]:
        if t.startswith("weight_grad/reduced/") and t.endswith("/norm"):
            for ev in ea.Tensors(t):
                per_step[ev.step].add(t)
    for s in range(STEPS):
        largest = names[int(np.argmax([np.linalg.norm(g.astype(np.float64)) for g in passed[s]]))]
        assert per_step[s] == {f"weight_grad/reduced/{largest}/norm"}

    _, plain = train(tmp_path / "none")
    assert all(np.array_equal(weights[k], plain[k]) for k in plain)
