"""The two paths of the MindSpore statistics engine and the hooks that exist only on
written steps.

On the CPU the engine reads tensors in place (zero-copy ``asnumpy`` + the one-pass C
kernel, or NumPy in fp64 for other dtypes); on other devices it reduces with MindSpore
primitives (``aminmax``, ``sum``, sum of squares). Both must give NumPy's statistics
(fp64 on copies), NaN and Inf included. The module and weight_grad hooks are installed
only while a written step runs, and training stays bit-identical."""

import pytest

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")

from support import assert_row_matches, find_row, rows_of  # noqa: E402
from support.ms_helpers import MLP, batches, grads_np, ms, mse, nn, np, np_stats, weights_of  # noqa: E402

from msprobe.core.monitor_v2 import native  # noqa: E402
from msprobe.core.monitor_v2.frameworks.mindspore.stats import MsStatsEngine  # noqa: E402
from msprobe.core.monitor_v2.stats import StatPlan, merge_records  # noqa: E402
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

NAN, INF = float("nan"), float("inf")
ALL = StatPlan.from_ops(["min", "max", "mean", "norm", "nans"])


def cases():
    rng = np.random.default_rng(3)
    big = rng.standard_normal((257, 129)).astype(np.float32)  # crosses the kernel's blocks, odd tail
    with_nan = big.copy()
    with_nan[5, 7] = NAN
    with_inf = big[:3].copy()
    with_inf[0, 0], with_inf[1, 1] = INF, -INF
    eighths = (np.arange(-40, 40, dtype=np.float32) / 8.0).reshape(8, 10)  # exact in bf16 and fp16
    return {
        "fp32": (ms.Tensor(big), big),
        "fp32 NaN": (ms.Tensor(with_nan), with_nan),
        "fp32 +-Inf": (ms.Tensor(with_inf), with_inf),
        "fp32 transposed view": (ms.Tensor(big).transpose(1, 0), big.T),
        "bf16": (ms.Tensor(eighths).astype(ms.bfloat16), eighths),
        "fp16": (ms.Tensor(eighths).astype(ms.float16), eighths),
        "fp64": (ms.Tensor(big.astype(np.float64)), big.astype(np.float64)),
        "int32": (ms.Tensor(np.arange(-7, 9, dtype=np.int32)), np.arange(-7, 9)),
        "bool": (ms.Tensor(big > 0), (big > 0).astype(np.float64)),
    }


@pytest.mark.parametrize("read_host", [True, False], ids=["host, in place", "device primitives"])
def test_both_engine_paths_match_numpy(read_host):
    engine = MsStatsEngine(read_host=read_host)
    data = cases()
    records = [engine.record(t, ALL, 0, name, "s") for name, (t, _) in data.items()]
    if read_host:  # nothing left for the device: every vector is already a host list
        assert all(isinstance(r.vector, list) and isinstance(r.nans, int) for r in records)
    else:
        assert all(isinstance(r.vector, ms.Tensor) for r in records)
    engine.to_host(records)
    rows = {row.name: row.stat for row in merge_records(0, records)}
    for name, (_, ref) in data.items():
        want = np_stats(ref)
        got = {op: rows[name].value(op) for op in want}
        for op, value in want.items():
            if np.isnan(value):
                assert np.isnan(got[op]), (name, op, got)
            else:
                assert got[op] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, op, got)


def test_host_path_reads_the_tensor_in_place_and_uses_the_kernel():
    """The premise of the CPU path: ``asnumpy`` on the CPU is a view of the tensor's
    memory (no copy), so the kernel reads the training's own buffer."""
    t = ms.Tensor(np.zeros((4, 4), np.float32))
    view = t.asnumpy()
    assert view.ctypes.data == t.asnumpy().ctypes.data
    if native.load() is None:
        pytest.skip("no C compiler: the kernel cannot be built here (NumPy reads the view instead)")
    assert MsStatsEngine()._native is not None


def hook_counts(net, opt):
    cells = sum(len(getattr(c, attr, None) or ()) for _, c in net.cells_and_names()
                for attr in ("_lazy_forward_pre_hook", "_lazy_forward_hook", "_lazy_backward_hook"))
    params = sum(len(p.hooks()) for p in net.trainable_params())
    return cells, params


def test_hooks_exist_only_on_written_steps_and_rows_match(tmp_path):
    """step_interval 2: the module and weight_grad hooks are there during steps 0, 2, 4
    and gone during 1, 3; the written rows equal NumPy's statistics of the gradients a
    twin computes, and training is bit-identical to the twin's."""
    net, ref = MLP(), MLP()
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    ref_opt = nn.Adam(ref.trainable_params(), learning_rate=0.01)
    grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
    ref_grad_fn = ms.value_and_grad(mse(ref), None, ref_opt.parameters)
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "step_interval": 2, "monitors": {
        "module": {"enabled": True}, "weight_grad": {"enabled": True}}}, fr="ms")
    mon.start(model=net, optimizer=opt)
    passed, counts, outs = [], [], []
    for x, y in batches(5):
        counts.append(hook_counts(net, opt))
        out_np = ref(ms.Tensor(x)).asnumpy().astype(np.float64)
        outs.append((out_np, 2.0 * (out_np - y) / out_np.size))  # output, d mean((out - y)^2) / d out
        loss, g = grad_fn(ms.Tensor(x), ms.Tensor(y))
        ref_loss, ref_g = ref_grad_fn(ms.Tensor(x), ms.Tensor(y))
        assert loss.asnumpy().tobytes() == ref_loss.asnumpy().tobytes()
        passed.append(grads_np(ref_g))
        opt(g)
        ref_opt(ref_g)
    mon.stop()
    # MLP, fc1, act, fc2 (3 hooks each), 2 on the model that tell evaluation passes apart; 4 parameters
    n_hooks, n_params = 3 * 4 + 2, 4
    assert counts == [(n_hooks, n_params), (0, 0)] * 2 + [(n_hooks, n_params)]
    assert hook_counts(net, opt) == (0, 0)
    for name, a in weights_of(net).items():
        assert a.tobytes() == weights_of(ref)[name].tobytes(), name
    rows = rows_of(out, "weight_grad")
    assert sorted({int(r["step"]) for r in rows}) == [0, 2, 4]
    for s in (0, 2, 4):
        for i, name in enumerate(("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")):
            assert_row_matches(find_row(rows, step=s, module_name=name, scope="unreduced"), np_stats(passed[s][i]))
    module_rows = rows_of(out, "module")
    assert sorted({int(r["step"]) for r in module_rows}) == [0, 2, 4]
    for s in (0, 2, 4):  # hooks installed again after an unwritten step see the right tensors
        assert_row_matches(find_row(module_rows, step=s, module_name="MLP.output.0"), np_stats(outs[s][0]))
        assert_row_matches(find_row(module_rows, step=s, module_name="fc2.grad_output.0"), np_stats(outs[s][1]))
