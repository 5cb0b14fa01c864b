"""MindSpore's ``record_many`` on the device path (GPU, Ascend; here MindSpore's CPU with
``read_host=False``, the same primitives): small floating-point tensors of one dtype and
shape are stacked and reduced along rows, a group at a time, instead of eight primitives
per tensor. Every value against NumPy in fp64 on a copy; the groups are counted at the
engine's own grouping function."""

import math

import pytest

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")

from support.ms_helpers import ms, np, np_stats  # noqa: E402

from msprobe.core.monitor_v2.frameworks.mindspore import stats as ms_stats  # noqa: E402
from msprobe.core.monitor_v2.frameworks.mindspore.stats import MsStatsEngine  # noqa: E402
from msprobe.core.monitor_v2.stats import GROUP_MAX_NUMEL, StatPlan, merge_records  # noqa: E402

NAN, INF = float("nan"), float("inf")


def _layers(blocks: int):
    """(tensor, its values as fp64 NumPy) as a stack of ``blocks`` identical blocks would
    have them, NaN, infinities and zeros among them, and tensors reduced alone (integer,
    empty, larger than a group's member may be)."""
    rng = np.random.default_rng(7)
    pairs = []
    for i in range(blocks):
        for shape, dtype in (((8, 8), np.float32), ((8,), np.float64), ((2, 3), np.float16)):
            a = (rng.standard_normal(shape) * (i + 1)).astype(dtype)
            pairs.append((ms.Tensor(a), a.astype(np.float64)))
        eighths = (rng.integers(-40, 40, size=(4,)) / 8.0).astype(np.float32)  # exact in bf16
        pairs.append((ms.Tensor(eighths).astype(ms.bfloat16), eighths.astype(np.float64)))
    with_nan = pairs[0][1].astype(np.float32)
    with_nan[1, 2] = NAN
    pairs[0] = (ms.Tensor(with_nan), with_nan.astype(np.float64))
    with_inf = pairs[4][1].astype(np.float32)
    with_inf[0, 0], with_inf[3, 3] = INF, -INF
    pairs[4] = (ms.Tensor(with_inf), with_inf.astype(np.float64))
    zeros = pairs[5][1].copy()
    zeros[:3] = 0.0
    pairs[5] = (ms.Tensor(zeros), zeros)
    large = rng.standard_normal(GROUP_MAX_NUMEL + 1).astype(np.float32)
    ints = np.arange(-5, 9, dtype=np.int32)
    pairs += [(ms.Tensor(large), large.astype(np.float64)), (ms.Tensor(ints), ints.astype(np.float64)),
              (ms.Tensor(np.zeros((0,), np.float32)), np.zeros((0,)))]
    return pairs


@pytest.mark.parametrize("ops", [["min", "max", "mean", "norm", "nans", "zeros"], ["norm"], ["mean", "zeros"]],
                         ids="-".join)
def test_grouped_device_reads_equal_numpy(ops, monkeypatch):
    groups = []
    grouped = ms_stats._grouped_vectors

    def counted(group, plan, numel):
        groups.append(len(group))
        return grouped(group, plan, numel)

    alone = []
    record = MsStatsEngine.record

    def counted_record(self, t, *args, **kwargs):
        alone.append(tuple(t.shape))
        return record(self, t, *args, **kwargs)

    monkeypatch.setattr(ms_stats, "_grouped_vectors", counted)
    monkeypatch.setattr(MsStatsEngine, "record", counted_record)
    pairs = _layers(10)
    engine = MsStatsEngine(read_host=False)
    keys = [(0, f"t{i}", "param", None) for i in range(len(pairs))]
    records = engine.record_many([t for t, _ in pairs], StatPlan.from_ops(ops), keys)
    # fp32 8x8, fp64 8, fp16 2x3, bf16 4 (MindSpore's CPU stacks it after a cast to fp32);
    # only the large, the integer and the empty tensor are reduced alone
    assert len(groups) >= 4 and set(groups) == {10}, groups  # one more where bf16's stack is found missing
    assert sorted(alone) == sorted([(GROUP_MAX_NUMEL + 1,), (14,), (0,)]), alone
    engine.to_host(records)
    assert [r.key for r in records] == keys
    for i, ((_, ref), rec) in enumerate(zip(pairs, records)):
        stat = merge_records(0, [rec])[0].stat
        want = np_stats(ref)
        want["zeros"] = int((ref == 0).sum())
        for op in ops:
            got = stat.value(op)
            if op in ("nans", "zeros"):
                assert got == want[op], (i, op, got, want[op])
            elif math.isnan(want[op]):
                assert math.isnan(got), (i, op, got)
            else:
                assert got == pytest.approx(want[op], rel=1e-5, abs=1e-6), (i, op, got, want[op])


def test_grouped_device_reads_equal_one_record_each():
    """The grouped records hold what ``record`` of each tensor alone gives (the same
    primitives along rows: equal to fp32 rounding)."""
    pairs = _layers(6)
    plan = StatPlan.from_ops(["min", "max", "mean", "norm", "nans"])
    keys = [(0, f"t{i}", "param", None) for i in range(len(pairs))]
    engine = MsStatsEngine(read_host=False)
    many = engine.record_many([t for t, _ in pairs], plan, keys)
    alone = [engine.record(t, plan, *key) for (t, _), key in zip(pairs, keys)]
    engine.to_host(many + alone)
    for a, b in zip(many, alone):
        assert (a.nans, a.numel) == (b.nans, b.numel), a.name
        assert a.vector == pytest.approx(b.vector, rel=1e-6, abs=1e-6, nan_ok=True), a.name
