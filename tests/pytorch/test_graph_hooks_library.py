"""The module monitor's graph hooks put on autograd nodes from C++ (``graph_hooks.cpp``,
built by ``frameworks/pytorch/graph_hooks.py``): built and in use, the same rows as through
torch's Python API on every kind of graph the module monitor meets, its walk equal to the
Python one, a compiled backward pass calling the same hooks, an error never reaching the
backward pass, and torch's Python API, said at INFO, where the library cannot be built.
The build (``native/detached_build.py``) outlives a process that ends one step after
``start()``: the library is put in place for the next process, with no compiler left
running and no partial file left, also where the builder itself is stopped or killed."""

import copy
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest
import torch
from torch import nn

from support import TinyMLP, loss_fn, make_batches, numpy_stats, rows_of
from support.launch import worker_env
from test_module import TinyGPT, make_data, run_monitored
from msprobe.core.monitor_v2 import native
from msprobe.core.monitor_v2.frameworks.pytorch import graph_hooks
from msprobe.core.monitor_v2.frameworks.pytorch import module as module_mod
from msprobe.core.monitor_v2.native import detached_build
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

EVERY_MODULE = {"module": {"enabled": True, "targets": []}}


@pytest.fixture(scope="module")
def library():
    lib = graph_hooks.wait()
    assert lib is not None, "the C++ graph hooks were not built here: see the INFO line of graph_hooks"
    return lib


@pytest.fixture
def python_api(monkeypatch):
    """Torch's Python API for the node hooks, as where the library cannot be built: call the
    fixture's value to switch; the C++ hooks are back after the test."""
    ext = native.extension()
    saved = (module_mod._graph.register, module_mod._graph.edges_into)
    capi = graph_hooks.wait().capi if saved[0] is not None else None

    def switch() -> None:
        monkeypatch.setattr(graph_hooks, "library", lambda: None)  # graph_hooks.state looks it up there
        module_mod._graph.register = module_mod._graph.edges_into = None
        ext.graph_api(None, None, None)

    yield switch
    module_mod._graph.register, module_mod._graph.edges_into = saved
    ext.graph_api(*saved, capi)


def csv_files(out: Path) -> Dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(out).rglob("*.csv"))}


class DeepStack(nn.Module):
    """Residual Linear + LayerNorm blocks: the shape of the per-tensor benchmark's model."""

    def __init__(self, blocks: int = 6, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width)) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _train_gpt(out: Path, ckpt) -> Tuple[List[torch.Tensor], Dict[str, torch.Tensor]]:
    model = TinyGPT(ckpt=ckpt)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    config = {"output_dir": str(out), "monitors": EVERY_MODULE}
    _, losses = run_monitored(model, [[b] for b in make_data(3)], config, optimizer=opt)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("ckpt", [None, "nonreentrant", "reentrant"])
def test_rows_are_the_same_through_cpp_and_through_torchs_python_api(tmp_path, library, python_api, ckpt):
    # TinyGPT: attention, a module called twice, split and dict outputs, in-place ops, tied
    # weights, and a checkpointed block (reentrant: its nodes are a custom Function's, which
    # stay with the Python API)
    before = library.hooks()
    losses, params = _train_gpt(tmp_path / "cpp", ckpt)
    put = library.hooks() - before
    assert put > 0, "no hook went through the C++ library"
    python_api()
    ref_losses, ref_params = _train_gpt(tmp_path / "python", ckpt)
    assert library.hooks() == before + put, "the Python API run put hooks from C++"
    cpp, python = csv_files(tmp_path / "cpp"), csv_files(tmp_path / "python")
    assert any(name.startswith("module") for name in cpp)
    assert b",backward," in b"".join(cpp.values())
    assert cpp == python
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(params[k], ref_params[k]) for k in params)


def _train_without_module(out: Path) -> None:
    torch.manual_seed(0)
    model = TinyMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    monitors = {"weight_grad": {"enabled": True}, "param": {"enabled": True}, "optimizer": {"enabled": True}}
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": monitors})
    mon.start(model=model, optimizer=opt)
    for x, y in make_batches(3):
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()


def test_every_monitors_reads_are_the_same_through_the_librarys_tensor_descriptions(tmp_path, library, python_api):
    # no module monitor: the statistics engine alone puts the library in place (taken out
    # first: an earlier test of this process may have put it there)
    graph_hooks.state.register = graph_hooks.state.edges_into = None
    native.extension().graph_api(None, None, None)
    before = library.descriptions()
    _train_without_module(tmp_path / "cpp")
    assert library.descriptions() > before, "no tensor was described by the library"
    python_api()
    described = library.descriptions()
    _train_without_module(tmp_path / "python")
    assert library.descriptions() == described
    cpp = csv_files(tmp_path / "cpp")
    assert {name.split("_step")[0] for name in cpp} == {"weight_grad", "param", "optimizer"}
    assert cpp == csv_files(tmp_path / "python")


def test_deep_stack_rows_match_independent_gradients(tmp_path, library):
    """Every block's grad_output through the C++ hooks equals the gradient that
    ``torch.autograd.grad`` gives on an unmonitored copy (NumPy statistics)."""
    torch.manual_seed(0)
    model = DeepStack()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    outs = {}
    h = x
    for i, block in enumerate(ref.blocks):
        outs[i] = block(h)
        h = h + outs[i]
    grads = torch.autograd.grad(h.pow(2).mean(), [outs[i] for i in outs])
    before = library.hooks()
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "out"), "monitors": EVERY_MODULE})
    mon.start(model=model, optimizer=opt)
    model(x).pow(2).mean().backward()
    opt.step()
    mon.stop()
    assert library.hooks() > before
    rows = {r["module_name"]: r for r in rows_of(mon.config.output_dir, "module") if r["scope"] == "backward"}
    for i, g in enumerate(grads):
        row = rows[f"blocks.{i}.grad_output.0"]
        expected = numpy_stats(g)
        for op in ("min", "max", "mean", "norm"):
            assert float(row[op]) == pytest.approx(expected[op], rel=1e-5, abs=1e-7), (i, op)


def _graphs():
    """(name, target edge, roots, boundary) of graphs a module call can leave."""
    w = torch.randn(3, 3, requires_grad=True)
    cases = []

    def producer(t):
        return (t.grad_fn, t.output_nr)

    inp = torch.randn(2, 3) @ w  # made before the call: its node is the target, not walked into
    boundary = torch._C._autograd._get_sequence_nr()
    out = torch.relu(inp @ w) + inp * 2  # the input reached by two edges
    cases.append(("two edges", producer(inp), [out.grad_fn], boundary))

    leaf = torch.randn(2, 3, requires_grad=True)  # a leaf input: its accumulator is the target
    boundary = torch._C._autograd._get_sequence_nr()
    out = (leaf * leaf).sum(dim=1)
    cases.append(("leaf", (out.grad_fn.next_functions[0][0].next_functions[0][0], 0), [out.grad_fn], boundary))

    base = torch.randn(4, 3) @ w
    boundary = torch._C._autograd._get_sequence_nr()
    view = base.view(2, 6)
    view.mul_(3)  # an in-place op on a view inside the call
    out = view.tanh()
    cases.append(("view, in place", producer(base), [out.grad_fn], boundary))

    a = torch.randn(2, 3) @ w
    b = torch.randn(2, 3) @ w
    boundary = torch._C._autograd._get_sequence_nr()
    first, second = (a * b).unbind(0)
    cases.append(("two roots", producer(a), [second.grad_fn, first.grad_fn], boundary))
    cases.append(("no boundary", producer(a), [second.grad_fn], 0))
    return cases


@pytest.mark.parametrize("case", range(5))
def test_the_walk_in_cpp_finds_what_the_python_walk_finds(library, case):
    name, target, roots, boundary = _graphs()[case]
    expected = module_mod._edges_into(target, roots, boundary)
    found = library.edges_into(target, roots, boundary)
    assert expected, name
    assert [(type(n), e) for n, e in found] == [(type(n), e) for n, e in expected], name
    assert all(n is m and e == f for (n, e), (m, f) in zip(found, expected)), name


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_a_custom_functions_node_is_left_to_the_python_api(library):
    x = torch.randn(3, requires_grad=True)
    y = _Double.apply(x * 1.0)
    assert library.register(y.grad_fn, lambda *args: None, True) is False
    assert library.edges_into((x.grad_fn, 0), [y.grad_fn], 0) is None


def test_a_hook_that_raises_never_reaches_the_backward_pass(tmp_path, library, caplog):
    x = torch.randn(3, requires_grad=True)
    y = x * 2.0
    before = library.uncontained()

    def raising(grad_inputs, grad_outputs):
        raise RuntimeError("planted failure")

    assert library.register(y.grad_fn, raising, True)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    assert library.uncontained() == before + 1
    # the module monitor says it once, at its next written step
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "out"), "monitors": EVERY_MODULE})
    mon.start(model=model, optimizer=opt)
    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        for x_, y_ in make_batches(2):
            loss_fn(model, x_, y_).backward()
            opt.step()
            opt.zero_grad()
    mon.stop()
    said = [r for r in caplog.records if "came out of the module monitor's graph hooks" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING


def _train_compiled_backward(out: Path) -> Tuple[List[float], List[torch.Tensor]]:
    """TinyMLP, every backward pass through compiled autograd (Dynamo's eager backend)."""
    import torch._dynamo.compiled_autograd as compiled_autograd

    torch._dynamo.reset()
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": EVERY_MODULE})
    mon.start(model=model, optimizer=opt)
    losses = []
    try:
        for x, y in make_batches(2):
            loss = loss_fn(model, x, y)
            with compiled_autograd._enable(lambda gm: torch.compile(gm, backend="eager")):
                loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
    finally:
        mon.stop()
        torch._dynamo.reset()
    return losses, [p.detach().clone() for p in model.parameters()]


def test_a_compiled_backward_pass_calls_the_same_hooks(tmp_path, library, python_api):
    requests = library.compiled_requests()
    losses, params = _train_compiled_backward(tmp_path / "cpp")
    assert library.compiled_requests() > requests, "compiled autograd did not ask the C++ hooks"
    python_api()
    ref_losses, ref_params = _train_compiled_backward(tmp_path / "python")
    cpp = csv_files(tmp_path / "cpp")
    assert b",backward," in b"".join(v for k, v in cpp.items() if k.startswith("module_step0"))
    assert cpp == csv_files(tmp_path / "python")
    assert losses == ref_losses
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))


# --------------------------------------------------------------------- the build
_TRAIN = r"""
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
import torch
from support import TinyMLP, loss_fn, make_batches
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2
from msprobe.core.monitor_v2.frameworks.pytorch import graph_hooks
torch.manual_seed(0)
model = TinyMLP()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
mon = TrainerMonitorV2({"output_dir": sys.argv[1], "monitors": {"module": {"enabled": True, "targets": []}}})
mon.start(model=model, optimizer=opt)
for step, (x, y) in enumerate(make_batches(4)):
    if step == 2:
        print("LIBRARY BEFORE STEP 2", graph_hooks.library() is not None)
        graph_hooks.wait()
    loss_fn(model, x, y).backward()
    opt.step()
    opt.zero_grad()
mon.stop()
lib = graph_hooks.library()
print("HOOKS FROM C++", lib.hooks() if lib is not None else None)
"""


def _run(out: Path, **env: str) -> str:
    proc = subprocess.run([sys.executable, "-c", _TRAIN, str(out)], env=dict(worker_env(), **env),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_a_build_in_the_background_takes_over_between_steps(tmp_path):
    cache = tmp_path / "cache"  # nothing built yet: the first start() builds
    log = _run(tmp_path / "built", MSPROBE_MONITOR_CACHE_DIR=str(cache))
    assert "building the C++ graph hooks" in log and "in the background" in log
    assert "LIBRARY BEFORE STEP 2 False" in log  # steps 0 and 1 through the Python API
    hooks = int(log.rsplit("HOOKS FROM C++ ", 1)[1].split()[0])
    assert hooks > 0  # steps 2 and 3 through the library
    built = [p for p in cache.iterdir() if p.name.startswith("graph_hooks-")]
    assert len(built) == 1 and oct(built[0].stat().st_mode & 0o777) == "0o750"
    reference = _run(tmp_path / "python", MSPROBE_MONITOR_GRAPH="0")
    assert "HOOKS FROM C++ None" in reference and "graph hooks through torch's Python API" in reference
    assert csv_files(tmp_path / "built") == csv_files(tmp_path / "python")


def test_without_a_cpp_compiler_the_python_api_is_used_and_said_once(tmp_path):
    log = _run(tmp_path / "out", MSPROBE_MONITOR_CACHE_DIR=str(tmp_path / "cache"), CXX="false")
    said = [line for line in log.splitlines() if "graph hooks through torch's Python API" in line]
    assert len(said) == 1 and said[0].startswith("INFO") and "false exited with 1" in said[0], log
    assert "HOOKS FROM C++ None" in log
    module_rows = b"".join(v for k, v in csv_files(tmp_path / "out").items() if k.startswith("module"))
    assert module_rows.count(b",backward,") > 0


def test_a_planted_link_in_the_cache_is_neither_loaded_nor_replaced(tmp_path):
    cache = tmp_path / "cache"
    env = dict(worker_env(), MSPROBE_MONITOR_CACHE_DIR=str(cache))
    where = subprocess.run([sys.executable, "-c", "from msprobe.core.monitor_v2.frameworks.pytorch import "
                            "graph_hooks; print(graph_hooks.library_path())"], env=env, capture_output=True,
                           text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    path = Path(where.stdout.strip())
    assert path.parent == cache
    os.makedirs(cache, mode=0o700, exist_ok=True)
    target = tmp_path / "elsewhere.so"
    target.write_bytes(b"not a library")
    path.symlink_to(target)
    log = _run(tmp_path / "out", MSPROBE_MONITOR_CACHE_DIR=str(cache))
    said = [line for line in log.splitlines() if "graph hooks through torch's Python API" in line]
    assert len(said) == 1 and "is not a regular file of this user" in said[0], log
    assert path.is_symlink() and target.read_bytes() == b"not a library"
    assert "HOOKS FROM C++ None" in log


def test_a_lock_of_another_build_is_waited_for_and_taken_over_when_stale(tmp_path):
    lock = str(tmp_path / "graph_hooks-x.so.lock")
    assert detached_build.take_lock(lock)
    assert not detached_build.take_lock(lock)  # another build holds it (this process: alive)
    assert oct(os.stat(lock).st_mode & 0o777) == "0o640"
    assert Path(lock).read_text() == str(os.getpid())
    old = os.stat(lock).st_mtime - detached_build.STALE_LOCK_SECONDS - 1
    os.utime(lock, (old, old))
    assert detached_build.take_lock(lock)  # older than 10 minutes: left by a build that died
    library = tmp_path / "graph_hooks-x.so"
    library.write_bytes(b"")
    detached_build.await_build(str(library))  # returns at once: the library is there
    detached_build.release_lock(lock)
    assert not os.path.lexists(lock)


def test_what_a_build_that_ended_with_its_process_left_is_taken_over_and_cleared(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(gone.stdout)  # a process that has ended
    path = tmp_path / "graph_hooks-x.so"
    lock = tmp_path / "graph_hooks-x.so.lock"
    lock.write_text(str(pid))
    partial = tmp_path / f"graph_hooks-x.so.{pid}.1234.tmp"  # its compiler's unfinished output
    partial.write_bytes(b"half a library")
    alive = tmp_path / f"graph_hooks-x.so.{os.getpid()}.1234.tmp"  # a build still running
    alive.write_bytes(b"")
    assert detached_build.take_lock(str(lock))  # fresh, but its process has gone
    assert lock.read_text() == str(os.getpid())
    detached_build.clear_partial_builds(str(path))
    assert not partial.exists() and alive.exists()


# ------------------------------------------------ the build outlives a short process
def _processes() -> List[Tuple[int, int, str, bytes]]:
    """(pid, session, state, command line) of every process (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        found.append((int(entry), int(fields[3]), fields[0].decode(), cmdline))
    return found


def _build_processes(cache: Path, sessions: Set[int]) -> List[str]:
    """Processes still running (zombies aside) that belong to a build into ``cache``: their
    command line names it (the builder, the compiler driver, the linker), or they are in a
    builder's session (the compiler proper)."""
    return [f"{pid} {cmdline[:160]!r}" for pid, sid, state, cmdline in _processes()
            if state != "Z" and pid != os.getpid() and (str(cache).encode() in cmdline or sid in sessions)]


def _builder_sessions(cache: Path) -> Set[int]:
    """The sessions made by the builders into ``cache`` (a builder leads its own)."""
    return {sid for pid, sid, _, cmdline in _processes() if pid == sid and str(cache).encode() in cmdline}


def _left_in(cache: Path) -> List[str]:
    return sorted(p.name for p in cache.iterdir() if p.name.endswith((".tmp", ".lock")))


def _library_in(cache: Path) -> List[Path]:
    return [p for p in cache.iterdir() if p.name.startswith("graph_hooks-") and p.name.endswith(".so")]


_ONE_STEP = r"""
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
import torch
from support import TinyMLP, loss_fn, make_batches
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2
from msprobe.core.monitor_v2.frameworks.pytorch import graph_hooks
torch.manual_seed(0)
model = TinyMLP()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
mon = TrainerMonitorV2({"output_dir": sys.argv[1], "monitors": {"module": {"enabled": True, "targets": []}}})
mon.start(model=model, optimizer=opt)
x, y = make_batches(1)[0]
loss_fn(model, x, y).backward()
opt.step()
mon.stop()
print("LIBRARY AT EXIT", graph_hooks.library() is not None)
"""


def _one_step(out: Path, cache: Path) -> str:
    """A process that starts the monitor, trains one step, stops it and exits."""
    proc = subprocess.run([sys.executable, "-c", _ONE_STEP, str(out)],
                          env=dict(worker_env(), MSPROBE_MONITOR_CACHE_DIR=str(cache)),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "building the C++ graph hooks" in proc.stdout and "LIBRARY AT EXIT False" in proc.stdout, proc.stdout
    return proc.stdout


def _wait_for(done, seconds: float = 300.0) -> None:
    """Poll until ``done()`` or the bound has passed (the caller asserts what it needs)."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.25)


def test_a_process_that_ends_one_step_after_start_leaves_the_library_built(tmp_path):
    cache = tmp_path / "cache"
    _one_step(tmp_path / "short", cache)
    sessions = _builder_sessions(cache)
    assert _build_processes(cache, sessions), "no build was running when the short process ended"
    began = time.monotonic()
    _wait_for(lambda: _library_in(cache) and not _left_in(cache) and not _build_processes(cache, sessions))
    print(f"the build went on for {time.monotonic() - began:.1f} s after the short process ended")
    assert len(_library_in(cache)) == 1, sorted(p.name for p in cache.iterdir())
    library = _library_in(cache)[0]
    assert oct(library.stat().st_mode & 0o777) == "0o750"
    assert not _left_in(cache)
    assert not _build_processes(cache, sessions)
    # the next process loads it at its first step, without building
    before = library.stat()
    log = _run(tmp_path / "second", MSPROBE_MONITOR_CACHE_DIR=str(cache))
    assert "building the C++ graph hooks" not in log and "LIBRARY BEFORE STEP 2 True" in log, log
    assert int(log.rsplit("HOOKS FROM C++ ", 1)[1].split()[0]) > 0
    after = library.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert not _left_in(cache)


def test_a_builder_killed_outright_is_taken_over_by_the_next_process(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    _one_step(tmp_path / "short", cache)
    sessions = _builder_sessions(cache)
    assert len(sessions) == 1, _build_processes(cache, sessions)
    builder = sessions.pop()
    source = graph_hooks._SOURCE.encode()
    # the compiler proper is running (it names the source), then its builder is killed
    _wait_for(lambda: any(sid == builder and source in cmd for _, sid, _, cmd in _processes()), 60)
    os.kill(builder, signal.SIGKILL)
    orphans = [pid for pid, sid, state, _ in _processes() if sid == builder and state != "Z" and pid != builder]
    assert orphans, "the compiler ended with its builder: nothing to take over"
    monkeypatch.setenv("MSPROBE_MONITOR_CACHE_DIR", str(cache))
    library = Path(graph_hooks.library_path())
    partial = Path(f"{library}.{builder}.1.tmp")  # what its linker would have left
    partial.write_bytes(b"half a library")
    log = _run(tmp_path / "second", MSPROBE_MONITOR_CACHE_DIR=str(cache))
    assert "building the C++ graph hooks" in log, log
    assert int(log.rsplit("HOOKS FROM C++ ", 1)[1].split()[0]) > 0, log  # built, and used after wait()
    assert _library_in(cache) == [library]
    assert not _left_in(cache), _left_in(cache)
    assert not [pid for pid, sid, state, _ in _processes() if sid == builder and state != "Z"]


def test_a_builder_asked_to_stop_stops_its_compiler_and_leaves_nothing(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("MSPROBE_MONITOR_CACHE_DIR", str(cache))
    compiler, flags, libraries, path = graph_hooks._plan()
    os.makedirs(cache, mode=0o750)
    builder = detached_build.start(compiler, flags, libraries, graph_hooks._SOURCE, path)
    session = builder.process.pid
    source = graph_hooks._SOURCE.encode()
    _wait_for(lambda: any(sid == session and source in cmd and pid != session for pid, sid, _, cmd in _processes()),
              60)
    assert any(sid == session and pid != session for pid, sid, _, _ in _processes()), "no compiler ran"
    os.kill(session, signal.SIGTERM)
    with pytest.raises(native._Unavailable, match="stopped by signal 15"):
        builder.result()
    assert not [pid for pid, sid, state, _ in _processes() if sid == session and state != "Z"]
    assert sorted(p.name for p in cache.iterdir()) == []


_SLOW_TO_END_COMPILER = r"""
import signal, subprocess, sys, time
# a driver that ends at once on SIGTERM, and a compiler proper that takes 1.5 s to end on it
child = subprocess.Popen([sys.executable, "-c",
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.5), sys.exit(1)))\n"
    "open(sys.argv[1], 'w').close()\n"
    "while True: time.sleep(0.1)", sys.argv[1] + ".started"])
time.sleep(120)
"""


def test_a_stopped_builder_waits_for_a_compiler_that_outlives_its_driver(tmp_path):
    """The driver can exit before the compiler proper it ran: the builder says "stopped"
    only once every process of its build has ended."""
    compiler = tmp_path / "compiler.py"
    compiler.write_text(_SLOW_TO_END_COMPILER)
    source = tmp_path / "hooks.cpp"
    source.write_text("")
    started = Path(f"{source}.started")
    builder = detached_build.start([sys.executable, str(compiler), str(source)], [], [], str(source),
                                   str(tmp_path / "hooks.so"))
    session = builder.process.pid
    _wait_for(lambda: started.exists(), 60)
    assert started.exists(), "the compiler proper never started"
    os.kill(session, signal.SIGTERM)
    with pytest.raises(native._Unavailable, match="stopped by signal 15"):
        builder.result()
    assert not [pid for pid, sid, state, _ in _processes() if sid == session and state != "Z"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compiler.py", "hooks.cpp", "hooks.cpp.started"]


def test_only_the_processes_of_a_dead_builders_build_are_stopped(tmp_path):
    """A builder killed outright leaves its session's processes: those naming the source or
    the library's partial file are stopped; another process of that session is not."""
    source = str(tmp_path / "graph_hooks.cpp")
    path = str(tmp_path / "graph_hooks-x.so")
    # a session leader that starts three processes and ends at once
    leader = subprocess.run(
        [sys.executable, "-c", "import subprocess, sys\n"
         "for arg in sys.argv[1:]:\n"
         "    print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', arg],\n"
         "                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)",
         source, path + ".99.1.tmp", "unrelated"],
        capture_output=True, text=True, timeout=60, start_new_session=True)
    compiler, linker, other = (int(pid) for pid in leader.stdout.split())
    session = os.getsid(compiler)
    try:
        assert os.getsid(other) == session and not detached_build.running(session)
        assert sorted(detached_build.build_processes(session, source, path)) == sorted([compiler, linker])
        detached_build.stop_orphans(session, source, path)
        _wait_for(lambda: not (detached_build.running(compiler) or detached_build.running(linker)), 30)
        assert not detached_build.running(compiler) and not detached_build.running(linker)
        assert detached_build.running(other)
    finally:
        for pid in (compiler, linker, other):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
