"""A stalled file system and a preemption during it (issue 47, items 2 and 3).

The stall is real where the test may mount a file system (root, loop devices, ``fsfreeze``):
a small ext4 image is mounted on a loop device and frozen with ``fsfreeze -f`` (every write
to it waits in the kernel until ``fsfreeze -u``), and thawed in a ``finally``. Where that
is impossible the ``ext4`` cases are skipped with the reason, and the same tests run with
the stall injected at the writer's only write to the file system (``writer._write_all``
waits while a flag file exists): the test id says which (``ext4`` or ``injected``).

Item 2: with the default writer, training goes on while the file system is stalled
(a watchdog thaws it after a minute; the test fails if training needed it), the steps
queue in a bounded queue, and a step that finds it full is dropped and counted. Item 3:
real signals to a real training process stalled this way: what is not written is said on
stderr at once, the wait is bounded, what is lost is said again, and the numbers are
checked against the steps on disk and the steps trained. Training stays bit-identical.
"""

import collections
import contextlib
import csv
import functools
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Set

import pytest
import torch

import msprobe.core.monitor_v2.writer as writer_mod
from msprobe.core.monitor_v2.errors import ConfigError
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

from support import TinyMLP, loss_fn, make_batches

LOGGER = "msprobe.monitor_v2"
WORKER = Path(__file__).with_name("stalled_fs_worker.py")
MONITORS = {"weight_grad": {"enabled": True}, "param": {"enabled": True}}
# one file per monitor for the whole run: a stall never meets a file being created
CFG = {"step_count_per_record": 100000, "monitors": MONITORS}
# TinyMLP's 4 parameters: weight_grad unreduced and reduced, param origin and updated
ROWS_PER_STEP = 16
# "did not block forever": far beyond anything the monitor waits (1 s, the exit waits)
GENEROUS_S = 60.0
# the environment variables, as users set them
EXIT_WAIT_ENV = "MSPROBE_MONITOR_EXIT_WAIT"
QUEUE_RECORDS_ENV = "MSPROBE_MONITOR_QUEUE_RECORDS"


@pytest.fixture(autouse=True)
def _rank0(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv(EXIT_WAIT_ENV, raising=False)
    monkeypatch.delenv(QUEUE_RECORDS_ENV, raising=False)


@pytest.fixture
def sigterm_default():
    """SIGTERM with its default disposition in this process (restored after the test)."""
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, before)


# ------------------------------------------------------------------ the stall
@functools.lru_cache(maxsize=None)
def _why_no_freeze() -> Optional[str]:
    """None where this process can mount an ext4 image on a loop device and freeze it;
    else why not (tried once)."""
    if os.geteuid() != 0:
        return "not root: a loop mount and fsfreeze need root"
    for tool in ("truncate", "mkfs.ext4", "mount", "umount", "fsfreeze"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    where = tempfile.mkdtemp(prefix="msprobe_freeze_probe_")
    mnt = os.path.join(where, "mnt")
    os.mkdir(mnt)
    try:
        image = os.path.join(where, "image")
        for cmd in (["truncate", "-s", "8M", image], ["mkfs.ext4", "-q", image], ["mount", "-o", "loop", image, mnt]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                return f"{' '.join(cmd[:2])} failed: {done.stderr.strip()[:200]}"
        try:
            done = subprocess.run(["fsfreeze", "-f", mnt], capture_output=True, text=True)
            if done.returncode:
                return f"fsfreeze failed: {done.stderr.strip()[:200]}"
            subprocess.run(["fsfreeze", "-u", mnt], check=True)
        finally:
            subprocess.run(["umount", mnt], capture_output=True)
        return None
    finally:
        shutil.rmtree(where, ignore_errors=True)


class _FrozenExt4:
    """A 16 MiB ext4 image on a loop device under ``root``; ``freeze()`` is ``fsfreeze -f``."""

    kind = "ext4"

    def __init__(self, root: Path, image: Path) -> None:
        self.root = root
        self.image = image
        self.frozen = False

    def mount(self) -> None:
        subprocess.run(["truncate", "-s", "16M", str(self.image)], check=True)
        subprocess.run(["mkfs.ext4", "-q", str(self.image)], check=True)
        subprocess.run(["mount", "-o", "loop", str(self.image), str(self.root)], check=True)

    def freeze(self) -> None:
        subprocess.run(["fsfreeze", "-f", str(self.root)], check=True)
        self.frozen = True

    def thaw(self) -> None:
        if self.frozen:
            subprocess.run(["fsfreeze", "-u", str(self.root)], check=True)
            self.frozen = False

    def worker_args(self) -> List[str]:
        return []

    def unmount(self) -> None:
        self.thaw()
        subprocess.run(["umount", "-l", str(self.root)], check=True)


class _InjectedStall:
    """No mount possible: the monitor's writes wait while ``flag`` exists (in this process
    through ``writer._write_all``; a worker is given the flag)."""

    kind = "injected"

    def __init__(self, root: Path, flag: Path, monkeypatch) -> None:
        self.root = root
        self.flag = flag
        real = writer_mod._write_all

        def stalled_write(fd, data):
            while flag.exists():
                time.sleep(0.005)
            real(fd, data)

        monkeypatch.setattr(writer_mod, "_write_all", stalled_write)

    def freeze(self) -> None:
        self.flag.touch()

    def thaw(self) -> None:
        self.flag.unlink(missing_ok=True)

    def worker_args(self) -> List[str]:
        return [str(self.flag)]


@contextlib.contextmanager
def _stall(kind, tmp_path, monkeypatch):
    root = tmp_path / "disk"
    root.mkdir()
    if kind == "injected":
        fault = _InjectedStall(root, tmp_path / "stall.flag", monkeypatch)
        try:
            yield fault
        finally:
            fault.thaw()
        return
    why = _why_no_freeze()
    if why is not None:
        pytest.skip(f"a frozen file system cannot be made here ({why}); the 'injected' case runs instead")
    fault = _FrozenExt4(root, tmp_path / "image")
    fault.mount()
    try:
        yield fault
    finally:
        fault.unmount()


@pytest.fixture(params=["ext4", "injected"])
def stall(request, tmp_path, monkeypatch):
    """In-process tests (cheap): the real frozen file system and the injected stall."""
    with _stall(request.param, tmp_path, monkeypatch) as fault:
        yield fault


@pytest.fixture(params=["ext4" if _why_no_freeze() is None else "injected"])
def worker_stall(request, tmp_path, monkeypatch):
    """Tests of a training process (a few seconds each): the real frozen file system where
    one can be made, else the injected stall (the test id says which)."""
    with _stall(request.param, tmp_path, monkeypatch) as fault:
        yield fault


@contextlib.contextmanager
def watchdog(stall, seconds: float = GENEROUS_S):
    """Thaws the file system after ``seconds`` if the test has not: a monitor that waits
    for the stalled file system hangs the test no longer than that, and ``fired`` says so."""
    state = {"fired": False}
    done = threading.Event()

    def thaw_late() -> None:
        if not done.wait(seconds):
            state["fired"] = True
            stall.thaw()

    thread = threading.Thread(target=thaw_late, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        done.set()
        thread.join()
        stall.thaw()


# -------------------------------------------------------------- what is on disk
def rows_on_disk(out: Path) -> Dict[int, Dict[str, int]]:
    """step -> monitor -> rows, read with the csv module (every row whole, one header)."""
    steps: Dict[int, Dict[str, int]] = collections.defaultdict(collections.Counter)
    for path in sorted((out / "rank_0").glob("*.csv")):
        monitor = path.name.split("_step")[0]
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
        header, body = rows[0], rows[1:]
        assert header[:2] == ["vpp_stage", "step"], path
        for row in body:
            assert len(row) == len(header), (path, row)
            steps[int(row[1])][monitor] += 1
    return steps


def whole_steps(out: Path) -> List[int]:
    """Steps on disk, each with all its rows (asserted)."""
    steps = rows_on_disk(out)
    for step, per_monitor in steps.items():
        assert sum(per_monitor.values()) == ROWS_PER_STEP, (step, dict(per_monitor))
    return sorted(steps)


def parse_ranges(text: str) -> Set[int]:
    """``"3-5, 9"`` -> ``{3, 4, 5, 9}`` (the writer's ``_ranges``)."""
    steps: Set[int] = set()
    for part in text.split(","):
        a, _, b = part.strip().partition("-")
        steps.update(range(int(a), int(b or a) + 1))
    return steps


def _messages(caplog, level=logging.WARNING) -> List[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


class _Loop:
    """A real training loop, monitored, and an unmonitored twin on the same batches."""

    def __init__(self, cfg) -> None:
        self.model, self.plain = TinyMLP(), TinyMLP()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.plain_opt = torch.optim.SGD(self.plain.parameters(), lr=0.01)
        self.mon = TrainerMonitorV2(cfg)
        self.mon.start(model=self.model, optimizer=self.opt)
        self.batches = make_batches(16)
        self.done = 0

    def run(self, steps: int) -> None:
        for _ in range(steps):
            x, y = self.batches[self.done % len(self.batches)]
            for model, opt in ((self.model, self.opt), (self.plain, self.plain_opt)):
                loss_fn(model, x, y).backward()
                opt.step()
                opt.zero_grad()
            self.done += 1

    def assert_bit_identical(self) -> None:
        for p, q in zip(self.model.parameters(), self.plain.parameters()):
            assert torch.equal(p, q)


# --------------------------------------------------------- item 2: in process
def test_training_goes_on_while_the_file_system_is_stalled(stall, caplog, sigterm_default):
    out = stall.root / "out"
    caplog.set_level(logging.INFO, logger=LOGGER)
    loop = _Loop(dict(CFG, output_dir=str(out)))
    loop.run(3)
    assert whole_steps(out) == [0, 1, 2]  # on disk when step() returns, as with a synchronous writer
    with watchdog(stall) as dog:
        stall.freeze()
        loop.run(20)  # steps 3-22
        trained_while_stalled = not dog["fired"]
        # while steps wait, a SIGTERM of the default disposition goes through the monitor's handler
        handler = signal.getsignal(signal.SIGTERM)
        on_disk_while_stalled = whole_steps(out)
        stall.thaw()
    assert trained_while_stalled, "training waited for the stalled file system"
    assert handler is writer_mod._on_sigterm
    assert on_disk_while_stalled == [0, 1, 2]
    loop.mon._writer.drain()
    loop.run(1)  # step 23 finds the queue empty: waited for again, on disk when step() returns
    assert whole_steps(out) == list(range(24))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the default again once nothing waits
    loop.mon.stop()
    loop.assert_bit_identical()

    warnings = _messages(caplog)
    stalled = [m for m in warnings if "has not taken the rows" in m]
    assert len(stalled) == 1, warnings
    assert f"{out / 'rank_0'} has not taken the rows of step 3 for 1 s" in stalled[0], stalled
    assert "Training goes on without waiting" in stalled[0] and "A SIGTERM meanwhile" in stalled[0], stalled
    caught_up = [m for m in warnings if "caught up" in m]
    assert len(caught_up) == 1 and "has caught up by step 23" in caught_up[0] and "(step 3)" in caught_up[0], warnings
    assert not [m for m in warnings if "lost" in m], warnings
    (final,) = [m for m in _messages(caplog, logging.INFO) if "stopped after" in m]
    assert f"wrote {24 * ROWS_PER_STEP} rows of 24 step(s) to" in final and "lost" not in final, final


def test_a_full_queue_drops_the_steps_that_find_it_full_and_counts_them(stall, caplog, monkeypatch,
                                                                          sigterm_default):
    """The queue holds 5 steps' records: during the stall step 2 is being written, 3-6 wait,
    7-13 find the queue full and are dropped, said once; counts and names match the disk."""
    monkeypatch.setenv(QUEUE_RECORDS_ENV, str(5 * ROWS_PER_STEP))
    out = stall.root / "out"
    caplog.set_level(logging.INFO, logger=LOGGER)
    loop = _Loop(dict(CFG, output_dir=str(out)))
    loop.run(2)
    with watchdog(stall) as dog:
        stall.freeze()
        loop.run(12)  # steps 2-13
        trained_while_stalled = not dog["fired"]
        stall.thaw()
    assert trained_while_stalled
    loop.mon._writer.drain()
    loop.run(2)  # steps 14, 15
    loop.mon.stop()
    loop.assert_bit_identical()

    dropped = set(range(7, 14))
    assert whole_steps(out) == sorted(set(range(16)) - dropped)
    warnings = _messages(caplog)
    full = [m for m in warnings if "the most this monitor keeps in memory" in m]
    assert len(full) == 1, warnings
    assert f"5 step(s) ({5 * ROWS_PER_STEP} statistics records) are waiting" in full[0], full
    assert "step 7 is dropped" in full[0] and "MSPROBE_MONITOR_QUEUE_RECORDS=80" in full[0], full
    (caught_up,) = [m for m in warnings if "caught up" in m]
    assert "7 step(s) that found the queue full were dropped (7-13)" in caught_up, caught_up
    (summary,) = [m for m in warnings if "of output were lost" in m]
    assert f"7 step(s) of output were lost ({7 * ROWS_PER_STEP} row(s))" in summary and "steps 7-13." in summary
    assert "First error: the queue of steps to write was full" in summary, summary
    (final,) = [m for m in _messages(caplog, logging.INFO) if "stopped after" in m]
    assert f"wrote {9 * ROWS_PER_STEP} rows of 9 step(s) (7 step(s) lost" in final, final


def test_stop_during_a_stall_is_bounded_and_says_what_is_lost(stall, caplog, monkeypatch, sigterm_default):
    """stop() while the file system does not answer: said, given up after
    MSPROBE_MONITOR_EXIT_WAIT without a step written, the loss named and counted; the
    SIGTERM disposition is the default again. After the thaw the step that was being
    written lands, and none of the given-up steps is written."""
    monkeypatch.setenv(EXIT_WAIT_ENV, "1")
    out = stall.root / "out"
    caplog.set_level(logging.INFO, logger=LOGGER)
    loop = _Loop(dict(CFG, output_dir=str(out)))
    loop.run(2)
    with watchdog(stall) as dog:
        stall.freeze()
        loop.run(5)  # steps 2-6
        loop.mon.stop()
        returned_while_stalled = not dog["fired"]
        handler = signal.getsignal(signal.SIGTERM)
        stall.thaw()
    assert returned_while_stalled, "stop() waited for the stalled file system"
    assert handler is signal.SIG_DFL
    loop.assert_bit_identical()

    warnings = _messages(caplog)
    waiting = [m for m in warnings if "stop() is waiting for the file system" in m]
    assert len(waiting) == 1 and f"5 step(s) ({5 * ROWS_PER_STEP} row(s)) are not written" in waiting[0], warnings
    assert "(steps 2-6)" in waiting[0], waiting
    gave_up = [m for m in warnings if "gave up waiting" in m]
    assert len(gave_up) == 1, warnings
    assert (f"stop(): gave up waiting for the file system after 1 s: 5 step(s) ({5 * ROWS_PER_STEP} row(s)) were not "
            f"written to {out / 'rank_0'} and are lost (steps 2-6) (the first of them was being written") in gave_up[0]
    (final,) = [m for m in _messages(caplog, logging.INFO) if "stopped after" in m]
    assert f"wrote {2 * ROWS_PER_STEP} rows of 2 step(s) (5 step(s) lost" in final, final

    # thawed: the writer thread finishes the step it was writing, writes none of the others
    # and closes; it says the loss again, as it now stands on disk
    assert loop.mon._writer._finished.wait(GENEROUS_S)
    assert whole_steps(out) == [0, 1, 2]
    (summary,) = [m for m in _messages(caplog) if "of output were lost" in m]
    assert f"4 step(s) of output were lost ({4 * ROWS_PER_STEP} row(s))" in summary and "steps 3-6." in summary


def test_a_training_sigterm_handler_is_left_alone(stall, caplog):
    def own(signum, frame):  # pragma: no cover - never called
        raise SystemExit(143)

    before = signal.signal(signal.SIGTERM, own)
    try:
        out = stall.root / "out"
        loop = _Loop(dict(CFG, output_dir=str(out)))
        loop.run(1)
        with watchdog(stall) as dog:
            stall.freeze()
            loop.run(3)
            during = signal.getsignal(signal.SIGTERM)
            stall.thaw()
        assert not dog["fired"]
        loop.mon.stop()
        assert during is own and signal.getsignal(signal.SIGTERM) is own
        (stalled,) = [m for m in _messages(caplog) if "has not taken the rows" in m]
        assert "At exit the monitor waits at most 10 s for them (MSPROBE_MONITOR_EXIT_WAIT)" in stalled, stalled
        assert whole_steps(out) == [0, 1, 2, 3]
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("name, value", [(EXIT_WAIT_ENV, "-1"), (EXIT_WAIT_ENV, "soon"),
                                         (QUEUE_RECORDS_ENV, "0")])
def test_a_bad_wait_or_queue_bound_fails_at_start(tmp_path, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    model = TinyMLP()
    mon = TrainerMonitorV2(dict(CFG, output_dir=str(out)))
    with pytest.raises(ConfigError, match=name):
        mon.start(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    assert not (out / "rank_0" / ".csv-writer.lock").exists()  # the run lock is not left held
    monkeypatch.delenv(name)
    mon = TrainerMonitorV2(dict(CFG, output_dir=str(out)))
    mon.start(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    mon.stop()


# ----------------------------------------------------- item 3: real signals
class _Worker:
    """``stalled_fs_worker.py`` as a real process; its stdout and stderr lines collected."""

    def __init__(self, scenario: str, writer: str, out: Path, stall, exit_wait: Optional[str]) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        env.pop("RANK", None)
        env.pop(EXIT_WAIT_ENV, None)
        if exit_wait is not None:
            env[EXIT_WAIT_ENV] = exit_wait
        self.proc = subprocess.Popen([sys.executable, str(WORKER), scenario, writer, str(out)] + stall.worker_args(),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.out: List[str] = []
        self.err: List[str] = []
        self._readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                         for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, lines: List[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    def trained(self) -> int:
        """The last step the worker said it trained (-1: none yet)."""
        steps = [int(line.split()[1]) for line in list(self.out) if line.startswith("TRAINED ")]
        return steps[-1] if steps else -1

    def wait_until(self, what, seconds: float = GENEROUS_S) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if what():
                return True
            if self.proc.poll() is not None:
                return what()
            time.sleep(0.02)
        return False

    def said(self, text: str) -> List[str]:
        return [line for line in list(self.err) if text in line]

    def finish(self) -> int:
        rc = self.proc.wait(GENEROUS_S)
        for reader in self._readers:
            reader.join(GENEROUS_S)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(GENEROUS_S)


QUEUED_RE = re.compile(r"monitor_v2: (?P<why>[^:]+): (?P<steps>\d+) step\(s\) \((?P<rows>\d+) row\(s\)\) are not "
                       r"written to (?P<dir>\S+) yet \(steps (?P<range>[\d, -]+)\)")
LOST_RE = re.compile(r"monitor_v2: (?P<why>[^:]+): gave up waiting for the file system after (?P<wait>\S+) s: "
                     r"(?P<steps>\d+) step\(s\) \((?P<rows>\d+) row\(s\)\) were not written to (?P<dir>\S+) and are "
                     r"lost \(steps (?P<range>[\d, -]+)\)")


def _check_said_against_disk(match, out: Path, last_trained: int) -> Set[int]:
    """The steps a stderr line names: a contiguous range up to the last step trained (one
    more where the signal came between a step's end and its TRAINED line), as many as it
    counts, with their rows; the steps before it are all on disk, whole, and none after it
    (the first one named was being written: it may have reached its file)."""
    named = parse_ranges(match["range"])
    first, last = min(named), max(named)
    assert named == set(range(first, last + 1)), match[0]
    assert last_trained <= last <= last_trained + 1, (match[0], last_trained)
    assert int(match["steps"]) == len(named) and int(match["rows"]) == ROWS_PER_STEP * len(named), match[0]
    assert match["dir"] == str(out / "rank_0"), match[0]
    on_disk = rows_on_disk(out)
    for step in range(first):
        assert sum(on_disk.get(step, {}).values()) == ROWS_PER_STEP, (step, dict(on_disk))
    assert not set(on_disk) - set(range(first + 1)), (sorted(on_disk), match[0])
    return named


WRITERS = pytest.mark.parametrize("writer", ["default", "async"])


def _stalled_worker(stall, scenario, writer, exit_wait):
    out = stall.root / "out"
    worker = _Worker(scenario, writer, out, stall, exit_wait)
    try:
        assert worker.wait_until(lambda: worker.trained() >= 4, 240), worker.err[-20:]
        stall.freeze()
        frozen_at = worker.trained()
        # training goes on while the file system is stalled, which the monitor has said (after 1 s)
        assert worker.wait_until(lambda: worker.trained() >= frozen_at + 15 and worker.said("has not taken the rows")), \
            (frozen_at, worker.trained(), worker.err[-20:])
    except BaseException:
        stall.thaw()
        worker.kill()
        worker.finish()
        raise
    return out, worker


@WRITERS
def test_sigterm_with_the_default_disposition_during_a_stall(worker_stall, writer):
    """SIGTERM, default disposition (the process would die without a word): the monitor's
    handler says the queued steps at once, waits 2 s, says them lost, and the process then
    ends as SIGTERM ends it (no exit handler, status SIGTERM)."""
    stall = worker_stall
    worker = None
    try:
        out, worker = _stalled_worker(stall, "sigterm-default", writer, "2")
        worker.proc.send_signal(signal.SIGTERM)
        said = worker.wait_until(lambda: worker.said("gave up waiting"))
        last_trained = worker.trained()
        stall.thaw()
        rc = worker.finish()
    finally:
        stall.thaw()
        if worker is not None:
            worker.kill()
    err = worker.err
    assert said, err[-20:]
    assert rc == -signal.SIGTERM, (rc, err[-20:])
    assert "EXIT HANDLERS DONE" not in err  # as with the default disposition: no exit handler ran
    queued = [m for m in map(QUEUED_RE.search, err) if m]
    lost = [m for m in map(LOST_RE.search, err) if m]
    assert len(queued) == 1 and len(lost) == 1, err[-20:]
    assert queued[0]["why"] == "SIGTERM" and lost[0]["why"] == "SIGTERM" and lost[0]["wait"] == "2"
    assert err.index(queued[0].string) < err.index(lost[0].string)
    named = _check_said_against_disk(queued[0], out, last_trained)
    assert _check_said_against_disk(lost[0], out, last_trained) == named  # nothing was written meanwhile


@WRITERS
def test_sigterm_exit_handler_then_sigkill_during_a_stall(worker_stall, writer):
    """The trainer's SIGTERM handler calls sys.exit, SIGKILL 5 s later (Slurm, Kubernetes):
    the monitor's exit handler says the queued steps at once, before its wait (10 s, the
    default) on the file system, so they are said before the SIGKILL."""
    stall = worker_stall
    worker = None
    try:
        out, worker = _stalled_worker(stall, "sigterm-exit", writer, None)
        worker.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        said_at_once = worker.wait_until(lambda: worker.said("are not written"), 5.0)
        time.sleep(max(0.0, 5.0 - (time.monotonic() - sent)))  # the grace period
        last_trained = worker.trained()
        worker.proc.send_signal(signal.SIGKILL)
        stall.thaw()
        rc = worker.finish()
    finally:
        stall.thaw()
        if worker is not None:
            worker.kill()
    err = worker.err
    assert said_at_once, err[-20:]
    assert rc == -signal.SIGKILL, (rc, err[-20:])
    queued = [m for m in map(QUEUED_RE.search, err) if m]
    assert len(queued) == 1 and queued[0]["why"] == "the process is exiting", err[-20:]
    assert "waiting 10 s at most for the file system" in queued[0].string
    _check_said_against_disk(queued[0], out, last_trained)


@WRITERS
def test_sigterm_exit_handler_and_stop_in_finally_never_block_the_exit(worker_stall, writer):
    """The trainer's handler calls sys.exit and stop() runs in a finally block: stop() says
    the queued steps at once, gives up after 2 s, says them lost, and the program's exit
    goes on (its last exit handler runs) while the file system is still stalled."""
    stall = worker_stall
    worker = None
    try:
        out, worker = _stalled_worker(stall, "sigterm-exit-stop", writer, "2")
        worker.proc.send_signal(signal.SIGTERM)
        exited = worker.wait_until(lambda: worker.said("EXIT HANDLERS DONE"))
        last_trained = worker.trained()
        stall.thaw()
        rc = worker.finish()
    finally:
        stall.thaw()
        if worker is not None:
            worker.kill()
    err = worker.err
    assert exited, "the exit waited for the stalled file system: " + "\n".join(err[-20:])
    assert rc == 143, (rc, err[-20:])
    queued = [m for m in map(QUEUED_RE.search, err) if m]
    lost = [m for m in map(LOST_RE.search, err) if m]
    assert len(queued) == 1 and len(lost) == 1, err[-20:]
    assert queued[0]["why"] == lost[0]["why"] == "stop() while the program exits (SystemExit)"
    named = _check_said_against_disk(queued[0], out, last_trained)
    assert _check_said_against_disk(lost[0], out, last_trained) == named
    (final,) = worker.said("stopped after")
    assert f"({len(named)} step(s) lost" in final, final
    assert err.index(queued[0].string) < err.index(lost[0].string) < err.index(final) < err.index("EXIT HANDLERS DONE")
