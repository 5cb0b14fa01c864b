"""Device side of the statistics engine for PyTorch.

Each tensor becomes a 4-vector ``[min, max, sum, norm]``, plus a NaN count. Nothing is
cloned or kept: the reductions read the tensor in place.

- On the CPU, contiguous fp32/bf16/fp16 tensors go through the one-pass C kernel of
  ``monitor_v2.native`` when it could be built: one read of the data for all
  statistics and the NaN count, with the results already on the host (sums in fp64).
- On accelerators (and under the CPU test seam with Triton's interpreter), fp32/bf16/fp16
  tensors whose elements fill one block of memory go through the fused Triton kernel
  (``triton_stats.py``, the seam ``fused_reader``): one read of each element, two launches
  for one tensor in a hook or for a whole ``record_many`` list of any sizes, the results
  left on the device. Where Triton is missing, has no back end for the device, or a launch
  fails (said once at INFO, naming why), and for the other tensors, ATen's reductions below.
- Elsewhere, and without a C compiler, ATen's reductions compute the vector on the
  tensor's own device. The sum and the sum of squares are accumulated so that finite
  values give finite, accurate results (a 4M-element norm within ~1e-9 of an fp64
  reference; fp32 values up to the fp32 maximum never report ``inf``):

  * on accelerators (and under the CPU test seam, ``MSPROBE_MONITOR_ACCEL_ON_CPU=1``),
    no copy of the tensor is made: ``aminmax`` reads min and max in the tensor's dtype,
    the sum is accumulated in fp32 (fp64 for fp64 tensors: a wider sum of a narrower
    dtype is a full-size cast inside CUDA's reductions), and the norm comes from
    ``torch._foreach_norm(..., dtype=fp64)``, one multi-tensor call for a list, which
    reads the tensors as they are and accumulates in fp64 registers (fp32 on device types
    where that call fails: probed once per type; Apple MPS and Ascend NPUs are fp32
    without a probe), so finite fp32 values up to the fp32 maximum give a finite norm
    (the fp32 sum of several values near that maximum can overflow: the mean then reads
    ``inf``, the one statistic where this path is weaker than an fp64 copy);
    NaN and zero counts are taken in chunks of 2^23 elements (an 8 MiB boolean
    temporary at most). Nothing is stacked per tensor: the parts stay 0-d device
    tensors (``DeviceStats``) until ``to_host`` joins the whole step's;
  * on the CPU, ATen's fp64 reductions of fp32 data are ~20x slower than its fp32 ones,
    so partial sums of squares over 2^12 elements are computed in fp32 (one batched
    BLAS call) and added in fp64, as the C kernel does; ATen's fp32 sum is already
    accurate (cascade summation). When a partial overflows (values beyond ~1e19), the
    result is not finite although the data may be; only then (the tensor is in host
    memory: reading the result is not a synchronisation) the tensor is summed again
    in fp64 chunks.

  Integer and bool tensors are cast to fp32 first (a temporary freed at once). No value
  is read back to the host on accelerators. On the CPU the engine also reads the norm (or
  sum) to count NaNs only when it is not finite: counting NaNs costs about as much as all
  other statistics together, and a finite norm proves there is none. On accelerators the
  NaN count is computed on the device for every floating-point tensor.

Tensors that cannot be reduced as they are: 1-byte floats (float8 variants) are cast to
fp32 first (exact: every such value is an fp32 value); a quantized tensor gives the
statistics of the values it stands for (``dequantize()``, fp32); a jagged nested tensor
those of its packed values. A tensor without data (``device="meta"``), a strided nested
tensor, another layout (MKL-DNN...) or a dtype that cannot be cast exactly (packed
float4) gives no statistics: its record is marked unobserved (``vector`` None), its row
alone is left out, and the first tensor of each kind is named at WARNING once.
The optional ``zeros`` count (elements equal to zero; ``-0.0`` is zero, NaN is not) is
taken only when the monitor's ``ops`` ask for it: by the C kernel in the same read, by
ATen as ``count_nonzero(t == 0)`` in chunks (a bounded boolean temporary; the bf16/fp16
CPU path counts each fp32 chunk while it is in cache). On accelerators it
stays a device tensor until ``to_host``.

``to_host`` moves the vectors of a whole step to the host in one transfer per
(device, dtype) group: the number of transfers does not grow with the tensors. On
accelerators the transfer does not block: the step's values are joined into one buffer
per device, copied with ``non_blocking=True`` into pinned host memory, and an event is
recorded after the copy; ``to_host`` returns the function that waits on that event and
fills the records, which the writer calls when it formats the rows (on its own thread
with ``async_write``). Vectors made on another stream (the ``cc`` monitor's statistics in
a collective's future callback, which runs on a pool stream) are waited for on the
device (``mark_stream``: an event, no host wait) before the copy. Statistics are not
taken while a CUDA graph is being captured (a replay runs no hook: the rows would be
the capture's, once); the first tensor met so is named once at WARNING.

The training's dispatch modes never see the engine's work. Hooks run inside the
training's forward and backward, where Python dispatch modes and torch-function modes
may be active: selective activation checkpointing (which saves the results of the ops
its policy names and hands them back, in call order, to the recomputation), DebugMode,
FlopCounterMode, a user's ``TorchDispatchMode``. An ATen op of the engine seen there is
recorded as the model's own: under selective checkpointing the model's recomputed op then
receives the monitor's result. Every entry point that runs ATen ops (``_record_other``,
``record_many`` past the one-pass kernel, ``to_host``'s transfers, ``sum_parts``) runs
them with this thread's modes set aside (``outside_training_modes``), and puts them back
as they were. Without a mode that costs two C calls (the stacks' lengths); the one-pass
kernel's reads run no ATen op and need no check.
"""

import contextlib
import dataclasses
import functools
import logging
import math
import operator
import os
import threading
import weakref
from collections import defaultdict
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch

from ... import native
from . import graph_hooks, triton_stats
from ...logonce import LogOnce
from ...monitor import short_error
from ...stats import EMPTY_VECTOR, Record, StatPlan, read_grouped, record_type

logger = logging.getLogger("msprobe.monitor_v2")


_CHUNK = 1 << 20  # bf16/fp16 CPU tensors are cast to fp32 in chunks of this many elements
_DOT_CHUNK = 1 << 12  # CPU: fp32 partial sums of squares over this many elements, added in fp64
_WIDE_CHUNK = 1 << 22  # accelerators: elements cast to fp64 at a time
_NATIVE_CODES = {torch.float32: native.F32, torch.bfloat16: native.BF16, torch.float16: native.F16}
# Plain tensors only: a subclass may not own the memory its data pointer names.
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_EXPORTER_CHECKED: List[bool] = []

# The lengths of this thread's Python dispatch mode stack (user modes and the infra modes:
# FakeTensorMode, proxy and functional modes) and torch-function mode stack.
_dispatch_modes: Callable[[], int] = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)
_function_modes: Callable[[], int] = getattr(torch._C, "_len_torch_function_stack", lambda: 0)
_Fn = TypeVar("_Fn", bound=Callable[..., Any])


@contextlib.contextmanager
def _modes_set_aside() -> Iterator[None]:
    """This thread's torch-function modes and Python dispatch modes off their stacks for
    the block, and back on, in their order, after it (also when it raises)."""
    functions: List[Any] = []
    try:
        while _function_modes():
            functions.append(torch._C._pop_torch_function_stack())
        if _dispatch_modes():
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes():
                yield
        else:
            yield
    finally:
        for mode in reversed(functions):
            torch._C._push_on_torch_function_stack(mode)


def outside_training_modes(fn: _Fn) -> _Fn:
    """``fn`` run with the modes active around it set aside (``_modes_set_aside``): no
    tensor op it runs is recorded, counted, changed or replayed by them. Where no mode is
    active (the common case) the check is the two stacks' lengths, two C calls."""
    @functools.wraps(fn)
    def outside(*args: Any, **kwargs: Any) -> Any:
        if _dispatch_modes() or _function_modes():
            with _modes_set_aside():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return outside  # type: ignore[return-value]


# Device types found to lack fp64 reductions (Apple MPS is known; others are found by trying).
_NO_FP64 = {"mps"}

# The CPU test seam: CPU tensors take every accelerator branch (no C kernel, no value read
# on the host to decide anything, the non-blocking transfer). Read when an engine is made.
ACCEL_ON_CPU_ENV = "MSPROBE_MONITOR_ACCEL_ON_CPU"
# Accelerators: elements per NaN or zero counting pass (``isnan``/``eq`` write one byte an
# element): an 8 MiB temporary at most, whatever the tensor's size.
_COUNT_CHUNK = 1 << 23
# Device types whose fp64 norms are not used without a probe: Ascend NPUs may run an fp64
# op on the AI CPU, silently slow (Apple MPS has no fp64 at all: _NO_FP64).
_FP32_NORMS = {"npu"}
_norm_dtypes: Dict[str, torch.dtype] = {}
_foreach_norm_usable: List[bool] = []


def _wide_dtype(device: torch.device) -> torch.dtype:
    """The dtype the sums are accumulated in: fp64 wherever the device has it."""
    return torch.float32 if device.type in _NO_FP64 else torch.float64


def _capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph. CUDA tensors that
    exist have initialised CUDA; fake ones (a tracing of the engine) have not, and a torch
    built without CUDA cannot ask."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _has_foreach_norm() -> bool:
    """Whether this torch has ``torch._foreach_norm(tensors, ord, dtype=...)`` (older
    torch lacks the op or its ``dtype``): read once from the op's schema, nothing run."""
    if not _foreach_norm_usable:
        try:
            op = torch.ops.aten._foreach_norm
            schemas = [getattr(op, name)._schema for name in op.overloads()]
            usable = hasattr(torch, "_foreach_norm") and any(
                any(a.name == "dtype" for a in schema.arguments) for schema in schemas)
        except Exception:  # noqa: BLE001 - any failure: the per-tensor norm
            usable = False
        _foreach_norm_usable.append(usable)
    return _foreach_norm_usable[0]


def _norm_dtype(device: torch.device) -> torch.dtype:
    """The accelerator norms' accumulator: fp64 where the device type runs an fp64
    ``_foreach_norm`` of a bf16 tensor (tried once per device type, never assumed), else
    fp32. The probe launches one tiny kernel and reads nothing back."""
    kind = device.type
    dtype = _norm_dtypes.get(kind)
    if dtype is None:
        dtype = torch.float32
        if kind not in _NO_FP64 and kind not in _FP32_NORMS and _has_foreach_norm():
            try:
                torch._foreach_norm([torch.ones(2, dtype=torch.bfloat16, device=device)], 2, dtype=torch.float64)
                dtype = torch.float64
            except Exception:  # noqa: BLE001 - the device lacks it: fp32, said once
                logger.info("monitor_v2: %s tensors' norms are accumulated in fp32 here (no fp64 _foreach_norm)",
                            kind)
        _norm_dtypes[kind] = dtype
    return dtype


def _sum_dtype(t: torch.Tensor) -> torch.dtype:
    """The accumulator of an accelerator sum: fp32, which reductions read bf16/fp16 into
    without a copy, and fp64 for fp64 tensors."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class DeviceStats:
    """The statistics of one tensor on its device before ``to_host``: ``parts`` is
    ``(min, max, sum, norm)``, four 0-d tensors of their own dtypes, joined with the whole
    step's in one buffer by ``to_host`` instead of one stack per tensor."""

    __slots__ = ("parts",)

    def __init__(self, parts: Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        self.parts = parts

    def __repr__(self) -> str:
        return f"DeviceStats({self.parts!r})"


def _count_chunks(t: torch.Tensor, chunk: int = _COUNT_CHUNK) -> List[torch.Tensor]:
    """Views of ``t`` of at most ``chunk`` elements that cover it once: a contiguous
    tensor's flat view in slices; another's slices along its first dimension, each
    sliced again along the next where one row is larger than the chunk."""
    n = t.numel()
    if n <= chunk or t.dim() == 0:
        return [t]
    if t.is_contiguous():
        return list(t.view(-1).split(chunk))
    row = n // t.shape[0]
    if row <= chunk:
        return list(t.split(max(1, chunk // max(1, row))))
    return [part for r in t.unbind(0) for part in _count_chunks(r, chunk)]


def _device_count(t: torch.Tensor, what: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Elements of ``t`` for which ``what`` is true, counted on its device chunk by chunk:
    a 0-d int64 tensor, or a tuple of them (one a chunk) that ``to_host`` adds up."""
    counts = tuple(what(c).sum() for c in _count_chunks(t))
    return counts[0] if len(counts) == 1 else counts


def _is_zero(c: torch.Tensor) -> torch.Tensor:
    return torch.eq(c, 0)


def device_norms(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> List[torch.Tensor]:
    """Norms of same-device tensors as 0-d ``dtype`` tensors: one ``_foreach_norm`` for the
    dense ones where torch has it (it reads each tensor in its own dtype), else
    ``linalg.vector_norm`` per tensor, accumulated in fp32 (a wider accumulator of a
    narrower dtype is a full-size cast in CUDA's reductions)."""
    out: List[Any] = [None] * len(tensors)
    if _has_foreach_norm():
        # one call per dtype: a mixed list takes the multi-tensor op's per-tensor route
        by_dtype: Dict[torch.dtype, List[int]] = defaultdict(list)
        for i, t in enumerate(tensors):
            if t.is_contiguous():
                by_dtype[t.dtype].append(i)
        for of, dense in by_dtype.items():
            wide = torch.float64 if of == torch.float64 else dtype  # never narrower than the data
            for i, norm in zip(dense, torch._foreach_norm([tensors[i] for i in dense], 2, dtype=wide)):
                out[i] = norm
    for i, t in enumerate(tensors):
        if out[i] is None:
            out[i] = _strided_norm(t, dtype)
    return out


def _strided_norm(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Norm of a tensor that is not contiguous (or without ``_foreach_norm``): where torch
    has the multi-tensor op, a contiguous copy of each counting chunk (a bounded
    temporary in the tensor's own dtype) read by it, so the sum of squares is accumulated
    as the contiguous tensors' is; else ``linalg.vector_norm`` in fp32."""
    if not _has_foreach_norm():
        return torch.linalg.vector_norm(t, dtype=_sum_dtype(t))
    chunk = _COUNT_CHUNK // t.element_size()  # each copy 8 MiB at most
    wide = torch.float64 if t.dtype == torch.float64 else dtype
    parts = [torch._foreach_norm([c.contiguous()], 2, dtype=wide)[0] for c in _count_chunks(t, chunk)]
    return parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts))


# Device types whose tensors the fused kernel does not read (no Triton, no back end, a
# failed launch): found at their first read, said once at INFO by triton_stats, then
# skipped without a call.
_no_kernel: set = set()


def _kernel_reader(tensors: Sequence[torch.Tensor], plan: StatPlan) -> Optional[List[Tuple[Any, Any, Any]]]:
    """The fused Triton kernel (``triton_stats.fused_reader``: one read of each element,
    two launches for the whole list) where it reads ``tensors`` (one device, each
    ``triton_stats.accepts``-ed), else None: the caller's ATen path."""
    kind = tensors[0].device.type
    if kind in _no_kernel:
        return None
    if not triton_stats.usable(tensors[0].device):
        _no_kernel.add(kind)
        return None
    got = triton_stats.fused_reader(tensors, plan)
    if got is None and not triton_stats.available(tensors[0].device):  # its launch failed: said there
        _no_kernel.add(kind)
    return got


# The fused statistics kernel for accelerators: a function of (same-device tensors, plan)
# that returns for each tensor its (vector, nans, zeros) as device values ``to_host``
# moves (a [4] tensor or ``DeviceStats``; 0-d counts), or None where it does not read that
# list. The Triton kernel by default; tests set it to None to take the ATen path alone.
fused_reader: Optional[Callable[[Sequence[torch.Tensor], StatPlan],
                                Optional[List[Tuple[Any, Any, Any]]]]] = _kernel_reader


def _kernel_tensor(t: torch.Tensor) -> Optional[torch.Tensor]:
    """``t`` as the fused kernel reads it (a DTensor's local shard), or None where the
    kernel does not take it as it is (``triton_stats.accepts``: other dtypes and layouts,
    strided views that are not dense) or it has no element (the ATen path's empty record
    needs no launch)."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t if t.numel() and triton_stats.accepts(t) else None


def device_vectors(tensors: Sequence[torch.Tensor], plan: StatPlan,
                   zero_of: Callable[[torch.device, torch.dtype], torch.Tensor]) -> List[Tuple[Any, Any, Any]]:
    """``(vector, nans, zeros)`` of prepared, non-empty tensors of one accelerator, with
    nothing read back: per tensor ``aminmax`` and an fp32 ``sum``; the norms of the whole
    list in one multi-tensor call; the NaN (and zero) counts in bounded booleans, those of
    same-size tensors side by side in one (``_shared_counts``). The fused kernel
    (``fused_reader``) first, where one is set."""
    if fused_reader is not None:
        got = fused_reader(tensors, plan)
        if got is not None:
            return got
    device = tensors[0].device
    wide = _norm_dtype(device)
    # the stand-in for a statistic the plan leaves out, made only then (a launch once)
    zero = None if plan.minmax and plan.total and plan.norm else zero_of(device, wide)
    norms = device_norms(tensors, wide) if plan.norm else [zero] * len(tensors)
    nans = _shared_counts(tensors, _mark_nan, torch.isnan) if plan.nans else [None] * len(tensors)
    zeros = _shared_counts(tensors, _mark_zero, _is_zero) if plan.zeros else [None] * len(tensors)
    out = []
    for t, norm, nan_count, zero_count in zip(tensors, norms, nans, zeros):
        mn, mx = torch.aminmax(t) if plan.minmax else (zero, zero)
        total = t.sum(dtype=_sum_dtype(t)) if plan.total else zero
        out.append((DeviceStats((mn, mx, total, norm)), nan_count, zero_count))
    return out


def _mark_nan(t: torch.Tensor, marks: torch.Tensor) -> None:
    torch.ne(t, t, out=marks)  # true exactly for NaN: isnan, written into ``marks``


def _mark_zero(t: torch.Tensor, marks: torch.Tensor) -> None:
    torch.eq(t, 0, out=marks)


def _shared_counts(tensors: Sequence[torch.Tensor], mark: Callable[[torch.Tensor, torch.Tensor], None],
                   what: Callable[[torch.Tensor], torch.Tensor]) -> List[Any]:
    """Per tensor of one device, the elements ``what`` holds for, counted on the device
    (``_device_count``'s values). ATen has no reduction that counts NaNs, so each count is
    a boolean of its tensor (``mark`` writes it) and the boolean's sum: two launches. Tensors
    of one size up to half a counting chunk write theirs into the rows of one buffer of at
    most ``_COUNT_CHUNK`` bytes, summed along its rows in one launch: one launch a tensor and
    one a buffer (a list of 4M-element experts: 1.5 a tensor instead of 2). The others are
    counted alone, larger ones chunk by chunk."""
    counts: List[Any] = [None] * len(tensors)
    by_size: Dict[int, List[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        if t.numel() <= _COUNT_CHUNK // 2:
            by_size[t.numel()].append(i)
        else:
            counts[i] = _device_count(t, what)
    for numel, members in by_size.items():
        rows = _COUNT_CHUNK // numel
        for start in range(0, len(members), rows):
            part = members[start:start + rows]
            if len(part) == 1:
                counts[part[0]] = _device_count(tensors[part[0]], what)
                continue
            marks = torch.empty((len(part), numel), dtype=torch.bool, device=tensors[part[0]].device)
            for row, i in zip(marks, part):
                mark(tensors[i], row.view(tensors[i].shape))
            for i, count in zip(part, marks.sum(dim=1).unbind(0)):
                counts[i] = count
    return counts


def _sumsq_cpu(flat: torch.Tensor) -> torch.Tensor:
    """Sum of squares of a contiguous 1-D CPU tensor, as a 0-d fp64 tensor: fp32 dot
    products over rows of 2^12 elements (one batched BLAS call, as fast as one dot
    product over the whole tensor, whose fp32 accumulator drifts by ~1e-4 over 4M
    elements), added in fp64."""
    n = flat.numel()
    if n <= _DOT_CHUNK:
        return torch.dot(flat, flat).double()
    k = n // _DOT_CHUNK
    rows = flat[: k * _DOT_CHUNK].view(k, 1, _DOT_CHUNK)
    total = torch.bmm(rows, rows.transpose(1, 2)).double().sum()
    tail = flat[k * _DOT_CHUNK:]
    return total + torch.dot(tail, tail).double() if tail.numel() else total


# Squares of fp32 values below ~1e-19 underflow (1e-30 squares to 0): a sum of squares
# below this many times the element count may have lost them (each square's error is
# below 2^-149, so above the bound the loss is below 1e-9 of the sum).
_TINY_SQUARES = 2.0 ** -100


def _squares_underflowed(flat: torch.Tensor, sumsq: torch.Tensor, plan: StatPlan) -> bool:
    """Whether the fp32 sum of squares of a host tensor may have lost its squares to
    underflow: it is that small and the tensor holds a non-zero (read only then: data of
    ordinary size never pays for it). The one-pass kernel applies the same rule."""
    return bool(plan.norm and sumsq.item() < flat.numel() * _TINY_SQUARES and flat.any())


def _sums_wide(flat: torch.Tensor, wide: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(sum, sum of squares)`` of a 1-D tensor accumulated in ``wide``, chunk by chunk
    (a bounded temporary)."""
    sums, squares = [], []
    for c in flat.split(_WIDE_CHUNK):
        c = c.to(wide)
        sums.append(c.sum())
        squares.append(torch.dot(c, c))
    if len(sums) == 1:
        return sums[0], squares[0]
    return torch.stack(sums).sum(), torch.stack(squares).sum()


def _zero_count(t: torch.Tensor) -> torch.Tensor:
    """Elements of ``t`` equal to zero, as a 0-d int64 tensor on its device. The boolean
    temporary of ``t == 0`` is bounded by chunks for a contiguous tensor (2^20 elements
    on the CPU, where it then stays in cache, 2^22 elsewhere). ``count_nonzero`` of the
    booleans: ATen's ``sum`` of a bool tensor measured 3-4x slower on the CPU."""
    chunk = _CHUNK if t.device.type == "cpu" else _WIDE_CHUNK
    if not t.is_contiguous() or t.numel() <= chunk:
        return torch.count_nonzero(t == 0)
    return torch.stack([torch.count_nonzero(c == 0) for c in t.view(-1).split(chunk)]).sum()


@functools.lru_cache(maxsize=None)
def _without_nans(plan: StatPlan) -> StatPlan:
    return dataclasses.replace(plan, nans=False)


def _for_dtype(plan: StatPlan, t: torch.Tensor) -> StatPlan:
    """Integer and bool tensors hold no NaN: their count is known without a pass."""
    if plan.nans and not (t.is_floating_point() or t.is_complex()):
        return _without_nans(plan)
    return plan


def _data_pointer(t: torch.Tensor) -> Optional[int]:
    """The address of a plain, dense, contiguous tensor's first element, whose memory
    then holds exactly its values in order; None for anything else (subclasses, views
    with a sign or conjugate bit, nested or sparse tensors, storage-less wrappers such
    as functorch's, which look like plain tensors)."""
    if (type(t) not in _PLAIN or t.layout != torch.strided or t.is_nested or not t.is_contiguous()
            or t.is_neg() or t.is_conj()):
        return None
    try:
        return t.data_ptr()
    except RuntimeError:
        return None


_PLAIN_TYPES = frozenset(_PLAIN)
_HOST_COUNTS = frozenset((int, type(None)))  # a host record's NaN and zero counts
_dtype_of = operator.attrgetter("dtype")
_is_cpu = operator.attrgetter("is_cpu")
_layout_of = operator.attrgetter("layout")
_is_nested = operator.attrgetter("is_nested")


def _kernel_buffers(tensors: Sequence[torch.Tensor],
                    allowed: Dict[torch.dtype, int]) -> Optional[Tuple[List[int], List[int], List[int]]]:
    """``(pointers, counts, dtype codes)`` when the one-pass kernel reads every one of
    ``tensors`` (``_data_pointer``'s and ``_native_buffer``'s checks, each over the whole
    list in one C-level pass: a Python loop over thousands of small tensors cost more than
    the kernel itself), else None. The conjugate bit needs no check: only complex tensors
    carry it, and no complex dtype is in ``allowed``."""
    if not tensors or not set(map(type, tensors)) <= _PLAIN_TYPES:
        return None
    codes = list(map(allowed.get, map(_dtype_of, tensors)))
    if None in codes or not all(map(_is_cpu, tensors)) or set(map(_layout_of, tensors)) != {torch.strided}:
        return None
    counts = list(map(torch.Tensor.numel, tensors))
    if 0 in counts or any(map(_is_nested, tensors)) or not all(map(torch.Tensor.is_contiguous, tensors)) or any(
            map(torch.Tensor.is_neg, tensors)):
        return None
    try:
        pointers = list(map(torch.Tensor.data_ptr, tensors))
    except RuntimeError:  # a storage-less wrapper that looks like a plain tensor
        return None
    return pointers, counts, codes


# record_many's grouped ATen reductions (``read_grouped``: tensors the one-pass kernel does
# not read, every tensor on an accelerator and the CPU ones without a C compiler)
_GROUPED_DTYPES = frozenset((torch.float32, torch.float64, torch.bfloat16, torch.float16))


def _group_key(t: torch.Tensor) -> Optional[Tuple[torch.device, torch.dtype, Tuple[int, ...]]]:
    """The group ``t`` joins in ``_grouped_vectors`` (its device, dtype and shape), or None
    where it is reduced alone: anything but a plain, dense floating-point tensor of a usual
    dtype (the per-tensor path prepares the others: DTensors, complex, integer, 1-byte,
    quantized, sparse and nested tensors, and those with a sign bit, whose stack would
    resolve the bit into a copy)."""
    if (type(t) not in _PLAIN_TYPES or t.dtype not in _GROUPED_DTYPES or t.layout is not torch.strided
            or t.is_nested or t.is_meta or t.is_neg()):
        return None
    return t.device, t.dtype, tuple(t.shape)


def _grouped_vectors(group: List[torch.Tensor], plan: StatPlan,
                     zero_of: Callable[[torch.device, torch.dtype], torch.Tensor],
                     on_host: Optional[bool] = None) -> Tuple[Sequence[Any], Sequence[Any], Sequence[Any], int]:
    """``(vectors, nans, zeros, numel)`` of tensors of one device, dtype and shape, as
    ``_vector`` gives them one by one: each vector ``[min, max, sum, norm]`` with the sums
    accumulated in fp64 (fp32 on devices without it), NaN and zero counts as integers.

    The tensors are stacked into one ``[n, numel]`` temporary (freed when the read ends:
    nothing is kept) and reduced along its rows: one ``aminmax``, one sum, one norm and
    one NaN count for the whole group, where each tensor alone costs five or six ATen
    calls whose fixed cost, not the data, is most of a small tensor's time. On an
    accelerator nothing is read back (each tensor's vector is a ``DeviceStats`` of its
    row's results, which ``to_host`` moves with the step's others); on the CPU, where reading a
    value is not a synchronisation, the results are host values, and the NaN count runs
    only where a statistic is not finite (as ``_nan_count`` does). ``on_host`` False: the
    accelerator reads (``_grouped_device``), also for CPU tensors under the test seam."""
    numel = group[0].numel()
    device = group[0].device
    if on_host is None:
        on_host = device.type == "cpu"
    if not on_host:
        return _grouped_device(group, plan, zero_of)
    wide = _wide_dtype(device)
    with torch.no_grad():
        # every value of the other dtypes is exact in the wide one: min, max, NaN and
        # zero counts read from the cast are those of the tensors (and bf16/fp16
        # reductions in fp32 or fp64 are the fast ones on the CPU)
        # reshape, not view: tensors in another memory format (channels_last conv weights)
        # stack into a block that is not row-major, and are copied into one (a second
        # temporary of the same bound)
        x = torch.stack(group).reshape(len(group), numel).to(wide)
        zero = zero_of(device, wide).expand(len(group))
        total = x.sum(dim=1) if plan.total else zero
        norm = torch.linalg.vector_norm(x, dim=1) if plan.norm else zero
        mn, mx = torch.aminmax(x, dim=1) if plan.minmax else (zero, zero)
        vectors = torch.stack((mn, mx, total, norm), dim=1)
        nans: Optional[torch.Tensor] = None
        if plan.nans:
            probe = norm if plan.norm else total if plan.total else mx if plan.minmax else None
            if device.type != "cpu" or probe is None or not bool(torch.isfinite(probe).all()):
                nans = torch.isnan(x).sum(dim=1)
        zeros = torch.count_nonzero(x == 0, dim=1) if plan.zeros else None
    # the CPU's as host values (no transfer at the step's end, nothing for to_host to do),
    # an accelerator's as rows of the device tensors
    split = torch.Tensor.tolist if device.type == "cpu" else torch.Tensor.unbind
    absent = [None] * len(group)
    return (split(vectors), absent if nans is None else split(nans), absent if zeros is None else split(zeros),
            numel)


def _grouped_device(group: List[torch.Tensor], plan: StatPlan,
                    zero_of: Callable[[torch.device, torch.dtype], torch.Tensor],
                    ) -> Tuple[Sequence[Any], Sequence[Any], Sequence[Any], int]:
    """``_grouped_vectors`` on an accelerator: the group stacked in its own dtype (one
    bounded copy, ``GROUP_ELEMENTS`` at most) and reduced along its rows as
    ``device_vectors`` reduces one tensor: ``aminmax``, an fp32 sum, the rows' norms in one
    multi-tensor call, the NaN (and zero) counts of the block. Six launches for the whole
    group (eight with zeros), whatever its size: each tensor's vector is a ``DeviceStats``
    of its rows' 0-d results (views: no cast, no stack of the four columns; ``to_host``
    joins them with the step's others, widening each to the buffer's dtype exactly)."""
    numel = group[0].numel()
    device = group[0].device
    wide = _norm_dtype(device)
    count = len(group)
    with torch.no_grad():
        x = torch.stack(group).reshape(count, numel)
        zero = None if plan.minmax and plan.total and plan.norm else zero_of(device, wide)
        mn, mx = torch.aminmax(x, dim=1) if plan.minmax else ((zero,) * count, (zero,) * count)
        total = x.sum(dim=1, dtype=_sum_dtype(x)) if plan.total else (zero,) * count
        norms = device_norms(list(x.unbind(0)), wide) if plan.norm else (zero,) * count
        nans = torch.isnan(x).sum(dim=1).unbind(0) if plan.nans else [None] * count
        zeros = torch.eq(x, 0).sum(dim=1).unbind(0) if plan.zeros else [None] * count
    vectors = [DeviceStats(parts) for parts in zip(mn, mx, total, norms)]
    return vectors, nans, zeros, numel


def _memory_key(t: torch.Tensor, plan: StatPlan) -> Optional[Tuple[int, int, torch.dtype, Tuple[bool, ...]]]:
    """Where a tensor's values live; the same key means the same values."""
    pointer = _data_pointer(t)
    return None if pointer is None else (pointer, t.numel(), t.dtype, plan.key)


def unobservable(t: torch.Tensor) -> Optional[str]:
    """Why the engine cannot give statistics of ``t`` (None when it can)."""
    if t.is_meta:
        return "a meta tensor (it has a shape but no data)"
    if t.is_nested:
        return None if t.layout == torch.jagged else "a strided nested tensor (only jagged ones are reduced)"
    if t.layout not in _REDUCED_LAYOUTS:
        return f"a tensor of layout {t.layout} (strided and sparse tensors are reduced)"
    if t.dtype in _NO_EXACT_CAST:
        return f"a {t.dtype} tensor (packed values that no reduction reads)"
    return None


_REDUCED_LAYOUTS = {torch.strided, torch.sparse_coo, torch.sparse_csr, torch.sparse_csc,
                    torch.sparse_bsr, torch.sparse_bsc}
_NO_EXACT_CAST = {d for d in (getattr(torch, "float4_e2m1fn_x2", None),) if d is not None}


def _prepared(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if hasattr(t, "to_local"):  # DTensor: statistics of the local shard
        t = t.to_local()
    if t.is_nested:  # jagged (unobservable() turned the rest away): its packed values
        t = t.values()
    if t.is_quantized:
        return t.dequantize()
    if t.is_complex():
        t = t.abs()
    elif not t.is_floating_point() or t.element_size() == 1:  # ints, bool, float8: exact in fp32
        t = t.to(torch.float32)
    return t


def _use_exporter(ext: Any, codes: Dict[torch.dtype, int]) -> None:
    """Let the extension read CPU tensors through ``torch._C._to_dlpack``: one call for the
    address, dtype, device, shape and strides instead of seven getters (about a third of
    ``record``'s cost on a small tensor). Only where, on sample tensors, it gives what the
    getters give; else (another torch, another capsule) the getters stay. The warning
    filters are left alone: changing them, even for a moment, would change what the
    training's other threads warn."""
    export = getattr(torch._C, "_to_dlpack", None)
    if export is None or not hasattr(ext, "use_exporter"):
        return
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    samples = [base, base[1:], base[:, :1], base[0, 0], base.t(), base.to(torch.bfloat16), base.to(torch.float16),
               base.double(), torch._neg_view(base), torch.empty(0), base.clone().requires_grad_(),
               torch.empty(3, device="meta")]  # the view, which is not preceded by is_cpu, must turn it away
    try:
        wanted = [((t.data_ptr(), t.numel(), codes[t.dtype])
                   if t.is_cpu and t.dtype in codes and t.is_contiguous() and not t.is_neg() and t.numel() else None)
                  for t in samples]
        if any(ext.exported(t, export) != want for t, want in zip(samples, wanted)):
            return
    except Exception:  # noqa: BLE001 - an optimisation only: the getters stay
        return
    ext.use_exporter(export)
    _use_view(ext, samples, wanted)


def _use_view(ext: Any, samples: List[torch.Tensor], wanted: List[Any]) -> None:
    """Let the extension read CPU tensors through the DLPack C exchange API that torch
    publishes on its tensor type (``__dlpack_c_exchange_api__``, where torch has it: 2.13 does): a C
    function that describes a tensor without a Python call or a capsule (the export above
    costs about ten times as much). Only where, on the same samples, it gives what the
    getters give; else the export stays."""
    api = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
    if api is None or not hasattr(ext, "use_view"):
        return
    try:
        ext.use_view(api)
        if all(ext.viewed(t) == want for t, want in zip(samples, wanted)):
            return
    except Exception:  # noqa: BLE001 - an optimisation only: the export stays
        pass
    ext.use_view(None)


def _cache_entry(t: torch.Tensor, version: int, rec: Record) -> Tuple[Any, int, Record]:
    """An entry of the same-tensor cache (the extension's ``cache_entry`` where it is
    built): a weak reference to the tensor, its version when observed, its record."""
    return (weakref.ref(t), version, rec)


class TorchStatsEngine:
    def __init__(self, use_native: bool = True) -> None:
        # the test seam (docs/development.md): CPU tensors take the accelerator branches
        self._accel_on_cpu = os.environ.get(ACCEL_ON_CPU_ENV, "") == "1"
        if self._accel_on_cpu:
            use_native = False
        self._native = native.load() if use_native else None
        # the extension's records where it is built (outside the garbage collector)
        self._Record = record_type() if self._native is not None else Record
        ext = native.extension() if self._native is not None else None
        # the C++ graph hooks' library: its tensor descriptions serve every read of the kernel
        # (graph_hooks.py); looked for now (a build starts in the background) and between steps
        self._ext = ext
        self._graph_once = LogOnce()
        self._use_graph_library()
        # one buffer's statistics and its record in one call, the vector kept inline (no
        # tuple, no float objects); and the cache's entries outside the garbage collector
        self._record_read_ext = ext.record_read if ext is not None else None
        self._cache_entry = ext.cache_entry if ext is not None else _cache_entry
        # ``record`` of a tensor the kernel reads, checks, cache and read in one call
        self._tensor_record = ext.tensor_record if ext is not None else None
        # ``record_many``'s common case (the kernel reads every tensor) in one call
        self._records_of = ext.records_of if ext is not None else None
        # dtype -> the kernel's code, for the dtypes this build reduces
        self._kernel_codes: Dict[torch.dtype, int] = {} if self._native is None else {
            d: c for d, c in _NATIVE_CODES.items() if c in self._native.dtype_codes}
        if ext is not None and not _EXPORTER_CHECKED:
            _EXPORTER_CHECKED.append(True)  # once per process: the extension is shared
            _use_exporter(ext, self._kernel_codes)
        self._zeros: Dict[Tuple[torch.device, torch.dtype], torch.Tensor] = {}
        # The module monitor often observes one tensor object twice in a step (a block's
        # output is the next block's input; the root's output is the head's output). With
        # ``cache=True`` its vector is computed once: the cache holds a weak reference
        # (never the tensor) and the version counter, so a tensor modified in place, or a
        # new tensor that reuses a dead one's id, is computed again. Collectives write
        # into tensors from C++ without moving the version counter, so the cc monitor
        # clears the cache after each of them (``forget``). Cleared at every step end.
        self._seen: Dict[Tuple[int, Tuple[bool, ...]], Tuple["weakref.ref", int, Record]] = {}
        # The same memory also comes back through other tensor objects: in backward,
        # autograd hands a module's output gradient on as a view of another shape (the
        # gradient of a 3-D Linear output is reshaped to 2-D for the matmul). A view
        # shares its base's version counter, so for contiguous tensors a second key,
        # (first element's address, count, dtype), finds them. It counts only while the
        # tensor first seen is alive (so the memory cannot have been freed and reused)
        # and neither it nor the new view has been modified since. With ``module`` on
        # every module of the benchmark's model this reads 12 % fewer elements per step.
        self._seen_memory: Dict[Tuple[int, int, torch.dtype, Tuple[bool, ...]], Tuple["weakref.ref", int, Record]] = {}
        # The kernel's tensors (``_record_read``: contiguous, on the CPU) have one cache,
        # by plan then by first element's address: an int key, where the two above make
        # two tuples per observation that live until the step ends. The entry's tensor
        # (alive, same address, dtype and version) and record (same count) say the rest of
        # what the memory key holds; the same object always passes.
        self._seen_buffers: Dict[Tuple[bool, ...], Dict[int, Tuple["weakref.ref", int, Record]]] = {}
        self._unobserved = LogOnce()
        # the last event of each stream that made vectors (mark_stream: collectives'
        # callbacks), waited for on the device before the step's copy; one a stream, the
        # latest (it follows the earlier ones), so steps that write nothing add nothing
        self._other_streams: Dict[Tuple[int, int], Any] = {}
        self._streams_lock = threading.Lock()
        self._capture_said = LogOnce()

    def on_host(self, device: torch.device) -> bool:
        """Whether tensors of ``device`` are in host memory, where reading a value is no
        device synchronisation (False for every device under the test seam)."""
        return device.type == "cpu" and not self._accel_on_cpu

    def _zero(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (device, dtype)
        z = self._zeros.get(key)
        if z is None:
            z = self._zeros[key] = torch.zeros((), device=device, dtype=dtype)
        return z

    def _cpu_low_precision(self, t: torch.Tensor, plan: StatPlan) -> Tuple[torch.Tensor, torch.Tensor, Any]:
        """``[min, max, sum, norm]`` of a contiguous bf16/fp16 CPU tensor, its norm, and
        its zero count (None unless ``plan.zeros``).

        ATen's CPU reductions of bf16/fp16 with an fp32 accumulator are about ten times
        slower than fp32 ones; casting chunks of 2^20 elements to fp32 (a 4 MiB temporary)
        and reducing those is much faster, and the per-chunk partials merge exactly."""
        zero = self._zero(t.device, torch.float64)
        flat = t.view(-1)
        parts, zero_counts = [], []
        for start in range(0, flat.numel(), _CHUNK):
            c = flat[start:start + _CHUNK].float()
            mn, mx = torch.aminmax(c) if plan.minmax else (zero, zero)
            parts.append(torch.stack((mn.double(), mx.double(), c.sum().double() if plan.total else zero,
                                      _sumsq_cpu(c) if plan.norm else zero)))
            if plan.zeros:  # the chunk is still in cache
                zero_counts.append(torch.count_nonzero(c == 0))
        p = torch.stack(parts)
        total, sumsq = p[:, 2].sum(), p[:, 3].sum()
        if (plan.total or plan.norm) and (not math.isfinite((total + sumsq).item())
                                          or _squares_underflowed(flat, sumsq, plan)):
            total, sumsq = self._exact_sums(t, plan, zero)
        norm = sumsq.sqrt()
        zeros = torch.stack(zero_counts).sum() if plan.zeros else None
        return torch.stack((p[:, 0].min(), p[:, 1].max(), total, norm)), norm, zeros

    def _native_buffer(self, t: torch.Tensor) -> Optional[Tuple[int, int, int]]:
        """``(data pointer, element count, dtype code)`` of a raw (unprepared) tensor the
        one-pass kernel reads, or None where it does not apply. It touches nothing but the
        tensor's metadata: hooks run between large kernels, with the CPU caches cold,
        where every skipped Python call (detach, no_grad) is worth several microseconds.
        ``_data_pointer``'s checks are written out here rather than called (every module
        activation and gradient comes through), without its conjugate bit: only complex
        tensors carry it, and the kernel reads no complex dtype."""
        if self._native is None or type(t) not in _PLAIN_TYPES or not t.is_cpu:
            return None
        code = self._kernel_codes.get(t.dtype)
        if (code is None or t.layout is not torch.strided or t.is_nested or not t.is_contiguous()
                or t.is_neg()):
            return None
        numel = t.numel()
        if not numel:
            return None
        try:
            return t.data_ptr(), numel, code
        except RuntimeError:  # a storage-less wrapper that looks like a plain tensor
            return None

    def _native_vector(self, t: torch.Tensor, plan: StatPlan) -> Optional[Tuple[List[float], Optional[int],
                                                                                 Optional[int]]]:
        """Host statistics of a raw tensor from the one-pass kernel, or None where it
        does not apply (see ``_native_buffer``)."""
        buffer = self._native_buffer(t)
        return None if buffer is None else self._kernel_read(*buffer, plan)

    def _vector(self, t: torch.Tensor, plan: StatPlan) -> Tuple[Any, Any, Any]:
        """``(vector, nans, zeros)`` of a prepared, non-empty tensor."""
        if not self.on_host(t.device):
            return device_vectors([t], plan, self._zero)[0]
        if t.dtype in (torch.bfloat16, torch.float16) and t.is_contiguous():
            vector, norm, zeros = self._cpu_low_precision(t, plan)
            return vector, self._nan_count(t, plan, norm, vector[2], vector[1]), zeros
        wide = _wide_dtype(t.device)
        total = sumsq = None
        if plan.total or plan.norm:
            total, sumsq = self._sums(t, plan, wide, self._zero(t.device, wide))
            wide = total.dtype  # fp32 where the device turned out to lack fp64
        zero = self._zero(t.device, wide)
        total = zero if total is None else total
        sumsq = zero if sumsq is None else sumsq
        if plan.minmax:
            mn, mx = torch.aminmax(t)
            mn, mx = mn.to(wide), mx.to(wide)
        else:
            mn = mx = zero
        norm = sumsq.sqrt() if plan.norm else zero
        vector = torch.stack((mn, mx, total if plan.total else zero, norm))
        return vector, self._nan_count(t, plan, norm, total, mx), _zero_count(t) if plan.zeros else None

    def _sums(self, t: torch.Tensor, plan: StatPlan, wide: torch.dtype,
              zero: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(sum, sum of squares)`` of a prepared host tensor, in ``wide`` (see the module doc)."""
        if t.dtype not in (torch.float32, torch.float64):
            t = t.float()  # bf16/fp16 views that are not contiguous: a temporary
        flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().view(-1)  # a temporary at most
        total = flat.sum().double() if plan.total else zero
        sumsq = _sumsq_cpu(flat) if plan.norm else zero
        # Host memory: reading the result is not a synchronisation. Not finite: an fp32
        # partial overflowed, or the data holds inf/NaN; summing in fp64 tells them apart.
        # Tiny: the fp32 squares underflowed (see _squares_underflowed).
        if flat.dtype != torch.float64 and (not math.isfinite((total + sumsq).item())
                                            or _squares_underflowed(flat, sumsq, plan)):
            return self._exact_sums(flat, plan, zero)
        return total, sumsq

    @staticmethod
    def _exact_sums(t: torch.Tensor, plan: StatPlan, zero: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        total, sumsq = _sums_wide(t.reshape(-1), torch.float64)
        return (total if plan.total else zero), (sumsq if plan.norm else zero)

    @staticmethod
    def _nan_count(t: torch.Tensor, plan: StatPlan, norm: torch.Tensor, total: torch.Tensor,
                   mx: torch.Tensor) -> Optional[torch.Tensor]:
        if not plan.nans:
            return None
        # Host memory: reading a scalar is not a device synchronisation. A finite norm
        # (or sum, or max) proves there is no NaN, and the count is skipped.
        probe = norm if plan.norm else total if plan.total else mx if plan.minmax else None
        if probe is None or not math.isfinite(probe.item()):
            return torch.isnan(t).sum()
        return None

    def record(
        self,
        t: torch.Tensor,
        plan: StatPlan,
        vpp_stage: int,
        name: str,
        scope: str,
        micro_step: Optional[int] = None,
        cache: bool = False,
    ) -> Record:
        """Statistics of one tensor, computed now (inside a hook): kept on the device, or
        host values where the one-pass kernel read a CPU tensor."""
        fast = self._tensor_record
        if fast is not None:  # _native_buffer's checks and _record_read in C; None: not one it takes
            seen_here = self._buffer_cache(plan) if cache else None
            rec = fast(t, _PLAIN_TYPES, self._kernel_codes, torch.strided, torch.get_num_threads(), plan.nans,
                       plan.zeros, vpp_stage, name, scope, micro_step, seen_here)
            if rec is not None:
                return rec
        return self._record_other(t, plan, vpp_stage, name, scope, micro_step, cache)

    def recorder(self, plan: StatPlan, cache: bool = True) -> Callable[..., Record]:
        """``record(t, plan, vpp_stage, name, scope, micro_step, cache)`` for one plan, as
        ``recorder(t, vpp_stage, name, scope[, micro_step])``: the extension's ``Recorder``
        where it is built (the fixed arguments kept in C: the module monitor records
        thousands of tensors a step, and the Python method around the C read cost more
        than the read), else a closure over ``record``. The same records either way."""
        # _tensor_record is the extension's: set only where the extension is built
        if self._tensor_record is None or not hasattr(self._native.ext, "Recorder"):
            def fallback(t: torch.Tensor, vpp_stage: int, name: str, scope: str,
                         micro_step: Optional[int] = None) -> Record:
                return self.record(t, plan, vpp_stage, name, scope, micro_step, cache=cache)

            return fallback

        def slow(t: torch.Tensor, vpp_stage: int, name: str, scope: str, micro_step: Optional[int]) -> Record:
            return self._record_other(t, plan, vpp_stage, name, scope, micro_step, cache)

        # the cache dict is the one record() uses for this plan; forget() clears it in place
        return self._native.ext.Recorder(_PLAIN_TYPES, self._kernel_codes, torch.strided, torch.get_num_threads,
                                         plan.nans, plan.zeros, self._buffer_cache(plan) if cache else None, slow)

    def _buffer_cache(self, plan: StatPlan) -> Dict[int, Tuple["weakref.ref", int, Record]]:
        """The same-tensor cache of buffers the kernel read for ``plan``: first element's
        address -> cache entry. Made once per plan and cleared in place by ``forget()``."""
        seen_here = self._seen_buffers.get(plan.key)
        if seen_here is None:
            seen_here = self._seen_buffers[plan.key] = {}
        return seen_here

    @outside_training_modes
    def _record_other(self, t: torch.Tensor, plan: StatPlan, vpp_stage: int, name: str, scope: str,
                      micro_step: Optional[int], cache: bool) -> Record:
        """``record`` of a tensor the extension's ``tensor_record`` did not take (or without it)."""
        buffer = self._native_buffer(t)
        if buffer is not None:  # the common case on the CPU: every module activation and gradient
            return self._record_read(t, plan, vpp_stage, name, scope, micro_step, cache, *buffer)
        cacheable = cache and not t.is_inference()  # inference tensors have no version counter
        key = memory_key = None
        if cacheable:
            key = (id(t), plan.key)
            seen = self._seen.get(key)
            if seen is not None and seen[0]() is t and seen[1] == t._version:
                return seen[2].relabelled(vpp_stage, name, scope, micro_step)
            memory_key = _memory_key(t, plan)
            seen = self._seen_memory.get(memory_key) if memory_key is not None else None
            if seen is not None:
                first = seen[0]()
                if (first is not None and seen[1] == first._version == t._version
                        and first.data_ptr() == memory_key[0]):
                    return seen[2].relabelled(vpp_stage, name, scope, micro_step)
        vector, nans, numel, zeros = self._compute_aten(t, plan, name)  # not one the kernel reads
        rec = self._Record(vpp_stage, name, scope, micro_step, vector, nans, numel, zeros)
        if cacheable and numel:
            # the cache keeps the first record: its statistics, not a second copy of them
            try:
                entry = self._cache_entry(t, t._version, rec)
            except TypeError:  # a tensor subclass without weak references: no caching
                return rec
            self._seen[key] = entry
            if memory_key is not None:
                self._seen_memory[memory_key] = entry
        return rec

    def _record_read(self, t: torch.Tensor, plan: StatPlan, vpp_stage: int, name: str, scope: str,
                     micro_step: Optional[int], cache: bool, pointer: int, numel: int, code: int) -> Record:
        """``record`` of a tensor the one-pass kernel reads at ``pointer`` (the same cache
        and the same statistics as the general path, without its repeated checks)."""
        cacheable = cache and not t.is_inference()  # inference tensors have no version counter
        if cacheable:
            seen_here = self._buffer_cache(plan)
            seen = seen_here.get(pointer)
            if seen is not None:
                first, rec = seen[0](), seen[2]
                if (first is not None and seen[1] == first._version == t._version and rec.numel == numel
                        and first.dtype is t.dtype and first.data_ptr() == pointer):
                    return rec.relabelled(vpp_stage, name, scope, micro_step)
        read = self._record_read_ext
        if read is not None:
            rec = read(pointer, numel, code, torch.get_num_threads(), plan.nans, plan.zeros, vpp_stage, name, scope,
                       micro_step)
        else:
            vector, nans, zeros = self._kernel_read(pointer, numel, code, plan)
            rec = self._Record(vpp_stage, name, scope, micro_step, vector, nans, numel, zeros)
        if cacheable:
            # the cache keeps the first record: its statistics, not a second copy of them
            try:
                seen_here[pointer] = self._cache_entry(t, t._version, rec)
            except TypeError:  # a tensor subclass without weak references: no caching
                pass
        return rec

    def _kernel_read(self, pointer: int, numel: int, code: int, plan: StatPlan) -> Tuple[List[float], Any, Any]:
        """``(vector, nans or None, zeros or None)`` of a buffer, from the one-pass kernel."""
        if plan.zeros:
            vector, nans, zeros = self._native.stats_zeros(pointer, numel, code, torch.get_num_threads())
            return vector, nans if plan.nans else None, zeros
        vector, nans = self._native.stats(pointer, numel, code, torch.get_num_threads())
        return vector, nans if plan.nans else None, None

    def _compute(self, t: torch.Tensor, plan: StatPlan, name: str = "") -> Tuple[Any, Any, int, Any]:
        """``(vector, nans, numel, zeros)`` of one tensor: the one-pass kernel where it
        applies, else ATen reductions on the prepared tensor. ``zeros`` is None unless
        ``plan.zeros``; ``(None, None, 0, None)`` for a tensor without statistics (see
        ``unobservable``)."""
        host = self._native_vector(t, plan)
        if host is not None:
            return host[0], host[1], t.numel(), host[2]
        return self._compute_aten(t, plan, name)

    def _compute_aten(self, t: torch.Tensor, plan: StatPlan, name: str) -> Tuple[Any, Any, int, Any]:
        """``_compute`` of a tensor the one-pass kernel does not read."""
        why = unobservable(t)
        if why is None and t.is_cuda and _capturing():
            why = self._captured(name)
        if why is not None:
            self.warn_unobserved(name, why)
            return None, None, 0, None
        if t.layout != torch.strided and not t.is_nested:
            return self._sparse(t, plan)
        with torch.no_grad():
            plan = _for_dtype(plan, t)
            t = _prepared(t)
            numel = t.numel()
            if numel == 0:
                return EMPTY_VECTOR, 0, 0, 0 if plan.zeros else None
            vector, nans, zeros = self._vector(t, plan)
        return vector, nans, numel, zeros

    def _sparse(self, t: torch.Tensor, plan: StatPlan) -> Tuple[Any, Any, int, Any]:
        """Statistics of the dense tensor a sparse one stands for (``nn.Embedding(sparse=True)``
        gradients): its implicit zeros count, as in ``t.to_dense()``, which is never built.
        COO indices may repeat (an embedding row looked up twice), so the tensor is coalesced
        first: a temporary the size of the stored values (on a GPU, coalescing synchronises
        with the host). The stored values then give the sum, the sum of squares and the NaN
        count; min and max also take 0 when some elements are not stored, and the elements
        not stored are zeros."""
        with torch.no_grad():
            t = t.detach()
            if t.layout == torch.sparse_coo:
                t = t.coalesce()
                values = t._values()
            else:  # compressed layouts (CSR, CSC, BSR, BSC) store each element once
                values = t.values()
            numel = t.numel()
            if numel == 0:
                return EMPTY_VECTOR, 0, 0, 0 if plan.zeros else None
            vector, nans, stored, zeros = self._compute(values, plan)
            if stored == numel:
                return vector, nans, numel, zeros
            if stored == 0:
                return (0.0, 0.0, 0.0, 0.0), 0, numel, numel if plan.zeros else None
            if isinstance(zeros, tuple):  # chunk counts, added up by to_host
                zeros = zeros + (numel - stored,)
            elif zeros is not None:
                zeros = zeros + (numel - stored)
            if isinstance(vector, DeviceStats):  # clamp keeps NaN
                mn, mx, total, norm = vector.parts
                vector = DeviceStats((mn.clamp(max=0), mx.clamp(min=0), total, norm))
            elif isinstance(vector, torch.Tensor):
                vector = torch.stack((vector[0].clamp(max=0), vector[1].clamp(min=0), vector[2], vector[3]))
            else:
                mn, mx, total, norm = vector
                vector = [mn if mn != mn else min(mn, 0.0), mx if mx != mx else max(mx, 0.0), total, norm]
            return vector, nans, numel, zeros

    def record_many(
        self,
        tensors: Sequence[torch.Tensor],
        plan: StatPlan,
        keys: Sequence[Tuple[int, str, str, Optional[int]]],
    ) -> List[Record]:
        """Statistics of many tensors at once (parameters, gradients, optimizer states).

        The CPU tensors the one-pass kernel reads go to it in one call for all of them:
        for a small tensor the fixed cost of a call from Python (ctypes, its argument and
        result objects) is most of the cost, and a model with thousands of small tensors
        paid it for each. The kernel reduces each buffer as a call of its own would, with
        the same thread count, so the numbers are the same to the bit. The other tensors
        take ``_compute``'s ATen path one by one, in their place in the result."""
        fast = self._records_of
        if fast is not None:  # _kernel_buffers' checks and the read in C; None: one it does not read
            got = fast(tensors, _PLAIN_TYPES, self._kernel_codes, torch.strided, keys, torch.get_num_threads(),
                       plan.nans, plan.zeros)
            if got is not None:
                return got
        return self._records_other(tensors, plan, keys)

    @outside_training_modes
    def _records_other(self, tensors: Sequence[torch.Tensor], plan: StatPlan,
                       keys: Sequence[Tuple[int, str, str, Optional[int]]]) -> List[Record]:
        """``record_many`` of a list the extension's ``records_of`` did not take (or without
        the extension): the kernel's tensors in one call, the others through ATen."""
        kernel = self._native
        if kernel is None:
            return self._records_aten(tensors, plan, keys)
        threads = torch.get_num_threads()
        buffers = _kernel_buffers(tensors, self._kernel_codes)
        if buffers is not None:  # the common case: every tensor is one the kernel reads
            return kernel.host_records(keys, *buffers, threads, plan.nans, plan.zeros, self._Record.host)
        # a tensor the kernel does not read in the list: the kernel's in one call, the
        # others through ATen (grouped where they can be), each record in its place
        records: List[Any] = list(keys)  # each replaced below
        batched: List[int] = []  # indices of the kernel's buffers
        others: List[int] = []  # indices of the tensors ATen reduces
        pointers: List[int] = []
        counts: List[int] = []
        codes: List[int] = []
        for i, t in enumerate(tensors):
            buffer = self._native_buffer(t)
            if buffer is None:
                others.append(i)
                continue
            batched.append(i)
            pointers.append(buffer[0])
            counts.append(buffer[1])
            codes.append(buffer[2])
        if batched:
            read = kernel.host_records([keys[i] for i in batched], pointers, counts, codes, threads, plan.nans,
                                       plan.zeros, self._Record.host)
            for i, rec in zip(batched, read):
                records[i] = rec
        if others:
            read = self._records_aten([tensors[i] for i in others], plan, [keys[i] for i in others])
            for i, rec in zip(others, read):
                records[i] = rec
        return records

    def _records_aten(self, tensors: Sequence[torch.Tensor], plan: StatPlan,
                      keys: Sequence[Tuple[int, str, str, Optional[int]]]) -> List[Record]:
        """``record_many`` of tensors the one-pass kernel does not read: on accelerators
        those the fused kernel takes in one ``fused_reader`` call per device
        (``_records_fused``); of the rest, small tensors of
        one device, dtype and shape (a model's repeated layers, an MoE model's experts) in
        grouped reductions (``_grouped_vectors``: a handful of ATen calls per group
        instead of five or six per tensor, none of which waits for the device), the others
        one by one; on an accelerator the plain ones of those in one ``device_vectors`` call
        per device (their norms in one multi-tensor call)."""
        if tensors and any(t.is_cuda for t in tensors) and _capturing():
            self.warn_unobserved(keys[0][1], self._captured(keys[0][1]))
            return [self._Record(*key, None, None, 0, None) for key in keys]
        if fused_reader is not None:
            return self._records_fused(tensors, plan, keys)
        return self._records_unfused(tensors, plan, keys)

    def _records_fused(self, tensors: Sequence[torch.Tensor], plan: StatPlan,
                       keys: Sequence[Tuple[int, str, str, Optional[int]]]) -> List[Record]:
        """``_records_aten`` where a fused kernel is set: every accelerator tensor it takes,
        whatever its size, in one ``fused_reader`` call per device (no stack, no per-tensor
        launch); the others, and a device whose kernel did not read, through
        ``_records_unfused``, each record in its place."""
        by_device: Dict[torch.device, List[Tuple[int, torch.Tensor]]] = defaultdict(list)
        rest: List[int] = []
        on_host = self.on_host
        for i, t in enumerate(tensors):
            u = _kernel_tensor(t) if not on_host(t.device) else None
            if u is None:
                rest.append(i)
            else:
                by_device[u.device].append((i, u))
        if not by_device:
            return self._records_unfused(tensors, plan, keys)
        records: List[Any] = [None] * len(tensors)
        with torch.no_grad():
            for members in by_device.values():
                got = fused_reader([u for _, u in members], plan) if fused_reader is not None else None
                if got is None:
                    rest.extend(i for i, _ in members)
                    continue
                for (i, u), (vector, nans, zeros) in zip(members, got):
                    records[i] = self._Record(*keys[i], vector, nans, u.numel(), zeros)
        if rest:
            rest.sort()
            read = self._records_unfused([tensors[i] for i in rest], plan, [keys[i] for i in rest])
            for i, rec in zip(rest, read):
                records[i] = rec
        return records

    def _records_unfused(self, tensors: Sequence[torch.Tensor], plan: StatPlan,
                         keys: Sequence[Tuple[int, str, str, Optional[int]]]) -> List[Record]:
        """``_records_aten`` without the fused kernel: grouped and per-tensor ATen reads."""
        later: Dict[torch.device, List[int]] = defaultdict(list)  # accelerator tensors read together

        def group_of(i: int) -> Optional[Tuple[Any, int]]:
            key = _group_key(tensors[i])
            return None if key is None else (key, tensors[i].numel())

        def read_group(part: List[int]) -> Optional[List[Record]]:
            read = self._grouped_read([tensors[i] for i in part], plan)
            if read is None:
                return None
            vectors, nans, zeros, numel = read
            return [self._Record(*keys[i], vectors[j], nans[j], numel, zeros[j]) for j, i in enumerate(part)]

        def read_one(i: int) -> Optional[Record]:
            t = tensors[i]
            if _group_key(t) is not None and t.numel() and not self.on_host(t.device):
                later[t.device].append(i)
                return None  # read below with the device's others
            return self._Record(*keys[i], *self._compute_aten(t, plan, keys[i][1]))

        records = read_grouped(len(tensors), group_of, read_group, read_one)
        with torch.no_grad():
            for part in later.values():
                read = device_vectors([tensors[i].detach() for i in part], plan, self._zero)
                for i, (vector, nans, zeros) in zip(part, read):
                    records[i] = self._Record(*keys[i], vector, nans, tensors[i].numel(), zeros)
        return records

    def _grouped_read(self, group: List[torch.Tensor],
                      plan: StatPlan) -> Optional[Tuple[Sequence[Any], Sequence[Any], Sequence[Any], int]]:
        """``(vectors, nans, zeros, numel)`` of a group (``_grouped_vectors``), or None
        where the device cannot reduce it so (it is then reduced one tensor at a time,
        where the per-tensor path finds and says what the device lacks)."""
        try:
            return _grouped_vectors(group, plan, self._zero, self.on_host(group[0].device))
        except (RuntimeError, TypeError, NotImplementedError):
            return None

    def _captured(self, name: str) -> str:
        """Why ``name`` gets no statistics inside a CUDA-graph capture; said once at WARNING
        naming the first one (the others' rows are left out the same way)."""
        self._capture_said.warning(
            "capture", "monitor_v2: %s was observed while a CUDA graph was being captured: the monitor takes no "
            "statistics inside a capture (the graph's replays run no hook, so the rows would be the capture's, "
            "once); the rows of the captured region are left out. Run monitored steps outside the graph, or "
            "capture a part that the monitor does not observe. Logged once.", name)
        return "a tensor observed during CUDA-graph capture"

    def warn_unobserved(self, name: str, why: str) -> None:
        """Say once per kind of tensor that its rows are left out."""
        kind = why.split(" (")[0]
        self._unobserved.warning(kind, "monitor_v2: %s is %s: no statistics, its row is left out (the other rows "
                                 "of the step are written). Logged once for %s.", name, why, kind)

    def _use_graph_library(self) -> None:
        if self._ext is None:
            return
        try:
            graph_hooks.state.update(self._ext, self._graph_once)
        except Exception as exc:  # noqa: BLE001 - an optional speed-up never stops a step
            self._graph_once.warning("graph", "monitor_v2: the C++ graph hooks' library is not used (%s: %s)",
                                     type(exc).__name__, exc)

    @staticmethod
    @outside_training_modes
    def sum_parts(total: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        """``total + part``: the running sum of the gradient one input receives through
        several graph edges (the module monitor's ``grad_input``), in a backward pass that a
        mode may observe. Parts through a view's node and through its base's node differ
        only in shape."""
        return total + (part if part.shape == total.shape else part.reshape(total.shape))

    def forget(self) -> None:
        """Forget the tensors seen so far (step end, or after a collective); start using
        the C++ graph hooks' library once its build has ended."""
        self._use_graph_library()
        self._seen.clear()
        self._seen_memory.clear()
        for seen_here in self._seen_buffers.values():  # cleared in place: recorders hold them
            seen_here.clear()

    @outside_training_modes
    def to_host(self, records: Sequence[Record]) -> Optional[Callable[[], None]]:
        """Replace the device vectors, NaN and zero counts of ``records`` by host values,
        with one transfer per (device, dtype) group. Records may share a vector.

        Host tensors' values are in place when it returns, and it returns None. Where some
        are on an accelerator (or under the test seam) their copy is only issued
        (``_stage``: non-blocking, into pinned memory) and it returns the function that
        waits for it and puts the values in the records: the writer calls it when it
        formats the step's rows. Until then those records hold device values."""
        # the kernel's records are host ones already (a tuple, counts int or None): one
        # pass finds the others, if any
        ext = self._native.ext if self._native is not None else None
        if ext is not None and type(records) is list:
            records = ext.not_on_host(records)
        else:
            host = _HOST_COUNTS
            records = [rec for rec in records if type(rec._vector) is not tuple or type(rec.nans) not in host
                       or type(rec.zeros) not in host]
        if not records:
            return None
        host: List[Record] = []
        staged: List[Record] = []
        on_host = self.on_host
        for rec in records:
            device = _device_of(rec._vector) or _device_of(rec.nans) or _device_of(rec.zeros)
            (host if device is None or on_host(device) else staged).append(rec)
        if host:
            self._transfer(host)
        return self._stage(staged) if staged else None

    def mark_stream(self) -> None:
        """Vectors were just made on the current CUDA stream, which need not be the one the
        step ends on (a collective's future callback runs on a pool stream): an event
        recorded on it now is waited for on the device before the step's copy (no host
        wait). Nothing to do without CUDA (and under the CPU seam)."""
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return
        stream = torch.cuda.current_stream()
        event = torch.cuda.Event()
        event.record(stream)
        with self._streams_lock:
            self._other_streams[(stream.device_index, stream.stream_id)] = event

    def _wait_other_streams(self) -> None:
        with self._streams_lock:
            events, self._other_streams = self._other_streams, {}
        if events:
            stream = torch.cuda.current_stream()
            for event in events.values():
                stream.wait_event(event)

    @outside_training_modes
    def _stage(self, records: Sequence[Record]) -> Callable[[], None]:
        """``to_host`` of records with accelerator values: per device, every value joined
        into one buffer and every count into another (``cat``: the number of copies does
        not grow with the records), both copied to host memory without blocking
        (``_copy_to_host``); returns the function that waits for the copy and fills the
        records. A record whose values cannot be joined is moved alone, now (``_settle``)."""
        by_device: Dict[torch.device, List[Record]] = defaultdict(list)
        for rec in records:
            by_device[_device_of(rec._vector) or _device_of(rec.nans) or _device_of(rec.zeros)].append(rec)
        waits: List[Callable[[], None]] = []
        with torch.no_grad():
            self._wait_other_streams()
            for device, recs in by_device.items():
                try:
                    waits.append(self._stage_device(device, recs))
                except Exception:  # noqa: BLE001 - narrowed down record by record
                    for rec in recs:
                        self._settle(rec)

        @outside_training_modes  # the sync writer calls it on the training's thread
        def ready() -> None:
            for wait in waits:
                wait()

        return ready

    def _stage_device(self, device: torch.device, records: Sequence[Record]) -> Callable[[], None]:
        values: List[torch.Tensor] = []  # 1-D pieces of the value buffer
        counts: List[torch.Tensor] = []  # 1-element pieces of the count buffer
        where: Dict[int, int] = {}  # id of a vector object -> its offset (records share vectors)
        filled: List[Tuple[Record, Optional[int], Any, Any]] = []
        offset = 0
        for rec in records:
            vector = rec._vector
            at: Optional[int] = None
            if isinstance(vector, (DeviceStats, torch.Tensor)):
                at = where.get(id(vector))
                if at is None:
                    at = where[id(vector)] = offset
                    if isinstance(vector, DeviceStats):
                        values.extend(p.reshape(1) for p in vector.parts)
                    else:
                        values.append(vector.reshape(-1))
                    offset += 4
            filled.append((rec, at, _count_slots(rec.nans, counts), _count_slots(rec.zeros, counts)))
        flats = [torch.cat(values) if values else None, torch.cat(counts) if counts else None]
        hosts, event = self._copy_to_host(device, flats)

        def wait() -> None:
            try:
                if event is not None:
                    event.synchronize()
                got = [h.tolist() if h is not None else [] for h in hosts]
            except Exception as exc:  # noqa: BLE001 - an error the device reports late costs these rows only
                for rec, *_ in filled:
                    self._drop(rec, exc)
                return
            vals, cnts = got
            for rec, at, nans, zeros in filled:
                if at is not None:
                    rec.vector = vals[at:at + 4]
                if nans is not None:
                    rec.nans = _counted(nans, cnts)
                if zeros is not None:
                    rec.zeros = _counted(zeros, cnts)
            flats.clear()  # the device buffers live until the copy is waited for

        return wait

    def _copy_to_host(self, device: torch.device,
                      flats: List[Optional[torch.Tensor]]) -> Tuple[List[Optional[torch.Tensor]], Any]:
        """Host copies of device buffers and the event to wait on: pinned memory, a
        ``non_blocking`` copy and an event recorded after it (CUDA; other accelerators
        through ``torch.Event`` where they have it); the CPU seam takes the same steps with
        a plain copy and no event. A device where any of that fails copies blocking."""
        pinned = device.type != "cpu"
        try:
            hosts = [None if f is None else torch.empty(f.shape, dtype=f.dtype, pin_memory=pinned) for f in flats]
            for h, f in zip(hosts, flats):
                if h is not None:
                    h.copy_(f, non_blocking=pinned)
            event = None
            if pinned:
                event = torch.cuda.Event() if device.type == "cuda" else torch.Event(device=device)
                event.record()
            return hosts, event
        except Exception as exc:  # noqa: BLE001 - a device without pinned memory or events
            self._capture_said.info("blocking", "monitor_v2: the step's statistics are copied from %s to the host "
                                    "with a blocking copy (%s). Logged once.", device, short_error(exc))
            return [None if f is None else f.cpu() for f in flats], None

    def _settle(self, rec: Record) -> None:
        """One record's device values moved to the host now (a blocking copy), or the
        record marked unobserved where that fails too."""
        try:
            vector = rec._vector
            if isinstance(vector, DeviceStats):
                rec.vector = torch.stack([p.double() for p in vector.parts]).cpu().tolist()
            elif isinstance(vector, torch.Tensor):
                rec.vector = vector.cpu().tolist()
            counts: List[torch.Tensor] = []
            nans, zeros = _count_slots(rec.nans, counts), _count_slots(rec.zeros, counts)
            host = torch.stack(counts).cpu().tolist() if counts else []
            if nans is not None:
                rec.nans = _counted(nans, host)
            if zeros is not None:
                rec.zeros = _counted(zeros, host)
        except Exception as exc:  # noqa: BLE001
            self._drop(rec, exc)

    def _drop(self, rec: Record, exc: BaseException) -> None:
        self.warn_unobserved(rec.name, f"a tensor whose statistics could not reach the host ({short_error(exc)})")
        rec.vector, rec.nans, rec.numel, rec.zeros = None, None, 0, None

    @outside_training_modes
    def _transfer(self, records: Sequence[Record]) -> None:
        """``to_host`` of the records whose vector or counts are device tensors."""
        vec_groups: Dict[Tuple[torch.device, torch.dtype], List[Record]] = defaultdict(list)
        nan_groups: Dict[torch.device, List[Record]] = defaultdict(list)
        zero_groups: Dict[torch.device, List[Record]] = defaultdict(list)
        tensor = torch.Tensor
        for rec in records:
            vector = rec._vector  # as stored: ``vector`` builds a list of a host tuple
            if isinstance(vector, tensor):
                vec_groups[(vector.device, vector.dtype)].append(rec)
            nans = rec.nans
            if nans is not None and isinstance(nans, tensor):
                nan_groups[nans.device].append(rec)
            zeros = rec.zeros
            if zeros is not None and isinstance(zeros, tensor):
                zero_groups[zeros.device].append(rec)
        with torch.no_grad():
            for recs in vec_groups.values():
                self._replace_or_drop(recs, "vector")
            for recs in nan_groups.values():
                self._replace_or_drop(recs, "nans")
            for recs in zero_groups.values():
                self._replace_or_drop(recs, "zeros")

    def _replace_or_drop(self, records: Sequence[Record], attr: str) -> None:
        """``_replace``; where a group's transfer fails, each record is moved alone and
        only those that fail again are unobserved (one bad vector never costs the step)."""
        try:
            _replace(records, attr)
            return
        except Exception:  # noqa: BLE001 - narrowed down below
            pass
        for rec in records:
            try:
                _replace([rec], attr)
            except Exception as exc:  # noqa: BLE001
                self.warn_unobserved(rec.name, f"a tensor whose statistics could not reach the host ({short_error(exc)})")
                rec.vector, rec.nans, rec.numel, rec.zeros = None, None, 0, None


def _device_of(value: Any) -> Optional[torch.device]:
    """The device of a record's vector or count that is not a host value yet, else None."""
    if isinstance(value, torch.Tensor):
        return value.device
    if isinstance(value, DeviceStats):
        return value.parts[0].device
    if isinstance(value, tuple):  # chunk counts
        for part in value:
            if isinstance(part, torch.Tensor):
                return part.device
    return None


def _count_slots(count: Any, pieces: List[torch.Tensor]) -> Any:
    """Where a device count (a 0-d tensor, or a tuple of chunk counts and ints) goes in
    the count buffer ``pieces`` (appended to it): ``(indices, constant)``; None for a
    host count (an int, None), which stays as it is."""
    if isinstance(count, torch.Tensor):
        pieces.append(count.reshape(1))
        return [len(pieces) - 1], 0
    if isinstance(count, tuple):
        indices, constant = [], 0
        for part in count:
            if isinstance(part, torch.Tensor):
                pieces.append(part.reshape(1))
                indices.append(len(pieces) - 1)
            else:
                constant += int(part)
        return indices, constant
    return None


def _counted(slots: Tuple[List[int], int], host: List[Any]) -> int:
    indices, constant = slots
    return int(sum(host[i] for i in indices)) + constant


def _replace(records: Sequence[Record], attr: str) -> None:
    """One transfer for the distinct tensors in ``attr`` of ``records``."""
    index: Dict[int, int] = {}
    distinct: List[torch.Tensor] = []
    for rec in records:
        t = getattr(rec, attr)
        if id(t) not in index:
            index[id(t)] = len(distinct)
            distinct.append(t)
    host = torch.stack(distinct).cpu().tolist()
    for rec in records:
        setattr(rec, attr, host[index[id(getattr(rec, attr))]])
