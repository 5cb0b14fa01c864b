"""The accelerator kernel: min, max, sum, sum of squares, NaN count and (when asked) zero
count of a whole list of device tensors in one read of each element, in one Triton launch
plus one small finalising launch. It is the device twin of the C kernel
(``monitor_v2/native/stats_kernel.c``), and gives what it gives.

How a list is read:

- The host writes a small int64 table: each tensor's address, element count, dtype code
  and the index of its first chunk (a prefix sum over ``ceil(numel / chunk)``). On a GPU
  the table goes to the device by a non-blocking copy from pinned memory: no host sync.
- Launch 1 runs one program per chunk of ``chunk`` elements of every tensor of the list
  (a 2^24-element tensor and a 10-element one in the same launch). A program finds its
  tensor by a binary search in the table, turns the address into a pointer of the
  tensor's dtype (fp32, bf16 or fp16) and reads its chunk once, in tiles of ``_BLOCK``
  elements, with fp32 lane accumulators: min and max (NaN skipped), sum, sum of squares,
  NaN count and zero count (``-0.0`` is zero, NaN is not). Whole tiles are read without a
  mask and, where every address of the list is 16-byte aligned (the caching allocator
  aligns its blocks; a view may start inside one), in 16-byte vector loads; the last,
  partial tile with a mask. The lanes are added by a tree (``tl.sum``), and the chunk's
  sums are written as fp64 partials with its other results. ``chunk`` is chosen so that
  a list gives at least ``_PROGRAMS_PER_SM`` programs a multiprocessor, between
  ``_BLOCK`` and ``_MAX_CHUNK`` elements.
- Launch 2 runs one program per tensor and adds its chunks' partials in fp64; the
  vector is ``[min, max, sum, sqrt(sum of squares)]`` in fp64.
- A list of more than ``_MAX_CHUNKS_A_LAUNCH`` chunks (2^17: 8.6G elements at the largest
  chunk) is read in parts of at most that many chunks (``parts``), a pair of launches each,
  so that the partials, 48 bytes a chunk, stay under 6 MiB.

Values, as the C kernel's:

- A tensor holding a NaN has NaN min, max, sum and norm (the sums become NaN by
  themselves; min and max skip NaN in the lanes and are set to NaN from the count).
- An empty tensor gives ``[nan, nan, 0, 0]``, no NaN and no zero (``EMPTY_VECTOR``).
- Inf: min/max are ±inf, the sum is ±inf (NaN for +inf and -inf, as in fp64), the norm inf.
- fp32 lanes can overflow (squares of |x| > 1.8e19, sums near the fp32 maximum) where
  fp64 does not, and can lose squares of |x| < 1e-19 to underflow (to zero where the
  device flushes subnormals). A chunk whose fp32 sum or sum of squares is not finite, or
  whose sum of squares is below 2^-80 while it holds a non-zero element, is read a second
  time, in fp64 lanes, inside the same program (what the C kernel does for non-finite
  blocks). A chunk holding a NaN is not read again: its sums are NaN in any precision.
  So finite data always gives finite, fp64-accurate sums; ordinary data pays one read.
- Accuracy: chains of ``chunk / _BLOCK`` fp32 additions per lane, a tree over the lanes,
  fp64 across chunks: well within 1e-7 relative of fp64 for a 4M-element norm.

Triton is optional. ``available(device)`` says whether the kernel can read tensors of a
device: Triton importable, and a CUDA device (ROCm builds of torch call theirs ``cuda``
too), or the CPU under Triton's interpreter (the tests: ``TRITON_INTERPRET=1`` set before
Triton is first imported, since Triton makes its own library functions for the mode of
that moment). Under the interpreter CUDA tensors are not accepted: the interpreter would
hand device addresses to host code. Where a build or a launch fails, ``read_many``
says so once at INFO, the device type is not tried again, and it returns None: the caller
then uses its ATen path.

How to call it (inside ``outside_training_modes``: the table and the outputs are ATen
allocations and a copy)::

    if triton_stats.available(device) and all(map(triton_stats.accepts, tensors)):
        read = triton_stats.read_many(tensors, zeros=plan.zeros)
        if read is not None:
            vectors, nans, zeros = read  # fp64 [n, 4], int64 [n], int64 [n] or None

or, as the engine's seam ``stats.fused_reader`` expects it, ``fused_reader(tensors, plan)``:
per tensor ``(vector, nans, zeros)`` (views into those three), or None for the ATen path.

All three stay on the device; nothing is read back. The tensors must stay alive, and
unchanged, until the kernels have run on the current stream (the caching allocator keeps
their memory for that stream's later work).
"""

import contextlib
import functools
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ...logonce import LogOnce
from ...monitor import short_error

logger = logging.getLogger("msprobe.monitor_v2")

_CODES: Dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_BLOCK = 2048  # elements a program reads per tile
_WARPS = 8  # 8 elements a thread per tile: 16-byte loads for bf16/fp16, two for fp32
_FINISH_BLOCK = 256  # chunk partials a finalising program reads per tile
_MAX_CHUNK = 1 << 16  # elements a program reads at most (then 32 fp32 additions a lane)
_PROGRAMS_PER_SM = 8  # a list is cut into at least this many chunks a multiprocessor
_PARTIALS = 6  # min, max, sum, sum of squares, NaN count, zero count
_TINY_SUMSQ = 2.0 ** -80  # below it, subnormal squares may matter: the chunk is read in fp64
# chunks one pair of launches reads at most: 6 MiB of partials (48 bytes a chunk), 8.6G
# elements at the largest chunk; a longer list takes one more pair a part
_MAX_CHUNKS_A_LAUNCH = 1 << 17

_said = LogOnce()
_failed: set = set()  # device types whose build or launch failed once: not tried again


def _mode() -> Optional[bool]:
    """How Triton runs kernels here: True in its interpreter, False compiled, None where
    it cannot run ours (not importable, or ``TRITON_INTERPRET`` changed since Triton was
    imported: its own library functions, ``tl.zeros`` and the reductions, were made for
    the mode of that moment, and ours would be made for the mode of now)."""
    if not _triton_importable():
        return None
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    interpret = bool(triton.knobs.runtime.interpret)
    return interpret if interpret != isinstance(tl.zeros, JITFunction) else None


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install is as good as none
        return False
    return True


def available(device: torch.device) -> bool:
    """True where ``read_many`` can read tensors of ``device``: Triton importable and a
    CUDA/ROCm device with Triton compiling, or the CPU under Triton's interpreter
    (``TRITON_INTERPRET=1`` set before Triton was first imported, and still set); False
    also once a build or launch failed on this device type."""
    return why_unavailable(device) is None


def why_unavailable(device: torch.device) -> Optional[str]:
    """None where ``available(device)``, else why not, in words for the INFO line that
    says the ATen path reads that device's tensors."""
    device = torch.device(device)
    if device.type in _failed:
        return "a build or launch of the kernel failed on this device type earlier"
    if not _triton_importable():
        return "Triton is not installed (or does not import)"
    mode = _mode()
    if mode is None:
        return "TRITON_INTERPRET changed after Triton was imported"
    if device.type == "cpu":
        return None if mode else "CPU tensors are read by the kernel only under Triton's interpreter " \
                                 "(TRITON_INTERPRET=1)"
    if device.type != "cuda":
        return f"Triton has no back end for {device.type} devices here"
    if mode:
        return "Triton's interpreter (TRITON_INTERPRET=1) cannot read device memory"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def usable(device: torch.device) -> bool:
    """``available(device)``; where not, said once at INFO (why, and that ATen reads the
    device type's tensors: one line per device type, a failed launch's included)."""
    why = why_unavailable(device)
    if why is None:
        return True
    _say_unavailable(torch.device(device), why)
    return False


def _say_unavailable(device: torch.device, why: str) -> None:
    _said.info(("fallback", device.type), "monitor_v2: the Triton statistics kernel does not read %s tensors (%s); "
               "their statistics use ATen. Logged once.", device.type, why)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel`` consecutive places of memory, each once:
    its dimensions, by increasing stride, are those of a contiguous tensor (dimensions of
    size 1 have any stride)."""
    expected = 1
    for size, stride in sorted(((size, stride) for size, stride in zip(t.shape, t.stride()) if size != 1),
                               key=lambda dim: dim[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def accepts(t: torch.Tensor) -> bool:
    """True for a tensor ``read_many`` reads as it is: a plain fp32, bf16 or fp16 tensor
    without a negative bit whose elements fill one block of memory, each once (contiguous
    in some order of its dimensions: a transpose or a permutation of a contiguous tensor,
    a channels-last one; min, max, the sums and the counts do not depend on the order).
    Its first element is then the block's lowest address. Any other (a strided slice, an
    expanded tensor) goes to the caller's fallback."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype in _CODES and t.layout == torch.strided
            and not t.is_nested and (t.is_contiguous() or _dense(t)) and not t.is_neg())


# The kernels of the mode they were built in: ``triton.jit`` picks the interpreter when it
# decorates, so they are made at the first call (not at import) and again if the mode changed.
_built: Optional[Tuple[bool, Any, Any]] = None
# Triton and the helpers the main kernel calls, set by ``_kernels``. Module globals, not
# closures: the interpreter runs a kernel's source again in its module's globals, where a
# closure's names are not seen.
triton: Any = None
tl: Any = None
_fold_tile: Any = None
_pointer: Any = None
_reduce_chunk: Any = None


def _kernels() -> Tuple[Any, Any]:
    """``(partials_kernel, finish_kernel)`` for the mode Triton is in now."""
    global _built, _fold_tile, _pointer, _reduce_chunk, triton, tl
    mode = _mode()
    if _built is not None and _built[0] == mode:
        return _built[1], _built[2]
    import triton
    import triton.language as tl

    @triton.jit
    def fold_tile(v, live, mn, mx, s, q, nans, zeros, ZEROS: tl.constexpr):
        # One tile into the fp32 lanes; ``v`` is 0 where not ``live``.
        nan = v != v
        seen = live & (v == v)
        mn = tl.minimum(mn, tl.where(seen, v, float("inf")))
        mx = tl.maximum(mx, tl.where(seen, v, float("-inf")))
        s += v
        q += v * v
        nans += nan.to(tl.int32)
        if ZEROS:
            zeros += (live & (v == 0.0)).to(tl.int32)
        return mn, mx, s, q, nans, zeros

    @triton.jit
    def pointer(address, dtype: tl.constexpr, ALIGNED: tl.constexpr):
        # With ALIGNED the compiler is told the address is 16-byte aligned, so whole tiles
        # are read in 16-byte loads (the hint must be made here, not on a callee's argument).
        typed = address.to(tl.pointer_type(dtype))
        if ALIGNED:
            typed = tl.multiple_of(typed, 16)
        return typed

    @triton.jit
    def reduce_chunk(base, start, count, BLOCK: tl.constexpr, ZEROS: tl.constexpr, TINY: tl.constexpr):
        # One chunk of one tensor: fp32 lanes, fp64 partials, and a second read in fp64
        # where fp32 overflowed or underflowed (see the module docstring). Whole tiles
        # are read without a mask, the last one with.
        lanes = tl.arange(0, BLOCK)
        every = lanes < BLOCK
        mn = tl.full([BLOCK], float("inf"), tl.float32)
        mx = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        q = tl.zeros([BLOCK], tl.float32)
        nans = tl.zeros([BLOCK], tl.int32)
        zeros = tl.zeros([BLOCK], tl.int32)
        whole = count - count % BLOCK
        for off in range(0, whole, BLOCK):
            v = tl.load(base + (start + off + lanes)).to(tl.float32)
            mn, mx, s, q, nans, zeros = _fold_tile(v, every, mn, mx, s, q, nans, zeros, ZEROS)
        if whole < count:
            live = whole + lanes < count
            v = tl.load(base + (start + whole + lanes), mask=live, other=0.0).to(tl.float32)
            mn, mx, s, q, nans, zeros = _fold_tile(v, live, mn, mx, s, q, nans, zeros, ZEROS)
        chunk_min = tl.min(mn, axis=0)
        chunk_max = tl.max(mx, axis=0)
        nan_count = tl.sum(nans, axis=0)
        total = tl.sum(s, axis=0).to(tl.float64)
        squares = tl.sum(q, axis=0).to(tl.float64)
        not_finite = ((total - total) != 0) | ((squares - squares) != 0)
        underflow = (squares < TINY) & (tl.maximum(chunk_max, -chunk_min) > 0)
        if (nan_count == 0) & (not_finite | underflow):
            s64 = tl.zeros([BLOCK], tl.float64)
            q64 = tl.zeros([BLOCK], tl.float64)
            for off in range(0, count, BLOCK):
                live = off + lanes < count
                w = tl.load(base + (start + off + lanes), mask=live, other=0.0).to(tl.float64)
                s64 += w
                q64 += w * w
            total = tl.sum(s64, axis=0)
            squares = tl.sum(q64, axis=0)
        return chunk_min, chunk_max, total, squares, nan_count, tl.sum(zeros, axis=0)

    @triton.jit
    def partials_kernel(table, n, steps, chunk, partials, n_chunks, BLOCK: tl.constexpr, ZEROS: tl.constexpr,
                        TINY: tl.constexpr, ALIGNED: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        # The tensor whose chunks hold this one: the last t with first_chunk[t] <= pid
        # (empty tensors have no chunk, so equal neighbours precede the owner).
        lo = pid * 0
        hi = lo + n
        for _ in range(steps):
            mid = (lo + hi) // 2
            below = tl.load(table + 3 * n + mid) <= pid
            lo = tl.where(below, mid, lo)
            hi = tl.where(below, hi, mid)
        address = tl.load(table + lo)
        numel = tl.load(table + n + lo)
        code = tl.load(table + 2 * n + lo)
        start = (pid - tl.load(table + 3 * n + lo)) * chunk
        count = tl.minimum(numel - start, chunk)
        if code == 0:
            mn, mx, total, squares, nan_count, zero_count = _reduce_chunk(
                _pointer(address, tl.float32, ALIGNED), start, count, BLOCK, ZEROS, TINY)
        elif code == 1:
            mn, mx, total, squares, nan_count, zero_count = _reduce_chunk(
                _pointer(address, tl.bfloat16, ALIGNED), start, count, BLOCK, ZEROS, TINY)
        else:
            mn, mx, total, squares, nan_count, zero_count = _reduce_chunk(
                _pointer(address, tl.float16, ALIGNED), start, count, BLOCK, ZEROS, TINY)
        tl.store(partials + pid, mn.to(tl.float64))
        tl.store(partials + n_chunks + pid, mx.to(tl.float64))
        tl.store(partials + 2 * n_chunks + pid, total)
        tl.store(partials + 3 * n_chunks + pid, squares)
        tl.store(partials + 4 * n_chunks + pid, nan_count.to(tl.float64))
        tl.store(partials + 5 * n_chunks + pid, zero_count.to(tl.float64))

    @triton.jit
    def finish_kernel(table, n, partials, n_chunks, vectors, nan_counts, zero_counts, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        first = tl.load(table + 3 * n + t)
        last = tl.load(table + 3 * n + t + 1)
        numel = tl.load(table + n + t)
        lanes = tl.arange(0, BLOCK)
        mn = tl.full([BLOCK], float("inf"), tl.float64)
        mx = tl.full([BLOCK], float("-inf"), tl.float64)
        s = tl.zeros([BLOCK], tl.float64)
        q = tl.zeros([BLOCK], tl.float64)
        nans = tl.zeros([BLOCK], tl.float64)
        zeros = tl.zeros([BLOCK], tl.float64)
        for off in range(first, last, BLOCK):
            at = off + lanes
            live = at < last
            mn = tl.minimum(mn, tl.load(partials + at, mask=live, other=float("inf")))
            mx = tl.maximum(mx, tl.load(partials + n_chunks + at, mask=live, other=float("-inf")))
            s += tl.load(partials + 2 * n_chunks + at, mask=live, other=0.0)
            q += tl.load(partials + 3 * n_chunks + at, mask=live, other=0.0)
            nans += tl.load(partials + 4 * n_chunks + at, mask=live, other=0.0)
            zeros += tl.load(partials + 5 * n_chunks + at, mask=live, other=0.0)
        nan_count = tl.sum(nans, axis=0)
        undefined = (nan_count > 0) | (numel == 0)  # NaN min/max: a NaN inside, or no element
        tl.store(vectors + 4 * t, tl.where(undefined, float("nan"), tl.min(mn, axis=0)))
        tl.store(vectors + 4 * t + 1, tl.where(undefined, float("nan"), tl.max(mx, axis=0)))
        tl.store(vectors + 4 * t + 2, tl.sum(s, axis=0))
        tl.store(vectors + 4 * t + 3, tl.sqrt(tl.sum(q, axis=0)))
        tl.store(nan_counts + t, nan_count.to(tl.int64))
        tl.store(zero_counts + t, tl.sum(zeros, axis=0).to(tl.int64))

    _fold_tile, _pointer, _reduce_chunk = fold_tile, pointer, reduce_chunk
    _built = (mode, partials_kernel, finish_kernel)
    return partials_kernel, finish_kernel


def _chunk_size(device: torch.device, total: int) -> int:
    """Elements a program reads: enough programs to fill the device (``_PROGRAMS_PER_SM``
    a multiprocessor), a power of two between ``_BLOCK`` and ``_MAX_CHUNK``."""
    if device.type != "cuda":
        return _MAX_CHUNK  # the interpreter: fewer programs, less Python
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = -(-total // (_PROGRAMS_PER_SM * sms))
    return min(_MAX_CHUNK, max(_BLOCK, 1 << max(0, wanted - 1).bit_length()))


def _table(tensors: Sequence[torch.Tensor], chunk: int, device: torch.device) -> Tuple[torch.Tensor, int, bool]:
    """The int64 table ``[addresses | numels | dtype codes | first chunks (n + 1)]`` on
    ``device``, the number of chunks, and whether every address is 16-byte aligned (the
    kernel then reads whole tiles in 16-byte loads; the caching allocator aligns every
    block, so only views that start inside one are not)."""
    numels = [t.numel() for t in tensors]
    firsts: List[int] = [0]
    for numel in numels:
        firsts.append(firsts[-1] + -(-numel // chunk))
    addresses = [t.data_ptr() for t in tensors]
    aligned = all(address % 16 == 0 for address, numel in zip(addresses, numels) if numel)
    host = torch.tensor(addresses + numels + [_CODES[t.dtype] for t in tensors] + firsts, dtype=torch.int64)
    if device.type != "cpu":
        # pinned, so the copy does not block the host; the caching host allocator keeps the
        # buffer until the copy has run
        host = host.pin_memory().to(device, non_blocking=True)
    return host, firsts[-1], aligned


def read_many(tensors: Sequence[torch.Tensor], zeros: bool, *, chunk: Optional[int] = None,
              block: int = _BLOCK) -> Optional[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
    """``(vectors, nans, zeros)`` of ``tensors`` (one device, each ``accepts``-ed): fp64
    ``[n, 4]`` rows ``[min, max, sum, norm]``, int64 ``[n]`` NaN counts, and int64 ``[n]``
    zero counts when ``zeros`` is asked for, else None. All on the tensors' device, from
    two kernel launches, no host sync. None where the kernel could not run (said once at
    INFO; the caller uses its ATen path). For tests and tuning, ``chunk`` overrides how
    many elements a program reads and ``block`` how many it reads at a time (powers of
    two, ``block`` at least 16 and ``chunk`` a multiple of it); the defaults are the
    device's."""
    if not tensors:
        raise ValueError("read_many needs at least one tensor")
    device = tensors[0].device
    for t in tensors:
        if t.device != device or not accepts(t):
            raise ValueError(f"read_many cannot read a {t.dtype} tensor of layout {t.layout} on {t.device} "
                             f"(dense: {_dense(t)}) in a list on {device}: check accepts() first")
    why = why_unavailable(device)
    if why is not None:
        _say_unavailable(device, why)
        return None
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two of at least 16, not {block}")
    if chunk is None:
        chunk = max(block, _chunk_size(device, sum(t.numel() for t in tensors)))
    elif chunk < block or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two and a multiple of block ({block}), not {chunk}")
    try:
        return _launch(tensors, zeros, chunk, block, device)
    except Exception as exc:  # noqa: BLE001 - contained: the caller falls back to ATen
        _failed.add(device.type)
        _said.info(("fallback", device.type), "monitor_v2: the Triton statistics kernel failed on %s (%s); "
                   "statistics of %s tensors use ATen from now on. Logged once.", device, short_error(exc),
                   device.type)
        return None


def parts(numels: Sequence[int], chunk: int, most: Optional[int] = None) -> List[Tuple[int, int]]:
    """``[start, stop)`` ranges of a list, in order, each read by one pair of launches:
    together at most ``most`` chunks (``_MAX_CHUNKS_A_LAUNCH``), so that the partials of
    one launch stay under 6 MiB however long the list (a tensor with more chunks than
    that is a part alone)."""
    most = _MAX_CHUNKS_A_LAUNCH if most is None else most
    out: List[Tuple[int, int]] = []
    start = taken = 0
    for i, numel in enumerate(numels):
        chunks = -(-numel // chunk)
        if taken and taken + chunks > most:
            out.append((start, i))
            start, taken = i, 0
        taken += chunks
    out.append((start, len(numels)))
    return out


def _launch(tensors: Sequence[torch.Tensor], zeros: bool, chunk: int, block: int,
            device: torch.device) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    partials_kernel, finish_kernel = _kernels()
    n = len(tensors)
    vectors = torch.empty((n, 4), dtype=torch.float64, device=device)
    counts = torch.empty((2, n), dtype=torch.int64, device=device)
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:
        for start, stop in parts([t.numel() for t in tensors], chunk):
            part = tensors[start:stop]
            m = stop - start
            table, n_chunks, aligned = _table(part, chunk, device)
            partials = torch.empty(_PARTIALS * max(n_chunks, 1), dtype=torch.float64, device=device)
            if n_chunks:
                partials_kernel[(n_chunks,)](table, m, m.bit_length(), chunk, partials, n_chunks, BLOCK=block,
                                             ZEROS=zeros, TINY=_TINY_SUMSQ, ALIGNED=aligned, num_warps=_WARPS)
            finish_kernel[(m,)](table, m, partials, n_chunks, vectors[start:stop], counts[0, start:stop],
                                counts[1, start:stop], BLOCK=_FINISH_BLOCK, num_warps=4)
            del partials  # the next part's may reuse its memory (the caching allocator orders them on the stream)
    return vectors, counts[0], counts[1] if zeros else None


def fused_reader(tensors: Sequence[torch.Tensor], plan: Any) -> Optional[List[Tuple[Any, Any, Any]]]:
    """``read_many`` in the shape of the engine's seam (``stats.fused_reader``): for each
    of ``tensors`` (one device) its ``(vector [4] fp64, nans 0-d int64 or None, zeros 0-d
    int64 or None)``, the counts as ``plan`` asks for them; None where the kernel does not
    read this list (no tensor, one it does not ``accepts``, tensors of several devices, an
    unavailable device: said once at INFO, or a failed launch), so the caller reads it
    with ATen."""
    if not tensors or not all(map(accepts, tensors)) or len({t.device for t in tensors}) != 1:
        return None
    read = read_many(tensors, bool(plan.zeros))
    if read is None:
        return None
    vectors, nans, zeros = read
    n = len(tensors)
    # one C++ call a column for all the views (a Python index a tensor costs ~2 us each)
    return list(zip(vectors.unbind(0), nans.unbind(0) if plan.nans else [None] * n,
                    zeros.unbind(0) if zeros is not None else [None] * n))
