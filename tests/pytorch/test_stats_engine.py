"""The PyTorch statistics engine (``TorchStatsEngine``) and the host-side merge.

Every test runs twice: with the one-pass C kernel (``monitor_v2.native``, used for
contiguous fp32/bf16/fp16 CPU tensors) and with ATen reductions only
(``MSPROBE_MONITOR_NATIVE=0``), so both paths meet the same expectations.

Every value is checked against an independent NumPy reference computed in float64 on
a copy of the tensor (``support.numpy_stats``), following MONITOR_V2.md "Output":
min/max/mean, L2 norm and NaN count, computed in at least fp32, int/bool cast, an
empty tensor gives nan for min/max/mean and 0 for norm/nans, a NaN is never hidden.
"""

import gc
import itertools
import math
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from support import TinyMLP, find_row, make_batches, numpy_stats, rows_of
from msprobe.core.monitor_v2 import native
from msprobe.core.monitor_v2.frameworks.pytorch import stats as torch_stats
from msprobe.core.monitor_v2.frameworks.pytorch.stats import StatPlan, TorchStatsEngine
from msprobe.core.monitor_v2.stats import Record, format_value, merge_records
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

# numpy_stats on arrays holding inf and -inf warns about inf - inf; that NaN is expected.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

ALL_OPS = ("min", "max", "mean", "norm", "nans")
NAN = float("nan")
INF = float("inf")

DTYPES = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
]
SHAPES = ["scalar", "1d", "3d", "transposed", "slice", "empty", "empty3d"]



@pytest.fixture(autouse=True, params=["native", "aten"])
def stats_path(request, monkeypatch):
    """Which reduction path engines created in the test use."""
    if request.param == "aten":
        monkeypatch.setenv(native.ENV_SWITCH, "0")
        assert TorchStatsEngine()._native is None
    else:
        monkeypatch.delenv(native.ENV_SWITCH, raising=False)
        assert native.load() is not None, "the one-pass kernel did not build: is a C compiler (gcc) installed?"
    return request.param


# ----------------------------------------------------------------------------- helpers
def _dt_id(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _values(shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Deterministic values of ``dtype`` (exactly representable in it)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g).to(torch.uint8)
    if dtype in (torch.int64, torch.int32):
        return torch.randint(-1000, 1000, shape, generator=g).to(dtype)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 0.25).to(dtype)


def make_tensor(dtype: torch.dtype, kind: str, seed: int = 0) -> torch.Tensor:
    if kind == "scalar":
        t = _values((), dtype, seed)
        assert t.dim() == 0
        return t
    if kind == "1d":
        return _values((37,), dtype, seed)
    if kind == "3d":
        return _values((3, 4, 5), dtype, seed)
    if kind == "transposed":
        t = _values((5, 7), dtype, seed).t()
        assert not t.is_contiguous()
        return t
    if kind == "slice":
        t = _values((6, 9), dtype, seed)[::2, 1::3]
        assert not t.is_contiguous()
        return t
    if kind == "empty":
        return _values((0,), dtype, seed)
    if kind == "empty3d":
        return _values((3, 0, 2), dtype, seed)
    raise ValueError(kind)


def _key(name: str = "t", scope: str = "s"):
    return (0, name, scope, None)


def via_record(t: torch.Tensor, ops=ALL_OPS, engine=None):
    engine = engine or TorchStatsEngine()
    rec = engine.record(t, StatPlan.from_ops(ops), 0, "t", "s")
    engine.to_host([rec])
    rows = merge_records(0, [rec])
    assert len(rows) == 1
    return {op: rows[0].stat.value(op) for op in ops}


def via_record_many(tensors, ops=ALL_OPS, engine=None):
    engine = engine or TorchStatsEngine()
    keys = [_key(f"t{i}") for i in range(len(tensors))]
    recs = engine.record_many(list(tensors), StatPlan.from_ops(ops), keys)
    assert len(recs) == len(tensors)
    engine.to_host(recs)
    rows = merge_records(0, recs)
    assert [r.name for r in rows] == [k[1] for k in keys]
    return [{op: r.stat.value(op) for op in ops} for r in rows]


def assert_stats(got, want, ops=ALL_OPS, rtol=1e-5, atol=1e-6, what=""):
    for op in ops:
        g, w = got[op], want[op]
        msg = f"{what} {op}: got {g!r}, expected {w!r}"
        if op == "nans":
            assert isinstance(g, int) and not isinstance(g, bool), msg
            assert g == w, msg
        elif math.isnan(w):
            assert math.isnan(g), msg
        elif math.isinf(w):
            assert g == w, msg
        else:
            assert not math.isnan(g) and not math.isinf(g), msg
            assert math.isclose(g, w, rel_tol=rtol, abs_tol=atol), msg


def _atol_for(t: torch.Tensor) -> float:
    """Absolute slack for a mean close to zero: fp32 rounding of the sum."""
    if t.numel() == 0:
        return 1e-7
    a = t.detach().to(torch.float64).abs()
    a = a[torch.isfinite(a)]
    m = float(a.max()) if a.numel() else 0.0
    return 1e-6 * (1.0 + m)


# ------------------------------------------------------------------ values by dtype/shape
@pytest.mark.parametrize("kind", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
def test_record_matches_numpy(dtype, kind):
    t = make_tensor(dtype, kind)
    before = t.clone()
    want = numpy_stats(t)
    got = via_record(t)
    assert_stats(got, want, atol=_atol_for(t), what=f"{dtype} {kind}")
    # the engine never modifies the monitored tensor
    assert torch.equal(t, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
def test_record_many_matches_numpy(dtype):
    tensors = [make_tensor(dtype, kind, seed=i) for i, kind in enumerate(SHAPES)]
    got = via_record_many(tensors)
    for kind, t, g in zip(SHAPES, tensors, got):
        assert_stats(g, numpy_stats(t), atol=_atol_for(t), what=f"{dtype} {kind}")


def test_record_many_mixed_dtypes_in_one_call():
    tensors = [make_tensor(dt, kind, seed=i) for i, (dt, kind) in enumerate(itertools.product(DTYPES, SHAPES))]
    got = via_record_many(tensors)
    for t, g in zip(tensors, got):
        assert_stats(g, numpy_stats(t), atol=_atol_for(t), what=f"{t.dtype} {tuple(t.shape)}")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt_id)
def test_empty_tensor_values(dtype):
    for t in (make_tensor(dtype, "empty"), make_tensor(dtype, "empty3d")):
        for got in (via_record(t), via_record_many([t])[0]):
            assert math.isnan(got["min"]) and math.isnan(got["max"]) and math.isnan(got["mean"])
            assert got["norm"] == 0.0
            assert got["nans"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_dt_id)
def test_large_tensor(dtype):
    g = torch.Generator().manual_seed(3)
    t = (torch.randn(200_000, generator=g) * 2 + 1.5).to(dtype)
    want = numpy_stats(t)
    assert_stats(via_record(t), want, rtol=1e-4, what="record")
    assert_stats(via_record_many([t])[0], want, rtol=1e-4, what="record_many")


def test_large_non_contiguous_tensor():
    g = torch.Generator().manual_seed(4)
    t = (torch.randn(500, 400, generator=g) - 0.5).t()[:, ::3]
    assert not t.is_contiguous()
    want = numpy_stats(t)
    assert_stats(via_record(t), want, rtol=1e-4)
    assert_stats(via_record_many([t])[0], want, rtol=1e-4)


def test_half_precision_statistics_do_not_overflow():
    """Sums and squares exceed the fp16/bf16 range: at least fp32 is required."""
    t16 = torch.full((100,), 60000.0, dtype=torch.float16)
    t16[::2] = -60000.0
    # bf16 accumulation of 5000 values would stall far below the true sum
    tb = torch.full((5000,), 3.0, dtype=torch.bfloat16)
    tb[::7] = 1.0078125
    for t in (t16, tb):
        want = numpy_stats(t)
        assert math.isfinite(want["norm"])
        assert_stats(via_record(t), want, rtol=1e-5, what=str(t.dtype))
        assert_stats(via_record_many([t])[0], want, rtol=1e-5, what=str(t.dtype))


def test_float64_is_not_rounded_to_fp32():
    t = torch.tensor([1.0 + 1e-12, 1.0 + 3e-12, 2.0 ** 40 + 1.0], dtype=torch.float64)
    want = numpy_stats(t)
    for got in (via_record(t), via_record_many([t])[0]):
        assert got["min"] == want["min"] and got["max"] == want["max"]
        assert_stats(got, want, rtol=1e-12)


def test_integer_and_bool_known_values():
    cases = [
        (torch.tensor([True, False, True, True]), dict(min=0.0, max=1.0, mean=0.75, norm=math.sqrt(3), nans=0)),
        (torch.tensor([0, 255, 7], dtype=torch.uint8), dict(min=0.0, max=255.0, mean=262 / 3, norm=math.sqrt(255 ** 2 + 49), nans=0)),
        (torch.tensor([-3, 4], dtype=torch.int32), dict(min=-3.0, max=4.0, mean=0.5, norm=5.0, nans=0)),
        (torch.tensor(-7, dtype=torch.int64), dict(min=-7.0, max=-7.0, mean=-7.0, norm=7.0, nans=0)),
    ]
    for t, want in cases:
        assert_stats(via_record(t), want, what=str(t))
        assert_stats(via_record_many([t])[0], want, what=str(t))


def test_a_negative_view_is_not_read_as_raw_memory():
    """Its sign is held in a bit, not in memory: the statistics are those of its values."""
    x = _values((64,), torch.float32)
    neg = torch._neg_view(x)
    assert neg.is_neg()
    assert_stats(via_record(neg), numpy_stats(-x))
    assert_stats(via_record_many([neg])[0], numpy_stats(-x))


def test_requires_grad_and_parameter_inputs():
    p = torch.nn.Parameter(make_tensor(torch.float32, "3d"))
    y = p * 2  # non-leaf with a grad_fn
    for t in (p, y):
        want = numpy_stats(t)
        assert_stats(via_record(t), want)
        assert_stats(via_record_many([t])[0], want)


# --------------------------------------------------------------------------- NaN / Inf
def _special(case: str, dtype: torch.dtype) -> torch.Tensor:
    base = torch.tensor([0.5, -1.25, 2.0, 3.5, -0.75, 1.0, 4.25, -2.5, 0.125, 6.0], dtype=torch.float64)
    if case == "finite":
        pass
    elif case == "nan3":
        base[[1, 4, 8]] = NAN
    elif case == "nan_first":
        base[0] = NAN
    elif case == "nan_last":
        base[-1] = NAN
    elif case == "pinf":
        base[3] = INF
    elif case == "ninf":
        base[6] = -INF
    elif case == "both_inf":
        base[2], base[5] = INF, -INF
    elif case == "nan_and_inf":
        base[[0, 7]] = NAN
        base[2], base[5] = INF, -INF
    elif case == "only_pinf":
        base[:] = INF
    elif case == "only_ninf":
        base[:] = -INF
    elif case == "only_nan":
        base[:] = NAN
    else:
        raise ValueError(case)
    return base.to(dtype)


SPECIAL_CASES = [
    "finite", "nan3", "nan_first", "nan_last", "pinf", "ninf", "both_inf", "nan_and_inf",
    "only_pinf", "only_ninf", "only_nan",
]
FLOAT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("case", SPECIAL_CASES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=_dt_id)
def test_nan_inf_all_ops(dtype, case):
    t = _special(case, dtype)
    want = numpy_stats(t)
    n_nan = int(torch.isnan(t).sum())
    assert want["nans"] == n_nan
    if n_nan:
        for op in ("min", "max", "mean", "norm"):
            assert math.isnan(want[op])
    assert_stats(via_record(t), want, what=f"record {case}")
    assert_stats(via_record_many([t])[0], want, what=f"record_many {case}")


def test_nan_known_values():
    t = torch.tensor([1.0, NAN, -2.0, NAN, NAN, 3.0])
    for got in (via_record(t), via_record_many([t])[0]):
        assert got["nans"] == 3
        for op in ("min", "max", "mean", "norm"):
            assert math.isnan(got[op]), op


def test_only_inf_known_values():
    t = torch.full((5,), INF)
    for got in (via_record(t), via_record_many([t])[0]):
        assert got["nans"] == 0
        assert got["norm"] == INF
        assert got["min"] == INF and got["max"] == INF and got["mean"] == INF


def test_non_contiguous_view_with_nan():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    base[1, 2] = NAN
    base[3, 0] = NAN
    base[0, 1] = NAN  # not in the view below
    view = base[1:, ::2].t()
    assert not view.is_contiguous()
    assert int(torch.isnan(view).sum()) == 2
    want = numpy_stats(view)
    assert_stats(via_record(view), want)
    assert_stats(via_record_many([view])[0], want)


def _op_subsets():
    for r in range(1, len(ALL_OPS) + 1):
        for combo in itertools.combinations(ALL_OPS, r):
            if "nans" in combo:
                yield list(combo)


OP_SUBSETS = list(_op_subsets())
SUBSET_CASES = ["finite", "nan3", "only_nan", "pinf", "both_inf", "nan_and_inf", "overflow"]


def _subset_tensor(case: str) -> torch.Tensor:
    if case == "overflow":
        # finite fp32 values whose sum of squares overflows fp32 (and not fp64)
        g = torch.Generator().manual_seed(5)
        t = torch.rand(1000, generator=g) * 2e30 + 1e30
        t[::3] *= -1
        assert bool(torch.isfinite(t).all())
        assert not math.isfinite(float(t.pow(2).sum()))
        return t
    return _special(case, torch.float32)


@pytest.mark.parametrize("path", ["record", "record_many"])
@pytest.mark.parametrize("case", SUBSET_CASES)
@pytest.mark.parametrize("ops", OP_SUBSETS, ids=lambda o: "+".join(o))
def test_nan_count_for_every_ops_subset(ops, case, path):
    """The CPU engine skips the NaN count when a computed statistic proves there is no
    NaN; whichever statistic is used as the probe, the count must stay right."""
    t = _subset_tensor(case)
    want = numpy_stats(t)
    got = via_record(t, ops) if path == "record" else via_record_many([t], ops)[0]
    assert set(got) == set(ops)
    checked = list(ops)
    if case == "overflow" and "norm" in ops:
        # fp32 may overflow to inf ("at least fp32"); a finite answer must be right
        checked.remove("norm")
        assert got["norm"] == INF or math.isclose(got["norm"], want["norm"], rel_tol=1e-5)
    assert_stats(got, want, ops=checked, rtol=1e-4, what=f"{ops} {case}")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=_dt_id)
def test_single_nan_in_large_tensor_every_ops_subset(dtype):
    """One NaN deep inside a large tensor (vectorised reduction paths)."""
    g = torch.Generator().manual_seed(9)
    t = torch.randn(100_003, generator=g).to(dtype)
    t[61_237] = NAN
    want = numpy_stats(t)
    assert want["nans"] == 1
    for ops in OP_SUBSETS:
        for got in (via_record(t, ops), via_record_many([t], ops)[0]):
            assert_stats(got, want, ops=ops, what=f"{dtype} {ops}")
    finite = torch.randn(100_003, generator=g).to(dtype)
    for ops in OP_SUBSETS:
        for got in (via_record(finite, ops), via_record_many([finite], ops)[0]):
            assert got["nans"] == 0, ops


def test_overflow_tensor_min_max_exact():
    t = _subset_tensor("overflow")
    for got in (via_record(t), via_record_many([t])[0]):
        assert got["nans"] == 0
        assert got["min"] == float(t.min())
        assert got["max"] == float(t.max())


def test_nans_only_plan_on_many_tensors():
    tensors = [_special(c, torch.float32) for c in SPECIAL_CASES]
    got = via_record_many(tensors, ["nans"])
    assert [g["nans"] for g in got] == [int(torch.isnan(t).sum()) for t in tensors]


# ----------------------------------------------------------------------------- merging
def _merge_same_key(tensors, ops=ALL_OPS, many=False):
    engine = TorchStatsEngine()
    plan = StatPlan.from_ops(ops)
    if many:
        recs = engine.record_many(tensors, plan, [_key("w")] * len(tensors))
    else:
        recs = [engine.record(t, plan, 0, "w", "s") for t in tensors]
    engine.to_host(recs)
    rows = merge_records(7, recs)
    assert len(rows) == 1
    row = rows[0]
    assert (row.vpp_stage, row.step, row.name, row.scope, row.micro_step) == (0, 7, "w", "s", None)
    assert row.stat.numel == sum(t.numel() for t in tensors)
    return {op: row.stat.value(op) for op in ops}


def _concat(tensors):
    return torch.cat([t.detach().to(torch.float64).reshape(-1) for t in tensors])


MERGE_ORDERS = list(itertools.permutations(range(3)))


@pytest.mark.parametrize("many", [False, True], ids=["record", "record_many"])
@pytest.mark.parametrize("order", MERGE_ORDERS, ids=lambda o: "".join(map(str, o)))
def test_merge_three_observations_with_empty_and_nan(order, many):
    g = torch.Generator().manual_seed(11)
    a = torch.randn(10, generator=g) * 2
    empty = torch.empty(0)
    with_nan = torch.randn(4, 5, generator=g)
    with_nan[1, 2] = NAN
    with_nan[3, 4] = NAN
    tensors = [[a, empty, with_nan][i] for i in order]
    got = _merge_same_key(tensors, many=many)
    want = numpy_stats(_concat(tensors))
    assert want["nans"] == 2
    assert_stats(got, want)


@pytest.mark.parametrize("many", [False, True], ids=["record", "record_many"])
@pytest.mark.parametrize("order", MERGE_ORDERS, ids=lambda o: "".join(map(str, o)))
def test_merge_three_finite_observations_with_empty(order, many):
    g = torch.Generator().manual_seed(12)
    a = torch.randn(10, generator=g) * 2 + 5  # different sizes and means: weighting matters
    b = torch.randn(3, 7, generator=g) - 4
    empty = torch.empty(2, 0)
    tensors = [[a, empty, b][i] for i in order]
    got = _merge_same_key(tensors, many=many)
    want = numpy_stats(_concat(tensors))
    assert_stats(got, want)
    # explicit formulae
    assert got["min"] == min(float(a.min()), float(b.min()))
    assert got["max"] == max(float(a.max()), float(b.max()))
    assert math.isclose(got["mean"], (float(a.double().sum()) + float(b.double().sum())) / 31, rel_tol=1e-6)
    assert math.isclose(got["norm"], math.sqrt(float(a.double().pow(2).sum() + b.double().pow(2).sum())), rel_tol=1e-6)


def test_merge_mixed_dtypes_and_inf():
    tensors = [
        torch.tensor([1.0, INF, 2.0]),
        torch.tensor([[3, 4], [5, 6]], dtype=torch.int64),
        torch.tensor([-0.5, 0.25], dtype=torch.bfloat16),
        torch.tensor(9.0, dtype=torch.float64),
    ]
    for many in (False, True):
        assert_stats(_merge_same_key(tensors, many=many), numpy_stats(_concat(tensors)))


@pytest.mark.parametrize("many", [False, True], ids=["record", "record_many"])
def test_merge_nan_counts_are_summed(many):
    tensors = [
        torch.tensor([NAN, 1.0, NAN]),
        torch.tensor([[2.0, NAN], [NAN, NAN]]),
        torch.tensor([4.0]),
        torch.tensor(NAN, dtype=torch.bfloat16),
    ]
    got = _merge_same_key(tensors, many=many)
    assert got["nans"] == 6
    assert_stats(got, numpy_stats(_concat(tensors)))
    assert _merge_same_key(tensors, ops=["nans"], many=many)["nans"] == 6


def test_merge_all_empty():
    got = _merge_same_key([torch.empty(0), torch.empty(3, 0)])
    assert math.isnan(got["min"]) and math.isnan(got["max"]) and math.isnan(got["mean"])
    assert got["norm"] == 0.0 and got["nans"] == 0


def test_merge_nan_in_first_observation_is_not_hidden():
    tensors = [torch.tensor([NAN, 1.0]), torch.tensor([5.0, -5.0]), torch.tensor([2.0])]
    got = _merge_same_key(tensors)
    assert got["nans"] == 1
    for op in ("min", "max", "mean", "norm"):
        assert math.isnan(got[op]), op


def test_merge_keeps_distinct_keys_apart_and_in_order():
    engine = TorchStatsEngine()
    plan = StatPlan.from_ops(ALL_OPS)
    ta, tb, tc = torch.tensor([1.0, 2.0]), torch.tensor([10.0]), torch.tensor([-3.0, 3.0, NAN])
    recs = [
        engine.record(ta, plan, 0, "b", "s"),
        engine.record(tb, plan, 0, "a", "s"),
        engine.record(tc, plan, 0, "b", "s"),
        engine.record(tb, plan, 1, "b", "s"),  # another vpp stage
        engine.record(tb, plan, 0, "b", "other"),  # another scope
        engine.record(tb, plan, 0, "b", "s", micro_step=2),  # another micro step
    ]
    engine.to_host(recs)
    rows = merge_records(0, recs)
    assert [(r.vpp_stage, r.name, r.scope, r.micro_step) for r in rows] == [
        (0, "b", "s", None), (0, "a", "s", None), (1, "b", "s", None), (0, "b", "other", None), (0, "b", "s", 2),
    ]
    assert_stats({op: rows[0].stat.value(op) for op in ALL_OPS}, numpy_stats(_concat([ta, tc])))
    for r in rows[1:]:
        assert_stats({op: r.stat.value(op) for op in ALL_OPS}, numpy_stats(tb))


# ----------------------------------------------------------------- host transfers
def _count_cpu_calls(monkeypatch, records):
    calls = []
    original = torch.Tensor.cpu

    def counting_cpu(self, *args, **kwargs):
        calls.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:  # undoes only this patch, not the test's
        patch.setattr(torch.Tensor, "cpu", counting_cpu)
        TorchStatsEngine().to_host(records)
    return len(calls)


def _tensors(n: int, with_nan: bool, dtype=torch.float32):
    g = torch.Generator().manual_seed(n)
    out = []
    for i in range(n):
        t = torch.randn(3 + i % 5, generator=g).to(dtype)
        if with_nan and i % 2 == 0:
            t[0] = NAN
        out.append(t)
    return out


@pytest.mark.parametrize("with_nan", [False, True], ids=["finite", "nan"])
@pytest.mark.parametrize("many", [False, True], ids=["record", "record_many"])
def test_host_transfers_do_not_grow_with_tensor_count(monkeypatch, many, with_nan, stats_path):
    counts = {}
    for n in (3, 300):
        tensors = _tensors(n, with_nan)
        engine = TorchStatsEngine()
        plan = StatPlan.from_ops(ALL_OPS)
        if many:
            recs = engine.record_many(tensors, plan, [_key(f"t{i}") for i in range(n)])
        else:
            recs = [engine.record(t, plan, 0, f"t{i}", "s") for i, t in enumerate(tensors)]
        counts[n] = _count_cpu_calls(monkeypatch, recs)
        # the values still arrive, right
        rows = merge_records(0, recs)
        assert len(rows) == n
        for t, row in zip(tensors, rows):
            assert_stats({op: row.stat.value(op) for op in ALL_OPS}, numpy_stats(t))
    # The one-pass kernel reads host memory and returns host values: nothing to move. So
    # does record_many's grouped ATen read on the CPU (300 tensors in five shapes: five
    # groups); three tensors of three shapes are reduced alone, their vectors (and NaN
    # counts) moved in one transfer each.
    if stats_path == "native":
        assert counts[3] == counts[300] == 0, counts
    elif many:
        assert 1 <= counts[3] <= 2 and counts[300] == 0, counts
    else:
        assert counts[3] == counts[300] and 1 <= counts[300] <= 2, counts


def test_host_transfers_bounded_per_dtype_group(monkeypatch):
    n_groups = 0
    tensors = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
        tensors += _tensors(150, with_nan=dtype.is_floating_point, dtype=dtype)
    engine = TorchStatsEngine()
    recs = engine.record_many(tensors, StatPlan.from_ops(ALL_OPS), [_key(f"t{i}") for i in range(len(tensors))])
    n_groups = len({(r.vector.device, r.vector.dtype) for r in recs if isinstance(r.vector, torch.Tensor)})
    count = _count_cpu_calls(monkeypatch, recs)
    assert count <= 2 * n_groups, (count, n_groups)
    for t, row in zip(tensors, merge_records(0, recs)):
        assert_stats({op: row.stat.value(op) for op in ALL_OPS}, numpy_stats(t), atol=_atol_for(t))


# ------------------------------------------------------------------------ no copies
def _assert_small_record(rec: Record):
    if isinstance(rec.vector, list):  # host values from the one-pass kernel
        assert len(rec.vector) == 4 and all(isinstance(v, float) for v in rec.vector)
        assert isinstance(rec.nans, (int, type(None)))
        return
    assert isinstance(rec.vector, torch.Tensor)
    assert rec.vector.numel() == 4
    if isinstance(rec.nans, torch.Tensor):
        assert rec.nans.numel() == 1


@pytest.mark.parametrize("many", [False, True], ids=["record", "record_many"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(64, 32),
        lambda: torch.randn(64, 32).t(),
        lambda: torch.tensor([1.0, NAN, 3.0] * 100),
        lambda: torch.randint(0, 9, (50, 7)),
        lambda: torch.randn(20, 20).to(torch.bfloat16),
        lambda: torch.nn.Parameter(torch.randn(16, 16)),
    ],
    ids=["fp32", "transposed", "nan", "int64", "bf16", "parameter"],
)
def test_no_reference_to_monitored_tensor(make, many):
    engine = TorchStatsEngine()
    plan = StatPlan.from_ops(ALL_OPS)
    t = make()
    want = numpy_stats(t)
    ref = weakref.ref(t)
    storage = StorageWeakRef(t.untyped_storage())  # also catches a kept detached alias
    if many:
        (rec,) = engine.record_many([t], plan, [_key()])
    else:
        rec = engine.record(t, plan, 0, "t", "s")
    _assert_small_record(rec)
    del t
    gc.collect()
    assert ref() is None, "the engine or its record keeps a reference to the monitored tensor"
    assert storage.expired(), "the engine or its record keeps the memory of the monitored tensor alive"
    engine.to_host([rec])
    assert len(rec.vector) == 4
    assert_stats({op: merge_records(0, [rec])[0].stat.value(op) for op in ALL_OPS}, want)


def test_no_reference_to_grad_of_parameter():
    p = torch.nn.Parameter(torch.randn(8, 8))
    (p * 3).sum().backward()
    engine = TorchStatsEngine()
    ref = weakref.ref(p.grad)
    storage = StorageWeakRef(p.grad.untyped_storage())
    rec = engine.record(p.grad, StatPlan.from_ops(ALL_OPS), 0, "p", "grad")
    _assert_small_record(rec)
    p.grad = None
    gc.collect()
    assert ref() is None
    assert storage.expired()


# ----------------------------------------------------------------------- end to end
def _set_values(model: torch.nn.Module, dtype: torch.dtype):
    """Specific values, NaN at known positions; returns expected NaN counts."""
    with torch.no_grad():
        w1, b1, w2, b2 = model.fc1.weight, model.fc1.bias, model.fc2.weight, model.fc2.bias
        w1[0, 1] = NAN
        w1[2, 3] = NAN
        w1[9, 5] = NAN
        b2[1] = NAN
        if dtype == torch.float16:
            w2[0, 0] = 60000.0  # squares overflow fp16
            w2[2, 9] = -65504.0
        elif dtype == torch.bfloat16:
            w2[0, 0] = 3.0e18  # squares far beyond the fp16 range, fine in fp32
            w2[1, 4] = -1.5e-30
        else:
            w2[0, 0] = 1.0e18
            w2[1, 4] = -7.25
        b1[0] = -0.0
        b1[3] = 123.456
    return {"fc1.weight": 3, "fc1.bias": 0, "fc2.weight": 0, "fc2.bias": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_dt_id)
def test_end_to_end_param_origin_matches_numpy(write_config, tmp_path, dtype):
    model = TinyMLP().to(dtype)
    nan_counts = _set_values(model, dtype)
    copies = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    out = tmp_path / "out"
    mon = TrainerMonitorV2(write_config({"monitors": {"param": {"enabled": True}}, "output_dir": str(out)}))
    mon.start(model=model, optimizer=opt)
    try:
        ((x, y),) = make_batches(1)
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype))
        loss.backward()
        opt.step()
        opt.zero_grad()
    finally:
        mon.stop()

    files = sorted(p.name for p in (out / "rank_0").glob("*.csv"))
    assert files == ["param_step0-0.csv"]
    header = (out / "rank_0" / "param_step0-0.csv").read_text().splitlines()[0]
    assert header == "vpp_stage,step,module_name,scope,min,max,mean,norm,nans"

    rows = rows_of(out, "param")
    assert {r["scope"] for r in rows} == {"param_origin", "param_updated"}
    for name, copy in copies.items():
        row = find_row(rows, module_name=name, scope="param_origin")
        assert row["vpp_stage"] == "0" and row["step"] == "0"
        want = numpy_stats(copy)
        assert want["nans"] == nan_counts[name]
        assert row["nans"] == str(nan_counts[name])  # an integer, literally
        if want["nans"]:
            for op in ("min", "max", "mean", "norm"):
                assert row[op] == "nan", (name, op, row[op])
        else:
            for op in ("min", "max"):
                # min/max are elements of the tensor: 9 significant digits give back the
                # exact fp32 value
                assert np.float32(float(row[op])) == np.float32(want[op]), (name, op, row[op], want[op])
                assert row[op] == format_value(op, want[op])
            for op in ("mean", "norm"):
                got = float(row[op])
                assert math.isfinite(got), (name, op, row[op])
                assert math.isclose(got, want[op], rel_tol=1e-5, abs_tol=1e-7), (name, op, row[op], want[op])


def test_end_to_end_finite_float32_values_round_trip(write_config, tmp_path):
    model = TinyMLP()
    with torch.no_grad():
        model.fc1.weight.fill_(0.1)
        model.fc1.weight[0, 0] = -3.3333333
        model.fc1.weight[4, 2] = 1.0e-20
        model.fc2.bias.copy_(torch.tensor([1.0 / 3.0, 2.0 / 3.0, 16777217.0]))
    copies = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    out = tmp_path / "out"
    mon = TrainerMonitorV2(write_config({"monitors": {"param": {"enabled": True}}, "output_dir": str(out)}))
    mon.start(model=model, optimizer=opt)
    try:
        for x, y in make_batches(2):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    finally:
        mon.stop()
    rows = rows_of(out, "param")
    for step in (0, 1):
        for scope in ("param_origin", "param_updated"):
            for name, copy in copies.items():
                row = find_row(rows, module_name=name, scope=scope, step=step)
                want = numpy_stats(copy)  # lr=0: parameters never change
                assert row["nans"] == "0"
                assert np.float32(float(row["min"])) == np.float32(want["min"])
                assert np.float32(float(row["max"])) == np.float32(want["max"])
                assert math.isclose(float(row["mean"]), want["mean"], rel_tol=1e-5, abs_tol=1e-7)
                assert math.isclose(float(row["norm"]), want["norm"], rel_tol=1e-5)


def test_format_value_literals():
    assert format_value("min", NAN) == "nan"
    assert format_value("norm", INF) == "inf"
    assert format_value("min", -INF) == "-inf"
    assert format_value("nans", 3) == "3"
    assert format_value("nans", 0) == "0"
    x = float(np.float32(1.0 / 3.0))
    assert np.float32(float(format_value("mean", x))) == np.float32(x)


# ------------------------------------------------------- one computation per tensor
def _counting_engine(monkeypatch):
    """An engine whose reductions (on either path: the kernel's, or ATen's) are counted in ``calls``."""
    engine = TorchStatsEngine()
    calls = []
    real = engine._compute_aten
    monkeypatch.setattr(engine, "_compute_aten", lambda t, *a, **k: calls.append(1) or real(t, *a, **k))
    read = engine._kernel_read
    monkeypatch.setattr(engine, "_kernel_read", lambda *a, **k: calls.append(1) or read(*a, **k))
    record_read = engine._record_read_ext  # the extension's read-and-record, where it is built
    if record_read is not None:
        monkeypatch.setattr(engine, "_record_read_ext", lambda *a: calls.append(1) or record_read(*a))
    # the Python path, where the reads can be counted (the compiled one's cache is tested
    # by what it returns: test_the_compiled_record_reads_a_tensor_once_per_version)
    monkeypatch.setattr(engine, "_tensor_record", None)
    return engine, StatPlan.from_ops(ALL_OPS), calls


def test_same_tensor_twice_in_a_step_is_computed_once_and_in_place_change_is_seen(monkeypatch):
    engine, plan, calls = _counting_engine(monkeypatch)
    t = torch.arange(6, dtype=torch.float32)
    first = engine.record(t, plan, 0, "a.output.0", "forward", cache=True)
    second = engine.record(t, plan, 0, "b.input.0", "forward", cache=True)
    assert len(calls) == 1, "the second observation of the same, unchanged tensor is not recomputed"
    t.mul_(-1)  # in place: version counter moves, statistics must be taken again
    third = engine.record(t, plan, 0, "c.input.0", "forward", cache=True)
    uncached = engine.record(t, plan, 0, "d.input.0", "forward")  # the default does not use the cache
    assert len(calls) == 3
    engine.forget()
    engine.record(t, plan, 0, "e.input.0", "forward", cache=True)
    assert len(calls) == 4, "forget() drops the cache"
    engine.to_host([first, second, third, uncached])
    assert first.vector == second.vector
    assert third.vector[0] == -5.0 and first.vector[0] == 0.0


def _compiled_engine(stats_path: str) -> TorchStatsEngine:
    """The engine of this path: the extension's ``tensor_record`` on the native one."""
    engine = TorchStatsEngine()
    assert (engine._tensor_record is not None) == (stats_path == "native"), (
        "the kernel was not built as an extension: are Python's headers (Python.h) installed?")
    return engine


def test_the_compiled_record_reads_a_tensor_once_per_version(stats_path):
    """The extension's ``tensor_record`` (``record`` of a CPU tensor the kernel reads) keeps
    the Python path's cache: values written behind the version counter's back (through
    NumPy, sharing the memory) show only where the tensor is read again. The same holds
    on the ATen path."""
    engine, plan = _compiled_engine(stats_path), StatPlan.from_ops(ALL_OPS)

    def read(t, name, cache=True):
        rec = engine.record(t, plan, 0, name, "forward", cache=cache)
        engine.to_host([rec])
        return rec

    t = torch.arange(6, dtype=torch.float32)
    first = read(t, "a")
    assert first.vector == [0.0, 5.0, 15.0, math.sqrt(55.0)]
    t.numpy()[:] = 100.0  # same version: a cache hit keeps the first statistics
    assert read(t, "b").vector == first.vector
    assert read(t.view(2, 3), "c").vector == first.vector, "another object over the same memory and version counter"
    assert read(t, "d", cache=False).vector[0] == 100.0, "without cache=True the tensor is read"
    assert read(t.view(torch.bfloat16), "e").numel == 12, "the same address as another dtype and count"
    t.add_(0)  # the version moves: read again
    assert read(t, "f").vector[0] == 100.0
    t.numpy()[:] = 7.0
    engine.forget()
    assert read(t, "g").vector[0] == 7.0, "forget() drops the cache"
    with torch.inference_mode():
        frozen = torch.ones(4)
    assert read(frozen, "h").vector[0] == 1.0
    frozen.numpy()[:] = 3.0  # an inference tensor has no version counter: never cached
    assert read(frozen, "i").vector[0] == 3.0


@pytest.mark.parametrize("reader", ["view", "exporter", "getters"])
def test_the_compiled_record_gives_the_python_paths_records(stats_path, reader):
    """Every kind of tensor gives the same record through the extension's ``tensor_record``
    as through the Python path (the ones it does not take go to the Python path), whether
    the extension reads a tensor's buffer through the DLPack C exchange API's view (what
    this torch gets), through ``torch._C._to_dlpack`` (a torch without that API) or through the
    tensor's getters (another torch)."""
    compiled, plan = _compiled_engine(stats_path), StatPlan.from_ops(ALL_OPS + ("zeros",))
    ext = native.extension()
    if stats_path == "native":
        # the engine's check, again (once per process; an earlier refused tensor may have
        # turned the view off since: see the next test)
        ext.use_exporter(None)
        ext.use_view(None)
        torch_stats._use_exporter(ext, compiled._kernel_codes)
        assert ext.exporter() is torch._C._to_dlpack, "this torch's exporter passed the engine's check"
        assert ext.view() is torch.Tensor.__dlpack_c_exchange_api__, "this torch's exchange API passed it too"
        if reader != "view":
            ext.use_view(None)
        if reader == "getters":
            ext.use_exporter(None)
    python = TorchStatsEngine()
    python._tensor_record = None
    base = _values((6, 5), torch.float32, seed=3)
    base[1, 2] = 0.0
    with_nan = base.clone()
    with_nan[0, 0] = float("nan")

    class Sub(torch.Tensor):
        pass

    tensors = [base, base.t(), base[1:], base[:, 1:], with_nan, base.to(torch.bfloat16), base.to(torch.float16),
               base.double(), _values((7,), torch.int64), torch.empty(0), torch.nn.Parameter(base.clone()),
               base.clone().requires_grad_(), torch._neg_view(base), base.as_subclass(Sub), base[0, 0],
               torch.nested.nested_tensor([base[0], base[1, :3]], layout=torch.jagged),
               torch.zeros(3, 4).to_sparse(), base[2:4], base[:, :1], base.reshape(30)[::2],
               torch.empty(3, 2, device="meta")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the strided layout of nested tensors is a prototype
        tensors.append(torch.nested.nested_tensor([base[0], base[1, :3]]))
    complex_one = torch.complex(base[:1, 0], base[1:2, 0])
    tensors.append(complex_one.conj().imag)  # contiguous, with the negative bit: DLPack does not carry it
    if torch.backends.mkldnn.is_available():
        tensors.append(base.to_mkldnn())
    try:
        for i, t in enumerate(tensors):
            for cache in (False, True):
                if stats_path == "native" and reader == "view":  # each tensor through the view (see below)
                    ext.use_view(torch.Tensor.__dlpack_c_exchange_api__)
                got = compiled.record(t, plan, 1, f"t{i}", "forward", 2, cache=cache)
                want = python.record(t, plan, 1, f"t{i}", "forward", 2, cache=cache)
                compiled.to_host([got])
                python.to_host([want])
                assert repr(got) == repr(want), (i, cache)
    finally:
        if stats_path == "native":
            ext.use_exporter(torch._C._to_dlpack)
            ext.use_view(torch.Tensor.__dlpack_c_exchange_api__)


def test_the_recorder_gives_what_record_gives_with_the_same_cache(stats_path):
    """``engine.recorder(plan)`` (what the module monitor calls for every tensor: the
    extension's ``Recorder`` on the native path) gives the records ``record(..., cache=True)``
    gives, for tensors the kernel reads and for the others (float64, int64: the rest of the
    Python path); a tensor seen again is not read again until ``forget()``, which the
    recorder sees although it holds the cache."""
    engine, plan = _compiled_engine(stats_path), StatPlan.from_ops(ALL_OPS + ("zeros",))
    read = engine.recorder(plan)
    assert (type(read).__name__ == "Recorder") == (stats_path == "native")
    python = TorchStatsEngine()
    python._tensor_record = None
    base = _values((6, 5), torch.float32, seed=11)
    base[2, 3] = 0.0
    tensors = [base, base.t(), base[1:], base.double(), _values((7,), torch.int64), base.to(torch.bfloat16),
               torch.empty(0), torch.nn.Parameter(base.clone())]
    for i, t in enumerate(tensors):
        got, want = read(t, 1, f"t{i}", "forward", 2), python.record(t, plan, 1, f"t{i}", "forward", 2, cache=True)
        engine.to_host([got])
        python.to_host([want])
        assert repr(got) == repr(want), i
    t = base.clone()
    first = read(t, 0, "a", "backward")
    t.numpy()[:] = 7.0  # behind the version counter's back: only a new read sees it
    again = read(t, 0, "b", "backward")
    engine.forget()
    fresh = read(t, 0, "c", "backward")
    engine.to_host([first, again, fresh])
    assert again.vector == first.vector and again.name == "b" and again.micro_step is None
    assert fresh.vector[0] == 7.0 and fresh.vector[1] == 7.0, "forget() dropped the recorder's cache too"


def test_a_tensor_the_view_refuses_turns_it_off_and_the_export_reads_on(stats_path):
    """torch's exchange API refuses a tensor it cannot describe (sparse, meta, no storage)
    through a C++ exception that costs about a millisecond: the first such tensor turns
    the view off for good, and it and every later tensor are read through the export
    (which refuses such tensors in microseconds), with the same records. On the ATen path
    the same tensors give the same records."""
    ext = native.extension()
    engine, plan = _compiled_engine(stats_path), StatPlan.from_ops(ALL_OPS)
    api = torch.Tensor.__dlpack_c_exchange_api__
    native_path = stats_path == "native"
    base = _values((6, 5), torch.float32, seed=5)
    try:
        if native_path:
            ext.use_view(api)  # on, as the engine's check leaves it (an earlier test may have turned it off)
        first = engine.record(base, plan, 0, "a", "forward")
        assert not native_path or ext.view() is api, "a tensor the view describes leaves it on"
        sparse = engine.record(base.to_sparse(), plan, 0, "b", "forward")
        assert not native_path or ext.view() is None, "the refused tensor turned the view off"
        after = engine.record(base.t(), plan, 0, "c", "forward")
        engine.to_host([first, sparse, after])
        want = numpy_stats(base)
        for rec in (first, sparse, after):
            assert rec.numel == 30 and rec.vector == pytest.approx([want["min"], want["max"], want["mean"] * 30,
                                                                     want["norm"]], rel=1e-6), rec.name
    finally:
        if native_path:
            ext.use_view(api)


def test_a_new_tensor_reusing_a_dead_tensors_id_is_not_confused(monkeypatch):
    engine = TorchStatsEngine()
    plan = StatPlan.from_ops(ALL_OPS)
    recs = []
    for value in (1.0, 2.0, 3.0):  # each tensor dies before the next is made: ids may repeat
        recs.append(engine.record(torch.full((4,), value), plan, 0, f"t{value}", "forward", cache=True))
    engine.to_host(recs)
    assert [r.vector[0] for r in recs] == [1.0, 2.0, 3.0]


def test_a_view_of_memory_already_seen_is_not_read_again_unless_changed(monkeypatch):
    engine, plan, calls = _counting_engine(monkeypatch)
    base = _values((4, 6), torch.float32)
    first = engine.record(base, plan, 0, "a.grad_output.0", "backward", cache=True)
    flat = base.view(24)  # another object, the same memory: how autograd passes gradients on
    second = engine.record(flat, plan, 0, "b.grad_input.0", "backward", cache=True)
    assert len(calls) == 1
    engine.record(base[1:], plan, 0, "c", "backward", cache=True)  # other memory: read
    engine.record(base.t(), plan, 0, "d", "backward", cache=True)  # not contiguous: read
    assert len(calls) == 3
    flat.mul_(-1)  # a view shares its base's version counter: both are stale now
    third = engine.record(base.view(2, 12), plan, 0, "e", "backward", cache=True)
    assert len(calls) == 4
    alias = base.data  # a version counter of its own (the documented blind spot for `base`)
    alias.add_(1)
    fourth = engine.record(alias, plan, 0, "f", "backward", cache=True)
    assert len(calls) == 5, "a modified alias is read again"
    engine.to_host([first, second, third, fourth])
    want = numpy_stats(base)
    assert_stats({op: v for op, v in zip(("min", "max"), fourth.vector[:2])}, want, ops=("min", "max"))
    assert first.vector == second.vector and third.vector[0] == -first.vector[1]


def test_memory_seen_through_a_dead_tensor_is_read_again(monkeypatch):
    engine, plan, calls = _counting_engine(monkeypatch)
    base = _values((32,), torch.float32)
    engine.record(base.view(4, 8), plan, 0, "a", "forward", cache=True)  # that view dies at once
    gc.collect()
    engine.record(base.view(8, 4), plan, 0, "b", "forward", cache=True)
    assert len(calls) == 2, "only a living first tensor proves the memory was not freed and reused"
