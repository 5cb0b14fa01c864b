"""MindSpore: ``log_scalars`` with the loss as a MindSpore 0-d tensor and the gradient norm
as a Python float (computed with NumPy from the gradients), checked against those values;
a NaN tensor; ``layout.json``'s ``dtypes`` for the parameters and the module rows."""

import json
import math

import numpy as np

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")

from support import rows_of  # noqa: E402
from support.ms_helpers import MLP, batches, grads_np, ms, mse, nn  # noqa: E402

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402


def test_log_scalars_and_dtypes(tmp_path):
    net = MLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "step_interval": 2,
                            "monitors": {"weight_grad": {"enabled": True}, "module": {"enabled": True}}},
                           fr="mindspore")
    mon.start(model=net, optimizer=opt)
    losses, norms = [], []
    for step, (x, y) in enumerate(batches(4)):
        loss, g = grad_fn(ms.Tensor(x), ms.Tensor(y))
        norm = math.sqrt(sum(float(np.sum(a.astype(np.float64) ** 2)) for a in grads_np(g)))
        losses.append(float(loss.asnumpy()))
        norms.append(norm)
        opt(g)  # the patched optimizer ends the step: the values are logged for the step just ended
        mon.log_scalars(step, loss=loss, grad_norm=norm)
        if step == 2:
            mon.log_scalars(step, {"bad": ms.Tensor(np.float32("nan"))})
    mon.stop()

    rows = rows_of(out, "scalars")
    assert [(r["step"], r["module_name"], r["scope"]) for r in rows] == [
        ("0", "loss", "scalars"), ("0", "grad_norm", "scalars"),
        ("2", "loss", "scalars"), ("2", "grad_norm", "scalars"), ("2", "bad", "scalars")]
    for r in rows:
        if r["module_name"] == "bad":
            assert [r[op] for op in ("min", "max", "mean", "norm", "nans")] == ["nan"] * 4 + ["1"]
            continue
        step = int(r["step"])
        if r["module_name"] == "loss":  # an fp32 tensor: its value exactly
            expected = losses[step]
            assert [np.float32(r[op]) for op in ("min", "max", "mean", "norm")] == [np.float32(expected)] * 3 + [
                np.float32(abs(expected))]
        else:
            expected = norms[step]
            for op in ("min", "max", "mean", "norm"):
                assert math.isclose(float(r[op]), expected, rel_tol=1e-8), (r, expected)
        assert r["nans"] == "0"

    dtypes = json.loads((out / "rank_0" / "layout.json").read_text())["dtypes"]
    params = {p.name for p in net.trainable_params()}
    assert {n: dtypes[n] for n in params} == {n: "float32" for n in params}
    module_rows = {r["module_name"] for r in rows_of(out, "module")}
    assert module_rows and module_rows <= set(dtypes)
    assert {dtypes[n] for n in module_rows} == {"float32"}
