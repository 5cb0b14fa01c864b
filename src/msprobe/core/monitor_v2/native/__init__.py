"""An optional compiled kernel that reduces a CPU buffer in one read.

ATen needs three passes for the statistics (``aminmax``, which runs at half speed,
``sum`` and a norm): about 3.5 times the cost of reading the data once. The C kernel in
``stats_kernel.c`` computes min, max, sum, sum of squares and the NaN count in a single
pass, at the speed of one ``torch._foreach_norm`` pass.

The package ships the C source, not a binary. ``load()`` builds it once per machine with
the system C compiler (``$CC``, else ``cc``, ``gcc`` or ``clang``; about 0.4 s), keeps
the library in a cache directory and checks it on known data before using it. The cache is
used only if this user owns it and nobody else can write it, and a cached file is loaded
only if it is a regular file of this user (never a link); otherwise the kernel is built in
a private temporary directory, removed again once the library is loaded. Our own cached
file that has gained a second hard link (``perf record`` links every library it samples
into ``~/.debug``) is built again in its place, once, instead of privately by every
process that follows. Without a
compiler, or with ``MSPROBE_MONITOR_NATIVE=0``, ``load()`` returns ``None`` and the
engines use framework reductions: the same numbers, slower. Nothing here knows a
framework: callers pass a data pointer, an element count and a dtype code.

Where this interpreter's headers (``Python.h``) are installed, the kernel is built as a
CPython extension instead (``python_ext.c``, which includes the kernel's source): a call
then costs about 0.2 us instead of ctypes' 1.9 us, which is most of a small tensor's
cost, and the extension also formats the writer's CSV rows (``format_rows``). Without the
headers, or with ``MSPROBE_MONITOR_NATIVE=ctypes``, the ctypes library serves the same
statistics, bit for bit, and the writer formats rows in Python, byte for byte the same.
"""

import array
import ctypes
import hashlib
import importlib.machinery
import importlib.util
import logging
import math
import os
import platform
import shlex
import shutil
import stat
import struct
import subprocess
import sysconfig
import tempfile
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

from .. import safe_fs
from ..errors import UnsafePathError

logger = logging.getLogger("msprobe.monitor_v2")

ENV_SWITCH = "MSPROBE_MONITOR_NATIVE"
ENV_CACHE = "MSPROBE_MONITOR_CACHE_DIR"

# Codes understood by the kernel (see the enum in stats_kernel.c).
F32, BF16, F16 = 0, 1, 2

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_HERE, "stats_kernel.c")
# The kernel as a CPython extension (it includes _SOURCE): built where Python's headers are.
_EXT_SOURCE = os.path.join(_HERE, "python_ext.c")
_EXT_MODULE = "_msprobe_monitor_native"
_BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-pthread"]
# Retried without CPU-specific clones where the compiler or libc lacks them.
_FLAG_SETS = [_BASE_FLAGS, _BASE_FLAGS + ["-DMSPROBE_NO_CLONES"]]
# Made once: building the array type per call costs ~0.2 us of a small tensor's ~3 us call.
_FOUR_DOUBLES = ctypes.c_double * 4
# stats_many hands array.array buffers to the kernel where their items have its types' sizes
_ARRAYS_FIT = (array.array("Q").itemsize == ctypes.sizeof(ctypes.c_void_p)
               and array.array("q").itemsize == ctypes.sizeof(ctypes.c_int64)
               and array.array("i").itemsize == ctypes.sizeof(ctypes.c_int))


class NativeStats:
    """The loaded kernel: ``stats(pointer, count, dtype_code, threads)``.

    ``ext`` is the kernel built as a CPython extension (``python_ext.c``), where the Python
    headers were there to build it: the same reductions at a fraction of a ctypes call's
    fixed cost, with the records, merging and row formatting the rest of the package uses
    from it (``ext.Record``, ``ext.merge_fields``, ``ext.format_rows``...). Without it,
    ``lib`` (the ctypes library of ``stats_kernel.c``) serves the statistics alone."""

    def __init__(self, lib: Optional[ctypes.CDLL], path: str, ext: Any = None) -> None:
        self.path = path
        self.ext = ext
        if ext is not None:
            mask = ext.dtypes()
            self.dtype_codes = frozenset(code for code in (F32, BF16, F16) if mask & (1 << code))
            # the binding's methods replaced by the extension's, with the same results
            self.stats = ext.stats  # type: ignore[method-assign]
            self.stats_zeros = ext.stats_zeros  # type: ignore[method-assign]
            return
        assert lib is not None
        self._fn = lib.msprobe_stats
        self._fn.restype = ctypes.c_int64
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                             ctypes.POINTER(ctypes.c_double)]
        self._fn_zeros = lib.msprobe_stats_zeros
        self._fn_zeros.restype = ctypes.c_int64
        self._fn_zeros.argtypes = self._fn.argtypes + [ctypes.POINTER(ctypes.c_int64)]
        self._fn_many = lib.msprobe_stats_many
        self._fn_many.restype = None
        self._fn_many.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64),
                                  ctypes.POINTER(ctypes.c_int), ctypes.c_int64, ctypes.c_int,
                                  ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_int64),
                                  ctypes.POINTER(ctypes.c_int64)]
        lib.msprobe_stats_dtypes.restype = ctypes.c_int
        mask = lib.msprobe_stats_dtypes()
        self.dtype_codes = frozenset(code for code in (F32, BF16, F16) if mask & (1 << code))

    def stats(self, pointer: int, count: int, dtype_code: int, threads: int = 1) -> Tuple[List[float], int]:
        """``([min, max, sum, norm], nan_count)`` of ``count`` elements at ``pointer``
        (contiguous, ``count`` > 0). Min and max are NaN when the count is not zero.
        ctypes releases the GIL for the duration of the call."""
        out = _FOUR_DOUBLES()
        nans = self._fn(pointer, count, dtype_code, threads, out)
        mn, mx, total, sumsq = out
        if nans:
            mn = mx = math.nan
        return [mn, mx, total, math.sqrt(sumsq)], nans  # sqrt keeps NaN and inf

    def stats_zeros(self, pointer: int, count: int, dtype_code: int,
                    threads: int = 1) -> Tuple[List[float], int, int]:
        """``stats`` and the number of elements equal to zero (``-0.0`` counts, NaN does
        not), from the same read: ``([min, max, sum, norm], nan_count, zero_count)``."""
        out = _FOUR_DOUBLES()
        zeros = ctypes.c_int64(0)
        nans = self._fn_zeros(pointer, count, dtype_code, threads, out, ctypes.byref(zeros))
        mn, mx, total, sumsq = out
        if nans:
            mn = mx = math.nan
        return [mn, mx, total, math.sqrt(sumsq)], nans, zeros.value


    def stats_many(self, pointers: Sequence[int], counts: Sequence[int], dtype_codes: Sequence[int],
                   threads: int = 1, zeros: bool = False) -> Tuple[List[Tuple[float, ...]], List[int],
                                                               Optional[List[int]]]:
        """``stats`` (``stats_zeros`` with ``zeros``) of many buffers in one call, one
        ctypes transition for all of them: ``(vectors, nan_counts, zero_counts or None)``,
        item ``i`` exactly what ``stats`` of buffer ``i`` alone gives (its vector as a
        tuple: records keep host vectors as tuples, and building a list first is one
        more object per tensor)."""
        if self.ext is not None:
            return self.ext.stats_many(pointers, counts, dtype_codes, threads, zeros)
        n = len(pointers)
        out = (ctypes.c_double * (4 * n))()
        nans = (ctypes.c_int64 * n)()
        zero_counts = (ctypes.c_int64 * n)() if zeros else None
        # array.array converts a list in C; a ctypes array built from *args converts each
        # item through a Python call
        if n and _ARRAYS_FIT:
            ptrs, lens, kinds = array.array("Q", pointers), array.array("q", counts), array.array("i", dtype_codes)
            self._fn_many((ctypes.c_void_p * n).from_buffer(ptrs), (ctypes.c_int64 * n).from_buffer(lens),
                          (ctypes.c_int * n).from_buffer(kinds), n, threads, out, nans, zero_counts)
        else:
            self._fn_many((ctypes.c_void_p * n)(*pointers), (ctypes.c_int64 * n)(*counts),
                          (ctypes.c_int * n)(*dtype_codes), n, threads, out, nans, zero_counts)
        flat = out[:]
        nan_list = nans[:]
        sqrt, nan = math.sqrt, math.nan
        it = iter(flat)
        vectors = [
            (nan, nan, total, sqrt(sumsq)) if nan_count else (mn, mx, total, sqrt(sumsq))
            for nan_count, mn, mx, total, sumsq in zip(nan_list, it, it, it, it)
        ]
        return vectors, nan_list, zero_counts[:] if zero_counts is not None else None

    def host_records(self, keys: Sequence[Any], pointers: Sequence[int], counts: Sequence[int],
                     dtype_codes: Sequence[int], threads: int, nans: bool, zeros: bool,
                     host: Callable[..., Any]) -> List[Any]:
        """The records of many buffers, record ``i`` under row key ``keys[i]``: built in
        the kernel's call where the extension is (its ``Record``, ``records_many``), else
        ``host(key, vector, nan_count, count, zero_count)`` of ``stats_many``'s items (an
        engine's ``Record.host``). The NaN count is kept where ``nans`` is true, the zero
        count counted where ``zeros`` is. Both engines' batches end here."""
        if self.ext is not None:
            return self.ext.records_many(keys, pointers, counts, dtype_codes, threads, nans, zeros)
        vectors, nan_counts, zero_counts = self.stats_many(pointers, counts, dtype_codes, threads, zeros)
        n = len(vectors)
        return list(map(host, keys, vectors, nan_counts if nans else [None] * n, counts,
                        zero_counts if zero_counts is not None else [None] * n))


_lock = threading.Lock()
_loaded: Optional[NativeStats] = None
_tried = False


def load() -> Optional[NativeStats]:
    """The kernel, built on first use in this process; ``None`` where it cannot be built
    (the reason is logged once) or ``MSPROBE_MONITOR_NATIVE=0``."""
    global _loaded, _tried
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    with _lock:
        if not _tried:
            _tried = True
            try:
                _loaded = _build_and_load()
            except _Unavailable as exc:
                logger.info("monitor_v2: the one-pass statistics kernel is not used (%s); "
                            "framework reductions give the same numbers about 3x slower.", exc)
            except Exception as exc:  # never let an optional speed-up stop training
                logger.warning("monitor_v2: the one-pass statistics kernel failed to load (%s: %s); "
                               "using framework reductions.", type(exc).__name__, exc)
        return _loaded


def extension() -> Any:
    """The kernel's CPython extension module (its ``Record``, ``merge_fields``,
    ``format_rows``, ``GradNote``...) where ``load()`` built it, else None."""
    kernel = load()
    return None if kernel is None else kernel.ext


class _Unavailable(Exception):
    pass


def _compiler() -> List[str]:
    return _find_compiler("CC", ("cc", "gcc", "clang"), "no C compiler found; set CC or install gcc")


def _find_compiler(variable: str, names: Sequence[str], missing: str) -> List[str]:
    """The command in ``$variable`` (split as a shell would), else the first of ``names`` on
    the PATH; ``_Unavailable(missing)`` where there is none."""
    given = os.environ.get(variable)
    if given:
        return shlex.split(given)
    for name in names:
        path = shutil.which(name)
        if path:
            return [path]
    raise _Unavailable(missing)


def _cache_dir() -> str:
    configured = os.environ.get(ENV_CACHE)
    if configured:
        return configured
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "msprobe-monitor")


def _python_include() -> Optional[str]:
    """The directory of this interpreter's ``Python.h``, None where it is not installed or
    the extension is not built for this interpreter: another implementation than CPython,
    or a free-threaded build, where importing an extension that does not declare itself
    free-threading-safe would turn the GIL back on for the whole training process."""
    if platform.python_implementation() != "CPython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None
    include = sysconfig.get_paths().get("include")
    return include if include and os.path.isfile(os.path.join(include, "Python.h")) else None


def _build_and_load() -> NativeStats:
    with open(_SOURCE, "rb") as f:
        source = f.read()
    compiler = _compiler()
    errors = []
    # MSPROBE_MONITOR_NATIVE=ctypes: the ctypes library only (to compare the two bindings)
    ctypes_only = os.environ.get(ENV_SWITCH, "").strip().lower() == "ctypes"
    include = None if ctypes_only else _python_include()
    if include is not None:
        with open(_EXT_SOURCE, "rb") as f:
            ext_source = f.read()
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        for flags in _FLAG_SETS:
            flags = flags + ["-I", include]
            key = hashlib.sha256(source + ext_source + "\0".join(compiler + flags + [suffix]).encode()).hexdigest()[:16]
            loaded = _load_built(compiler, flags, _EXT_SOURCE, f"stats_ext-{key}{suffix}", _load_extension, errors)
            if loaded is not None:
                return loaded
    for flags in _FLAG_SETS:
        key = hashlib.sha256(source + "\0".join(compiler + flags).encode()).hexdigest()[:16]
        name = f"stats_kernel-{key}-{platform.system()}-{platform.machine()}.so"
        loaded = _load_built(compiler, flags, _SOURCE, name, lambda path: NativeStats(ctypes.CDLL(path), path), errors)
        if loaded is not None:
            return loaded
    raise _Unavailable("; ".join(errors))


def _load_extension(path: str) -> NativeStats:
    loader = importlib.machinery.ExtensionFileLoader(_EXT_MODULE, path)
    spec = importlib.util.spec_from_file_location(_EXT_MODULE, path, loader=loader)
    if spec is None:
        raise OSError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return NativeStats(None, path, module)


def _load_built(compiler: List[str], flags: List[str], source: str, name: str,
                load_library: Callable[[str], NativeStats], errors: List[str]) -> Optional[NativeStats]:
    """The library built from ``source`` (cached), loaded and self-tested; None (the
    reason appended to ``errors``) where it cannot be built or loaded."""
    private: Optional[str] = None
    try:
        path, private = _cached_build(compiler, flags, name, source)
        native = load_library(path)
    except (_Unavailable, OSError, ImportError) as exc:
        errors.append(str(exc))
        return None
    finally:
        # a private build is loaded (mapped) by now or failed: its directory goes, so
        # no msprobe_native_* directory is left behind in the temp folder
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
    try:
        _self_test(native)
    except _Unavailable as exc:
        errors.append(f"{os.path.basename(source)}: {exc}")
        return None
    return native


def _cache_problem(directory: str) -> Optional[str]:
    """Why ``directory`` cannot hold libraries this process loads (None if it can):
    created 0750 if missing, never reached through another user's link, owned by this
    user and writable by nobody else (so no one can swap a file in it before dlopen)."""
    try:
        safe_fs.make_dirs(directory)
        return safe_fs.private_dir_problem(directory)
    except UnsafePathError as exc:
        return exc.why
    except OSError as exc:
        return exc.strerror or str(exc)


def _cached_build(compiler: List[str], flags: List[str], name: str, source: str,
                  libraries: Sequence[str] = ()) -> Tuple[str, Optional[str]]:
    """``(path of the library, private directory to remove after loading or None)``;
    ``libraries``: linker arguments that must follow the source (``-l...``)."""
    cache = _cache_dir()
    problem = _cache_problem(cache)
    if problem is not None:
        logger.info("monitor_v2: the kernel cache %s is not used (%s); building for this process only", cache, problem)
    for directory in ((cache,) if problem is None else ()) + (None,):
        private = None
        if directory is None:  # an unusable cache: build for this process only
            try:
                directory = private = tempfile.mkdtemp(prefix="msprobe_native_")
            except OSError:
                break
        path = os.path.join(directory, name)
        if private is None:
            try:
                info: Optional[os.stat_result] = os.lstat(path)
            except FileNotFoundError:
                info = None
            except OSError:
                continue
            if info is not None:
                if _trusted(info):
                    return path, None
                if not _own_with_other_links(info):
                    continue  # a link or someone else's file: build a private copy instead
                # Our own build, also reached by another name (perf's build-id cache links
                # every library it samples): built again under this name, so that the next
                # process finds one link instead of building a private copy each time.
                logger.info("monitor_v2: the cached kernel %s has %d hard links (perf record's build-id cache "
                            "makes one); building it again in its place", path, info.st_nlink)
        # Ranks that start together each build under their own name; the rename is atomic.
        partial = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            result = subprocess.run(compiler + flags + ["-o", partial, source] + list(libraries),
                                    capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            _discard(private)
            raise _Unavailable(f"running {compiler[0]} failed: {exc}") from None
        if result.returncode != 0:
            _remove(partial)
            _discard(private)
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise _Unavailable(f"{' '.join(compiler)} exited with {result.returncode}: {last}")
        try:
            os.chmod(partial, 0o750)  # whatever the umask: see _trusted
            os.replace(partial, path)
            return path, private
        except OSError:
            _remove(partial)
            _discard(private)
    raise _Unavailable("no writable directory to build the kernel in")


def _discard(directory: Optional[str]) -> None:
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


def _ours(info: os.stat_result) -> bool:
    """A regular file (``lstat``, never followed) that this user owns and nobody else may write."""
    if not stat.S_ISREG(info.st_mode):
        return False
    if not hasattr(os, "getuid"):
        return True
    return info.st_uid == os.geteuid() and not info.st_mode & 0o022


def _trusted(info: os.stat_result) -> bool:
    """A cached library is loaded only if it is ``_ours`` with one link, the cache's name
    alone (a link or a file planted in a shared cache directory must not be a way to run
    code here)."""
    return info.st_nlink == 1 and _ours(info)


def _own_with_other_links(info: os.stat_result) -> bool:
    """A cached library that is ``_ours``, safe but for a second hard link."""
    return info.st_nlink > 1 and _ours(info)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _self_test(native: NativeStats) -> None:
    """Check the build on data whose statistics are known exactly, crossing the vector
    width, a block boundary and a tail, with a NaN in a second run."""
    values: Sequence[float] = [((i * 37) % 101 - 50) / 8.0 for i in range(4096 + 16 + 5)]
    expected = [min(values), max(values), math.fsum(values), math.sqrt(math.fsum(v * v for v in values))]
    buf = ctypes.create_string_buffer(struct.pack(f"{len(values)}f", *values))
    got, nans = native.stats(ctypes.addressof(buf), len(values), F32)
    if nans != 0 or any(not math.isclose(g, e, rel_tol=1e-6) for g, e in zip(got, expected)):
        raise _Unavailable(f"self-test failed: {got} instead of {expected}")
    bf16 = struct.pack("<3H", 0x3F80, 0x7FC0, 0xC000)  # 1.0, NaN, -2.0
    buf16 = ctypes.create_string_buffer(bf16)
    got, nans = native.stats(ctypes.addressof(buf16), 3, BF16)
    if nans != 1 or not math.isnan(got[0]) or not math.isnan(got[2]):
        raise _Unavailable(f"self-test failed on bf16 with a NaN: {got}, {nans} NaN")
    want_zeros = sum(1 for v in values if v == 0.0)
    got, nans, zeros = native.stats_zeros(ctypes.addressof(buf), len(values), F32)
    if zeros != want_zeros or nans != 0 or not math.isclose(got[2], expected[2], rel_tol=1e-6):
        raise _Unavailable(f"self-test failed counting zeros: {zeros} instead of {want_zeros}")
    many = native.stats_many([ctypes.addressof(buf), ctypes.addressof(buf16)], [len(values), 3], [F32, BF16],
                             zeros=True)
    single = native.stats(ctypes.addressof(buf), len(values), F32)[0]
    if many[1] != [0, 1] or many[2] != [want_zeros, 0] or list(many[0][0]) != single or not math.isnan(many[0][1][2]):
        raise _Unavailable(f"self-test failed on two buffers in one call: {many}")
