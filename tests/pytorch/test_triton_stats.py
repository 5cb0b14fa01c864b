"""The accelerator kernel (``frameworks/pytorch/triton_stats.py``, issue 48 item 1) on the
CPU under Triton's interpreter: every statistic of every tensor of a list against NumPy
in float64 on the tensor's raw bits (fp32/bf16/fp16 decoded by NumPy, not by torch),
sizes 0 to 2^24 + 7, NaN, ±Inf, -0.0, values near the fp32 maximum and below the fp32
square's range, mixed lists, and the number of launches. Min, max and the counts must be
exact; sum and norm within 1e-6 relative (the sum: 1e-6 of the sum of |x|, the spec's
"absolute 1e-6 x mean |x|").

Triton reads ``TRITON_INTERPRET`` when it is imported (its own library functions, such as
``tl.zeros`` and the reductions, are made for the mode of that moment) and when a kernel
is made. Setting it in this process could come too late (another test may have imported
Triton) and would leak into later tests, so the checks (``check_*``) run in one child
Python per mode for the whole module (``support.child_checks``): ``interpreted``
(``TRITON_INTERPRET=1`` from the start) and ``compiling`` (unset). Each test sends its
check's name there and fails with the child's traceback.

The interpreter runs the kernels' own code, not the GPU's compiler; the last check
compiles them with Triton's real back ends (CUDA sm_90 and sm_80, ROCm gfx942: no device
needed) and checks that aligned tensors are read in vector loads."""

import logging
import math
import os
import re
from typing import Any, List, Optional, Tuple

import numpy as np
import pytest
import torch

from support.extras import require
from support.child_checks import ChildChecks

require("triton", "the accelerator statistics kernel is written in Triton and tested under its interpreter")

from msprobe.core.monitor_v2.frameworks.pytorch import triton_stats  # noqa: E402

CPU = torch.device("cpu")
RTOL = 1e-6
FP32_MAX = float(np.finfo(np.float32).max)

@pytest.fixture(scope="module")
def interpreted():
    child = ChildChecks(__file__, {"TRITON_INTERPRET": "1"})
    yield child
    child.close()


@pytest.fixture(scope="module")
def compiling():
    child = ChildChecks(__file__, {"TRITON_INTERPRET": None})
    yield child
    child.close()


def _float64(t: torch.Tensor) -> np.ndarray:
    """The tensor's values in float64, decoded by NumPy from its bits."""
    t = t.detach().contiguous()
    if t.dtype == torch.float32:
        return t.numpy().astype(np.float64)
    bits = t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.float16:
        return bits.view(np.float16).astype(np.float64)
    assert t.dtype == torch.bfloat16
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _reference(t: torch.Tensor) -> Tuple[List[float], int, int, float]:
    """``([min, max, sum, norm], nans, zeros, sum of |x|)`` in float64: NaN min/max/sum/norm
    where a NaN is inside, ``[nan, nan, 0, 0]`` for no element."""
    a = _float64(t)
    nans = int(np.isnan(a).sum())
    zeros = int((a == 0).sum())
    if a.size == 0:
        return [math.nan, math.nan, 0.0, 0.0], 0, 0, 0.0
    if nans:
        return [math.nan] * 4, nans, zeros, math.nan
    with np.errstate(over="ignore", invalid="ignore"):
        return ([float(a.min()), float(a.max()), float(a.sum()), float(np.sqrt(np.sum(a * a)))], nans, zeros,
                float(np.abs(a).sum()))


def _check(got_vector: torch.Tensor, got_nans: int, got_zeros: Optional[int], t: torch.Tensor, label: str) -> None:
    want, nans, zeros, abs_sum = _reference(t)
    mn, mx, total, norm = got_vector.tolist()
    where = f"{label} ({t.dtype}, {t.numel()} elements)"
    assert got_nans == nans, where
    if got_zeros is not None:
        assert got_zeros == zeros, where
    for name, got, ref in (("min", mn, want[0]), ("max", mx, want[1])):
        assert (math.isnan(got) and math.isnan(ref)) or got == ref, (where, name, got, ref)
    for name, got, ref, tol in (("sum", total, want[2], RTOL * abs_sum), ("norm", norm, want[3], RTOL * want[3])):
        if math.isnan(ref) or math.isinf(ref):
            assert (math.isnan(got) and math.isnan(ref)) or got == ref, (where, name, got, ref)
        else:
            assert math.isfinite(got) and abs(got - ref) <= tol, (where, name, got, ref, tol)


def _read_and_check(tensors: List[torch.Tensor], zeros: bool = True, label: str = "", device: str = "cpu",
                    **knobs) -> None:
    """``tensors`` (on the CPU: the reference's copy) read on ``device`` and checked."""
    on_device = [t.to(device) for t in tensors]
    before = [t.clone() for t in on_device]
    read = triton_stats.read_many(on_device, zeros, **knobs)
    assert read is not None
    vectors, nans, zero_counts = (None if x is None else x.cpu() for x in read)
    assert vectors.dtype == torch.float64 and tuple(vectors.shape) == (len(tensors), 4)
    assert nans.dtype == torch.int64 and tuple(nans.shape) == (len(tensors),)
    if zeros:
        assert zero_counts is not None and zero_counts.dtype == torch.int64
    else:
        assert zero_counts is None
    for i, t in enumerate(tensors):
        _check(vectors[i], int(nans[i]), int(zero_counts[i]) if zeros else None, t, f"{label}[{i}]")
    for t, old in zip(on_device, before):  # read, never written
        assert torch.equal(t.view(torch.uint8) if t.numel() else t, old.view(torch.uint8) if t.numel() else old)


def _data(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal values with a mean, a few exact zeros and negative zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3 + 0.25
    if n >= 8:
        x[n // 3] = 0.0
        x[n // 2] = -0.0
        x[-1] = 0.0
    return x.to(dtype)


SIZES = (0, 1, 2, 1023, 1024, 1025, 2047, 2048, 2049, 65535, 65536, 65537, (1 << 20) + 3)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_sizes_in_one_list(dtype: str) -> None:
    tensors = [_data(n, DTYPES[dtype], seed=n) for n in SIZES]
    _read_and_check(tensors, label=dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sizes_in_one_list(interpreted, dtype):
    """Every size from empty to 2^20 + 3 (tile and chunk boundaries included) in one list."""
    interpreted(check_sizes_in_one_list, dtype)


def check_many_chunks_a_tensor() -> None:
    _read_and_check([_data((1 << 17) + 3, torch.float32, 1), _data(1025, torch.bfloat16, 2)],
                    label="chunk 512", chunk=512, block=256)
    _read_and_check([_data(1025, torch.float16, 3), _data(5, torch.float32, 4), _data(0, torch.float32, 5)],
                    label="chunk 64", chunk=64, block=16)


def test_many_chunks_a_tensor(interpreted):
    """Small chunks: a tensor spread over 257 programs (the finalising pass reads its
    partials in two tiles), others over 3 and 17, tiles of 256 and 16 elements."""
    interpreted(check_many_chunks_a_tensor)


def check_largest_size_fp32() -> None:
    _read_and_check([_data((1 << 24) + 7, torch.float32, 24)], label="2^24+7", block=1 << 16)


def test_largest_size_fp32(interpreted):
    """2^24 + 7 fp32 elements (257 chunks, the last of 7 elements). Tiles of 2^16 elements:
    the interpreter's time goes by tile (about 3 s on an idle core, 20 s with the GPU's
    2048-element tiles)."""
    interpreted(check_largest_size_fp32)


def check_mixed_sizes_and_dtypes() -> None:
    rng = np.random.default_rng(7)
    dtypes = list(DTYPES.values())
    sizes = [0, 1, 3, 17, 100, 2048, 4096, 5000, 70000, 0, 1 << 17]
    tensors = [_data(int(n), dtypes[int(rng.integers(3))], seed=i) for i, n in enumerate(rng.permutation(sizes * 3))]
    _read_and_check(tensors, label="mixed")
    _read_and_check(tensors, zeros=False, label="mixed, no zeros")


def test_mixed_sizes_and_dtypes(interpreted):
    """Many tensors of every dtype and size in one launch, empty ones among them, in a
    shuffled order: each gets its own statistics; without ``zeros`` no zero count."""
    interpreted(check_mixed_sizes_and_dtypes)


def _special_values() -> List[Tuple[str, torch.Tensor]]:
    big = torch.full((5000,), 3.0e38)
    big[::2] = FP32_MAX
    big[1::7] = -3.3e38
    overflow_in_one_chunk = torch.randn(3 * 2048 + 5)
    overflow_in_one_chunk[2048 + 10] = 3.3e38
    overflow_in_one_chunk[2048 + 11] = 3.3e38
    squares_overflow = torch.full((3000,), 2e19)  # x^2 = 4e38 > fp32 max, the sum is not
    squares_overflow[::3] = -1.9e19
    tiny = torch.full((4099,), 1e-30)  # x^2 = 1e-60: zero in fp32
    tiny[::5] = -3e-25
    subnormal = torch.full((100,), 1e-40)
    subnormal[7] = -1.4e-45
    one_nan = torch.randn(3000)
    one_nan[1234] = math.nan
    one_nan[5] = 0.0
    one_nan[6] = -0.0
    both_infs = torch.randn(2500)
    both_infs[3] = math.inf
    both_infs[2000] = -math.inf
    plus_inf = torch.randn(10)
    plus_inf[4] = math.inf
    minus_inf = torch.randn(2049)
    minus_inf[2048] = -math.inf
    inf_and_nan = torch.tensor([math.inf, math.nan, -1.0, 0.0])
    zeros_signed = torch.tensor([0.0, -0.0] * 1500)
    cases = [
        ("near the fp32 maximum", big),
        ("near the fp32 maximum, in one chunk of four", overflow_in_one_chunk),
        ("squares beyond fp32", squares_overflow),
        ("squares below fp32", tiny),
        ("subnormals", subnormal),
        ("one NaN", one_nan),
        ("all NaN", torch.full((3000,), math.nan)),
        ("one NaN alone", torch.tensor([math.nan])),
        ("+inf and -inf", both_infs),
        ("+inf", plus_inf),
        ("-inf at a tile's end", minus_inf),
        ("inf and NaN", inf_and_nan),
        ("+0 and -0", zeros_signed),
        ("empty", torch.empty(0)),
        ("bf16 near its maximum", torch.tensor([3.38e38, 3.3e38, -3.38e38, 1.0] * 700).bfloat16()),
        ("bf16 NaN and inf", torch.tensor([1.0, math.nan, math.inf, -0.0]).bfloat16()),
        ("bf16 squares below fp32", torch.full((3000,), 1e-25).bfloat16()),
        ("fp16 maximum", torch.tensor([65504.0, -65504.0, 65504.0] * 1000).half()),
        ("fp16 subnormals", torch.tensor([6e-8, -6e-8, 1e-5, 0.0] * 600).half()),
        ("fp16 inf and NaN", torch.tensor([math.inf, -math.inf, math.nan, 2.0]).half()),
    ]
    return cases


def check_special_values() -> None:
    cases = _special_values()
    _read_and_check([t for _, t in cases], label="specials")
    for label, t in cases:
        _read_and_check([t], label=label, chunk=2048)


def test_special_values(interpreted):
    """NaN, ±Inf, -0.0, values near the fp32 maximum (finite data gives finite sums, as
    in fp64), squares below fp32's range, all-NaN and empty tensors, in one list and one
    at a time."""
    interpreted(check_special_values)


def check_nan_semantics_exact() -> None:
    t = torch.tensor([1.0, math.nan, -0.0, 0.0, math.nan, 2.0])
    vectors, nans, zeros = triton_stats.read_many([t], True)
    assert all(math.isnan(v) for v in vectors[0].tolist())
    assert int(nans[0]) == 2 and int(zeros[0]) == 2
    vectors, nans, zeros = triton_stats.read_many([torch.empty(0, dtype=torch.bfloat16)], True)
    row = vectors[0].tolist()
    assert math.isnan(row[0]) and math.isnan(row[1]) and row[2:] == [0.0, 0.0]
    assert int(nans[0]) == 0 and int(zeros[0]) == 0


def test_nan_semantics_exact(interpreted):
    """A NaN makes min, max, sum and norm NaN; the count is exact and NaN is never a zero;
    an empty tensor is ``[nan, nan, 0, 0]``."""
    interpreted(check_nan_semantics_exact)


def check_norm_of_4m_bf16_gradient() -> None:
    g = torch.Generator().manual_seed(48)
    t = (torch.randn(1 << 22, generator=g) * 1e-3 + 2e-6).bfloat16()
    a = _float64(t)
    vectors, _, _ = triton_stats.read_many([t], False)
    norm = math.sqrt(math.fsum(a * a))
    assert abs(vectors[0, 3].item() - norm) <= 1e-7 * norm, (vectors[0, 3].item(), norm)
    assert abs(vectors[0, 2].item() - math.fsum(a)) <= 1e-7 * float(np.abs(a).sum())


def test_norm_of_4m_bf16_gradient_within_1e_7(interpreted):
    """A 4M-element bf16 gradient-like tensor (small values around a small mean), with the
    default tiles and chunks: the norm within 1e-7 of fp64 (exactly summed), the sum within
    1e-7 of the sum of |x|."""
    interpreted(check_norm_of_4m_bf16_gradient)


def _count_launches():
    partials_kernel, finish_kernel = triton_stats._kernels()
    launches: List[str] = []
    hooks = []
    for name, kernel in (("partials", partials_kernel), ("finish", finish_kernel)):
        def hook(*args, _name=name, **kwargs):
            launches.append(_name)
        kernel.add_pre_run_hook(hook)
        hooks.append((kernel, hook))
    return launches, hooks


def check_one_list_two_launches() -> None:
    launches, hooks = _count_launches()
    try:
        tensors = [_data(n * 37 % 3000, list(DTYPES.values())[n % 3], n) for n in range(150)]
        vectors, nans, _ = triton_stats.read_many(tensors, True)
        assert launches == ["partials", "finish"]
        for i in (0, 1, 75, 149):
            _check(vectors[i], int(nans[i]), None, tensors[i], f"list[{i}]")
        launches.clear()
        vectors, _, _ = triton_stats.read_many([torch.empty(0), torch.empty(0).half()], False)
        assert launches == ["finish"]
        assert math.isnan(vectors[1, 0].item()) and vectors[1, 3].item() == 0.0
    finally:
        for kernel, hook in hooks:
            kernel.pre_run_hooks.remove(hook)


def check_long_list_in_parts() -> None:
    assert triton_stats.parts([5000, 5000, 1, 9000, 0, 2048], 2048, most=4) == [(0, 1), (1, 3), (3, 4), (4, 6)]
    assert triton_stats.parts([10 ** 6], 2048, most=4) == [(0, 1)]  # more chunks than that: a part alone
    launches, hooks = _count_launches()
    most = triton_stats._MAX_CHUNKS_A_LAUNCH
    triton_stats._MAX_CHUNKS_A_LAUNCH = 4
    try:
        tensors = [_data(n, list(DTYPES.values())[i % 3], i) for i, n in enumerate([5000, 5000, 1, 9000, 0, 2048])]
        tensors[1][17] = math.nan
        tensors[3][0] = 0.0
        vectors, nans, zeros = triton_stats.read_many(tensors, True, chunk=2048)
        assert launches == ["partials", "finish"] * 4, launches
        for i, t in enumerate(tensors):
            _check(vectors[i], int(nans[i]), int(zeros[i]), t, f"part list[{i}]")
    finally:
        triton_stats._MAX_CHUNKS_A_LAUNCH = most
        for kernel, hook in hooks:
            kernel.pre_run_hooks.remove(hook)


def test_a_long_list_is_read_in_parts(interpreted):
    """A list of more chunks than one pair of launches reads (2^17; 4 here) is read in
    parts, in order, a pair of launches each, so that the partials stay bounded; the
    values are those of one list."""
    interpreted(check_long_list_in_parts)


def test_one_list_two_launches(interpreted):
    """A list of 150 tensors of mixed sizes and dtypes: one launch for the chunks, one to
    finish; a list of empty tensors needs only the second."""
    interpreted(check_one_list_two_launches)


def check_fused_reader() -> None:
    from msprobe.core.monitor_v2.stats import StatPlan

    tensors = [_data(3000, torch.bfloat16, 1), _data(5, torch.float32, 2), torch.tensor([math.nan, -0.0]).half()]
    got = triton_stats.fused_reader(tensors, StatPlan.from_ops(("min", "max", "mean", "norm", "nans", "zeros")))
    assert got is not None and len(got) == 3
    for (vector, nans, zeros), t in zip(got, tensors):
        assert tuple(vector.shape) == (4,) and nans.dim() == 0 and zeros.dim() == 0
        _check(vector, int(nans), int(zeros), t, "fused_reader")
    got = triton_stats.fused_reader(tensors, StatPlan.from_ops(("norm",)))
    assert got is not None and all(nans is None and zeros is None for _, nans, zeros in got)
    _check(got[0][0], 0, None, tensors[0], "fused_reader, norm only")
    assert triton_stats.fused_reader([tensors[0], torch.randn(3, 4)[:, ::2]], StatPlan.from_ops(("norm",))) is None
    # a dense permutation is read in memory order: the same statistics
    base = _data(6 * 7 * 5, torch.float32, 3).view(6, 7, 5)
    got = triton_stats.fused_reader([base.permute(2, 0, 1), base.transpose(0, 2)], StatPlan.from_ops(("norm",)))
    assert got is not None
    for (vector, _, _), t in zip(got, (base.permute(2, 0, 1), base.transpose(0, 2))):
        _check(vector, 0, None, t, "fused_reader, permuted")
    assert triton_stats.fused_reader([tensors[0], torch.empty(2, device="meta")], StatPlan.from_ops(("norm",))) is None


def test_fused_reader(interpreted):
    """The engine's seam (``stats.fused_reader``): per tensor a [4] vector and 0-d counts,
    only the counts the plan asks for; dense permutations (a transpose) read in memory
    order; a list holding a tensor it does not read as it is (a strided slice with gaps),
    or tensors of two devices, goes back to the caller (None)."""
    interpreted(check_fused_reader)


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: List[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def check_available_and_accepts() -> None:
    assert triton_stats.available(CPU)
    assert not triton_stats.available(torch.device("cuda"))  # the interpreter cannot read device memory
    assert not triton_stats.available(torch.device("meta"))
    x = torch.randn(4, 6)
    assert triton_stats.accepts(x) and triton_stats.accepts(x.bfloat16()) and triton_stats.accepts(x.half())
    assert triton_stats.accepts(x.t()) and triton_stats.accepts(torch.randn(2, 3, 4).permute(2, 0, 1))  # dense
    assert not triton_stats.accepts(x[:, ::2]) and not triton_stats.accepts(x[:1].expand(4, 6))  # gaps, repeats
    assert not triton_stats.accepts(x.double()) and not triton_stats.accepts(x.int())
    assert not triton_stats.accepts(x._neg_view())
    with pytest.raises(ValueError, match="accepts"):
        triton_stats.read_many([x, x[:, ::2]], False)
    os.environ.pop("TRITON_INTERPRET")  # changed after Triton's import: not usable
    try:
        assert not triton_stats.available(CPU)
    finally:
        os.environ["TRITON_INTERPRET"] = "1"
    assert triton_stats.available(CPU)


def test_available_and_accepts(interpreted):
    """Where the kernel runs (the CPU only under the interpreter it was imported with, no
    device memory there), and which tensors it reads as they are."""
    interpreted(check_available_and_accepts)


def check_not_available_is_said_once() -> None:
    assert not triton_stats.available(CPU)
    said = _Said()
    logger = logging.getLogger("msprobe.monitor_v2")
    logger.addHandler(said)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        assert triton_stats.read_many([torch.randn(10)], False) is None
        assert triton_stats.read_many([torch.randn(10).half()], True) is None
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)
    messages = [r for r in said.records if "Triton statistics kernel" in r.getMessage()]
    assert len(messages) == 1 and messages[0].levelname == "INFO", [r.getMessage() for r in said.records]


def test_not_available_is_said_once(compiling):
    """Compiling Triton on a machine without a GPU: a CPU list is not read, None (the
    caller's ATen path), said once at INFO."""
    compiling(check_not_available_is_said_once)


def check_kernels_compile(backend: str, arch: Any, warp: int) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    partials_kernel, finish_kernel = triton_stats._kernels()
    target = GPUTarget(backend, arch, warp)
    divisible = [["tt.divisibility", 16]]
    wide_loads = {}
    for aligned in (True, False):
        source = ASTSource(
            partials_kernel,
            {"table": "*i64", "n": "i32", "steps": "i32", "chunk": "i32", "partials": "*fp64", "n_chunks": "i32",
             "BLOCK": "constexpr", "ZEROS": "constexpr", "TINY": "constexpr", "ALIGNED": "constexpr"},
            constexprs={"BLOCK": triton_stats._BLOCK, "ZEROS": True, "TINY": triton_stats._TINY_SUMSQ,
                        "ALIGNED": aligned},
            attrs={(0,): divisible, (3,): divisible, (4,): divisible})
        compiled = triton.compile(source, target=target, options={"num_warps": triton_stats._WARPS})
        code = compiled.asm["ptx"] if backend == "cuda" else compiled.asm["amdgcn"]
        wide_loads[aligned] = len(re.findall(r"ld\.global\.v4\.b32|global_load_dwordx[24]", code))
    assert wide_loads[True] >= 3 and wide_loads[False] == 0, wide_loads
    finish = ASTSource(finish_kernel, {"table": "*i64", "n": "i32", "partials": "*fp64", "n_chunks": "i32",
                                       "vectors": "*fp64", "nan_counts": "*i64", "zero_counts": "*i64",
                                       "BLOCK": "constexpr"},
                       constexprs={"BLOCK": triton_stats._FINISH_BLOCK})
    assert triton.compile(finish, target=target, options={"num_warps": 4}).asm


def check_on_the_gpu() -> None:
    device = "cuda"
    assert triton_stats.available(torch.device(device))
    for dtype in DTYPES:
        _read_and_check([_data(n, DTYPES[dtype], seed=n) for n in SIZES], label=f"gpu {dtype}", device=device)
    _read_and_check([_data((1 << 24) + 7, torch.float32, 24)], label="gpu 2^24+7", device=device)
    cases = _special_values()
    _read_and_check([t for _, t in cases], label="gpu specials", device=device)
    for label, t in cases:
        _read_and_check([t], label=f"gpu {label}", device=device, chunk=2048)
    base = _data(70001, torch.bfloat16, 9)  # views 2 bytes into a block: the unaligned variant
    _read_and_check([base[1:], base[3:5000], _data(100, torch.float16, 10)], label="gpu unaligned", device=device)
    g = torch.Generator().manual_seed(48)
    t = (torch.randn(1 << 22, generator=g) * 1e-3 + 2e-6).bfloat16()
    a = _float64(t)
    norm = math.sqrt(math.fsum(a * a))
    assert abs(triton_stats.read_many([t.to(device)], False)[0][0, 3].item() - norm) <= 1e-7 * norm
    # no host sync on the way: torch raises on any synchronising call in this mode
    tensors = [_data(n * 37 % 30000, list(DTYPES.values())[n % 3], n).to(device) for n in range(300)]
    launches, hooks = _count_launches()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        vectors, nans, zeros = triton_stats.read_many(tensors, True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        for kernel, hook in hooks:
            kernel.pre_run_hooks.remove(hook)
    assert launches == ["partials", "finish"]
    for i in (0, 1, 150, 299):
        _check(vectors[i].cpu(), int(nans[i]), int(zeros[i]), tensors[i].cpu(), f"gpu list[{i}]")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA (or ROCm) GPU: the kernel compiled and run "
                    "on a device; the interpreter's checks above run everywhere (scripts/gpu_checks.sh runs this)")
def test_on_the_gpu(compiling):
    """On a GPU: the same values against NumPy (sizes to 2^24 + 7 with the GPU's tiles and
    chunks, the special values, an unaligned list, the 4M-element norm within 1e-7), two
    launches for 300 tensors, and no host sync under ``set_sync_debug_mode("error")``."""
    compiling(check_on_the_gpu)


@pytest.mark.parametrize("backend,arch,warp", [("cuda", 90, 32), ("cuda", 80, 32), ("hip", "gfx942", 64)])
def test_kernels_compile_for_gpus(compiling, backend, arch, warp):
    """The kernels go through Triton's real compiler to device code (cubin, hsaco) with
    the arguments a launch specialises; whole tiles of aligned tensors are read in vector
    loads (16 bytes a thread on CUDA, 8-16 on gfx942), unaligned ones in element loads
    (correct, slower)."""
    compiling(check_kernels_compile, backend, arch, warp)
