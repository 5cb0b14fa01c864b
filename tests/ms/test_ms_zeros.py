"""MindSpore: the optional ``zeros`` statistic (elements exactly equal to zero) on the
three paths of the engine (host memory read by the C kernel, host memory read by NumPy,
MindSpore primitives on the device), against ``np.count_nonzero(a == 0)`` on copies;
then end to end on a ReLU network against an unmonitored twin."""

import pytest

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")

from support import rows_of  # noqa: E402
from support.ms_helpers import MLP, batches, ms, mse, nn, np, set_weights  # noqa: E402

from msprobe.core.monitor_v2 import native  # noqa: E402
from msprobe.core.monitor_v2.frameworks.mindspore.stats import MsStatsEngine  # noqa: E402
from msprobe.core.monitor_v2.stats import StatPlan, merge_records  # noqa: E402
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

SIX = StatPlan.from_ops(["min", "max", "mean", "norm", "nans", "zeros"])
FIVE = StatPlan.from_ops(["min", "max", "mean", "norm", "nans"])


def with_zeros(shape, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape)
    a[np.abs(a) < 0.43] = 0.0
    a[(a == 0) & (rng.random(shape) < 0.5)] = -0.0
    return a


def cases():
    big = with_zeros((257, 129)).astype(np.float32)  # crosses the kernel's blocks, odd tail
    special = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-3, -0.0, 2.0] * 50, np.float32)
    eighths = (np.arange(-40, 40, dtype=np.float32) / 8.0).reshape(8, 10)  # exact in bf16/fp16, one 0
    ints = np.arange(-7, 9, dtype=np.int32) % 3 - 1
    return {
        "fp32": (ms.Tensor(big), big),
        "fp32 NaN Inf -0": (ms.Tensor(special), special),
        "fp32 transposed view": (ms.Tensor(big).transpose(1, 0), big.T),
        "bf16": (ms.Tensor(eighths).astype(ms.bfloat16), eighths),
        "fp16": (ms.Tensor(eighths).astype(ms.float16), eighths),
        "fp64": (ms.Tensor(with_zeros((33, 7), 1)), with_zeros((33, 7), 1)),
        "int32": (ms.Tensor(ints), ints),
        "bool": (ms.Tensor(big > 0), big > 0),
        "empty": (ms.Tensor(np.zeros((0, 3), np.float32)), np.zeros((0, 3), np.float32)),
    }


PATHS = {"host, kernel": dict(read_host=True), "host, NumPy": dict(read_host=True, use_native=False),
         "device primitives": dict(read_host=False)}


@pytest.mark.parametrize("path", list(PATHS))
def test_zeros_on_every_engine_path_match_numpy(path):
    engine = MsStatsEngine(**PATHS[path])
    if path == "host, kernel":
        if native.load() is None:
            pytest.fail("the one-pass kernel did not build: is a C compiler (gcc) installed?")
        assert engine._native is not None
    data = cases()
    records = [engine.record(t, SIX, 0, name, "s") for name, (t, _) in data.items()]
    without = [engine.record(t, FIVE, 0, name, "s") for name, (t, _) in data.items()]
    if path.startswith("host"):
        assert all(isinstance(r.zeros, int) for r in records)
    else:
        assert all(isinstance(r.zeros, ms.Tensor) for r in records if r.numel)
    assert all(r.zeros is None for r in without)
    engine.to_host(records + without)
    rows = {row.name: row.stat for row in merge_records(0, records)}
    rows5 = {row.name: row.stat for row in merge_records(0, without)}
    for name, (_, ref) in data.items():
        want = int(np.count_nonzero(ref.copy() == 0))
        assert rows[name].value("zeros") == want, (name, rows[name].value("zeros"), want)
        for op in ("min", "max", "mean", "norm", "nans"):
            a, b = rows[name].value(op), rows5[name].value(op)
            assert a == b or (np.isnan(a) and np.isnan(b)), (name, op)
    assert rows["fp32 NaN Inf -0"].value("zeros") == 150 and rows["fp32 NaN Inf -0"].value("nans") == 50


def test_csv_zeros_column_on_a_relu_network(tmp_path):
    net, ref = MLP(seed=4, d_hidden=32), MLP(seed=4, d_hidden=32)
    weights = {n: p.asnumpy().copy() for n, p in net.parameters_and_names()}
    weights["fc1.weight"][::3] = 0.0  # exact zeros in a parameter
    weights["fc2.bias"][1] = -0.0
    set_weights(net, weights)
    set_weights(ref, weights)
    opt = nn.SGD(net.trainable_params(), learning_rate=0.01)
    grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {
        "module": {"targets": ["act"], "ops": ["zeros", "mean"]},
        "param": {"enabled": True, "ops": ["zeros"]}}}, fr="ms")
    mon.start(model=net, optimizer=opt)
    (x, y), = batches(1)
    _, g = grad_fn(ms.Tensor(x), ms.Tensor(y))
    opt(g)
    mon.stop()
    hidden = ref.act(ref.fc1(ms.Tensor(x))).asnumpy().copy()
    rows = {(r["module_name"], r["scope"]): r for r in rows_of(out, "module")}
    assert list(rows_of(out, "module")[0])[-2:] == ["mean", "zeros"]
    assert int(rows[("act.output.0", "forward")]["zeros"]) == np.count_nonzero(hidden == 0) > 0
    params = {r["module_name"]: r for r in rows_of(out, "param") if r["scope"] == "param_origin"}
    assert set(params) == set(weights)
    for name, a in weights.items():
        assert int(params[name]["zeros"]) == np.count_nonzero(a == 0), name
    assert int(params["fc1.weight"]["zeros"]) >= 11 * 4
