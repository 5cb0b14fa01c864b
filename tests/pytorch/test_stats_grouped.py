"""``record_many`` reduces the tensors the one-pass kernel does not read (every tensor on
an accelerator; CPU tensors without a C compiler, fp64 and strided views with one) in
groups: small tensors of one device, dtype and shape are stacked and reduced along rows,
a few ATen calls per group instead of five or six per tensor.

Every value is checked against NumPy on a copy of the tensor; the number of ATen
reductions is counted with a dispatch mode (the calls torch itself sees), so a group that
falls apart into per-tensor calls fails here. On the CPU the same code runs as on a GPU,
with host values at the end instead of device tensors; the GPU case (no host sync) is in
test_gpu_no_sync.py.
"""

import copy
import math
from collections import Counter

import pytest
import torch

from support import assert_row_matches, find_row, numpy_stats, rows_of
from support.modes import SeenByTheEngine
from msprobe.core.monitor_v2 import native
from msprobe.core.monitor_v2 import stats as core_stats
from msprobe.core.monitor_v2.frameworks.pytorch import stats as torch_stats
from msprobe.core.monitor_v2.frameworks.pytorch.stats import TorchStatsEngine
from msprobe.core.monitor_v2.stats import StatPlan, merge_records
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

# numpy_stats on arrays holding inf and -inf warns about inf - inf; that NaN is expected.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

ALL_OPS = ("min", "max", "mean", "norm", "nans", "zeros")


class AtenCalls(SeenByTheEngine):
    """Counts the ATen operators run inside it, by name (``aminmax``, ``sum``...). The
    engine sets the training's modes aside (none of them sees its work:
    test_dispatch_modes.py); this one, which counts the engine's own calls, is let in by
    hiding the mode stacks' lengths from the engine's check while it is entered."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _layer_tensors(layers: int, seed: int = 0):
    """The parameters a stack of ``layers`` identical blocks would have: shapes repeat
    once per block, in several dtypes, with NaN, inf, zeros and a transposed view among
    them, plus tensors that are reduced alone (large, integer, empty, negative-bit, meta)."""
    g = torch.Generator().manual_seed(seed)
    tensors = []
    for i in range(layers):
        tensors.append(torch.randn(16, 16, generator=g) * (i + 1))
        tensors.append(torch.randn(16, generator=g).double() - 0.5)
        tensors.append((torch.randn(3, 5, generator=g) * 4).bfloat16())
        tensors.append(torch.randn(7, generator=g).half())
        tensors.append(torch.randn(6, 4, generator=g).t())  # not contiguous: stacks all the same
    tensors[0][3, 4] = math.nan
    tensors[5][0, 0] = math.inf
    tensors[5][1, 1] = -math.inf
    tensors[10][2] = math.nan
    tensors[10][3] = math.inf
    tensors[15][:4] = 0.0
    tensors[7][0, :] = 0.0
    tensors += [torch.randn(1 << 17, generator=g), torch.arange(-5, 9), torch.empty(0), torch._neg_view(tensors[1]),
                torch.empty(3, device="meta")]
    return tensors


def _stats_of(engine, tensors, ops=ALL_OPS):
    keys = [(0, f"t{i}", "param", None) for i in range(len(tensors))]
    records = engine.record_many(tensors, StatPlan.from_ops(ops), keys)
    engine.to_host(records)
    assert [r.key for r in records] == keys
    return [{op: row.stat.value(op) for op in ops} if (row := _row(rec)) else None for rec in records]


def _row(rec):
    rows = merge_records(0, [rec])
    return rows[0] if rows else None


def _want(t):
    t = t.resolve_neg()  # a copy of the values it stands for
    want = numpy_stats(t)
    want["zeros"] = int((t.detach().to(torch.float64).numpy() == 0).sum())
    return want


def _assert_close(got, want, what, rtol=1e-12):
    for op, w in want.items():
        if op not in got:
            continue
        g = got[op]
        if op in ("nans", "zeros"):
            assert g == w, f"{what} {op}: {g} != {w}"
        elif math.isnan(w):
            assert math.isnan(g), f"{what} {op}: {g} != nan"
        else:
            assert math.isclose(g, w, rel_tol=rtol, abs_tol=rtol), f"{what} {op}: {g} != {w}"


@pytest.fixture(params=["aten", "native"])
def engine(request, monkeypatch):
    """An engine without the C kernel (every tensor through ATen) and one with it (which
    still leaves fp64 tensors and strided views to ATen)."""
    if request.param == "aten":
        monkeypatch.setenv(native.ENV_SWITCH, "0")
        e = TorchStatsEngine()
        assert e._native is None
    else:
        monkeypatch.delenv(native.ENV_SWITCH, raising=False)
        assert native.load() is not None, "the one-pass kernel did not build: is a C compiler (gcc) installed?"
        e = TorchStatsEngine()
    return e


@pytest.mark.parametrize("ops", [ALL_OPS, ("min", "max"), ("norm", "nans"), ("mean", "zeros"), ("nans",)],
                         ids=lambda ops: "-".join(ops))
def test_grouped_statistics_equal_numpy(engine, ops):
    """The sums of a group are accumulated in fp64: each grouped tensor's statistics are
    NumPy's in fp64 to 1e-12, the counts exact, a NaN or an infinity only where it is (the
    tensors reduced alone or by the C kernel, whose fp32 partial sums are good to 1e-7,
    to 1e-6)."""
    tensors = _layer_tensors(12)
    before = [t.clone() for t in tensors[:-1]]
    got = _stats_of(engine, tensors, ops)
    for i, (t, g) in enumerate(zip(tensors[:-1], got)):
        grouped = i < 60 and (engine._native is None or t.dtype == torch.float64 or not t.is_contiguous())
        _assert_close(g, {op: v for op, v in _want(t).items() if op in ops}, f"tensor {i} {t.dtype} {tuple(t.shape)}",
                      rtol=1e-12 if grouped else 1e-6)
    assert got[-1] is None  # the meta tensor: no statistics, said once
    # the engine never modifies a monitored tensor: every value as it was, NaN where it was
    assert all(torch.allclose(a.double(), b.double(), rtol=0.0, atol=0.0, equal_nan=True)
               for a, b in zip(tensors[:-1], before))


def test_one_group_is_one_reduction_of_each_kind():
    """60 tensors in five shapes and dtypes, each shape repeated 12 times: five groups, so
    five ``aminmax`` and five norms, where the tensors one by one took one of each per
    tensor. The large, integer and negative-bit tensors take their own calls."""
    engine = TorchStatsEngine(use_native=False)
    tensors = _layer_tensors(12)[:60]
    plan = StatPlan.from_ops(("min", "max", "mean", "norm", "nans"))
    keys = [(0, f"t{i}", "param", None) for i in range(len(tensors))]
    with AtenCalls() as grouped:
        engine.record_many(tensors, plan, keys)
    with AtenCalls() as alone:
        for t, key in zip(tensors, keys):
            engine.record(t, plan, *key)
    assert grouped.calls["aminmax"] == 5, grouped.calls
    assert grouped.calls["linalg_vector_norm"] == 5, grouped.calls
    assert grouped.calls["stack"] <= 10, grouped.calls
    assert alone.calls["aminmax"] == 60, alone.calls
    assert sum(grouped.calls.values()) * 8 < sum(alone.calls.values()), (grouped.calls, alone.calls)


def test_a_group_larger_than_the_temporary_is_stacked_in_parts(monkeypatch):
    """The stacked temporary is bounded: a group of more elements than
    ``GROUP_ELEMENTS`` is reduced in parts, each tensor still once."""
    monkeypatch.setattr(core_stats, "GROUP_ELEMENTS", 16 * 16 * 5)  # five 16x16 tensors a part
    engine = TorchStatsEngine(use_native=False)
    g = torch.Generator().manual_seed(4)
    tensors = [torch.randn(16, 16, generator=g) + i for i in range(23)]
    with AtenCalls() as calls:
        got = _stats_of(engine, tensors)
    assert calls.calls["aminmax"] == 5  # 5 + 5 + 5 + 5 + 3
    for i, (t, g) in enumerate(zip(tensors, got)):
        _assert_close(g, _want(t), f"tensor {i}")


def test_channels_last_weights_are_grouped_too():
    """Conv weights in channels_last stack into a block that is not row-major: still one
    group (one ``aminmax``), each tensor's statistics NumPy's."""
    g = torch.Generator().manual_seed(6)
    tensors = [torch.randn(8, 4, 3, 3, generator=g).to(memory_format=torch.channels_last) * (i + 1) for i in range(6)]
    assert not tensors[0].is_contiguous()
    with AtenCalls() as calls:
        got = _stats_of(TorchStatsEngine(use_native=False), tensors)
    assert calls.calls["aminmax"] == 1, calls.calls
    for i, (t, g) in enumerate(zip(tensors, got)):
        _assert_close(g, _want(t), f"tensor {i}")


@pytest.mark.parametrize("ops", [ALL_OPS, ("nans",), ("norm", "nans"), ("min", "max")], ids="-".join)
def test_off_the_cpu_a_group_read_reads_nothing_back(ops):
    """Off the CPU the group's results stay on the device: no value is read back to decide
    anything (reading one there would be a host synchronisation inside a hook). Tensors on
    ``meta``, where any read of a value raises, stand in for an accelerator here; the GPU
    check is test_gpu_no_sync.py."""
    group = [torch.empty(4, 5, device="meta") for _ in range(3)]
    plan = StatPlan.from_ops(ops)
    vectors, nans, zeros, numel = torch_stats._grouped_vectors(group, plan, TorchStatsEngine(use_native=False)._zero)
    assert numel == 20 and len(vectors) == len(nans) == len(zeros) == 3
    # each vector is its rows' four 0-d results (torch_stats.DeviceStats), joined at to_host
    assert all(isinstance(v, torch_stats.DeviceStats) and len(v.parts) == 4 for v in vectors)
    assert all(p.device.type == "meta" and p.dim() == 0 for v in vectors for p in v.parts)
    if plan.nans:  # counted on the device for every tensor, not skipped after a host probe
        assert all(n.device.type == "meta" for n in nans)
    if plan.zeros:
        assert all(z.device.type == "meta" for z in zeros)


def test_a_group_the_device_cannot_reduce_is_read_one_tensor_at_a_time(monkeypatch):
    """A group read that fails (a device without fp64 kernels, memory for the stack) costs
    no row: each of its tensors is reduced alone, with NumPy's values."""
    def no_group(*args, **kwargs):
        raise RuntimeError("no fp64 reductions on this device")

    monkeypatch.setattr(torch_stats, "_grouped_vectors", no_group)
    tensors = _layer_tensors(4)[:20]
    with AtenCalls() as calls:
        got = _stats_of(TorchStatsEngine(use_native=False), tensors)
    assert calls.calls["aminmax"] == 20, calls.calls
    for i, (t, g) in enumerate(zip(tensors, got)):
        _assert_close(g, _want(t), f"tensor {i}", rtol=1e-6)


def test_a_group_of_one_and_a_large_tensor_are_reduced_alone():
    """A shape seen once gains nothing from a stack (it would be a copy): it is reduced as
    ``record`` reduces it, bit for bit; so is a tensor above ``GROUP_MAX_NUMEL``."""
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(9, 3, generator=g).t(), torch.randn(core_stats.GROUP_MAX_NUMEL + 1, generator=g).double(),
               torch.randn(core_stats.GROUP_MAX_NUMEL + 1, generator=g).double()]
    plan = StatPlan.from_ops(ALL_OPS)
    keys = [(0, f"t{i}", "param", None) for i in range(len(tensors))]
    engine = TorchStatsEngine(use_native=False)
    many = engine.record_many(tensors, plan, keys)
    alone = [engine.record(t, plan, *key) for t, key in zip(tensors, keys)]
    engine.to_host(many + alone)
    for a, b in zip(many, alone):
        assert [v.hex() for v in a.vector] == [v.hex() for v in b.vector]
        assert (a.nans or 0, a.zeros, a.numel) == (b.nans or 0, b.zeros, b.numel)


def test_grouped_reads_in_training_rows_equal_numpy_and_training_is_unchanged(tmp_path, monkeypatch):
    """End to end without the C kernel: a model of repeated blocks trained with AdamW beside
    an unmonitored twin. The gradients read in groups when each backward pass ends (inside
    ``backward()``: ``unreduced``) and the parameters and moments read in groups at the
    optimizer step are NumPy's on the twin's copies, and the parameters stay bit-identical
    to the twin's."""
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)) for _ in range(6)])
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "out"),
                            "monitors": {"param": {"enabled": True}, "optimizer": {"enabled": True},
                                         "weight_grad": {"enabled": True}}})
    mon.start(model=model, optimizer=opt)
    assert mon._session.engine._native is None
    expected = []
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(4, 8, generator=g)
        model(x).pow(2).mean().backward()
        twin(x).pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in twin.named_parameters()}
        opt.step()
        twin_opt.step()
        expected.append({n: (grads[n], p.detach().clone(), twin_opt.state[p]["exp_avg"].clone(),
                             twin_opt.state[p]["exp_avg_sq"].clone()) for n, p in twin.named_parameters()})
        opt.zero_grad()
        twin_opt.zero_grad()
    mon.stop()
    assert mon.errors.count == 0
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n
    params, moments = rows_of(mon.config.output_dir, "param"), rows_of(mon.config.output_dir, "optimizer")
    grad_rows = rows_of(mon.config.output_dir, "weight_grad")
    for step, state in enumerate(expected):
        for name, (grad, param, exp_avg, exp_avg_sq) in state.items():
            assert_row_matches(find_row(grad_rows, step=step, module_name=name, scope="unreduced"), numpy_stats(grad))
            assert_row_matches(find_row(params, step=step, module_name=name, scope="param_updated"),
                               numpy_stats(param))
            assert_row_matches(find_row(moments, step=step, module_name=f"{name}.exp_avg"), numpy_stats(exp_avg))
            assert_row_matches(find_row(moments, step=step, module_name=f"{name}.exp_avg_sq"),
                               numpy_stats(exp_avg_sq))
