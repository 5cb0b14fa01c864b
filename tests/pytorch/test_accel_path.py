"""The PyTorch engine's accelerator path, run on the CPU through its test seam
(``MSPROBE_MONITOR_ACCEL_ON_CPU=1``: CPU tensors take every accelerator branch: no C kernel,
no value read back to decide anything, the non-blocking transfer that the writer waits for).

Values are checked against NumPy float64 on a copy of each tensor: min, max, NaN and zero
counts exactly, mean and norm within 1e-6 relative (absolute 1e-6 x the mean of |x| for a
mean near zero). The cost is counted with a dispatch mode let past the engine's
``outside_training_modes`` (the mode stacks' lengths hidden from its check, as
test_stats_grouped.py's ``AtenCalls`` does): ATen ops per tensor, bytes they read and
write, and the largest set of temporaries alive at once. The whole monitor (every monitor
on test_module.py's tiny GPT, sync and async writer) runs under the seam with its rows
against NumPy and training bit-identical. The CUDA-only checks (capture, streams) are at
the end and run on a GPU machine. This process has no ``TRITON_INTERPRET=1``, so the fused
Triton kernel does not read CPU tensors here: these are the ATen path's checks (said once at
INFO, the last test); test_kernel_path.py runs the kernel's path under the seam.
"""

import copy
import math
import weakref
from collections import Counter
from typing import Dict, List

import numpy as np
import pytest
import torch

from support import find_row, rows_of
from support.modes import SeenByTheEngine
from msprobe.core.monitor_v2.frameworks.pytorch import stats as torch_stats
from msprobe.core.monitor_v2.frameworks.pytorch.stats import ACCEL_ON_CPU_ENV, DeviceStats, TorchStatsEngine
from msprobe.core.monitor_v2.stats import StatPlan, merge_records
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

ALL_OPS = ("min", "max", "mean", "norm", "nans", "zeros")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MiB = 1 << 20


@pytest.fixture
def seam(monkeypatch):
    monkeypatch.setenv(ACCEL_ON_CPU_ENV, "1")
    engine = TorchStatsEngine()
    assert engine._native is None and not engine.on_host(torch.device("cpu"))
    return engine


class OpCost(SeenByTheEngine):
    """ATen ops the engine runs inside it (views left out: they launch nothing), the bytes
    their tensor arguments and results hold, and the peak of the bytes of results alive
    at once (each result's storage followed by a weak reference until it is freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.read = self.written = 0
        self.live = self.peak = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func.overloadpacket.__name__ in ("detach", "lift_fresh"):
            return out
        self.ops[func.overloadpacket.__name__] += 1
        for a in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor):
                self.read += a.numel() * a.element_size()
        # an out= or in-place op writes into a tensor that exists: no new temporary
        writes_into = any(r.alias_info is not None for r in func._schema.returns)
        for o in torch.utils._pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor):
                nbytes = o.numel() * o.element_size()
                self.written += nbytes
                if not writes_into:
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(o, self._freed, nbytes)
        return out

    @property
    def launches(self) -> int:
        return sum(self.ops.values())


def _special(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """n values of ``dtype``: normal values with NaN, +-inf, -0.0, zeros and one value near
    the dtype's maximum placed in them where there is room."""
    g = torch.Generator().manual_seed(seed + n)
    t = (torch.randn(n, generator=g) * 3 + 0.25).to(dtype)
    big = 3.0e38 if dtype != torch.float16 else 65000.0
    for i, v in enumerate((big, 0.0, -0.0, 0.0)):
        if i < n:
            t[(i * 7919) % n] = v
    return t


def _finite_and_special(n: int, dtype: torch.dtype) -> List[torch.Tensor]:
    t = _special(n, dtype)
    out = [t]
    if n >= 8:
        nan = t.clone()
        nan[1] = math.nan
        nan[n // 2] = math.nan
        inf = t.clone()
        inf[n - 1] = math.inf
        inf[n // 3] = -math.inf
        pos_inf = t.clone()
        pos_inf[2] = math.inf
        out += [nan, inf, pos_inf]
    return out


def _assert_matches_numpy(vector, nans, zeros, numel, t: torch.Tensor, what: str) -> None:
    a = t.detach().to(torch.float64).numpy().copy().ravel()
    assert numel == a.size, what
    if a.size == 0:
        assert nans == 0 and zeros == 0, what
        return
    mn, mx, total, norm = vector
    assert (nans or 0) == int(np.isnan(a).sum()), what  # None: an integer tensor, no count needed
    assert zeros is None or zeros == int((a == 0).sum()), what  # None: not asked for
    if np.isnan(a).any():
        assert all(math.isnan(v) for v in (mn, mx, total, norm)), (what, vector)
        return
    assert mn == a.min() and mx == a.max(), (what, vector, a.min(), a.max())
    want_norm = float(np.sqrt(np.sum(a * a)))
    if math.isinf(want_norm):
        assert norm == math.inf, (what, vector)
    else:
        assert math.isclose(norm, want_norm, rel_tol=1e-6), (what, norm, want_norm)
    with np.errstate(invalid="ignore"):
        want_mean = float(np.mean(a))
    if not math.isfinite(want_mean):
        assert (math.isnan(want_mean) and math.isnan(total)) or total / numel == want_mean, (what, vector)
        return
    scale = float(np.mean(np.abs(a)))
    assert math.isclose(total / numel, want_mean, rel_tol=1e-6, abs_tol=1e-6 * scale), (what, total / numel, want_mean)


def _host(engine: TorchStatsEngine, recs):
    on_device = any(isinstance(r.vector, (DeviceStats, torch.Tensor)) for r in recs)
    ready = engine.to_host(recs)
    assert (ready is not None) == on_device  # the seam's transfer: issued, then waited for by the caller
    if ready is not None:
        ready()
    return recs


SIZES = [0, 1, 7, 4096, 65537, (1 << 22) + 5]


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_tensor_against_numpy(seam, dtype, n):
    plan = StatPlan.from_ops(ALL_OPS)
    tensors = _finite_and_special(n, dtype) if n < (1 << 20) else [_special(n, dtype)]
    recs = [seam.record(t, plan, 0, f"t{i}", "s") for i, t in enumerate(tensors)]
    for rec, t in zip(_host(seam, recs), tensors):
        assert isinstance(rec.vector, (list, tuple))
        _assert_matches_numpy(rec.vector, rec.nans, rec.zeros, rec.numel, t, f"{dtype} n={n}")


def test_lists_of_mixed_sizes_dtypes_and_layouts_against_numpy(seam):
    """``record_many`` of a mixed list: small same-shape tensors (grouped), large ones
    (one multi-tensor norm for the list), views that are not contiguous, fp64, integers,
    an empty tensor; and the records a tensor shares (the same vector object twice)."""
    plan = StatPlan.from_ops(ALL_OPS)
    tensors: List[torch.Tensor] = []
    for dtype in DTYPES:
        for n in (3, 3, 3, 100, 100, 70000, 70001, 200003):
            tensors += _finite_and_special(n, dtype)
    g = torch.Generator().manual_seed(5)
    tensors += [torch.randn(300, 500, generator=g).t(), torch.randn(9, 9, generator=g).double(),
                torch.arange(-50, 70), torch.empty(0), torch.randn(4, 70000, generator=g)[:, ::2]]
    keys = [(0, f"t{i}", "s", None) for i in range(len(tensors))]
    recs = seam.record_many(tensors, plan, keys)
    recs.append(recs[3].relabelled(0, "again", "s", None))
    _host(seam, recs)
    for rec, t in zip(recs, tensors + [tensors[3]]):
        _assert_matches_numpy(rec.vector, rec.nans, rec.zeros, rec.numel, t, rec.name)
    rows = merge_records(0, recs)
    assert len(rows) == len(recs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_counts_in_chunks_exact_with_a_bounded_temporary(seam, dtype):
    """A tensor of more than one counting chunk (2^23 elements): NaN and zero counts are
    the sum of the chunks' counts, exact, and no temporary alive at once exceeds 8 MiB
    (a whole-tensor ``isnan`` would be n bytes)."""
    n = (1 << 23) + 9
    t = _special(n, dtype)
    t[5] = t[n - 2] = math.nan
    t[(1 << 23) + 3] = 0.0
    plan = StatPlan.from_ops(ALL_OPS)
    with OpCost() as cost:
        rec = seam.record(t, plan, 0, "big", "s")
    assert cost.ops["isnan"] == 2 and cost.ops["eq"] == 2, cost.ops
    assert cost.peak <= 8 * MiB + 4096, cost.peak
    assert "_to_copy" not in cost.ops and "copy_" not in cost.ops, cost.ops  # no widened copy
    _host(seam, [rec])
    _assert_matches_numpy(rec.vector, rec.nans, rec.zeros, rec.numel, t, str(dtype))


def test_a_device_type_with_fp32_norms_reads_every_dtype(seam, monkeypatch):
    """Where the norms are accumulated in fp32 (MPS, NPUs, a device type whose fp64 probe
    failed), fp64 tensors keep fp64 norms (a narrower accumulator is refused by torch,
    which failed the whole list before). The bf16 tensor's fp32 norm is checked to 1e-5:
    the CPU's fp32 reduction is less accurate than a device's tree of partial sums."""
    monkeypatch.setitem(torch_stats._norm_dtypes, "cpu", torch.float32)
    g = torch.Generator().manual_seed(11)
    tensors = [torch.randn(70000, generator=g).double(), torch.randn(70000, generator=g).bfloat16(),
               torch.randn(300, 400, generator=g).double().t(), torch.randn(5, generator=g).double()]
    plan = StatPlan.from_ops(ALL_OPS)
    recs = seam.record_many(tensors, plan, [(0, f"t{i}", "s", None) for i in range(len(tensors))])
    recs += [seam.record(t, plan, 0, f"one{i}", "s") for i, t in enumerate(tensors)]
    _host(seam, recs)
    for rec, t in zip(recs, tensors + tensors):
        if t.dtype == torch.float64:
            _assert_matches_numpy(rec.vector, rec.nans, rec.zeros, rec.numel, t, rec.name)
        else:
            want = float(np.linalg.norm(t.double().numpy()))
            assert math.isclose(rec.vector[3], want, rel_tol=1e-5), (rec.name, rec.vector, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_strided_tensor_is_read_with_a_bounded_temporary(seam, dtype):
    """A view that is not contiguous (a transposed 2^23-element tensor, an expanded one):
    its norm reads contiguous copies of chunks of 8 MiB at most, so the sum of squares is
    accumulated as a contiguous tensor's; values against NumPy."""
    g = torch.Generator().manual_seed(9)
    base = torch.randn(2048, 4099, generator=g).to(dtype)
    base[3, 5] = 0.0
    for t in (base.t(), torch.randn(4099, generator=g).to(dtype).expand(2048, 4099)):
        assert not t.is_contiguous()
        plan = StatPlan.from_ops(ALL_OPS)
        with OpCost() as cost:
            rec = seam.record(t, plan, 0, "strided", "s")
        assert cost.peak <= 8 * MiB + 4096, cost.peak
        _host(seam, [rec])
        _assert_matches_numpy(rec.vector, rec.nans, rec.zeros, rec.numel, t, str(dtype))


@pytest.mark.parametrize("n", [1000, (1 << 22) + 5], ids=["small", "4M"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_tensor_costs_five_ops_and_one_byte_temporary_per_element(seam, dtype, n):
    """A hook's tensor (``record``): ``aminmax``, an fp32 ``sum``, one ``_foreach_norm`` and
    the NaN count (``isnan`` and its ``sum``), whatever the size up to 2^23 elements; no
    copy of the tensor in another dtype: the only tensor-sized result is the 1-byte
    boolean of the NaN count. The reads are four of the tensor's and one of that boolean."""
    t = _special(n, dtype)
    plan = StatPlan.from_ops(("min", "max", "mean", "norm", "nans"))
    seam.record(t[:3], plan, 0, "warm", "s")  # the engine's cached 0-d zero is made once
    with OpCost() as cost:
        rec = seam.record(t, plan, 0, "t", "s")
    assert cost.ops == Counter({"aminmax": 1, "sum": 2, "_foreach_norm": 1, "isnan": 1}), cost.ops
    e = t.element_size()
    assert cost.written <= n + 64, cost.written
    assert cost.read <= (4 * e + 1) * n + 64, (cost.read / n, e)
    assert cost.peak <= n + 64
    _host(seam, [rec])
    _assert_matches_numpy(rec.vector, rec.nans, rec.zeros, rec.numel, t, str(dtype))


def test_a_list_reads_its_norms_in_one_multi_tensor_call(seam):
    """``record_many`` of tensors above the group size: one ``_foreach_norm`` per dtype for
    the whole list, then ``aminmax``, ``sum`` and the NaN count per tensor: 4 ops a
    tensor plus one a dtype."""
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(70000 + i, generator=g).to(d) for i in range(6) for d in (torch.float32, torch.bfloat16)]
    plan = StatPlan.from_ops(("min", "max", "mean", "norm", "nans"))
    keys = [(0, f"t{i}", "s", None) for i in range(len(tensors))]
    seam.record(tensors[0], plan, 0, "warm", "s")  # the engine's cached 0-d zero is made once
    with OpCost() as cost:
        recs = seam.record_many(tensors, plan, keys)
    assert cost.ops["_foreach_norm"] == 2, cost.ops
    assert cost.launches <= 4 * len(tensors) + 2, cost.ops
    _host(seam, recs)
    for rec, t in zip(recs, tensors):
        _assert_matches_numpy(rec.vector, rec.nans, rec.zeros, rec.numel, t, rec.name)


# ---------------------------------------------------- the size matrix (issue 48 item 2)
MATRIX_SIZES = [0, 1, 1025, (1 << 20) + 3, (1 << 22) + 5]


def _matrix_tensors(n: int, dtype: torch.dtype) -> List[torch.Tensor]:
    """The matrix's tensors of ``n`` elements: ``_finite_and_special``'s (NaN, +-inf, -0.0,
    zeros, one value near the dtype's maximum; above 2^16 elements only the first two, the
    small sizes cover the others), an all-NaN one, and one whose values near the maximum
    make a square sum that fp64 holds and fp32 does not (3e38 and -3e38: its sum stays
    finite in any order; fp16's maximum squares within fp32 anyway)."""
    out = _finite_and_special(n, dtype)
    if n > 1 << 16:
        out = out[:2]
    if n:
        out.append(torch.full((n,), math.nan, dtype=dtype))
    if n >= 3:
        big = 3.0e38 if dtype != torch.float16 else 65000.0
        wide = _special(n, dtype, seed=1)
        wide[0], wide[n // 2] = big, -big
        out.append(wide)
    return out


@pytest.mark.parametrize("n", MATRIX_SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_size_matrix_in_hooks_and_in_lists_against_numpy(seam, dtype, n):
    """Each tensor of the matrix read as a hook reads it (``record``) and all of them in
    one ``record_many`` (small same-shape ones grouped, the others one multi-tensor norm
    call): min, max, NaN and zero counts exact, mean and norm within 1e-6 of NumPy's
    float64; a tensor with a NaN reads NaN everywhere, as the C kernel's does."""
    plan = StatPlan.from_ops(ALL_OPS)
    tensors = _matrix_tensors(n, dtype)
    hooks = [seam.record(t, plan, 0, f"hook{i}", "s") for i, t in enumerate(tensors)]
    listed = seam.record_many(tensors, plan, [(0, f"list{i}", "s", None) for i in range(len(tensors))])
    _host(seam, hooks + listed)
    for rec, t in zip(hooks + listed, tensors + tensors):
        _assert_matches_numpy(rec.vector, rec.nans, rec.zeros, rec.numel, t, f"{rec.name} {dtype} n={n}")


def test_a_2_24_plus_7_fp32_tensor_against_numpy(seam):
    """Above 2^24 elements an fp32 accumulator that added serially would drift (its
    spacing at 1.7e7 is 2): values around 1, with a few specials, in a hook and in a list."""
    n = (1 << 24) + 7
    g = torch.Generator().manual_seed(24)
    t = torch.randn(n, generator=g) * 0.5 + 1.0
    t[3], t[n - 5], t[n // 2] = 0.0, -0.0, 3.0e38
    plan = StatPlan.from_ops(ALL_OPS)
    recs = [seam.record(t, plan, 0, "hook", "s"), *seam.record_many([t, t[:1025]], plan, [(0, "l0", "s", None),
                                                                                         (0, "l1", "s", None)])]
    _host(seam, recs)
    for rec, want in zip(recs, (t, t, t[:1025])):
        _assert_matches_numpy(rec.vector, rec.nans, rec.zeros, rec.numel, want, rec.name)


@pytest.mark.parametrize("members", [8, 64])
def test_a_group_costs_six_launches_whatever_its_members(seam, members):
    """``record_many`` of same-shape small tensors (a model's repeated layers): the stack,
    ``aminmax``, the sum, one ``_foreach_norm`` for the rows, and the NaN count (``isnan``,
    ``sum``): six launches for the group, none per member (no cast of the columns, no stack
    of the four of them: each vector is its rows' 0-d results, joined at ``to_host``)."""
    g = torch.Generator().manual_seed(members)
    tensors = [torch.randn(30, 33, generator=g).to(torch.bfloat16) for _ in range(members)]
    tensors[1][2, 3] = math.nan
    tensors[2][0, 0] = math.inf
    plan = StatPlan.from_ops(("min", "max", "mean", "norm", "nans"))
    torch_stats._norm_dtype(torch.device("cpu"))  # the once-a-process probe, outside the count
    with OpCost() as cost:
        recs = seam.record_many(tensors, plan, [(0, f"t{i}", "s", None) for i in range(members)])
    assert cost.ops == Counter({"stack": 1, "aminmax": 1, "sum": 2, "_foreach_norm": 1, "isnan": 1}), cost.ops
    _host(seam, recs)
    for rec, t in zip(recs, tensors):
        _assert_matches_numpy(rec.vector, rec.nans, rec.zeros, rec.numel, t, rec.name)


def test_a_fresh_engine_launches_only_the_reductions(seam):
    """The first read of a new engine launches what every read does, nothing more: the
    stand-in zero of a statistic the plan leaves out is made only when one is left out."""
    torch_stats._norm_dtype(torch.device("cpu"))  # the once-a-process probe, outside the count
    t = torch.randn(5000, generator=torch.Generator().manual_seed(2))
    with OpCost() as cost:
        rec = seam.record(t, StatPlan.from_ops(("min", "max", "mean", "norm", "nans")), 0, "t", "s")
    assert cost.ops == Counter({"aminmax": 1, "sum": 2, "_foreach_norm": 1, "isnan": 1}), cost.ops
    with OpCost() as cost:
        without_norm = seam.record(t, StatPlan.from_ops(("min", "max", "mean", "nans")), 0, "u", "s")
    assert cost.ops == Counter({"zeros": 1, "aminmax": 1, "sum": 2, "isnan": 1}), cost.ops
    _host(seam, [rec, without_norm])
    _assert_matches_numpy(rec.vector, rec.nans, rec.zeros, rec.numel, t, "t")
    assert without_norm.vector[3] == 0.0 and without_norm.vector[:3] == rec.vector[:3]


@pytest.mark.parametrize("ops", [("min", "max", "mean", "norm", "nans"), ALL_OPS], ids=["nans", "nans-zeros"])
def test_same_size_tensors_of_a_list_share_their_count_buffer(seam, ops):
    """``record_many`` of eight tensors of 2^20 elements (an MoE model's experts, a model's
    repeated projections; one a transposed view): their NaN (and zero) booleans are the rows of one 8 MiB buffer,
    summed in one launch: per tensor ``aminmax``, ``sum`` and the boolean (``ne``, ``eq``),
    one sum of the buffer and one ``_foreach_norm`` for the list (and the transposed one's
    copy and norm: 8 x 4 + 3 launches before, 8 x 6 + 3 with zeros); the counts exact, with
    no temporary above 8 MiB."""
    g = torch.Generator().manual_seed(20)
    tensors = [torch.randn(1 << 10, 1 << 10, generator=g).to(torch.bfloat16) for _ in range(8)]
    tensors[2][5, 7] = tensors[2][0, 0] = tensors[7][1023, 1023] = math.nan
    tensors[3][4, :] = 0.0
    tensors[3][5, 1] = -0.0
    tensors[6][:, 9] = math.inf
    tensors[5] = tensors[5].t()  # a view that is not contiguous writes its row all the same
    tensors[5][0, 3] = math.nan
    plan = StatPlan.from_ops(ops)
    torch_stats._norm_dtype(torch.device("cpu"))  # the once-a-process probe, outside the count
    with OpCost() as cost:
        recs = seam.record_many(tensors, plan, [(0, f"t{i}", "s", None) for i in range(len(tensors))])
    launched = Counter({op: k for op, k in cost.ops.items() if not op.startswith("empty")})
    # the transposed one's norm reads a contiguous copy of it (``_strided_norm``, 2 MiB)
    want = Counter({"aminmax": 8, "sum": 8 + 1, "ne": 8, "_foreach_norm": 1 + 1, "clone": 1})
    if plan.zeros:
        want.update({"eq": 8, "sum": 1})
    assert launched == want, launched
    assert cost.peak <= 8 * MiB + 4096, cost.peak
    _host(seam, recs)
    for rec, t in zip(recs, tensors):
        _assert_matches_numpy(rec.vector, rec.nans, rec.zeros, rec.numel, t, rec.name)


def test_the_step_moves_in_one_copy_per_buffer(seam):
    """``to_host`` joins a whole step's values into one buffer (and counts into another):
    the copies to the host do not grow with the records, and nothing is read before the
    writer calls what it returns."""
    g = torch.Generator().manual_seed(4)
    tensors = [torch.randn(50 + i, generator=g) for i in range(200)]
    plan = StatPlan.from_ops(ALL_OPS)
    recs = [seam.record(t, plan, 0, f"t{i}", "s") for i, t in enumerate(tensors)]
    with OpCost() as cost:
        ready = seam.to_host(recs)
    assert cost.ops == Counter({"cat": 2, "copy_": 2, "empty": 2}) or cost.ops == Counter(
        {"cat": 2, "copy_": 2, "empty.memory_format": 2}), cost.ops
    assert all(isinstance(r.vector, DeviceStats) for r in recs)  # filled only by ready()
    ready()
    for rec, t in zip(recs, tensors):
        _assert_matches_numpy(rec.vector, rec.nans, rec.zeros, rec.numel, t, rec.name)


# ------------------------------------------------------------------ the whole monitor
from test_module import TinyGPT, assert_rows_match_reference, expected, make_data  # noqa: E402


def _train(model, batches, config=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = None
    if config is not None:
        mon = TrainerMonitorV2(config)
        mon.start(model=model, optimizer=opt)
        mon.engine_used = mon._session.engine
    losses, grads, params, moments = [], [], [], []
    try:
        for idx, tgt in batches:
            params.append({n: p.detach().clone() for n, p in model.named_parameters()})
            loss = model(idx, targets=tgt).loss
            loss.backward()
            losses.append(loss.detach().clone())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
            moments.append({n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters() if p in opt.state})
            opt.zero_grad()
    finally:
        if mon is not None:
            mon.stop()
    return mon, losses, grads, params, moments


def _tight(row: Dict[str, str], t: torch.Tensor) -> None:
    """A CSV row (9 significant digits) against NumPy float64 of ``t``."""
    a = t.detach().double().numpy().ravel()
    assert math.isclose(float(row["min"]), a.min(), rel_tol=1e-8, abs_tol=1e-30), row
    assert math.isclose(float(row["max"]), a.max(), rel_tol=1e-8, abs_tol=1e-30), row
    assert math.isclose(float(row["norm"]), float(np.sqrt(np.sum(a * a))), rel_tol=1e-6), row
    assert math.isclose(float(row["mean"]), float(a.mean()), rel_tol=1e-6, abs_tol=1e-6 * float(np.abs(a).mean())), row
    assert int(row["nans"]) == 0


@pytest.mark.parametrize("async_write", [False, True], ids=["sync", "async"])
def test_whole_monitor_under_the_seam(tmp_path, monkeypatch, async_write):
    monkeypatch.setenv(ACCEL_ON_CPU_ENV, "1")
    model = TinyGPT()
    twin = copy.deepcopy(model)
    batches = make_data(2)
    exp = expected(model, batches[:1])
    config = {"output_dir": str(tmp_path / "out"), "async_write": async_write, "monitors": {
        "module": {"enabled": True},
        "weight_grad": {"enabled": True},
        "optimizer": {"enabled": True},
        "param": {"enabled": True}}}
    mon, losses, grads, params, moments = _train(model, batches, config)
    _, losses_off, _, params_off, _ = _train(twin, batches)
    assert mon.errors.count == 0
    assert mon.engine_used._accel_on_cpu and mon.engine_used._native is None
    assert all(torch.equal(a, b) for a, b in zip(losses, losses_off))  # training bit-identical
    for a, b in zip(params + [dict(model.named_parameters())], params_off + [dict(twin.named_parameters())]):
        assert all(torch.equal(a[n], b[n]) for n in a)
    out = tmp_path / "out"
    assert_rows_match_reference(rows_of(out, "module"), exp, step=0)
    wg, opt_rows, param_rows = rows_of(out, "weight_grad"), rows_of(out, "optimizer"), rows_of(out, "param")
    for s in range(2):
        for n, g in grads[s].items():
            _tight(find_row(wg, step=s, module_name=n, scope="reduced"), g)
        for n, m in moments[s].items():
            _tight(find_row(opt_rows, step=s, module_name=f"{n}.exp_avg", scope="exp_avg"), m)
        for n, p in params[s].items():
            _tight(find_row(param_rows, step=s, module_name=n, scope="param_origin"), p)


# ------------------------------------------------------------------ CUDA only
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: streams, events and graph capture")


@cuda
def test_cuda_copy_is_pinned_and_waited_for_by_an_event():
    engine = TorchStatsEngine()
    plan = StatPlan.from_ops(ALL_OPS)
    t = torch.randn(1 << 20, device="cuda")
    t[7] = math.nan
    rec = engine.record(t, plan, 0, "t", "s")
    torch.cuda.set_sync_debug_mode("error")
    try:
        ready = engine.to_host([rec])  # no synchronisation while the copy is issued
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert ready is not None
    ready()
    _assert_matches_numpy(rec.vector, rec.nans, rec.zeros, rec.numel, t.cpu(), "cuda")


@cuda
def test_vectors_of_another_stream_are_waited_for():
    """Statistics made on a side stream (as in a collective's future callback) after a
    long kernel there: the step's copy waits for them through ``mark_stream``'s event."""
    engine = TorchStatsEngine()
    plan = StatPlan.from_ops(("min", "max", "mean", "norm", "nans"))
    side = torch.cuda.Stream()
    x = torch.randn(4096, 4096, device="cuda")
    with torch.cuda.stream(side):
        side.wait_stream(torch.cuda.current_stream())
        y = x
        for _ in range(20):
            y = y @ x / 64.0
        rec = engine.record(y, plan, 0, "y", "s")
        engine.mark_stream()
    ready = engine.to_host([rec])
    ready()
    torch.cuda.synchronize()
    _assert_matches_numpy(rec.vector, rec.nans, rec.zeros, rec.numel, y.cpu(), "side stream")


@cuda
def test_no_statistics_during_graph_capture(caplog):
    engine = TorchStatsEngine()
    plan = StatPlan.from_ops(("min", "max", "mean", "norm", "nans"))
    x = torch.randn(1000, device="cuda")
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x * 2
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        y = x * 2
        rec = engine.record(y, plan, 0, "captured.output.0", "forward")
        recs = engine.record_many([y, x], plan, [(0, "a", "s", None), (0, "b", "s", None)])
    graph.replay()
    assert rec.vector is None and all(r.vector is None for r in recs)
    said = [r.getMessage() for r in caplog.records if "CUDA graph" in r.getMessage()]
    assert len(said) == 1 and "captured.output.0" in said[0], said


# ------------------------------------------------------------------ DDP, 2 ranks
def test_ddp_two_ranks_under_the_seam(tmp_path):
    """tests/distributed/workers/data_parallel.py's DDP job (gloo, 2 ranks, 2 micro-batches a
    step) with the seam on in both ranks: each rank's unreduced rows are its local gradients
    and its reduced rows their mean over the ranks (NumPy on the worker's unmonitored
    copies); the job's own bit-identity check, with every monitor on, holds in both ranks."""
    from pathlib import Path

    from support import run_torchrun

    worker = Path(__file__).parents[1] / "distributed" / "workers" / "data_parallel.py"
    out = tmp_path / "ddp"
    out.mkdir()
    run_torchrun(worker, "ddp", out, env={ACCEL_ON_CPU_ENV: "1"})
    refs = [torch.load(out / f"ref_rank{r}.pt") for r in range(2)]
    for r in range(2):
        bitwise = torch.load(out / f"bitwise_rank{r}.pt")
        assert bitwise["bit_identical"] is True
        rows = rows_of(out, "weight_grad", rank=r)
        steps = len(refs[r]["grads"])
        for s in range(steps):
            for name, _ in refs[r]["grads"][s][0].items():
                local = sum(g[name] for g in refs[r]["grads"][s])
                _tight(find_row(rows, step=s, module_name=name, scope="unreduced"), local)
                mean = sum(sum(g[name] for g in refs[q]["grads"][s]) for q in range(2)) / 2
                _tight(find_row(rows, step=s, module_name=name, scope="reduced"), mean)


# ------------------------------------------------------------------ the fused kernel's absence
def test_where_the_kernel_does_not_read_the_reads_use_aten_said_once(seam, monkeypatch, caplog):
    """Under the seam without Triton's interpreter the fused kernel cannot read CPU tensors
    (on a device: no Triton, no back end for it): every read takes the ATen path, with
    the values right, and one INFO line says why; the engine does not ask again."""
    from msprobe.core.monitor_v2.frameworks.pytorch import triton_stats
    from msprobe.core.monitor_v2.logonce import LogOnce

    if triton_stats.available(torch.device("cpu")):  # TRITON_INTERPRET=1 in this process since Triton's import
        pytest.fail("this check needs a process without TRITON_INTERPRET=1 (test_kernel_path.py runs that case)")
    monkeypatch.setattr(torch_stats, "_no_kernel", set())
    monkeypatch.setattr(triton_stats, "_said", LogOnce())
    asked: List[int] = []
    usable = triton_stats.usable
    monkeypatch.setattr(triton_stats, "usable", lambda device: asked.append(1) or usable(device))
    caplog.set_level("INFO", logger="msprobe.monitor_v2")
    g = torch.Generator().manual_seed(12)
    tensors = [torch.randn(70000, generator=g), torch.randn(50, generator=g).bfloat16()]
    plan = StatPlan.from_ops(ALL_OPS)
    recs = seam.record_many(tensors, plan, [(0, f"t{i}", "s", None) for i in range(len(tensors))])
    recs += [seam.record(t, plan, 0, f"one{i}", "s") for i, t in enumerate(tensors)]
    _host(seam, recs)
    for rec, t in zip(recs, tensors + tensors):
        _assert_matches_numpy(rec.vector, rec.nans, rec.zeros, rec.numel, t, rec.name)
    said = [r for r in caplog.records if "Triton statistics kernel" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "INFO", [r.getMessage() for r in said]
    assert "does not read cpu tensors (" in said[0].getMessage() and "use ATen" in said[0].getMessage()
    assert asked == [1]  # found once, then skipped without a call
