"""Statistics engine for MindSpore (PyNative).

The same contract as the PyTorch engine: each tensor becomes ``[min, max, sum, norm]``
plus a NaN count when one is needed; ``to_host`` moves a step's device vectors with one
transfer per dtype.

On the CPU (``device_target`` CPU) the tensor's memory is read where it lies:
``Tensor.asnumpy()`` there is a zero-copy view of it (no transfer), which waits only for
the operator that produces the tensor, and the one-pass C kernel of ``native`` (fp32,
bf16, fp16) or NumPy in fp64 (other dtypes) reduces it at once. MindSpore's CPU
reductions cost about a millisecond each on a 256 x 1024 tensor (one thread), and the
engine needed five to seven of them per tensor; one pass in C takes about a tenth of a
millisecond (docs/mindspore-performance.md has the measurements).

Elsewhere (GPU, Ascend) the reductions stay on the device, with the cheapest primitives
measured on the CPU: ``min``, ``max``, ``sum`` and the sum of squares as the ``sum`` of
the squared tensor (``ops.norm`` costs twice as much), stacked into one vector;
reading the tensor back inside a hook would force a device sync there. Low-precision and
integer tensors are cast to fp32 first (MindSpore's CPU reductions have no bf16
kernels), a temporary freed at once. MindSpore's CPU ``min``/``max`` skip NaN; the NaN
count is therefore also taken when ``min``/``max`` are asked for, and the host side
reports NaN min/max for any tensor that holds a NaN.

``record_many`` (parameters, gradients, optimizer states) sends all the host views the
kernel reads to it in one call (``NativeStats.host_records``), the same numbers as one call each.

The optional ``zeros`` count (asked for in ``ops``) comes from the same read on the CPU
(the C kernel's zero-counting variant, or ``np.count_nonzero(x == 0)`` on the NumPy
path) and from ``(flat == 0).sum()`` on the device elsewhere.
"""

import logging
import math
from collections import defaultdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import mindspore as ms
from mindspore import ops

from ... import native
from ...logonce import LogOnce
from ...monitor import short_error
from ...stats import EMPTY_VECTOR, Record, StatPlan, read_grouped, record_type

logger = logging.getLogger("msprobe.monitor_v2")

_FLOATS = (ms.float32, ms.float64)
# NumPy dtype names (as ``asnumpy`` returns them) of the kernel's element types.
_NATIVE_CODES = {"float32": native.F32, "bfloat16": native.BF16, "float16": native.F16}


def _host_memory_readable() -> bool:
    """True where tensors live in host memory (MindSpore's CPU target)."""
    try:
        return ms.get_context("device_target") == "CPU"
    except Exception:  # noqa: BLE001 - an unknown context: take the device path
        return False


def _kernel_threads() -> int:
    try:
        threads = int(ms.get_context("runtime_num_threads") or 1)
    except Exception:  # noqa: BLE001
        threads = 1
    return max(1, threads)


_COMPLEX = tuple(d for d in (getattr(ms, "complex64", None), getattr(ms, "complex128", None)) if d is not None)


_MISSING = object()

# record_many on the device: tensors of these dtypes are reduced in groups of one dtype and
# shape (``read_grouped``, whose bounds the PyTorch engine shares)
_GROUPED = (ms.float32, ms.float64, ms.float16, ms.bfloat16)
_NO_STACK: set = set()  # dtypes this device cannot stack (found by trying): cast to fp32 first


def _grouped_vectors(group: List[ms.Tensor], plan: StatPlan,
                     numel: int) -> Tuple[Sequence[ms.Tensor], Optional[Sequence[ms.Tensor]],
                                          Optional[Sequence[ms.Tensor]]]:
    """``(vectors, nans, zeros)`` of tensors of one dtype and shape, each what
    ``MsStatsEngine._vector`` gives alone (``[min, max, sum, sum of squares]``, the NaN
    count also where min and max are asked for, since MindSpore's CPU min/max skip NaN):
    the tensors stacked into one ``[n, numel]`` temporary and reduced along its rows, then
    the results split into per-tensor device tensors for ``to_host``. Nothing is read back."""
    dtype = group[0].dtype
    if dtype in _NO_STACK:
        group = [t.astype(ms.float32) for t in group]
    try:
        x = ops.stack(group).reshape(len(group), numel)
    except (TypeError, RuntimeError, ValueError):
        if dtype in _FLOATS or dtype in _NO_STACK:
            raise
        _NO_STACK.add(dtype)  # MindSpore's CPU has no bf16 stack: each cast to fp32 first from now on
        return _grouped_vectors(group, plan, numel)
    if x.dtype not in _FLOATS:
        x = x.astype(ms.float32)  # MindSpore's CPU reductions have no bf16 kernels
    zero = ops.zeros(len(group), x.dtype)
    mn = x.min(axis=1) if plan.minmax else zero
    mx = x.max(axis=1) if plan.minmax else zero
    total = x.sum(axis=1) if plan.total else zero
    sumsq = (x * x).sum(axis=1) if plan.norm else zero
    vectors = ops.unstack(ops.stack((mn, mx, total, sumsq), axis=1), axis=0)
    nans = ops.unstack(ops.isnan(x).sum(axis=1), axis=0) if (plan.nans or plan.minmax) else None
    zeros = ops.unstack((x == 0).astype(ms.int64).sum(axis=1), axis=0) if plan.zeros else None
    return vectors, nans, zeros


# The fewest tensors ``record_many`` sends to the kernel in one call: the batched call
# has a fixed cost of its own (the argument arrays, about 10 us from Python), and with
# fewer tensors than this one ``record`` each measured no slower.
_BATCH_FROM = 4


class MsStatsEngine:
    # False: ``record_many`` records one tensor at a time (the reference the tests
    # compare the batched kernel call with)
    _batched = True

    def __init__(self, use_native: bool = True, read_host: Optional[bool] = None) -> None:
        """``read_host``: read tensors in place on the host (default: on MindSpore's CPU
        target); ``False`` keeps every reduction on the device."""
        self._zeros: Dict[object, ms.Tensor] = {}
        self._host = _host_memory_readable() if read_host is None else read_host
        kernel = native.load() if (use_native and self._host) else None
        self._native = kernel
        self._native_codes = {} if kernel is None else {
            name: code for name, code in _NATIVE_CODES.items() if code in kernel.dtype_codes}
        self._codes_by_dtype: Dict[np.dtype, Optional[int]] = {}
        self._threads = _kernel_threads()
        self._unobserved = LogOnce()
        # the extension's records where it is built (outside the garbage collector)
        self._Record = record_type() if kernel is not None else Record

    def _zero(self, dtype) -> ms.Tensor:
        z = self._zeros.get(dtype)
        if z is None:
            z = self._zeros[dtype] = ms.Tensor(0, dtype)
        return z

    def _host_record(self, t: ms.Tensor, vpp_stage: int, name: str, scope: str,
                     micro_step: Optional[int], want_zeros: bool = False) -> Record:
        """Statistics of a CPU tensor read in place (``asnumpy`` is a view there)."""
        return self._array_record(t.asnumpy(), (vpp_stage, name, scope, micro_step), want_zeros)

    def _code(self, dtype: np.dtype) -> Optional[int]:
        """The kernel's code for arrays of ``dtype``, or None. Keyed by the dtype object:
        ``dtype.name`` builds a string each time (2 us, as much as a small tensor's kernel
        call)."""
        try:
            return self._codes_by_dtype[dtype]
        except KeyError:
            code = self._codes_by_dtype[dtype] = self._native_codes.get(dtype.name)
            return code

    def _array_record(self, a: np.ndarray, key: Tuple[int, str, str, Optional[int]], want_zeros: bool) -> Record:
        """Statistics of ``a``, the host view of a tensor, under the row key ``key``."""
        numel = a.size
        if numel == 0:
            return self._Record(*key, EMPTY_VECTOR, 0, 0, 0 if want_zeros else None)
        code = self._code(a.dtype)
        if code is not None:
            if not a.flags.c_contiguous:
                a = np.ascontiguousarray(a)
            if want_zeros:
                vector, nans, zeros = self._native.stats_zeros(a.ctypes.data, numel, code, self._threads)
                return self._Record(*key, vector, nans, numel, zeros)
            vector, nans = self._native.stats(a.ctypes.data, numel, code, self._threads)
            return self._Record(*key, vector, nans, numel)
        x = a.reshape(-1)
        # counted before the cast: exact for every dtype (bool False and integer 0 included)
        zeros = int(np.count_nonzero(x == 0)) if want_zeros else None
        if np.iscomplexobj(x):
            x = np.abs(x)  # magnitudes, as the PyTorch engine (a cast would drop the imaginary part)
        if x.dtype != np.float64:
            x = x.astype(np.float64)  # integers, bool, and low precision without the kernel
        nans = int(np.count_nonzero(np.isnan(x)))
        if nans:
            vector = [math.nan, math.nan, float(x.sum()), math.nan]
        else:
            with np.errstate(invalid="ignore", over="ignore"):
                vector = [float(x.min()), float(x.max()), float(x.sum()), math.sqrt(float(np.dot(x, x)))]
        return self._Record(*key, vector, nans, numel, zeros)

    def _vector(self, t: ms.Tensor, plan: StatPlan) -> Tuple[ms.Tensor, Optional[ms.Tensor], Optional[ms.Tensor]]:
        if t.dtype in _COMPLEX:
            t = ops.abs(t)  # magnitudes, as the PyTorch engine (a cast would drop the imaginary part)
        if t.dtype == ms.bool_:
            t = t.astype(ms.int32)  # some devices (the CPU) cast bool to int, not to float
        if t.dtype not in _FLOATS:
            t = t.astype(ms.float32)
        zero = self._zero(t.dtype)
        flat = t.reshape(-1)
        # min and max as two reductions: ops.aminmax measured slower than both together
        mn = flat.min() if plan.minmax else zero
        mx = flat.max() if plan.minmax else zero
        total = flat.sum() if plan.total else zero
        sumsq = (flat * flat).sum() if plan.norm else zero  # half the cost of ops.norm
        vector = ops.stack((mn, mx, total, sumsq))
        nans = ops.isnan(flat).sum() if (plan.nans or plan.minmax) else None
        # on the fp32 copy where there is one: CPU kernels lack bf16 comparisons, and no
        # nonzero value of any dtype becomes 0 in fp32 (-0.0 == 0 as everywhere)
        zeros = (flat == 0).astype(ms.int64).sum() if plan.zeros else None
        return vector, nans, zeros

    def record(self, t: ms.Tensor, plan: StatPlan, vpp_stage: int, name: str, scope: str,
               micro_step: Optional[int] = None, cache: bool = False) -> Record:
        """Statistics of one tensor; a tensor MindSpore cannot reduce here (a dtype without
        a cast kernel on this device: float8, hifloat8, packed int4) loses only its own row
        (an unobserved record, ``vector`` None), said once per dtype."""
        try:
            return self._record(t, plan, vpp_stage, name, scope, micro_step)
        except (TypeError, RuntimeError, ValueError) as exc:
            return self._unobserved_record(t, (vpp_stage, name, scope, micro_step), exc)

    def _warn_unobserved(self, name: str, dtype: str, why: str) -> None:
        self._unobserved.warning(dtype, "monitor_v2: %s is a %s tensor that MindSpore cannot reduce here (%s): no "
                                 "statistics, its row is left out (the other rows of the step are written). Logged "
                                 "once for %s.", name, dtype, why, dtype)

    def _record(self, t: ms.Tensor, plan: StatPlan, vpp_stage: int, name: str, scope: str,
                micro_step: Optional[int]) -> Record:
        if self._host:
            return self._host_record(t, vpp_stage, name, scope, micro_step, plan.zeros)
        numel = int(t.size)
        if numel == 0:
            return self._Record(vpp_stage, name, scope, micro_step, EMPTY_VECTOR, 0, 0, 0 if plan.zeros else None)
        vector, nans, zeros = self._vector(t, plan)
        return self._Record(vpp_stage, name, scope, micro_step, vector, nans, numel, zeros)

    def record_many(self, tensors: Sequence[ms.Tensor], plan: StatPlan,
                    keys: Sequence[Tuple[int, str, str, Optional[int]]]) -> List[Record]:
        """Statistics of many tensors at once (parameters, gradients, optimizer states):
        ``record`` of each, in order.

        On the host path the views the one-pass kernel reads (non-empty, C-contiguous,
        a dtype with a kernel code) go to it in one call for all of them: for a small
        tensor the fixed cost of a call from Python (ctypes, its argument and result
        objects) is most of the kernel's share. The kernel reduces each buffer as a call
        of its own would, with the same thread count, so the numbers are the same to the
        bit. The other tensors take ``record``'s path one by one, in their place."""
        if not self._host and self._batched:
            return self._device_many(tensors, plan, keys)
        kernel = self._native
        if kernel is None or not self._batched or len(tensors) < _BATCH_FROM:
            return [self.record(t, plan, *key) for t, key in zip(tensors, keys)]
        want_zeros = plan.zeros
        records: List[object] = []
        batched: List[int] = []  # indices in ``records`` of the kernel's buffers
        # alive until the kernel has read them: for a non-contiguous tensor ``asnumpy``
        # returns a contiguous copy (MindSpore 2.10), which only this list holds
        views: List[np.ndarray] = []
        pointers: List[int] = []
        counts: List[int] = []
        codes: List[int] = []
        code_of, missing = self._codes_by_dtype.get, _MISSING
        for t, key in zip(tensors, keys):
            try:
                a = t.asnumpy()  # waits for the operator that produces ``t``, as ``record`` does
                numel = a.size
                code = code_of(a.dtype, missing)
                if code is missing:
                    code = self._code(a.dtype)
                if code is None or not numel or not a.flags.c_contiguous:
                    records.append(self._array_record(a, key, want_zeros))
                    continue
                pointer = a.ctypes.data
            except (TypeError, RuntimeError, ValueError) as exc:
                records.append(self._unobserved_record(t, key, exc))
                continue
            batched.append(len(records))
            records.append(key)  # replaced below
            views.append(a)
            pointers.append(pointer)
            counts.append(numel)
            codes.append(code)
        if batched:
            try:  # NaN counts kept, as ``record`` keeps them
                read = kernel.host_records([records[i] for i in batched], pointers, counts, codes, self._threads,
                                           True, want_zeros, self._Record.host)
            except (TypeError, RuntimeError, ValueError):  # each buffer alone, as ``record`` would
                for i, a in zip(batched, views):
                    try:
                        records[i] = self._array_record(a, records[i], want_zeros)
                    except (TypeError, RuntimeError, ValueError) as exc:
                        records[i] = self._unobserved_record(tensors[i], records[i], exc)
                return records
            for i, rec in zip(batched, read):
                records[i] = rec
        return records

    def _device_many(self, tensors: Sequence[ms.Tensor], plan: StatPlan,
                     keys: Sequence[Tuple[int, str, str, Optional[int]]]) -> List[Record]:
        """``record_many`` on the device: small floating-point tensors of one dtype and shape
        (a model's repeated layers) in groups (``_grouped_vectors``: a stack, six
        reductions and the splits, about a dozen primitives a group, where each tensor
        alone takes eight), the others one by one through ``record``."""
        def group_of(i: int) -> Optional[Tuple[Any, int]]:
            t = tensors[i]
            return ((t.dtype, tuple(t.shape)), int(t.size)) if t.dtype in _GROUPED else None

        def read_group(part: List[int]) -> Optional[List[Record]]:
            numel = int(tensors[part[0]].size)
            try:
                vectors, nans, zeros = _grouped_vectors([tensors[i] for i in part], plan, numel)
            except (TypeError, RuntimeError, ValueError):
                return None  # each tensor alone: record() names what fails
            return [self._Record(*keys[i], vectors[j], None if nans is None else nans[j], numel,
                                 None if zeros is None else zeros[j]) for j, i in enumerate(part)]

        return read_grouped(len(tensors), group_of, read_group, lambda i: self.record(tensors[i], plan, *keys[i]))

    def _unobserved_record(self, t: ms.Tensor, key: Tuple[int, str, str, Optional[int]],
                           exc: BaseException) -> Record:
        self._warn_unobserved(key[1], str(t.dtype), short_error(exc))
        return self._Record(*key, None, None, 0)

    def forget(self) -> None:
        """Nothing is cached in MindSpore; the same interface as the PyTorch engine."""

    def to_host(self, records: Sequence[Record]) -> None:
        vec_groups: Dict[object, List[Record]] = defaultdict(list)
        nan_groups: List[Record] = []
        zero_groups: List[Record] = []
        for rec in records:
            if isinstance(rec.vector, ms.Tensor):
                vec_groups[rec.vector.dtype].append(rec)
            if isinstance(rec.nans, ms.Tensor):
                nan_groups.append(rec)
            if isinstance(rec.zeros, ms.Tensor):
                zero_groups.append(rec)
        for recs in vec_groups.values():
            try:
                host = ops.stack([r.vector for r in recs]).asnumpy().tolist()
            except (TypeError, RuntimeError, ValueError):
                recs, host = self._one_by_one(recs)  # one bad vector never costs the step
            for rec, values in zip(recs, host):
                # the device vector holds the sum of squares (one primitive fewer than a norm)
                values[3] = math.sqrt(values[3])
                rec.vector = values
        nan_groups = [r for r in nan_groups if r.vector is not None]
        if nan_groups:
            host = ops.stack([r.nans.astype(ms.int64) for r in nan_groups]).asnumpy().tolist()
            for rec, value in zip(nan_groups, host):
                rec.nans = value
        zero_groups = [r for r in zero_groups if r.vector is not None]
        if zero_groups:
            host = ops.stack([r.zeros for r in zero_groups]).asnumpy().tolist()
            for rec, value in zip(zero_groups, host):
                rec.zeros = value

    def _one_by_one(self, recs: List[Record]) -> Tuple[List[Record], List[List[float]]]:
        """The vectors of ``recs`` moved one at a time; those that fail are unobserved."""
        kept, host = [], []
        for rec in recs:
            try:
                host.append(rec.vector.asnumpy().tolist())
                kept.append(rec)
            except (TypeError, RuntimeError, ValueError) as exc:
                self._warn_unobserved(rec.name, "vector", short_error(exc))
                rec.vector, rec.nans, rec.numel, rec.zeros = None, None, 0, None
        return kept, host
