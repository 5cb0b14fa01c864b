"""File-system primitives for shared machines: no write through a link, fixed modes,
no blocking on a FIFO or a device.

Training jobs often run as root under a directory that other users can write (the system
temp directory, a shared scratch). Everything the monitor, the CLI and the native kernel
cache write goes through this module, with these rules:

- Directories are created ``0750`` and files ``0640`` whatever the umask (the modes are
  set with ``fchmod`` after creation). ``MSPROBE_MONITOR_DIR_MODE`` /
  ``MSPROBE_MONITOR_FILE_MODE`` (octal) may loosen read access, never write access:
  a directory mode is a subset of ``0755`` holding ``0700``, a file mode a subset of
  ``0644`` holding ``0600``.
- A name this code chooses (``rank_<r>``, a CSV file, ``analysis_report``, a report
  file, a cache file) is never followed when it is a symbolic link: the link is refused
  with an error naming it. A link on the way to a path the user chose (``output_dir``,
  ``--out``, ``DEST``) is followed only if this user or root owns it: a link another
  user planted in a shared directory is refused.
- The directory that receives the output (``output_dir``, ``rank_<r>``) must be owned by
  this user and writable by nobody else, so no one else can plant a name in it.
- A file appended to is opened with ``O_NOFOLLOW | O_NONBLOCK`` and then checked with
  ``fstat``: a regular file with one link, owned by this user. A new file is created with
  ``O_CREAT | O_EXCL``. A file the CLI rewrites is written to a fresh temporary file in
  the same directory (``O_EXCL``) and renamed over the old name (``rename`` replaces a
  link, it never writes through it), all relative to a directory opened with
  ``O_NOFOLLOW``.
- A file read (a config, a CSV file, a layout or merge report) is reached only through
  symbolic links that this user or root owns: every link met on the way, in any
  component of the path and in the targets of the links followed, is checked before the
  open, and the file opened must be the one the path leads to after it (a link swapped in
  meanwhile is caught). A link owned by another user is refused, never followed: as root,
  following a link planted in a shared directory would show the content of a file of
  root's in the log. The file is opened with ``O_NONBLOCK`` and refused unless ``fstat``
  says it is a regular file; a config's size is capped.
"""

import contextlib
import errno
import io
import os
import re
import secrets
import stat
from typing import IO, Iterator, List, Optional, Tuple

from .errors import ConfigError, UnsafePathError

DIR_MODE_ENV = "MSPROBE_MONITOR_DIR_MODE"
FILE_MODE_ENV = "MSPROBE_MONITOR_FILE_MODE"
DIR_MODE = 0o750
FILE_MODE = 0o640

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_HAS_UIDS = hasattr(os, "geteuid")


def _mode_from_env(name: str, default: int, most: int, least: int) -> int:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        mode = int(raw.strip(), 8)
    except ValueError:
        mode = -1
    if mode < 0 or mode & ~most or mode & least != least:
        raise ConfigError(
            f"monitor_v2: environment variable {name}={raw!r} is not allowed: it must be an octal mode "
            f"within {most:04o} that keeps {least:04o} (read access may be widened, write access never: "
            f"others must not be able to plant links in the output)", field=name)
    return mode


def dir_mode() -> int:
    """The mode of the directories this package creates (0750 unless loosened)."""
    return _mode_from_env(DIR_MODE_ENV, DIR_MODE, 0o755, 0o700)


def file_mode() -> int:
    """The mode of the files this package creates (0640 unless loosened)."""
    return _mode_from_env(FILE_MODE_ENV, FILE_MODE, 0o644, 0o600)


def _euid() -> int:
    return os.geteuid() if _HAS_UIDS else 0


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def _refuse(path: str, why: str) -> UnsafePathError:
    return UnsafePathError(f"monitor_v2: refusing {path!r}: {why}", path, why)


def _trusted_link(info: os.stat_result) -> bool:
    return not _HAS_UIDS or info.st_uid in (_euid(), 0)


# ------------------------------------------------------------------- directories
def _check_components(path: str) -> None:
    """Every existing component of ``path`` that is a link must be ours or root's."""
    parts: List[str] = []
    head = path
    while True:
        parent, tail = os.path.split(head)
        if not tail:
            break
        parts.append(head)
        head = parent
    for comp in reversed(parts):
        try:
            info = os.lstat(comp)
        except FileNotFoundError:
            return
        except OSError:
            return  # the creating call says what is wrong
        if stat.S_ISLNK(info.st_mode) and not _trusted_link(info):
            raise _refuse(comp, f"it is a symbolic link owned by uid {info.st_uid}, another user (a link "
                                f"planted in a shared directory would redirect the output); remove it or "
                                f"choose another path")


def _set_dir_mode(path: str, mode: int) -> None:
    fd = os.open(path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def missing_dirs(path: str) -> Tuple[List[str], str]:
    """The components of the absolute ``path`` that do not exist yet, deepest first, and
    the deepest one that does (or the root)."""
    missing: List[str] = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return missing, probe


def make_dirs(path: str, mode: Optional[int] = None, link_ok: bool = True) -> List[str]:
    """Create ``path`` and its missing parents with ``mode`` (default :func:`dir_mode`),
    whatever the umask; returns the directories created, deepest first. ``link_ok=False``:
    the last component is a name this package chose and must not be a symbolic link."""
    path = os.path.abspath(path)
    mode = dir_mode() if mode is None else mode
    _check_components(os.path.dirname(path) if not link_ok else path)
    if not link_ok:
        refuse_link(path)
    missing, _ = missing_dirs(path)
    created: List[str] = []
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:  # another rank was faster: it must still be a real directory
            info = os.lstat(directory)
            if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
                raise _refuse(directory, f"it appeared as {_kind(info.st_mode)} while it was being created")
            continue
        created.append(directory)
        _set_dir_mode(directory, mode)
    return created[::-1]


def refuse_link(path: str) -> None:
    """Raise if ``path`` exists and is a symbolic link (a name this package chose)."""
    try:
        info = os.lstat(path)
    except OSError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise _refuse(path, f"it is a symbolic link (to {os.readlink(path)!r}); this program creates that "
                            f"name itself and never follows a link there. Remove the link")


def private_dir_problem(path: str) -> Optional[str]:
    """Why ``path`` (followed) is not a directory that only this user can write, or None."""
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        return f"it is {_kind(info.st_mode)}, not a directory"
    if _HAS_UIDS and info.st_uid != _euid():
        return (f"it is owned by uid {info.st_uid}, not by this user (uid {_euid()}): its owner could plant "
                f"links in it that redirect the output; use a directory of your own")
    writers = info.st_mode & 0o022
    if writers == 0o020 and _private_group(info):
        writers = 0  # the owner's own group (umask 002 under user private groups): nobody else
    if writers:
        who = {0o022: "group and others", 0o020: "its group", 0o002: "others"}[writers]
        return (f"it is writable by {who} (mode {stat.S_IMODE(info.st_mode):04o}): they could plant links in it "
                f"that redirect the output; run 'chmod go-w {path}' or use another directory")
    return None


def _private_group(info: os.stat_result) -> bool:
    """Whether the group of ``info`` is its owner's private group: named after the owner,
    the owner's primary group, and with no other member listed. Debian, Ubuntu and Fedora
    give each user such a group and a umask of 002, so a user's own directories are
    group-writable without anybody else being able to write them."""
    try:
        import grp
        import pwd
        group = grp.getgrgid(info.st_gid)
        owner = pwd.getpwuid(info.st_uid)
    except (ImportError, KeyError):
        return False
    return (group.gr_name == owner.pw_name and owner.pw_gid == info.st_gid
            and set(group.gr_mem) <= {owner.pw_name})


def check_private_dir(path: str) -> None:
    """Raise ``UnsafePathError`` unless ``path`` is a directory only this user can write."""
    problem = private_dir_problem(path)
    if problem is not None:
        raise _refuse(path, problem)


# -------------------------------------------------------------------------- files
def _open_error(path: str, exc: OSError, dir_fd: Optional[int] = None) -> UnsafePathError:
    name = os.path.basename(path) if dir_fd is not None else path
    try:
        info = os.lstat(name, dir_fd=dir_fd)
        what = _kind(info.st_mode)
    except OSError:
        what = "not a regular file"
    if what == "a symbolic link":
        return _refuse(path, "it is a symbolic link; files are never written through a link. Remove it")
    if exc.errno == errno.ENXIO or what != "a regular file":
        return _refuse(path, f"it is {what}, not a regular file; remove it")
    return _refuse(path, f"{exc.strerror or exc}")


def _check_opened(fd: int, path: str) -> None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise _refuse(path, f"it is {_kind(info.st_mode)}, not a regular file; remove it")
    if info.st_nlink != 1:
        raise _refuse(path, f"it has {info.st_nlink} hard links; a file this program appends to has one")
    if _HAS_UIDS and info.st_uid != _euid():
        raise _refuse(path, f"it is owned by uid {info.st_uid}, not by this user (uid {_euid()})")


def _open_parent(path: str) -> int:
    """The directory of ``path``, opened without following a link in its last component
    (a name this package chose, such as ``rank_<r>``); FileNotFoundError when it is gone."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        return os.open(parent, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if os.path.islink(parent):
            raise _refuse(parent, "it is a symbolic link; this program writes only into a directory of its "
                                  "own. Remove the link") from None
        if exc.errno == errno.ENOTDIR:
            raise _refuse(parent, "it is not a directory") from None
        raise


def open_append(path: str, mode: Optional[int] = None) -> Tuple[int, bool]:
    """``(fd, created)``: ``path`` opened for reading and appending, created with ``mode``
    (default :func:`file_mode`) if missing. Never follows a link (neither the file nor its
    directory), never blocks, and only appends to a regular file of this user with one
    link. ``FileNotFoundError`` when the directory is gone; ``UnsafePathError`` (an
    ``OSError``) for anything refused."""
    mode = file_mode() if mode is None else mode
    dir_fd = _open_parent(path)
    try:
        return _open_append_at(dir_fd, path, mode)
    finally:
        os.close(dir_fd)


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (``os.write`` may write less; a full disk raises)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def append_bytes(path: str, data: bytes) -> None:
    """Append ``data`` to ``path`` as :func:`open_append` opens it, in one call."""
    fd, _ = open_append(path)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)


def _open_append_at(dir_fd: int, path: str, mode: int) -> Tuple[int, bool]:
    name = os.path.basename(path)
    flags = os.O_RDWR | os.O_APPEND | _NOFOLLOW | _NONBLOCK | _CLOEXEC
    for _ in range(3):  # a name removed between the two opens: try again
        try:
            fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
            created = True
            break
        except FileExistsError:
            try:
                fd = os.open(name, flags, dir_fd=dir_fd)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise _open_error(path, exc, dir_fd) from None
            created = False
            break
    else:
        raise _refuse(path, "it keeps appearing and disappearing while being opened")
    try:
        if created:
            os.fchmod(fd, mode)
        else:
            _check_opened(fd, path)
        _blocking(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd, created


def _blocking(fd: int) -> None:
    """Clear ``O_NONBLOCK`` (used only so that opening a FIFO cannot block) once ``fd`` is
    known to be a regular file."""
    if _NONBLOCK:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_NONBLOCK)


# ------------------------------------------------------------------ files read
_MAX_LINK_HOPS = 40  # as the kernel's own limit (ELOOP)


def _resolve_trusted(path: str) -> Tuple[Optional[str], Optional[Tuple[str, int]]]:
    """``(resolved, untrusted)``: ``path`` resolved component by component as the kernel
    would, following only symbolic links that this user or root owns. ``untrusted`` is
    ``(link, uid)`` for the first link another user owns (``resolved`` is then None);
    ``resolved`` is None too when a component is missing or cannot be looked at, or the
    links loop (the open that follows says why)."""
    if not os.path.isabs(path):
        path = os.path.join(os.getcwd(), path)  # getcwd is the physical path: no link in it to check
    pending = path.split(os.sep)
    current = os.sep
    hops = 0
    while pending:
        name = pending.pop(0)
        if name in ("", "."):
            continue
        if name == "..":  # relative to the directory reached, as the kernel resolves it
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, name)
        try:
            info = os.lstat(candidate)
        except (OSError, ValueError):
            return None, None
        if not stat.S_ISLNK(info.st_mode):
            current = candidate
            continue
        if not _trusted_link(info):
            return None, (candidate, info.st_uid)
        hops += 1
        if hops > _MAX_LINK_HOPS:
            return None, None
        try:
            target = os.readlink(candidate)
        except OSError:
            return None, None
        if os.path.isabs(target):
            current = os.sep
        pending = target.split(os.sep) + pending
    return current, None


def _untrusted_link_error(path: str, link: str, uid: int) -> UnsafePathError:
    which = "it is" if os.path.abspath(link) == os.path.abspath(path) else f"{link!r} on its way is"
    return _refuse(path, f"{which} a symbolic link owned by uid {uid}, another user (a link planted in a shared "
                         f"directory must not show the content of the file it points to); remove the link or "
                         f"name the file itself")


def open_for_reading(path: str, what: str = "file") -> int:
    """``path`` opened read-only, without blocking (``O_NONBLOCK``, cleared once the file
    is known to be regular), by the rules of the module's docstring: refused
    (``UnsafePathError``) when a symbolic link that neither this user nor root owns lies
    on the way, when it is not a regular file (a FIFO, a device, a directory), or when the
    path led elsewhere than the file opened (a link swapped in while it was opened).
    ``FileNotFoundError`` and the other ``OSError`` of the open as raised."""
    _, untrusted = _resolve_trusted(path)
    if untrusted is not None:
        raise _untrusted_link_error(path, *untrusted)
    fd = os.open(path, os.O_RDONLY | _NONBLOCK | _CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _refuse(path, f"it is {_kind(info.st_mode)}, not a regular file (a {what} is read from a "
                                f"regular file; reading this one could block or never end)")
        resolved, untrusted = _resolve_trusted(path)
        if untrusted is not None:
            raise _untrusted_link_error(path, *untrusted)
        try:
            now = os.lstat(resolved) if resolved is not None else None
        except OSError:
            now = None
        if now is None or (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
            raise _refuse(path, "it changed while it was being opened (a link or another file was put in its "
                                "place); try again")
        _blocking(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular_file(path: str, limit: int, what: str = "file") -> bytes:
    """The bytes of ``path``, opened by :func:`open_for_reading` (no link of another user,
    no blocking, a regular file only), refused above ``limit`` bytes
    (``UnsafePathError``; other ``OSError`` as raised)."""
    fd = open_for_reading(path, what)
    try:
        info = os.fstat(fd)
        if info.st_size > limit:
            raise _refuse(path, f"it is {info.st_size} bytes, more than the {limit} bytes a {what} may have")
        chunks = []
        total = 0
        while True:
            chunk = os.read(fd, min(1 << 16, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:  # it grew while being read
                raise _refuse(path, f"it is more than the {limit} bytes a {what} may have")
        return b"".join(chunks)
    finally:
        os.close(fd)


def open_regular(path: str) -> int:
    """``path`` opened for reading by :func:`open_for_reading`: refused
    (``UnsafePathError``) if it is a FIFO, a device or a directory, or if a symbolic link
    that neither this user nor root owns lies on its way (a file planted as a link to
    another one must not have its content shown)."""
    return open_for_reading(path)


def read_own_file(path: str) -> bytes:
    """The bytes of a file this package wrote: never through a link, never blocking."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    try:
        _check_opened_regular(fd, path)
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


# -------------------------------------------------------------------------- locks
class LockHeld(Exception):
    """Another open lock file (another live process) holds the lock: ``holder`` is what it
    wrote there, ``"process <pid> on host <name>"``, or "" when that cannot be read."""

    def __init__(self, path: str, holder: str) -> None:
        super().__init__(f"{path} is held by {holder or 'another process'}")
        self.path = path
        self.holder = holder


_HOLDER_RE = re.compile(rb"^(\d{1,10}) ([A-Za-z0-9._-]{1,253})\n$")


class DirLock:
    """An advisory lock (``flock``) on a lock file this package names in a directory of
    its own, held until :meth:`release`, or until the process dies (the kernel drops it:
    a job killed by SIGKILL never leaves the directory locked).

    The file is opened as :func:`open_append` opens a file (never through a link, created
    exclusively with mode 0640, else a regular file of this user with one link) and holds
    ``<pid> <host>`` of the holder, for the message of the next process that finds it held.
    :meth:`release` removes it, so a run leaves no lock file behind; a process that finds
    the name gone or replaced after it got the lock (a holder removed it in between) tries
    again, so two processes never both hold the name."""

    def __init__(self, dir_fd: int, name: str, fd: int, path: str) -> None:
        self._dir_fd: Optional[int] = dir_fd
        self._fd: Optional[int] = fd
        self.name = name
        self.path = path
        self._pid = os.getpid()  # a forked child shares the lock: only this process releases it

    @classmethod
    def acquire(cls, directory: str, name: str, mode: Optional[int] = None) -> "DirLock":
        """Take the lock ``name`` in ``directory`` without waiting. ``LockHeld`` when another
        live process holds it; ``OSError`` when the file system cannot lock (``ENOLCK``,
        ``EOPNOTSUPP``...) or the name is refused (``UnsafePathError``: a link, a FIFO...)."""
        import fcntl
        import socket

        mode = file_mode() if mode is None else mode
        path = os.path.join(directory, name)
        dir_fd = _open_parent(path)
        try:
            for _ in range(10):  # a holder removing the name at the same time: open it again
                fd, _created = _open_append_at(dir_fd, path, mode)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = _lock_holder(fd)
                    os.close(fd)
                    raise LockHeld(path, holder) from None
                except BaseException:
                    os.close(fd)
                    raise
                if _names(dir_fd, name, fd):
                    os.ftruncate(fd, 0)
                    write_all(fd, f"{os.getpid()} {socket.gethostname()}\n".encode("ascii", "replace"))
                    return cls(dir_fd, name, fd, path)
                os.close(fd)  # the name was removed (or replaced) before the lock came: not ours
            raise _refuse(path, "it keeps being removed and created again while being locked")
        except BaseException:
            os.close(dir_fd)
            raise

    def release(self) -> None:
        """Remove the lock file (if it is still this one) and drop the lock. Idempotent;
        in a forked child it only closes the child's descriptors (the parent keeps the lock)."""
        fd, dir_fd = self._fd, self._dir_fd
        self._fd = self._dir_fd = None
        if fd is None or dir_fd is None:
            return
        try:
            if os.getpid() == self._pid:
                import fcntl

                try:
                    if _names(dir_fd, self.name, fd):
                        os.unlink(self.name, dir_fd=dir_fd)  # before the unlock: see the class
                except OSError:
                    pass
                try:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                except OSError:
                    pass
        finally:
            os.close(fd)
            os.close(dir_fd)

    def __del__(self) -> None:
        # never unlocks: closing the descriptors drops the lock only when no forked child
        # shares them, as the kernel does at exit
        for fd in (self._fd, self._dir_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


def _names(dir_fd: int, name: str, fd: int) -> bool:
    """Whether ``name`` in the directory is still the file open as ``fd``."""
    try:
        by_name = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    held = os.fstat(fd)
    return (by_name.st_dev, by_name.st_ino) == (held.st_dev, held.st_ino)


def _lock_holder(fd: int) -> str:
    """``"process <pid> on host <name>"`` from a lock file, or "" when it holds anything else
    (nothing else a file holds is ever shown)."""
    try:
        m = _HOLDER_RE.match(os.pread(fd, 300, 0))
    except OSError:
        return ""
    return f"process {m.group(1).decode()} on host {m.group(2).decode()}" if m else ""


# ----------------------------------------------------------------- replaced files
class SafeDir:
    """A directory opened once with ``O_NOFOLLOW``; files are (re)written inside it by
    name, relative to that descriptor, so a link swapped in for the directory or a file
    later is never written through."""

    def __init__(self, path: str, create: bool = True, link_ok: bool = True) -> None:
        self.path = os.path.abspath(path)
        self._fd: Optional[int] = None
        if create:
            make_dirs(self.path, link_ok=link_ok)
        else:
            _check_components(self.path if link_ok else os.path.dirname(self.path))
        if not link_ok:
            refuse_link(self.path)
        target = os.path.realpath(self.path) if link_ok else self.path
        try:
            self._fd = os.open(target, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EMLINK):
                raise _refuse(self.path, "it is a symbolic link; remove it") from None
            raise
        info = os.fstat(self._fd)
        if not stat.S_ISDIR(info.st_mode):
            self.close()
            raise _refuse(self.path, f"it is {_kind(info.st_mode)}, not a directory")

    @property
    def fd(self) -> int:
        assert self._fd is not None
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "SafeDir":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def subdir(self, name: str) -> "SafeDir":
        """``name`` inside this directory, created if missing, never a link."""
        try:
            os.mkdir(name, 0o700, dir_fd=self.fd)
            created = True
        except FileExistsError:
            created = False
        sub = SafeDir.__new__(SafeDir)
        sub.path = os.path.join(self.path, name)
        sub._fd = None
        try:
            sub._fd = os.open(name, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR):
                try:
                    kind = _kind(os.lstat(name, dir_fd=self.fd).st_mode)
                except OSError:
                    kind = "not a directory"
                raise _refuse(sub.path, f"it is {kind}, not a directory of this program; remove it") from None
            raise
        if created:
            os.fchmod(sub._fd, dir_mode())
        return sub

    def listdir(self) -> List[str]:
        return os.listdir(self.fd)

    def remove(self, name: str) -> None:
        """Remove the name (a link is removed, never its target)."""
        os.unlink(name, dir_fd=self.fd)

    @contextlib.contextmanager
    def replace(self, name: str, mode: Optional[int] = None) -> Iterator[IO[bytes]]:
        """A binary file object; when the block ends without an error, what was written
        replaces ``name`` atomically (a link at ``name`` is replaced, not followed)."""
        mode = file_mode() if mode is None else mode
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
        for _ in range(100):
            tmp = f".{name}.{secrets.token_hex(6)}.tmp"
            try:
                fd = os.open(tmp, flags, 0o600, dir_fd=self.fd)
                break
            except FileExistsError:
                continue
        else:  # pragma: no cover - 100 collisions of 48 random bits
            raise _refuse(os.path.join(self.path, name), "no temporary name could be created next to it")
        done = False
        try:
            os.fchmod(fd, mode)
            with io.open(fd, "wb", closefd=False) as fh:
                yield fh
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            done = True
        finally:
            os.close(fd)
            if not done:
                try:
                    os.unlink(tmp, dir_fd=self.fd)
                except OSError:
                    pass

    def write_bytes(self, name: str, data: bytes) -> None:
        with self.replace(name) as fh:
            fh.write(data)

    def read_bytes(self, name: str) -> bytes:
        fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=self.fd)
        try:
            _check_opened_regular(fd, os.path.join(self.path, name))
            with io.open(fd, "rb", closefd=False) as fh:
                return fh.read()
        finally:
            os.close(fd)


def _check_opened_regular(fd: int, path: str) -> None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise _refuse(path, f"it is {_kind(info.st_mode)}, not a regular file")


@contextlib.contextmanager
def replace_file(path: str, mode: Optional[int] = None) -> Iterator[IO[bytes]]:
    """:meth:`SafeDir.replace` for one file: its directory must exist and not be a link."""
    with SafeDir(os.path.dirname(os.path.abspath(path)), create=False, link_ok=False) as d:
        with d.replace(os.path.basename(path), mode) as fh:
            yield fh
