"""A library built by a process of its own, which outlives the training process that asked for it.

The ``module`` monitor's C++ graph hooks take 10 to 30 s of one core to build. Built by a
thread of the training process, a process that ended sooner (a smoke run, a test, a job cut
short) left its compiler running without an owner, never renamed the finished file into
place, left its partial file in the cache, and the next short process started again.

So the training process (the *owner*) starts a *builder*: ``python -I`` running ``main()``
of this module in a session of its own, so that a terminal's Ctrl-C or a launcher's signal
to the training's process group does not reach it. The builder's only job is to take the
lock, compile into a partial file (``<library>.<pid>.<thread>.tmp``) and rename it into
place; the owner waits for it in a thread and loads the library, or ends first and the next
process finds the library built. The builder imports the standard library and this package's
``native`` helpers only (no torch): its plan (compiler, flags, paths) comes from the owner.
Letting the build finish, rather than stopping the compiler when the owner ends, is what
makes a short process pay for the build once instead of every time.

The lock file ``<library>.lock`` holds the builder's process id (created exclusively,
``0640``, never through a link). Nothing is left behind:

- a builder that gets SIGTERM, SIGINT or SIGHUP stops its compiler (SIGTERM to the
  compiler's own process group, so that the compiler driver removes its own temporary
  files, SIGKILL after 5 s), removes its partial file and its lock, and exits;
- a builder killed outright (SIGKILL, the OOM killer) leaves its lock, and may leave its
  compiler running and a partial file: the next builder takes the lock over (its process has
  gone, or it is older than 10 minutes), stops the processes of that build still running
  (on Linux: those in the dead builder's session whose command line names the source or
  the library's partial file, so nothing else is ever signalled), and removes the partial
  files of builds whose process has gone (our own regular files only).
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from . import _Unavailable, _own_with_other_links, _ours, _remove, _trusted

# a lock file older than this is taken to be left by a build that died
STALE_LOCK_SECONDS = 600.0
# a compiler that runs longer is stopped and the build given up
COMPILE_TIMEOUT_SECONDS = 300.0
# how long a stopped compiler has to end on SIGTERM before it gets SIGKILL
_STOP_GRACE_SECONDS = 5.0
# the builder's last line of output, read by the owner
BUILT, BUSY, FAILED = "built", "busy", "failed: "
# the package root on sys.path (the builder runs with -I: no PYTHONPATH, no user site, no
# current directory), so the builder imports the same files as its owner
_ROOT = os.path.abspath(__file__)
for _ in range(__name__.count(".") + 1):
    _ROOT = os.path.dirname(_ROOT)
_ENTRY = f"import sys; sys.path.insert(0, sys.argv[1]); from {__name__} import main; sys.exit(main(sys.argv[2]))"


class Builder:
    """A builder process started by ``start``; ``result()`` waits for its outcome."""

    def __init__(self, process: subprocess.Popen, report: Any) -> None:
        self.process = process
        self.report = report

    def result(self) -> bool:
        """True once the library is in place; False where another process held the lock
        (wait for it with ``await_build``); ``_Unavailable`` with the reason where it cannot
        be built."""
        try:
            returncode = self.process.wait()
            self.report.seek(0)
            output = self.report.read().decode("utf-8", "replace")
        finally:
            self.report.close()
        last = (output.strip().splitlines() or ["no output"])[-1]
        if returncode == 0 and last == BUILT:
            return True
        if returncode == 0 and last == BUSY:
            return False
        if last.startswith(FAILED):
            raise _Unavailable(last[len(FAILED):])
        raise _Unavailable(f"the build process exited with {returncode}: {last}")


def start(compiler: Sequence[str], flags: Sequence[str], libraries: Sequence[str], source: str, path: str,
          takeover: bool = False) -> Builder:
    """Owner side: start a builder for ``path`` (it runs on if this process ends). With
    ``takeover``, it takes the lock whoever holds it (after ``await_build`` found it left
    behind)."""
    if not sys.executable:
        raise _Unavailable("no Python executable to run the build in")
    plan = json.dumps({"compiler": list(compiler), "flags": list(flags), "libraries": list(libraries),
                       "source": os.path.abspath(source), "path": os.path.abspath(path), "takeover": takeover})
    # The builder's output goes to an unnamed file, not a pipe: a process forked from the
    # owner meanwhile (a data loader's worker) would hold a pipe open and the owner would
    # never see its end; the file vanishes with the last process that holds it.
    report = tempfile.TemporaryFile()
    try:
        process = subprocess.Popen([sys.executable, "-I", "-c", _ENTRY, _ROOT, plan], stdin=subprocess.DEVNULL,
                                   stdout=report, stderr=report, cwd=os.path.dirname(os.path.abspath(path)),
                                   start_new_session=True)
    except BaseException:
        report.close()
        raise
    return Builder(process, report)


def build(compiler: Sequence[str], flags: Sequence[str], libraries: Sequence[str], source: str, path: str,
          takeover: bool = False) -> bool:
    """``start`` a builder and wait for its ``result()``."""
    return start(compiler, flags, libraries, source, path, takeover).result()


class _Stopped(Exception):
    """A signal asked the builder to stop."""


def _stop_on(signum: int, frame: Any) -> None:
    raise _Stopped(f"stopped by signal {signum}")


def main(plan_text: str) -> int:
    """Builder side (run by ``start``): the build of one plan; its outcome is the last line
    printed (``built``, ``busy`` or ``failed: <why>``)."""
    for signum in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)):
        if signum is not None:
            signal.signal(signum, _stop_on)
    os.umask(0o027)  # the partial file is never writable by others, whatever the owner's umask
    plan = json.loads(plan_text)
    try:
        outcome = _build(plan["compiler"], plan["flags"], plan["libraries"], plan["source"], plan["path"],
                         bool(plan["takeover"]))
    except _Stopped as exc:
        outcome = FAILED + str(exc)
    try:
        print(outcome, flush=True)
    except OSError:
        pass  # the owner is gone, and so is the file it reads
    return 0


def _build(compiler: List[str], flags: List[str], libraries: List[str], source: str, path: str,
           takeover: bool) -> str:
    lock = path + ".lock"
    previous = lock_holder(lock)
    if not take_lock(lock, stale=takeover):
        return BUSY
    partial = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    compiling: Optional[subprocess.Popen] = None
    try:
        if previous is not None and not running(previous):
            stop_orphans(previous, source, path)
        clear_partial_builds(path)
        try:
            info: Optional[os.stat_result] = os.lstat(path)
        except FileNotFoundError:
            info = None
        if info is not None and _trusted(info):
            return BUILT  # built by a process that held the lock before
        if info is not None and not _own_with_other_links(info):
            return FAILED + f"{path} is not a regular file of this user; left as it is"
        # its own process group: stopped as a whole (the driver and the compiler, assembler
        # and linker it runs), without signalling the builder
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
        try:
            compiling = subprocess.Popen(list(compiler) + list(flags) + ["-o", partial, source] + list(libraries),
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         **group)
        except OSError as exc:
            return FAILED + f"running {compiler[0]} failed: {exc}"
        try:
            output, _ = compiling.communicate(timeout=COMPILE_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            return FAILED + f"running {compiler[0]} failed: it ran longer than {COMPILE_TIMEOUT_SECONDS:.0f} s"
        if compiling.returncode != 0:
            last = (output.decode("utf-8", "replace").strip().splitlines() or ["no output"])[-1]
            return FAILED + f"{' '.join(compiler)} exited with {compiling.returncode}: {last}"
        os.chmod(partial, 0o750)  # whatever the umask: see native._trusted
        os.replace(partial, path)  # atomic; a link planted meanwhile is replaced, never written through
        return BUILT
    except OSError as exc:
        return FAILED + f"{type(exc).__name__}: {exc}"
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)):
            if signum is not None:
                signal.signal(signum, signal.SIG_IGN)  # the clean-up runs to its end
        if compiling is not None and compiling.poll() is None:
            _stop_group(compiling)
        _remove(partial)
        release_lock(lock)


def _stop_group(compiling: subprocess.Popen) -> None:
    """SIGTERM to the compiler's process group (the driver removes its temporary files),
    SIGKILL where any of it is still there after the grace period. Returns once the whole
    group has ended: the driver can exit before the compiler proper it ran has (that one,
    signalled too, is still ending), and the builder must not exit and say "stopped" while
    a process of its build runs on."""
    for signum, grace in ((signal.SIGTERM, _STOP_GRACE_SECONDS), (signal.SIGKILL, _STOP_GRACE_SECONDS)):
        try:
            os.killpg(compiling.pid, signum)
        except OSError:
            pass
        deadline = time.monotonic() + grace
        try:
            compiling.wait(grace)
        except subprocess.TimeoutExpired:
            continue
        while group_members(compiling.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if not group_members(compiling.pid):
            return


def group_members(group: int) -> List[int]:
    """The live processes (not zombies) of process group ``group``. Linux only (``/proc``);
    elsewhere none are found."""
    return [pid for pid, pgrp, _ in _live_processes() if pgrp == group]


def _live_processes() -> Iterator[Tuple[int, int, int]]:
    """(pid, process group, session) of every live process (zombies aside) in ``/proc``;
    none where there is no ``/proc``. A process gone meanwhile is left out."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if fields[0] != b"Z":
                yield int(entry), int(fields[2]), int(fields[3])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile


def take_lock(lock: str, stale: bool = False) -> bool:
    """Create the lock file (0640, holding this process's id); False where another process
    holds it. With ``stale``, or where its holder has died or it is older than 10 minutes,
    it is taken over."""
    if stale:
        _remove(lock)
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0), 0o640)
    except FileExistsError:
        if stale or not left_behind(lock):
            return False
        return take_lock(lock, stale=True)
    try:
        os.fchmod(fd, 0o640)  # whatever the umask
        os.write(fd, str(os.getpid()).encode())
    finally:
        os.close(fd)
    return True


def release_lock(lock: str) -> None:
    """Remove the lock file where it still holds this process's id (a build that ran past
    the stale age may have had it taken over)."""
    if lock_holder(lock) == os.getpid():
        _remove(lock)


def lock_holder(lock: str) -> Optional[int]:
    """The process id a lock file holds; None where there is none, or it is not a regular
    file of this user (never read through a link, never waiting on a FIFO)."""
    try:
        fd = os.open(lock, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        if not _ours(os.fstat(fd)):
            return None
        holder = os.read(fd, 32).decode("ascii", "replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    return int(holder) if holder.isdigit() else None


def left_behind(lock: str) -> bool:
    """Whether a lock file was left by a build that is not running: its process has gone, or
    it is older than STALE_LOCK_SECONDS. Only the age counts where it is not a regular file
    of this user."""
    try:
        info = os.lstat(lock)
    except OSError:
        return False
    if time.time() - info.st_mtime > STALE_LOCK_SECONDS:
        return True
    holder = lock_holder(lock)
    return holder is not None and not running(holder)


def running(pid: int) -> bool:
    """Whether a process with this id runs (another user's included; a zombie does not: an
    init that never reaps, as in some containers, would keep a dead builder's lock)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # another user's process: it exists
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc here: kill() said it exists


def await_build(path: str) -> None:
    """Wait while another process builds ``path``: its lock file is there, its process runs,
    and the library is not there yet (at most STALE_LOCK_SECONDS)."""
    lock = path + ".lock"
    deadline = time.monotonic() + STALE_LOCK_SECONDS
    while (time.monotonic() < deadline and os.path.lexists(lock) and not os.path.lexists(path)
           and not left_behind(lock)):
        time.sleep(0.5)


def clear_partial_builds(path: str) -> None:
    """Remove the partial files (``<library>.<pid>.<thread>.tmp``) of builds whose process
    has gone: our own regular files only."""
    directory, name = os.path.split(path)
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    for entry in entries:
        parts = entry[len(name) + 1:].split(".") if entry.startswith(name + ".") else []
        if len(parts) != 3 or parts[2] != "tmp" or not parts[0].isdigit() or running(int(parts[0])):
            continue
        try:
            if _ours(os.lstat(os.path.join(directory, entry))):
                _remove(os.path.join(directory, entry))
        except OSError:
            pass


def stop_orphans(session: int, source: str, path: str) -> None:
    """Stop what is left running of a build whose builder has gone (``session``: its process
    id, the id of the session it made): SIGTERM, then SIGKILL after the grace period."""
    deadline = time.monotonic() + _STOP_GRACE_SECONDS
    signum = signal.SIGTERM
    while True:
        left = build_processes(session, source, path)
        if not left:
            return
        if time.monotonic() > deadline:
            if signum == signal.SIGKILL:
                return  # not ours to stop after all (a process of another user's build)
            signum, deadline = signal.SIGKILL, time.monotonic() + _STOP_GRACE_SECONDS
        for pid in left:
            try:
                os.kill(pid, signum)
            except OSError:
                pass
        time.sleep(0.05)


def build_processes(session: int, source: str, path: str) -> List[int]:
    """The live processes (not zombies) of this user in ``session`` whose command line names
    ``source`` or a partial file of ``path`` (the compiler driver, the compiler, the
    linker). Linux only (``/proc``); elsewhere none are found."""
    found = []
    partial = (path + ".").encode()
    wanted = source.encode()
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    for pid, _, sid in _live_processes():
        if sid != session:
            continue
        try:
            if uid is not None and os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        if any(arg == wanted or arg.startswith(partial) for arg in args):
            found.append(pid)
    return found
