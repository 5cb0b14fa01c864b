"""The module monitor's graph hooks put on autograd nodes from C++ (``graph_hooks.cpp``).

Through torch's Python API every node hook costs a hook dictionary and a handle, made in
Python and kept by the garbage collector as long as the graph. The C++ library adds the
monitor's hook to the node directly: same hook object, same arguments, same order.

It is built against the headers of the torch that runs (``torch/include``), with the
system C++ compiler (``$CXX``, else ``c++``, ``g++`` or ``clang++``), once per torch
version and machine, into the kernel's cache directory (the same checks: a directory
only this user can write, a regular file of this user with one link). A build takes 10 to
30 s, so it runs in the background the first time and the monitor uses torch's Python API
until it is there: ``library()`` looks at each written step's start. The build is a process
of its own (``native.detached_build``) that compiles into a partial file and renames it into
place, so a training process that ends first still leaves the library built for the next
one, with no compiler of its own left running and no partial file left behind; a thread of
this process waits for it. Ranks that start together build once: the first builder takes a
lock file, the others wait for its library. Where it cannot be built (no compiler, no
headers, a cache that cannot be used, a torch whose headers differ) the Python API stays
in use, said once at INFO: the rows are the same. ``MSPROBE_MONITOR_GRAPH=0`` keeps the
Python API (and so does ``MSPROBE_MONITOR_NATIVE=0``, which turns off the compiled code
altogether)."""

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import sysconfig
import threading
from typing import Any, Callable, List, Optional, Tuple

import torch

from ... import native
from ...logonce import LogOnce
from ...native import detached_build

logger = logging.getLogger("msprobe.monitor_v2")

ENV_SWITCH = "MSPROBE_MONITOR_GRAPH"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "graph_hooks.cpp")
_MODULE = "_msprobe_monitor_graph"

_lock = threading.Lock()
_library: Any = None
_tried = False
_build: Optional["_Build"] = None  # a build under way, until library() loads it


def library() -> Any:
    """The built library (``register``, ``hooks``, ``uncontained``, ``compiled_requests``),
    or None while it is being built in the background or where it cannot be. The first
    call loads a cached build at once, or starts the build; the calls after it load the
    build once it is done. Call it on the training thread, between steps."""
    global _tried, _library, _build
    with _lock:
        if not _tried:
            _tried = True
            try:
                _build = _Build.start()
            except Exception as exc:  # noqa: BLE001 - an optional speed-up never stops training
                _say_python_api(exc, "")
        if _build is not None and _build.done():
            build, _build = _build, None
            try:
                _library = build.load()
            except Exception as exc:  # noqa: BLE001 - an optional speed-up never stops training
                _say_python_api(exc, "the C++ graph hooks: ")
        return _library


def _say_python_api(exc: Exception, what: str) -> None:
    """Said once, at INFO: the rows are the same through torch's Python API."""
    why = str(exc) if isinstance(exc, native._Unavailable) else f"{type(exc).__name__}: {exc}"
    logger.info("monitor_v2 module: graph hooks through torch's Python API (%s%s)", what, why)


class GraphHooks:
    """What this process uses of the library: ``register`` and ``edges_into`` (the
    ``module`` monitor's node hooks and walk; None: torch's Python API), and, handed to the
    kernel's extension, its C API (the module calls' graph work, and the tensors'
    descriptions for every monitor's reads). ``uncontained``: the library's count of errors
    that came out of a hook, already said. Updated between steps by the statistics engine
    (when it is made and at each step's end): the library is used from the step after its
    build ends."""

    __slots__ = ("register", "edges_into", "uncontained")

    def __init__(self) -> None:
        self.register: Optional[Callable[[Any, Any, bool], bool]] = None
        self.edges_into: Optional[Callable[[Tuple[Any, int], List[Any], int], Optional[List[Tuple[Any, int]]]]] = None
        self.uncontained = 0

    def update(self, ext: Any, once: LogOnce) -> None:
        """Between steps: start using the library once it is built (the extension's
        ``CallHook`` and reads too), and say once if an error came out of one of its hooks."""
        if ext is None:
            return
        built = library()
        if built is None:
            return
        if self.register is None:
            self.register, self.edges_into = built.register, built.edges_into
            ext.graph_api(built.register, built.edges_into, built.capi)
        uncontained = built.uncontained()
        if uncontained > self.uncontained:
            self.uncontained = uncontained
            once.warning("graph.uncontained", "monitor_v2 module: %d error(s) came out of the module monitor's "
                         "graph hooks and were dropped; training went on (logged once)", uncontained)


state = GraphHooks()


def wait(timeout: float = 300.0) -> Any:
    """``library()`` once any build under way has finished (tests, benchmarks)."""
    library()
    build = _build
    if build is not None:
        build.thread.join(timeout)
    return library()


def enabled() -> bool:
    """Whether the C++ graph hooks may be used in this process (the switches)."""
    off = ("0", "false", "no", "off")
    return (os.environ.get(ENV_SWITCH, "1").strip().lower() not in off
            and os.environ.get(native.ENV_SWITCH, "1").strip().lower() not in off)


class _Build:
    """One build of the library: loaded from the cache at once, or waited for in a thread
    while a builder process (this one's, or another rank's) makes it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.thread = threading.Thread(target=self._run, name="msprobe-monitor-graph-build", daemon=True)
        self.error: Optional[str] = None
        self.compiler: List[str] = []
        self.flags: List[str] = []
        self.libraries: List[str] = []
        self.builder: Optional[detached_build.Builder] = None  # None: another process's builder

    @classmethod
    def start(cls) -> "_Build":
        if not enabled():
            raise native._Unavailable(f"{ENV_SWITCH} or {native.ENV_SWITCH} is off")
        if native.extension() is None:
            raise native._Unavailable("the kernel's extension is not built")
        compiler, flags, libraries, path = _plan()
        cache = os.path.dirname(path)
        problem = native._cache_problem(cache)
        if problem is not None:
            # built for one process only it would cost every rank its 10 to 30 s of a core
            raise native._Unavailable(f"the cache {cache} is not used ({problem})")
        build = cls(path)
        build.compiler, build.flags, build.libraries = compiler, flags, libraries
        try:
            info: Optional[os.stat_result] = os.lstat(path)
        except FileNotFoundError:
            info = None
        if info is not None and native._trusted(info):
            detached_build.clear_partial_builds(path)  # left by builders killed after it was built
            return build  # done(): the thread is never started
        if info is not None and not native._own_with_other_links(info):
            # a link or not this user's file: no build for this process alone (every rank
            # would pay for its own), the Python API instead
            raise native._Unavailable(f"{path} is not a regular file of this user; left as it is")
        lock = path + ".lock"
        if not os.path.lexists(lock) or detached_build.left_behind(lock):
            # started here, not in the thread: a process that ends right after start() has
            # started it all the same (the thread would die with the process before)
            build.builder = detached_build.start(compiler, flags, libraries, _SOURCE, path)
        logger.info("monitor_v2 module: building the C++ graph hooks for torch %s in the background (once "
                    "per torch version, 10 to 30 s of one core, in a process of its own that finishes even if "
                    "this one ends first); torch's Python API until then", torch.__version__)
        build.thread.start()
        return build

    def _cached(self) -> bool:
        try:
            info = os.lstat(self.path)
        except OSError:
            return False
        return native._trusted(info)

    def done(self) -> bool:
        return not self.thread.is_alive()

    def _run(self) -> None:
        """Wait for the library: this process's builder makes it, or another process's
        (which holds the lock); a builder that has gone without it is taken over."""
        try:
            if self.builder is None or not self.builder.result():
                detached_build.await_build(self.path)
                if not self._cached():
                    detached_build.build(self.compiler, self.flags, self.libraries, _SOURCE, self.path,
                                         takeover=True)
        except native._Unavailable as exc:
            self.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - reported by load()
            self.error = f"{type(exc).__name__}: {exc}"

    def load(self) -> Any:
        if self.error is not None:
            raise native._Unavailable(self.error)
        if not self._cached():
            raise native._Unavailable(f"{self.path} was not built")
        loader = importlib.machinery.ExtensionFileLoader(_MODULE, self.path)
        spec = importlib.util.spec_from_file_location(_MODULE, self.path, loader=loader)
        if spec is None:
            raise native._Unavailable(f"cannot load {self.path}")
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        _self_test(module)
        return module


def _plan() -> Tuple[List[str], List[str], List[str], str]:
    """(compiler, flags, linker arguments, the cached library's path) of this process's
    build: one file name per source, compiler, flags and torch build."""
    compiler = _compiler()
    flags, libraries = _flags()
    with open(_SOURCE, "rb") as f:
        source = f.read()
    version = f"{torch.__version__} {getattr(torch.version, 'git_version', '')}"
    key = hashlib.sha256(b"\0".join([source, " ".join(compiler + flags + libraries).encode(),
                                     version.encode()])).hexdigest()[:16]
    name = f"graph_hooks-{key}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    return compiler, flags, libraries, os.path.join(native._cache_dir(), name)


def library_path() -> str:
    """Where this process's build of the library is cached (it may not be there yet)."""
    return _plan()[3]


def _compiler() -> List[str]:
    return native._find_compiler("CXX", ("c++", "g++", "clang++"), "no C++ compiler found; set CXX or install g++")


def _flags() -> Tuple[List[str], List[str]]:
    """(compiler flags, linker arguments after the source) for this torch and Python."""
    root = os.path.dirname(os.path.abspath(torch.__file__))
    include = os.path.join(root, "include")
    if not os.path.isfile(os.path.join(include, "torch", "csrc", "autograd", "python_cpp_function.h")):
        raise native._Unavailable(f"torch's C++ headers are not installed ({include})")
    python_include = native._python_include()
    if python_include is None:
        raise native._Unavailable("this interpreter's Python.h is not installed")
    lib = os.path.join(root, "lib")
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    # torch 2.9 and later need C++20 for their headers, older ones C++17
    standard = "-std=c++20" if torch.__version__ >= (2, 9) else "-std=c++17"
    flags = ["-O2", "-fPIC", "-shared", standard, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-isystem", include,
             "-isystem", os.path.join(include, "torch", "csrc", "api", "include"), "-isystem", python_include]
    libraries = [f"-L{lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{lib}"]
    return flags, libraries


def _self_test(module: Any) -> None:
    """A pre-hook and a post-hook on a small graph: called once each, with the node's
    incoming gradients (and its results, for the post-hook), the gradient unchanged."""
    seen: List[Tuple[Any, ...]] = []
    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    y = x * 2.0
    node = y.grad_fn
    if not (module.register(node, lambda grads: seen.append(("pre", grads)), False)
            and module.register(node, lambda results, grads: seen.append(("post", results, grads)), True)):
        raise native._Unavailable("self-test: a C++ node was not accepted")
    y.sum().backward()
    ok = (len(seen) == 2 and seen[0][0] == "pre" and seen[1][0] == "post"
          and torch.equal(seen[0][1][0], torch.ones(3)) and torch.equal(seen[1][1][0], torch.full((3,), 2.0))
          and torch.equal(x.grad, torch.full((3,), 2.0)))
    if not ok:
        raise native._Unavailable(f"self-test failed: {seen}")
    # buffer(): what the kernel's extension reads of a tensor, against torch's own getters
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    samples = [base, base[1:], base.t(), base[:, 1], base.to(torch.bfloat16), base.to(torch.float16),
               base.to(torch.float64), base.to(torch.int32), torch.empty(0), torch.tensor(2.5),
               base.clone().requires_grad_(True), torch.conj(base.to(torch.complex64)).imag,
               base.to(torch.float16)._neg_view(), torch.empty(2, 3, device="meta")]
    codes = {torch.float32: native.F32, torch.bfloat16: native.BF16, torch.float16: native.F16}
    for t in samples:
        expected = None
        if (t.device.type == "cpu" and t.dtype in codes and t.is_contiguous() and not t.is_neg()
                and t.numel() > 0):
            expected = (t.data_ptr(), t.numel(), codes[t.dtype])
        got = module.buffer(t)
        if got != expected:
            raise native._Unavailable(f"self-test: buffer() gave {got} for a {t.dtype} tensor of shape "
                                      f"{tuple(t.shape)}, strides {t.stride()}, not {expected}")
