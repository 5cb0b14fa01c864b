"""CSV output: ``<output_dir>/rank_<r>/<monitor>_step<a>-<b>.csv``.

``CsvWriter`` appends the rows of one step to the file of the step's window in one write
(so a crash loses at most the steps not yet handed to the writer). ``AsyncCsvWriter``
does the merging, formatting and writing on a background thread; ``close()`` (called by
``stop()`` and at interpreter exit) drains it, for a bounded time. Which one runs
(``async_write``): by default ``AsyncCsvWriter`` with ``step()`` waiting up to ``STALL_S``
for each step (rows on disk when ``step()`` returns, and a stalled file system never
stalls training for longer); ``true``: it never waits; ``false``: ``CsvWriter`` on the
training thread, which waits as long as the file system does (docs/long-runs.md,
"A stalled file system").

Output problems while training never reach the training code and never make ``stop()``
raise. A step whose write to a file fails (a full disk, a quota) is rolled back, so a file
never holds half a step and no empty file is left behind; the first failure and the
recovery are logged once each, and ``close()`` logs what was lost, with counts: steps lost
whole, and steps written in part (some monitors' files got their rows, others not). A removed output
directory (or a deleted file) is re-created and writing goes on. Names that a CSV cannot
hold on one line (control characters) or that UTF-8 cannot encode (lone surrogates) are
written escaped: see ``csv_text``; a text cell that a spreadsheet would run as a formula
gets a leading single quote: see ``csv_cell``. Files and directories are opened and created
through ``safe_fs`` (no link followed, modes 0640/0750, nothing that blocks).

Runs that share a rank directory (see docs/output-format.md, "Files"):

- A file is appended to only when it starts with this run's header: a re-run with other
  ``ops`` (or another column set) writes beside it, into ``<monitor>_step<a>-<b>.run<k>.csv``
  (the first ``k`` whose file is absent or has this header), said once per run.
- While a writer runs it holds an advisory lock on ``rank_<r>/.csv-writer.lock``
  (``safe_fs.DirLock``: released at ``close()``, or by the kernel when the process dies). A
  second live job finds it held, says so once at ``start()`` and writes its own series of
  ``.run<k>`` files (each series has its own lock, ``.csv-writer.run<k>.lock``): two jobs
  never append to one file, so no file gets two headers or the rows of two jobs.
- A file that ends in the middle of a row (an earlier run killed while writing it) has
  that incomplete row cut off before anything is appended: the new rows start on a line
  of their own; the cut row is counted as lost and said once, naming the file.
"""

import atexit
import collections
import csv
import functools
import io
import logging
import math
import os
import queue
import signal
import sys
import threading
import time
import unicodedata
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from . import native, safe_fs
from .alert import Alerter
from .errors import ConfigError, OutputError, UnsafePathError
from .logonce import LogOnce
from .rows import ALL_OPS, BASE_COLUMNS, MICRO_STEP, file_name, header
from .schedule import StepSchedule
from .stats import Record, Row, RowFields, merge_fields

if TYPE_CHECKING:
    from .sinks import SinkHub

logger = logging.getLogger("msprobe.monitor_v2")

# After this many fail/recover episodes the transitions are no longer logged one by one
# (a disk that fills and frees every step must not flood the log); close() still counts all.
_EPISODES_LOGGED = 5
# The run series of a rank directory: 1 writes the plain file names, k >= 2 the names
# ``.run<k>.csv``; each has its own lock file. Past the last one nothing is written.
_MAX_SERIES = 1000
# Files whose cut last row is named one by one (then only counted).
_CUT_FILES_NAMED = 20
# What an existing file is to this run (``_check_existing``).
_NEW, _APPEND, _OTHER = "new", "append", "other"


def _lock_name(series: int) -> str:
    """The lock file of a run series in the rank directory (hidden: not an output file)."""
    return ".csv-writer.lock" if series == 1 else f".csv-writer.run{series}.lock"


def _write_all(fd: int, data: bytes) -> None:
    """The writer's only write to the file system (a full disk shows up here; the fault
    tests inject their errors here)."""
    safe_fs.write_all(fd, data)


_NAMED_ESCAPES = {"\r": "\\r", "\n": "\\n", "\t": "\\t"}


@functools.lru_cache(maxsize=1 << 16)
def csv_text(text: str) -> str:
    """``text`` as written in a CSV cell: every row stays on one line and is valid UTF-8.

    Control characters (``\\r``, ``\\n``, ``\\t``, ``\\x00``...), line and paragraph
    separators and lone surrogates are written as Python escapes (``\\r``, ``\\x1b``,
    ``\\u2028``, ``\\udcff``); everything else, quotes and commas included, is written as
    it is (the csv module quotes a cell with a comma or a quote). Names repeat every
    step, so the result is cached."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch.isprintable() or unicodedata.category(ch) not in ("Cc", "Cs", "Zl", "Zp"):
            out.append(ch)
        elif ch in _NAMED_ESCAPES:
            out.append(_NAMED_ESCAPES[ch])
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
    return "".join(out)


# A spreadsheet runs a cell that starts with one of these as a formula (OWASP, "CSV
# injection"); tab and CR never start a cell here (csv_text escapes them). A quote starts
# the escaped form, so a name that really starts with one is escaped too and reads back.
_FORMULA_START = frozenset("=+-@\t\r'")


@functools.lru_cache(maxsize=1 << 16)
def csv_cell(text: str) -> str:
    """A text cell (``module_name``, ``scope``) as written: ``csv_text``, then one single
    quote in front if it would start with ``=``, ``+``, ``-``, ``@`` or ``'``; readers
    remove exactly one leading quote (``analysis.reader.text_cell``)."""
    out = csv_text(text)
    return "'" + out if out[:1] in _FORMULA_START else out


_QUOTED_CHARS = frozenset(',"\r\n')  # what makes the csv module quote a cell here


@functools.lru_cache(maxsize=1 << 16)
def _row_cell(text: str) -> str:
    """``csv_cell(text)`` as the csv module writes it inside a row (quoted when it holds a
    comma, a quote or a line break, quotes doubled). The csv module itself writes it, once
    per name: the rows are joined by hand, and the quoting stays exactly the csv module's.
    A second, empty cell keeps its rule for a row of one empty cell out of it.

    A cell without a comma, a quote or a line break is written as it is by every Python's
    csv module (its minimal quoting looks for exactly these, the line terminator "\n"
    and the delimiter): such a name, nearly every one, skips the writer (about 3.4 us a
    name, 20 ms at a 6,000-row model's first written step; 1.2 us a name now)."""
    cell = csv_cell(text)
    if not _QUOTED_CHARS.intersection(cell):
        return cell
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow([cell, ""])
    return buf.getvalue()[:-2]


# The statistic cells of a row, by op: one ``str.format`` field each over the arguments
# (min, max, mean, norm, nans, zeros). ".9g" is ``format_value``'s: nine significant digits,
# and ``format`` itself writes NaN and infinities as nan, inf and -inf (a NaN of either sign
# as nan); the counts are ints.
_STAT_FIELDS = {"min": "{0:.9g}", "max": "{1:.9g}", "mean": "{2:.9g}", "norm": "{3:.9g}",
                "nans": "{4}", "zeros": "{5}"}
# The same columns for the compiled formatter (native/python_ext.c, ``format_rows``), which
# writes every cell as the template above does, with Python's own float formatting.
_STAT_CODES = {"min": 0, "max": 1, "mean": 2, "norm": 3, "nans": 4, "zeros": 5}
# Names kept by the compiled formatter's cell cache before it starts again (row names are
# a model's own, so a run seldom has more; a cap keeps a pathological run's memory bounded).
_CELL_CACHE_LIMIT = 1 << 16
# The compiled formatter's cells by text (``_row_cell`` of each), shared by every writer of the
# process: a cell is a function of its text alone, and a monitor started again (incident
# mode, or a benchmark's windows) finds its names' cells there instead of making them again
# at its first written step (about 5 ms at 24,000 rows).
_CELLS: Dict[str, str] = {}


def _describe_os_error(exc: BaseException) -> str:
    if isinstance(exc, UnsafePathError):
        return exc.strerror
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} (errno {exc.errno})" if exc.errno else exc.strerror
    return repr(exc)


def _ranges(steps: Iterable[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"`` (at most 10 ranges, then how many more)."""
    parts: List[str] = []
    ordered = sorted(steps)
    start = prev = ordered[0]
    for s in ordered[1:] + [None]:  # type: ignore[list-item]
        if s is not None and s == prev + 1:
            prev = s
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if s is not None:
            start = prev = s
    shown = ", ".join(parts[:10])
    return shown + (f" and {len(parts) - 10} more ranges" if len(parts) > 10 else "")


def count_rows(records: Dict[str, List[Record]]) -> int:
    """The rows a step's records make (one per row key of each monitor), for loss counts."""
    return sum(len({r.key for r in recs if r.vector is not None}) for recs in records.values())


class MonitorOutput:
    """What the writer needs to know about one monitor's file."""

    def __init__(self, name: str, ops: Sequence[str], with_micro_step: bool) -> None:
        self.name = name
        self.ops = tuple(ops)
        self.with_micro_step = with_micro_step
        self.header = header(self.ops, with_micro_step)
        # the statistic cells of a row, formatted in one call per row (the config admits
        # only the ops of rows.ALL_OPS, each of which has its field)
        self.stats_template = ",".join(_STAT_FIELDS[op] for op in self.ops)
        self.stat_codes = bytes(_STAT_CODES[op] for op in self.ops)


class CountsRecord:
    """One row of a sidecar file (``moe_counts``): a vector of counts, copied from the device
    without blocking (``event``, None where the copy is done), formatted ``c_0;c_1;...``."""

    __slots__ = ("vpp_stage", "name", "values", "event")
    scope = ""
    micro_step = None

    def __init__(self, vpp_stage: int, name: str, values: Any, event: Any = None) -> None:
        self.vpp_stage = vpp_stage
        self.name = name
        self.values = values  # a host tensor (or a sequence) of counts
        self.event = event

    @property
    def key(self) -> Tuple[int, str, str, None]:
        return (self.vpp_stage, self.name, "", None)

    @property
    def vector(self) -> Any:
        return self.values

    def cells(self) -> str:
        if self.event is not None:
            self.event.synchronize()  # on the writer's side, never in a hook
            self.event = None
        values = self.values.tolist() if hasattr(self.values, "tolist") else list(self.values)
        return ";".join(str(int(v)) for v in values)


class SidecarOutput(MonitorOutput):
    """A file of rows that are not statistics (``rows.MOE_COUNTS``): its own header, one
    ``CountsRecord`` a row, written with the step's other files under the same rules."""

    def __init__(self, name: str, columns: Sequence[str]) -> None:
        super().__init__(name, (), False)
        self.header = list(columns)

    def format(self, step: int, records: Sequence["CountsRecord"]) -> bytes:
        lines = [f"{rec.vpp_stage},{step},{_row_cell(rec.name)},{rec.cells()}\n" for rec in records]
        return "".join(lines).encode("utf-8", errors="backslashreplace")


class _OpenFile:
    """One open CSV file: its window, path and descriptor (opened for appending)."""

    __slots__ = ("window", "path", "fd")

    def __init__(self, window: Tuple[int, int], path: str, fd: int) -> None:
        self.window = window
        self.path = path
        self.fd = fd

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class CsvWriter:
    def __init__(self, rank_dir: str, schedule: StepSchedule, outputs: Sequence[MonitorOutput],
                 alerter: Optional[Alerter] = None, sinks: Optional["SinkHub"] = None) -> None:
        self.rank_dir = os.path.abspath(rank_dir)
        self.alerter = alerter
        self.sinks = sinks  # live dashboards: handed the merged rows, they work on their own thread
        self.schedule = schedule
        self.outputs = {o.name: o for o in outputs}
        # monitor -> the step its output was (re)started mid-run: that window's file is named
        # from there (a file never holds two headers, nor rows of two settings)
        self._since: Dict[str, int] = {}
        self._files: Dict[str, _OpenFile] = {}
        self._once = LogOnce()
        # losses: steps none of whose rows reached the disk and their rows; steps written in
        # part (a monitor's file got its rows, another's did not: a disk freed in between) and
        # the rows they lack; the first error
        self.lost_steps: Set[int] = set()
        self.lost_rows = 0
        self.partly_lost_steps: Set[int] = set()
        self.partly_lost_rows = 0
        self._partly_monitors: Set[str] = set()
        # rows earlier runs left cut mid-line, cut off before appending (files named once)
        self.cut_rows = 0
        self._cut_files: List[str] = []
        # what reached the disk: the end-of-run line counts these, not the schedule
        self.written_steps: Set[int] = set()
        self.written_rows = 0
        self._first_error: Optional[str] = None
        self._failing = False
        self._episodes = 0
        self._lost_in_episode: Set[int] = set()
        self._partly_in_episode: Set[int] = set()
        self._refused: Set[str] = set()
        self._running: Set[str] = set(self.outputs)  # monitors whose rows come now
        # run once, right before the first CSV file is opened (the trainer writes
        # layout.json there): a run that writes no rows leaves no file
        self.before_first_file: Optional[Callable[[], None]] = None
        # read once at start(): a later change of the environment cannot fail a write
        self._dir_mode = safe_fs.dir_mode()
        self._file_mode = safe_fs.file_mode()
        # rows formatted in C where the kernel's extension is built (None: in Python); the
        # cells it has written so far, by text
        ext = native.extension()
        self._format_rows = None if ext is None else ext.format_rows
        self._format_records = None if ext is None else ext.format_records
        self._cells = _CELLS
        self._make_rank_dir()
        # run series -> its lock; why locking is not possible here (then no series is locked)
        self._locks: Dict[int, safe_fs.DirLock] = {}
        self._unlockable: Optional[str] = None
        # the series this run writes (1 unless another live job holds it), and per monitor the
        # series its files went to (a file of another header moves the monitor to the next)
        self._base = self._first_series()
        self._series: Dict[str, int] = {}
        self._other_header_said = False

    def _make_rank_dir(self) -> None:
        """Create ``rank_<r>`` (0750) or check the existing one: never a link, owned by
        this user, writable by nobody else (no one else can plant a link in it)."""
        safe_fs.refuse_link(self.rank_dir)
        if os.path.isdir(self.rank_dir):
            safe_fs.check_private_dir(self.rank_dir)
            return
        if os.path.lexists(self.rank_dir):
            raise OutputError(
                f"monitor_v2: cannot write the output: {self.rank_dir!r} exists and is not a directory; "
                f"this rank writes its CSV files there. Move or delete that file, or choose another output_dir."
            )
        try:
            safe_fs.make_dirs(self.rank_dir, mode=self._dir_mode, link_ok=False)
        except UnsafePathError:
            raise
        except OSError as exc:
            raise OutputError(
                f"monitor_v2: cannot create the output directory {self.rank_dir!r}: {_describe_os_error(exc)}. "
                f"Check that output_dir is a writable directory, or choose another output_dir."
            ) from None

    # ------------------------------------------------------------------ locks
    def _first_series(self) -> int:
        """Lock the first run series no other live job holds (1 unless a job is writing to
        this rank directory now); said once, here at ``start()``, when it is not 1."""
        holders: List[str] = []
        for series in range(1, _MAX_SERIES):
            holder = self._take_series(series)
            if holder is None:
                break
            holders.append(holder)
        else:
            raise OutputError(f"monitor_v2: cannot write to {self.rank_dir}: {_MAX_SERIES - 1} other live jobs hold "
                              f"its run locks; give this job its own output_dir")
        if holders:
            logger.warning(
                "monitor_v2: another job is writing to %s right now (%s holds its lock %s). Two jobs appending to "
                "the same files would mix their rows, so this run writes its own files beside them, named "
                "<monitor>_step<a>-<b>.run%d.csv (msprobe-monitor reads them with the others). Give each job its "
                "own output_dir to keep them apart.",
                self.rank_dir, holders[0] or "another process", _lock_name(1), series)
        return series

    def _take_series(self, series: int) -> Optional[str]:
        """None when this writer may write run series ``series`` (its lock is now held, or
        the directory cannot be locked at all: said once); else who holds it."""
        if series in self._locks or self._unlockable is not None:
            return None
        try:
            self._locks[series] = safe_fs.DirLock.acquire(self.rank_dir, _lock_name(series), self._file_mode)
        except safe_fs.LockHeld as held:
            return held.holder or "another process"
        except OSError as exc:
            self._unlockable = _describe_os_error(exc)
            logger.warning(
                "monitor_v2: cannot lock %s (%s); a second job writing to the same output_dir at the same time "
                "would not be detected, and both would append to the same files. Give each job its own "
                "output_dir.", self.rank_dir, self._unlockable)
        return None

    def _next_series(self, series: int) -> int:
        """The first run series after ``series`` that no other live job holds (locked now)."""
        for later in range(series + 1, _MAX_SERIES):
            if self._take_series(later) is None:
                return later
        raise OutputError(f"monitor_v2: no run series is left in {self.rank_dir} (.run2 to .run{_MAX_SERIES - 1} "
                          f"are all in use); give this job its own output_dir")

    def _release_locks(self) -> None:
        locks, self._locks = self._locks, {}
        for lock in locks.values():
            try:
                lock.release()
            except OSError:
                pass

    def _window(self, monitor: str, step: int) -> Tuple[int, int]:
        a, b = self.schedule.window(step)
        since = self._since.get(monitor)
        if since is not None and a < since <= step:
            a = since
        return a, b

    def path(self, monitor: str, step: int) -> str:
        a, b = self._window(monitor, step)
        return os.path.join(self.rank_dir, file_name(monitor, a, b, self._series.get(monitor, self._base)))

    def update_outputs(self, step: int, outputs: Sequence[MonitorOutput], schedule: StepSchedule) -> None:
        """Monitors turned on, off or changed mid-run (``dynamic.py``), from ``step`` on:
        the file of a stopped monitor is closed (its rows so far are on disk); a new or
        changed monitor writes new files, the first named from ``step``."""
        self.schedule = schedule
        wanted = {o.name: o for o in outputs}
        for name in list(self._files):
            if name not in wanted or wanted[name].header != self.outputs[name].header:
                self._files.pop(name).close()
        for name, out in wanted.items():
            old = self.outputs.get(name)
            if old is None or old.header != out.header or name not in self._running:
                self._since[name] = step
            self.outputs[name] = out
            if self.sinks is not None and hasattr(getattr(self.sinks, "aggregates", None), "ops"):
                self.sinks.aggregates.ops[name] = out.ops
        self._running = set(wanted)

    # ------------------------------------------------------------------ files
    def _current(self, monitor: str, window: Tuple[int, int]) -> Optional[_OpenFile]:
        """The open file of ``monitor`` if it is the window's and still in the directory."""
        current = self._files.get(monitor)
        if current is None:
            return None
        if current.window == window:
            try:
                if os.fstat(current.fd).st_nlink > 0:
                    return current
            except OSError:
                pass
            self._note_recreated(f"the file {os.path.basename(current.path)} was deleted")
        current.close()
        del self._files[monitor]
        return None

    def _note_recreated(self, what: str) -> None:
        self._once.warning(
            "recreated",
            "monitor_v2: %s while the run was writing to %s; writing goes on in re-created files "
            "(and directories). Rows written to the deleted files are gone. Logged once.",
            what, self.rank_dir,
        )

    def _open_fd(self, path: str) -> Tuple[int, bool]:
        """``(fd, created)``; a link, a FIFO, a device or another user's file at ``path``
        is refused (``UnsafePathError``) without blocking and without touching it."""
        try:
            return safe_fs.open_append(path, self._file_mode)
        except FileNotFoundError:  # the directory was removed: re-create it, once per removal
            safe_fs.make_dirs(self.rank_dir, mode=self._dir_mode, link_ok=False)
            self._note_recreated("the output directory was removed")
            return safe_fs.open_append(path, self._file_mode)

    def _open(self, monitor: str, step: int) -> Tuple[_OpenFile, bool]:
        """The file of the step's window and whether it still needs its header: the
        monitor's file of its run series, or, when that one starts with another header,
        the first later series' file that is new or starts with this run's header."""
        window = self._window(monitor, step)
        current = self._current(monitor, window)
        if current is not None:
            return current, False
        if self.before_first_file is not None:
            first, self.before_first_file = self.before_first_file, None
            try:
                first()
            except (OSError, OutputError) as exc:
                self._once.warning("companion", "monitor_v2: %s; the CSV files are written as usual. Logged once.",
                                   exc)
        series = self._series.get(monitor, self._base)
        other: Optional[Tuple[str, str]] = None  # the first file of another header, and how it differs
        while True:
            path = os.path.join(self.rank_dir, file_name(monitor, window[0], window[1], series))
            fd, _created = self._open_fd(path)
            opened = _OpenFile(window, path, fd)
            try:
                state, differs = self._check_existing(monitor, opened)
            except BaseException:
                opened.close()
                raise
            if state != _OTHER:
                break
            opened.close()
            if other is None:
                other = (os.path.basename(path), differs)
            series = self._next_series(series)
        if other is not None:
            self._say_other_header(other[0], other[1], os.path.basename(path), series)
        self._series[monitor] = series
        self._files[monitor] = opened
        return opened, state == _NEW

    def _check_existing(self, monitor: str, opened: _OpenFile) -> Tuple[str, str]:
        """``(state, how)``: ``_NEW`` (empty: it gets the header), ``_APPEND`` (it starts with
        this run's header; a row cut mid-line at its end is cut off first) or ``_OTHER``
        (another header, or none: never appended to; ``how`` says how it differs).

        Read through the descriptor just checked, never by name again. Of what the file
        holds only column names this version writes are ever shown (it may not be ours
        to show)."""
        fd = opened.fd
        size = os.fstat(fd).st_size
        if size == 0:
            return _NEW, ""
        expected = (",".join(self.outputs[monitor].header) + "\n").encode("utf-8")
        head = os.pread(fd, len(expected), 0)
        if head != expected:
            if size == len(head) and b"\n" not in head and expected.startswith(head):
                try:  # it holds only the start of this header: a run killed while creating it
                    self._cut_off(opened, 0, size, "header")
                    return _NEW, ""
                except OSError:
                    pass
            return _OTHER, self._header_difference(monitor, fd)
        self._once.warning(
            "append",
            "monitor_v2: %s already holds CSV files (e.g. %s); appending to them. Use another "
            "output_dir to keep runs apart.", self.rank_dir, os.path.basename(opened.path),
        )
        if os.pread(fd, 1, size - 1) != b"\n":
            keep = _last_line_end(fd, size)
            try:
                self._cut_off(opened, keep, size, "row")
            except OSError as exc:  # an append-only file: rows appended would be glued to the cut one
                return _OTHER, (f"its last row was cut mid-line by a run that was killed, and cannot be cut off "
                                f"({_describe_os_error(exc)})")
        return _APPEND, ""

    def _header_difference(self, monitor: str, fd: int) -> str:
        """How the first line of a file differs from this run's header, in column names this
        version writes; a line of anything else is not shown."""
        mine = self.outputs[monitor].header
        try:
            line = os.pread(fd, 4096, 0).split(b"\n", 1)[0].decode("ascii")
        except (OSError, UnicodeDecodeError):
            line = ""
        known = set(BASE_COLUMNS) | {MICRO_STEP} | set(ALL_OPS)
        theirs = line.rstrip("\r").split(",") if line else []
        if not theirs or not set(theirs) <= known or len(set(theirs)) != len(theirs):
            return f"it does not start with a header this version writes; this run writes {','.join(mine)}"
        only_theirs = [c for c in theirs if c not in mine]
        only_mine = [c for c in mine if c not in theirs]
        if not only_theirs and not only_mine:
            return f"other columns: the same in another order ({','.join(theirs)}; this run writes {','.join(mine)})"
        parts = []
        if only_theirs:
            parts.append(f"column(s) {','.join(only_theirs)} only there")
        if only_mine:
            parts.append(f"column(s) {','.join(only_mine)} only in this run")
        return f"other columns: {' and '.join(parts)} (there: {','.join(theirs)}; this run: {','.join(mine)})"

    def _say_other_header(self, old: str, how: str, new: str, series: int) -> None:
        """Once per run: files this run cannot append to are left alone; where it writes instead."""
        if self._other_header_said:
            return
        self._other_header_said = True
        logger.warning(
            "monitor_v2: %s holds files of an earlier run that this run cannot append to (%s: %s). They are left "
            "as they are: this run writes beside them, into files named <monitor>_step<a>-<b>.run%d.csv (e.g. %s; "
            "msprobe-monitor reads them with the others), for every such file. Said once per run; use another "
            "output_dir to keep runs with other settings apart.",
            self.rank_dir, old, how, series, new)

    def _cut_off(self, opened: _OpenFile, keep: int, size: int, what: str) -> None:
        """Cut an incomplete last row (or header) that a killed run left, so that the rows
        appended start on a line of their own; counted as lost and named once per file.
        ``OSError`` where the file cannot be cut (an append-only file): it is then not
        appended to at all (a newline after the cut row would make its cut last value
        read as a whole one)."""
        os.ftruncate(opened.fd, keep)
        if what == "row":
            self.cut_rows += 1
        name = os.path.basename(opened.path)
        if name in self._cut_files or len(self._cut_files) >= _CUT_FILES_NAMED:
            return
        self._cut_files.append(name)
        logger.warning(
            "monitor_v2: %s ended in the middle of a %s (an earlier run was killed while writing it): that incomplete "
            "%s (%d byte(s)) is lost and was cut off, so that this run's rows start on a line of their own%s.",
            opened.path, what, what, size - keep,
            "" if len(self._cut_files) < _CUT_FILES_NAMED else " (further such files are only counted)")

    # ------------------------------------------------------------------ rows
    def _header(self, monitor: str, with_header: bool) -> bytes:
        if not with_header:
            return b""
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow(self.outputs[monitor].header)
        return buf.getvalue().encode("utf-8")

    def _format(self, monitor: str, step: int, rows: Sequence[RowFields], with_header: bool) -> bytes:
        out = self.outputs[monitor]
        head = self._header(monitor, with_header)
        fast = self._format_rows
        if fast is not None:
            if len(self._cells) > _CELL_CACHE_LIMIT:
                self._cells.clear()
            try:
                return head + fast(rows if type(rows) is list else list(rows), str(step), out.stat_codes,
                                   out.with_micro_step, self._cells, _row_cell)
            except (TypeError, ValueError, OverflowError):  # a value of another type: Python writes it
                pass
        return head + self._format_python(out, step, rows)

    @staticmethod
    def _format_python(out: MonitorOutput, step: int, rows: Sequence[RowFields]) -> bytes:
        """The rows as ``format_rows`` writes them (and where it is not built, or a row
        holds a value of another type): one ``str.format`` and one f-string per row."""
        lines: List[str] = []
        stats = out.stats_template.format
        sqrt, nan = math.sqrt, math.nan
        with_micro_step = out.with_micro_step
        for vpp_stage, name, scope, micro, numel, mn, mx, total, sumsq, nans, zeros in rows:
            # Row.value, inlined: min, max and mean are NaN for an empty row; norm from the
            # summed squares (sqrt keeps NaN and inf)
            if numel:
                cells = stats(mn, mx, total / numel, sqrt(sumsq), nans, zeros)
            else:
                cells = stats(nan, nan, nan, sqrt(sumsq), nans, zeros)
            if with_micro_step:
                lines.append(f"{vpp_stage},{step},{_row_cell(name)},{_row_cell(scope)},"
                             f"{'' if micro is None else micro},{cells}\n")
            else:
                lines.append(f"{vpp_stage},{step},{_row_cell(name)},{_row_cell(scope)},{cells}\n")
        return "".join(lines).encode("utf-8", errors="backslashreplace")

    def _formatted_rows(self, monitor: str, step: int, rows: Sequence[RowFields]) -> Tuple[Callable[[bool], bytes], int]:
        """``(format, rows)``: a function that gives the bytes of ``rows`` (with the header or
        not), and how many rows they are."""
        return (lambda with_header: self._format(monitor, step, rows, with_header)), len(rows)

    def _formatted_records(self, monitor: str, step: int, records: List[Record]) -> Tuple[Callable[[bool], bytes], int]:
        """``_formatted_rows`` of the merged rows of ``records``: merged and formatted in one
        call of the extension where it is built (no row tuple per row); else as
        ``merge_fields`` and ``_format``."""
        fast = self._format_records
        if fast is not None:
            out = self.outputs[monitor]
            if len(self._cells) > _CELL_CACHE_LIMIT:
                self._cells.clear()
            try:
                data, n = fast(records if type(records) is list else list(records), str(step), out.stat_codes,
                               out.with_micro_step, self._cells, _row_cell)
                return (lambda with_header: self._header(monitor, with_header) + data), n
            except (TypeError, ValueError, OverflowError):  # device vectors or other types: the general path
                pass
        return self._formatted_rows(monitor, step, merge_fields(records))

    def _write(self, monitor: str, step: int, formatted: Callable[[bool], bytes]) -> None:
        """Append ``formatted``'s bytes in one write; on failure the file is left as it was
        (a new file is removed again) and the error is raised."""
        opened, new = self._open(monitor, step)
        data = formatted(new)
        before = 0 if new else os.fstat(opened.fd).st_size
        try:
            _write_all(opened.fd, data)
        except OSError:
            self._roll_back(monitor, opened, before, new)
            raise

    def _roll_back(self, monitor: str, opened: _OpenFile, size: int, new: bool) -> None:
        """Cut a partly written step off the file; remove a file this write created."""
        try:
            os.ftruncate(opened.fd, size)
        except OSError:
            pass
        if new:
            opened.close()
            self._files.pop(monitor, None)
            try:
                os.unlink(opened.path)
            except OSError:
                pass

    def write_step(self, step: int, records: Dict[str, List[Record]],
                   ready: Optional[Callable[[], None]] = None) -> None:
        """Records carry host vectors; merge them into rows and write each monitor's file.
        Never raises for an output problem: it is logged and counted (see ``close``).
        ``ready``: what the engine's ``to_host`` returned where the step's values are still
        being copied from a device; waited for here, where the rows are formatted."""
        if ready is not None:
            ready()
        sidecars = [(m, recs) for m, recs in records.items() if isinstance(self.outputs.get(m), SidecarOutput)]
        if sidecars:
            records = {m: recs for m, recs in records.items() if not isinstance(self.outputs.get(m), SidecarOutput)}
        fields: Optional[Dict[str, List[RowFields]]] = None
        if self.alerter is not None or self.sinks is not None:
            # rows as plain tuples, merged once for the alerter, the sinks and the files; only
            # the alerter and the sinks need Row objects. Without them the rows are needed as
            # bytes only: each monitor's records are merged and formatted in one call.
            fields = {monitor: merge_fields(recs) for monitor, recs in records.items()}
            merged = [(monitor, [Row.from_fields(step, row) for row in rows]) for monitor, rows in fields.items()]
            if self.alerter is not None:
                try:
                    self.alerter.check_step(step, merged)
                except Exception as exc:  # noqa: BLE001 - an alert must never cost the rows
                    logger.error("monitor_v2: alert check failed at step %s: %r", step, exc)
            if self.sinks is not None:
                try:
                    self.sinks.send(step, merged)
                except Exception as exc:  # noqa: BLE001 - a dashboard must never cost the rows
                    logger.error("monitor_v2: handing step %s to the sinks failed: %r", step, exc)
            del merged
        failure: Optional[BaseException] = None
        lost = 0
        failed: List[str] = []
        for monitor, recs in list(records.items()) + sidecars:
            n = 0
            try:
                out = self.outputs[monitor]
                if isinstance(out, SidecarOutput):
                    data = out.format(step, recs)
                    formatted, n = (lambda with_header, m=monitor, d=data: self._header(m, with_header) + d), len(recs)
                elif fields is None:
                    formatted, n = self._formatted_records(monitor, step, recs)
                else:
                    formatted, n = self._formatted_rows(monitor, step, fields[monitor])
                if n:
                    self._write(monitor, step, formatted)
                    self.written_rows += n
                    self.written_steps.add(step)
            except Exception as exc:  # noqa: BLE001 - output problems are counted, never raised
                failure = failure or exc
                lost += n or _merged_count(recs)
                failed.append(monitor)
                if isinstance(exc, UnsafePathError):
                    self._note_refused(monitor, exc)
                if not isinstance(exc, OSError) and self._first_error is None:
                    logger.error("monitor_v2: writing %s rows of step %s failed", monitor, step, exc_info=exc)
        if failure is not None:
            self._count_loss(step, lost, failed)
            self._on_failure(step, failure)
        elif self._failing:
            self._on_recovery(step)

    def _count_loss(self, step: int, rows: int, monitors: Sequence[str]) -> None:
        """``rows`` of ``step`` did not reach the disk: the step is lost whole when none of
        its rows did, else written in part (each file holds a step whole or not at all, but
        a step's files are written one after another: a disk freed in between lands some)."""
        if step in self.written_steps:
            self.partly_lost_steps.add(step)
            self.partly_lost_rows += rows
            self._partly_monitors.update(monitors)
            self._partly_in_episode.add(step)
        else:
            self.lost_steps.add(step)
            self.lost_rows += rows
            self._lost_in_episode.add(step)

    def _note_refused(self, monitor: str, exc: UnsafePathError) -> None:
        """Each path refused (a link, a FIFO, another user's file) is named once: a
        failure episode is logged only once, and a second refused file must not go unsaid."""
        if exc.path in self._refused or len(self._refused) >= _EPISODES_LOGGED * 4:
            return
        self._refused.add(exc.path)
        logger.warning("%s; the %s rows that belong in it are not written (said once per path).",
                       exc.strerror, monitor)

    def _on_failure(self, step: int, exc: BaseException) -> None:
        if self._first_error is None:
            self._first_error = _describe_os_error(exc)
        if self._failing:
            return
        self._failing = True
        self._episodes += 1
        if self._episodes <= _EPISODES_LOGGED:
            logger.warning(
                "monitor_v2: cannot write step %d to %s: %s. Training goes on; the rows that cannot be written "
                "are lost (each file gets a step's rows whole or not at all). Logged once until writing works "
                "again.%s", step, self.rank_dir, _describe_os_error(exc),
                " Later episodes are only counted (see the summary at stop())." if self._episodes == _EPISODES_LOGGED
                else "",
            )

    def _on_recovery(self, step: int) -> None:
        self._failing = False
        lost, self._lost_in_episode = self._lost_in_episode, set()
        partly, self._partly_in_episode = self._partly_in_episode, set()
        if self._episodes <= _EPISODES_LOGGED:
            said = f"{len(lost)} step(s) were lost ({_ranges(lost)})" if lost else "no step was lost whole"
            if partly:
                said += f"; {len(partly)} step(s) were written in part ({_ranges(partly)})"
            logger.warning("monitor_v2: writing to %s works again from step %d; %s.", self.rank_dir, step, said)

    def report_lost(self, step: int, exc: BaseException, rows: int = 0) -> None:
        """A step that never reached ``write_step`` (its statistics failed to reach the host)
        and the ``rows`` it would have written."""
        self._count_loss(step, rows, ())
        if self._first_error is None:
            self._first_error = str(exc) if isinstance(exc, _NotWritten) else repr(exc)

    def call_in_order(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (a companion file written again) after the steps handed over so far:
        now, on this writer."""
        fn()

    def abandon_in_child(self) -> None:
        """In a forked child: nothing to undo (the child never writes; see the trainer)."""

    def close(self, sinks: bool = True) -> None:
        """Close the files, then drop the run's locks; log what was lost. Never raises.
        ``sinks`` False: the dashboards are closed by the caller (the async writer closes
        the files on its thread, the dashboards on the caller's)."""
        for opened in self._files.values():
            opened.close()
        self._files.clear()
        self._release_locks()
        if sinks and self.sinks is not None:
            self.sinks.close()
        said = self.loss_summary()
        if said:
            logger.warning("monitor_v2: %s", said)

    def loss_summary(self) -> str:
        """What ``close()`` says was lost ("" when nothing was): steps lost whole, steps
        written in part, rows that earlier runs left cut mid-line; counts match the disk."""
        parts = []
        if self.lost_steps:
            parts.append(f"{len(self.lost_steps)} step(s) of output were lost ({self.lost_rows} row(s)) in "
                         f"{self.rank_dir}: steps {_ranges(self.lost_steps)}")
        if self.partly_lost_steps:
            monitors = ", ".join(sorted(self._partly_monitors)) or "some monitors"
            where = "" if parts else f" in {self.rank_dir}"
            parts.append(f"{len(self.partly_lost_steps)} step(s) were written in part{where} ({self.partly_lost_rows} "
                         f"row(s) lost: the files of {monitors} lack them, the other monitors' rows are on disk): "
                         f"steps {_ranges(self.partly_lost_steps)}")
        if self.cut_rows:
            where = "" if parts else f" in {self.rank_dir}"
            parts.append(f"{self.cut_rows} incomplete row(s) that earlier runs left cut mid-line{where} were cut off "
                         f"before appending (named above)")
        if not parts:
            return ""
        error = f" First error: {self._first_error}." if self._first_error is not None else ""
        return "; ".join(parts) + "." + error


def _last_line_end(fd: int, size: int) -> int:
    """The offset just after the last newline of the file (0 when it has none)."""
    end = size
    while end > 0:
        start = max(0, end - (1 << 16))
        at = os.pread(fd, end - start, start).rfind(b"\n")
        if at >= 0:
            return start + at + 1
        end = start
    return 0


def _merged_count(records: List[Record]) -> int:
    """The rows ``records`` merge into (0 where even that fails: the rows are counted as
    written or lost by what could be merged)."""
    try:
        return len(merge_fields(records))
    except Exception:  # noqa: BLE001
        return 0


# ------------------------------------------------------------------ the writer thread
EXIT_WAIT_ENV = "MSPROBE_MONITOR_EXIT_WAIT"
QUEUE_RECORDS_ENV = "MSPROBE_MONITOR_QUEUE_RECORDS"
# How long the drain at exit (and a SIGTERM during a stall) waits for the file system, in
# seconds: well inside the grace period of a preemption (Slurm's KillWait, Kubernetes'
# terminationGracePeriodSeconds: 30 s by default).
EXIT_WAIT_S = 10.0
# How long step() waits for the writer thread to write a step (the default writer), and how
# long the writer thread may work on one step before the file system counts as stalled
# (async_write). A healthy file system takes a step's rows in milliseconds.
STALL_S = 1.0
# Statistics records kept in memory while the file system does not take them (a record is
# about 300 bytes on the host: some 80 MB); past that, steps are dropped and counted.
QUEUE_RECORDS = 1 << 18
# How long an exit drain interrupted by Ctrl-C waits for the writer thread to count what is
# left as lost (it writes nothing more: quick, unless it is stuck in the file system).
_GIVE_UP_WAIT_S = 1.0
_POLL_S = 0.05  # waits in short slices: a Ctrl-C is seen at once


def exit_wait() -> float:
    """``MSPROBE_MONITOR_EXIT_WAIT`` (seconds, >= 0; ``inf``: as long as it takes), else
    ``EXIT_WAIT_S``. Read at ``start()``: a bad value fails there, not at exit."""
    raw = os.environ.get(EXIT_WAIT_ENV)
    if raw is None or not raw.strip():
        return EXIT_WAIT_S
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not value >= 0:  # NaN too
        raise ConfigError(f"monitor_v2: environment variable {EXIT_WAIT_ENV}={raw!r} is not allowed: it must be a "
                          f"number of seconds >= 0 (0: do not wait at exit; inf: wait as long as the file system "
                          f"takes)", field=EXIT_WAIT_ENV)
    return value


def queue_records() -> int:
    """``MSPROBE_MONITOR_QUEUE_RECORDS`` (an integer >= 1), else ``QUEUE_RECORDS``."""
    raw = os.environ.get(QUEUE_RECORDS_ENV)
    if raw is None or not raw.strip():
        return QUEUE_RECORDS
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"monitor_v2: environment variable {QUEUE_RECORDS_ENV}={raw!r} is not allowed: it must be "
                          f"a number of statistics records >= 1", field=QUEUE_RECORDS_ENV)
    return value


def _seconds(value: float) -> str:
    return "as long as it takes" if math.isinf(value) else f"{value:g} s"


def say_on_stderr(text: str) -> None:
    """``text`` as one line on stderr at once, through the descriptor: not through
    ``sys.stderr`` (a signal handler may run while the training thread holds its lock) nor
    through logging (a handler may write to the stalled file system itself)."""
    data = (text + "\n").encode("utf-8", errors="backslashreplace")
    try:
        while data:
            data = data[os.write(2, data):]
    except OSError:
        pass


class _Step:
    """A step handed to the writer thread: its records, the device copy to wait for, how
    many records it holds (the queue's bound counts them) and, where ``step()`` waits for
    it, the event set once it is written."""

    __slots__ = ("step", "records", "ready", "n_records", "done")

    def __init__(self, step: int, records: Dict[str, List[Record]], ready: Optional[Callable[[], None]],
                 n_records: int, done: Optional[threading.Event]) -> None:
        self.step = step
        self.records = records
        self.ready = ready
        self.n_records = n_records
        self.done = done


class _Stall:
    """A stall of the file system, from the step the writer thread was stuck on to the
    ``write_step`` that finds the queue empty again."""

    __slots__ = ("first", "dropped")

    def __init__(self, first: int) -> None:
        self.first = first
        self.dropped: List[int] = []


class AsyncCsvWriter:
    """Same interface as ``CsvWriter``; merging, formatting and writing happen on a daemon
    thread, in the order the steps were handed over.

    ``wait_s`` set (the default writer): ``write_step`` waits up to ``wait_s`` for the step
    to be written, so on a healthy file system its rows are on disk when ``step()`` returns,
    as with the synchronous writer. A step not written by then means a stalled file system:
    said once, and training goes on without waiting (the steps queue) until a later step
    finds the queue empty again (said too). ``wait_s`` None (``async_write: true``): never
    waits; a stall is said when the writer thread has been on one step for ``STALL_S``.

    The queue is bounded (``MSPROBE_MONITOR_QUEUE_RECORDS``): a step that finds it full is
    dropped, said once, counted and named at ``close()``.

    During a stall, where SIGTERM has its default disposition and the training runs on the
    main thread, a handler of the monitor stands in for the default until the queue is
    empty again (or ``close()``): it says on stderr what is not written, waits for it at
    most ``MSPROBE_MONITOR_EXIT_WAIT`` seconds, then ends the process as SIGTERM does.

    ``close()`` drains the queue. At exit (the interpreter's exit handler, or ``stop()``
    while ``SystemExit`` or ``KeyboardInterrupt`` unwinds the program) steps still queued
    are said on stderr at once, the drain is bounded by ``MSPROBE_MONITOR_EXIT_WAIT`` in
    all, and what is still not written is said again, as lost. A ``stop()`` otherwise waits
    as long as steps get written and gives up after that time without one. Interrupted
    (Ctrl-C while ``stop()`` waits), it says how much is still queued and can be called
    again: it goes on where it stopped. The exit handler calls it too, so a program that
    never finishes ``stop()`` still writes its backlog; only when that last drain is
    interrupted as well are the remaining steps given up, counted exactly (steps and rows)
    and logged once."""

    _STOP = object()

    def __init__(self, writer: CsvWriter, wait_s: Optional[float] = None) -> None:
        try:
            self._exit_wait = exit_wait()
            self._max_records = queue_records()
        except ConfigError:
            writer.close()  # its run lock
            raise
        self._writer = writer
        self._wait_s = wait_s
        self._queue: "queue.Queue" = queue.Queue()
        # The steps handed over and not yet written, oldest first: appended by write_step,
        # taken off by the writer thread once a step is done (deque operations are atomic,
        # and reading it takes no lock: a signal handler may read it at any moment).
        self._outstanding: "collections.deque[_Step]" = collections.deque()
        # Counts of steps and records handed over (training thread) and done (writer thread):
        # one writer each, so no lock
        self._handed = self._done = 0
        self._handed_records = self._done_records = 0
        self._busy_since: Optional[float] = None  # when the writer thread took its current step
        self._stall: Optional[_Stall] = None
        self._stalls = 0
        self._dropped: Dict[int, int] = {}  # steps dropped at a full queue -> their rows
        self._abandoned: Set[int] = set()  # steps given up at a bounded drain
        self._error: Optional[BaseException] = None
        self._give_up = False  # set when a drain gave up: count the rest as lost, write nothing
        self._stop_sent = False
        self._once = LogOnce()
        self._closed = False
        # Set by the writer thread when it ends. Waited on instead of Thread.join(): a
        # KeyboardInterrupt inside join() can leave the Thread reporting it ended while it
        # still runs (CPython's tstate lock handling), and the files would be closed under it.
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name="msprobe-monitor-writer", daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)

    @property
    def rank_dir(self) -> str:
        return self._writer.rank_dir

    @property
    def lost_steps(self) -> Set[int]:
        return self._writer.lost_steps | self._abandoned | set(self._dropped)

    @property
    def partly_lost_steps(self) -> Set[int]:
        return self._writer.partly_lost_steps

    @property
    def written_steps(self) -> Set[int]:
        return self._writer.written_steps

    @property
    def written_rows(self) -> int:
        return self._writer.written_rows

    # ------------------------------------------------------------ writer thread
    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._finished.set()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is self._STOP:
                self._finish()
                self._queue.task_done()
                return
            if isinstance(item, _Call):  # an output change, in order with the steps queued before it
                try:
                    item.fn()
                except Exception as exc:  # noqa: BLE001
                    logger.error("monitor_v2: changing the outputs failed: %r", exc)
                self._queue.task_done()
                continue
            self._busy_since = time.monotonic()
            try:
                if self._give_up:
                    self._writer.report_lost(item.step, _NotWritten("the wait for the file system was given up"),
                                             count_rows(item.records))
                elif item.ready is None:
                    self._writer.write_step(item.step, item.records)
                else:
                    self._writer.write_step(item.step, item.records, item.ready)
            except Exception as exc:  # noqa: BLE001 - counted and reported by close(), never lost
                self._writer.report_lost(item.step, exc, count_rows(item.records))
                if self._error is None:
                    self._error = exc
                    logger.error("monitor_v2: writing step %s failed: %r", item.step, exc)
            self._busy_since = None
            self._done_records += item.n_records
            self._outstanding.popleft()  # this item: steps are written in the order handed over
            self._done += 1
            if item.done is not None:
                item.done.set()
            self._queue.task_done()

    def _finish(self) -> None:
        """On the writer thread, after the last step: count the dropped steps, close the
        files and drop the run's lock (the file system's part of closing: bounded by the
        caller's wait), log what was lost."""
        try:
            for step, rows in sorted(self._dropped.items()):
                self._writer.report_lost(step, _NotWritten("the queue of steps to write was full"), rows)
            self._writer.close(sinks=False)
        except Exception as exc:  # noqa: BLE001
            logger.error("monitor_v2: closing the output failed: %r", exc)

    # ---------------------------------------------------------- training thread
    def drain(self) -> None:
        """Wait until every step handed over so far has been written (or counted as lost)."""
        self._queue.join()

    def write_step(self, step: int, records: Dict[str, List[Record]],
                   ready: Optional[Callable[[], None]] = None) -> None:
        n_records = 0
        for recs in records.values():
            n_records += len(recs)
        outstanding = self._handed - self._done
        if self._stall is not None:
            if not outstanding:
                self._end_stall(step)
        elif outstanding and self._wait_s is None:
            busy = self._busy_since
            if busy is not None and time.monotonic() - busy >= STALL_S:
                self._begin_stall(step)
        if outstanding and self._handed_records - self._done_records + n_records > self._max_records:
            self._drop(step, records, outstanding)
            return
        wait = self._wait_s is not None and self._stall is None
        item = _Step(step, records, ready, n_records, threading.Event() if wait else None)
        self._outstanding.append(item)
        self._handed += 1
        self._handed_records += n_records
        self._queue.put(item)
        if wait and not item.done.wait(self._wait_s):  # type: ignore[union-attr]
            self._begin_stall(step)

    def _begin_stall(self, step: int) -> None:
        waiting = list(self._outstanding)
        stuck = waiting[0].step if waiting else step
        self._stall = _Stall(stuck)
        self._stalls += 1
        on_sigterm = _guard_sigterm(self)
        if self._stalls > _EPISODES_LOGGED:
            return
        if on_sigterm == "handled":
            sigterm = (f"A SIGTERM meanwhile (a preemption) is said on stderr with what is not written, which "
                       f"the monitor then waits for at most {_seconds(self._exit_wait)} (MSPROBE_MONITOR_EXIT_WAIT) "
                       f"before the process ends as SIGTERM ends it.")
        elif on_sigterm == "off-main":
            sigterm = ("A SIGTERM with its default disposition would end the process without a word about them: "
                       "the training runs outside the main thread, where the monitor cannot set a handler.")
        else:
            sigterm = (f"At exit the monitor waits at most {_seconds(self._exit_wait)} for them "
                       f"(MSPROBE_MONITOR_EXIT_WAIT).")
        logger.warning(
            "monitor_v2: the file system under %s has not taken the rows of step %d for %g s (it is stalled or very "
            "slow: a network file system that does not answer, a frozen mount). Training goes on without waiting: "
            "the rows of the next steps are kept in memory and written in order once it answers (at most %d "
            "statistics records, MSPROBE_MONITOR_QUEUE_RECORDS; past that, steps are dropped and counted). %s Said "
            "once per stall%s.", self._writer.rank_dir, stuck, STALL_S, self._max_records, sigterm,
            " (later stalls are not said)" if self._stalls == _EPISODES_LOGGED else "")

    def _end_stall(self, step: int) -> None:
        stall, self._stall = self._stall, None
        _unguard_sigterm(self)
        if stall is None or self._stalls > _EPISODES_LOGGED:
            return
        dropped = ""
        if stall.dropped:
            dropped = (f"; {len(stall.dropped)} step(s) that found the queue full were dropped "
                       f"({_ranges(stall.dropped)})")
        logger.warning("monitor_v2: writing to %s has caught up by step %d: the steps queued since the stall began "
                       "(step %d) are handed to the file system%s.", self._writer.rank_dir, step, stall.first, dropped)

    def _drop(self, step: int, records: Dict[str, List[Record]], outstanding: int) -> None:
        self._dropped[step] = count_rows(records)
        if self._stall is not None:
            self._stall.dropped.append(step)
        self._once.warning(
            "queue-full",
            "monitor_v2: %d step(s) (%d statistics records) are waiting to be written to %s, the most this monitor "
            "keeps in memory (MSPROBE_MONITOR_QUEUE_RECORDS=%d): step %d is dropped, and so is every step that finds "
            "the queue full, until the file system takes the queue. Dropped steps are counted and named by stop(). "
            "Logged once.", outstanding, self._handed_records - self._done_records, self._writer.rank_dir,
            self._max_records, step)

    def report_lost(self, step: int, exc: BaseException, rows: int = 0) -> None:
        self._writer.report_lost(step, exc, rows)

    def update_outputs(self, step: int, outputs: Sequence[MonitorOutput], schedule: StepSchedule) -> None:
        self._queue.put(_Call(functools.partial(self._writer.update_outputs, step, list(outputs), schedule)))

    def call_in_order(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the writer thread after the steps handed over so far."""
        self._queue.put(_Call(fn))

    def pending(self) -> Tuple[int, int]:
        """``(steps, rows)`` handed over and not written yet (queued or being written)."""
        items = list(self._outstanding)
        return len(items), sum(count_rows(i.records) for i in items)

    # -------------------------------------------------------------------- close
    def close(self) -> None:
        """Drain, then close the files. Bounded: see the class. A KeyboardInterrupt while
        waiting is raised after a warning; the next call goes on with the drain."""
        if self._closed:
            return
        exiting = isinstance(sys.exc_info()[1], (SystemExit, KeyboardInterrupt))
        self._close(f"stop() while the program exits ({type(sys.exc_info()[1]).__name__})" if exiting else None)

    def _close(self, exiting: Optional[str]) -> None:
        """``exiting``: why the process ends (said on stderr, the wait bounded in all);
        None: a ``stop()`` of a program that goes on (logged, the wait bounded by progress)."""
        said = self._say_exiting(exiting) if exiting else None
        deadline = time.monotonic() + self._exit_wait
        if not self._stop_sent:
            self._stop_sent = True
            self._queue.put(self._STOP)
        try:
            finished = self._wait_finished(deadline) if exiting else self._wait_in_stop()
        except BaseException:
            steps, rows = self.pending()
            self._once.warning(
                "interrupted",
                "monitor_v2: stop() was interrupted while %d step(s) (%d row(s)) were still to be written to "
                "%s; nothing is lost yet: call stop() again to write them (at exit the monitor writes them "
                "too). Logged once.", steps, rows, self._writer.rank_dir)
            raise
        if not finished:
            self._abandon(exiting or "stop()", say_on_stderr if exiting else _log_warning)
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        _unguard_sigterm(self)
        if said:
            say_on_stderr(f"monitor_v2: {exiting}: the {said} step(s) are written to {self._writer.rank_dir}.")
        if self._writer.sinks is not None:
            self._writer.sinks.close()

    def _wait_finished(self, deadline: float) -> bool:
        """Wait for the writer thread to end, until ``deadline`` at most."""
        while not self._finished.wait(_POLL_S):
            if time.monotonic() >= deadline:
                return False
        return True

    def _wait_in_stop(self) -> bool:
        """``stop()``'s wait: as long as the writer thread writes steps; said once it has
        waited ``STALL_S``, given up after ``MSPROBE_MONITOR_EXIT_WAIT`` without a step."""
        said = False
        done, since = self._done, time.monotonic()
        while not self._finished.wait(_POLL_S):
            now = time.monotonic()
            if self._done != done:
                done, since = self._done, now
            if not said and (self._stall is not None or now - since >= STALL_S):
                said = True  # at once during a stall, else once the wait is longer than a healthy one
                items = list(self._outstanding)
                if items:
                    logger.warning(
                        "monitor_v2: stop() is waiting for the file system: %d step(s) (%d row(s)) are not written to "
                        "%s yet (steps %s); it gives up after %s without a step written (MSPROBE_MONITOR_EXIT_WAIT).",
                        len(items), sum(count_rows(i.records) for i in items), self._writer.rank_dir,
                        _ranges(i.step for i in items), _seconds(self._exit_wait))
            if now - since >= self._exit_wait:
                return False
        return True

    def _say_exiting(self, why: str) -> Optional[int]:
        """Say on stderr, at once, the steps not written yet (None when there are none)."""
        items = list(self._outstanding)
        if not items:
            return None
        say_on_stderr(
            f"monitor_v2: {why}: {len(items)} step(s) ({sum(count_rows(i.records) for i in items)} row(s)) are not "
            f"written to {self._writer.rank_dir} yet (steps {_ranges(i.step for i in items)}){self._dropped_text()}; "
            f"waiting {_seconds(self._exit_wait)} at most for the file system to take them "
            f"(MSPROBE_MONITOR_EXIT_WAIT).")
        return len(items)

    def _dropped_text(self) -> str:
        if not self._dropped:
            return ""
        return (f"; {len(self._dropped)} earlier step(s) ({sum(self._dropped.values())} row(s)) were dropped when "
                f"the queue was full (steps {_ranges(self._dropped)})")

    def _abandon(self, why: str, say: Callable[[str], None]) -> None:
        """Give up the steps still queued: counted as lost, said, and nothing more waited
        for (the writer thread, if the file system ever answers, writes none of them)."""
        self._give_up = True
        self._closed = True
        atexit.unregister(self._at_exit)
        _unguard_sigterm(self)
        items = list(self._outstanding)
        self._abandoned.update(i.step for i in items)
        if not items:
            return
        current = " (the first of them was being written: it may still reach its file)" \
            if self._busy_since is not None else ""
        say(f"monitor_v2: {why}: gave up waiting for the file system after {_seconds(self._exit_wait)}: "
            f"{len(items)} step(s) ({sum(count_rows(i.records) for i in items)} row(s)) were not written to "
            f"{self._writer.rank_dir} and are lost (steps {_ranges(i.step for i in items)}){current}"
            f"{self._dropped_text()}.")

    def _drain_for_signal(self, why: str, deadline: float) -> None:
        """In the SIGTERM handler: say what is not written, wait for it until ``deadline``,
        say what is lost. Takes no lock (the training thread, which the handler
        interrupted, may hold the queue's) and closes nothing (the process ends now)."""
        said = self._say_exiting(why)
        if said is None:
            return
        target = self._handed
        while self._done < target and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        if self._done >= target:
            say_on_stderr(f"monitor_v2: {why}: the {said} step(s) are written to {self._writer.rank_dir}.")
        else:
            self._abandon(why, say_on_stderr)

    def _at_exit(self) -> None:
        if self._closed:
            return
        try:
            self._close("the process is exiting")
        except KeyboardInterrupt:
            # Interrupted at exit too: the process ends now. The writer thread counts the
            # rest as lost (no writing: quick) and says how much, once; where it is stuck in
            # the file system, that is said here instead.
            self._give_up = True
            if not self._finished.wait(_GIVE_UP_WAIT_S):
                self._abandon("the process is exiting", say_on_stderr)
            self._closed = True

    def abandon_in_child(self) -> None:
        """In a forked child: its writer thread does not exist and the files are the
        parent's; write nothing, drain nothing, log nothing at exit."""
        self._closed = True
        atexit.unregister(self._at_exit)
        _AT_RISK.discard(self)


def _log_warning(text: str) -> None:
    logger.warning("%s", text)


class _NotWritten(Exception):
    """Why a step handed to the writer was not written (the first error ``close()`` names)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "not written"


class _Call:
    """A function the writer thread runs between two steps."""

    __slots__ = ("fn",)

    def __init__(self, fn) -> None:  # type: ignore[no-untyped-def]
        self.fn = fn


# --------------------------------------------------------- SIGTERM during a stall
# Writers whose steps wait behind a stalled file system; while there is one, and SIGTERM had
# its default disposition, _on_sigterm is installed in its place.
_AT_RISK: Set[AsyncCsvWriter] = set()
_sigterm_installed = False


def _guard_sigterm(writer: AsyncCsvWriter) -> str:
    """``writer`` has steps at risk: stand in for SIGTERM's default disposition. What a
    SIGTERM does now: ``handled`` (the monitor's handler), ``own`` (the training's own
    disposition, left alone), ``off-main`` (the default, which no handler can replace from
    this thread)."""
    global _sigterm_installed
    _AT_RISK.add(writer)
    if _sigterm_installed:
        return "handled"
    if threading.current_thread() is not threading.main_thread():
        return "off-main"
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:  # a handler, SIG_IGN, or one set in C (None)
            return "own"
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        return "off-main"
    _sigterm_installed = True
    return "handled"


def _unguard_sigterm(writer: AsyncCsvWriter) -> None:
    """``writer`` has no step at risk any more: SIGTERM's default again once no writer has.
    Off the main thread the handler stays: with nothing at risk it does what the default
    does. A handler the training set since is left alone."""
    global _sigterm_installed
    _AT_RISK.discard(writer)
    if _AT_RISK or not _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except (ValueError, OSError):
        return
    _sigterm_installed = False


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM while steps wait behind a stalled file system (the disposition was the
    default): say them on stderr, wait for them at most ``MSPROBE_MONITOR_EXIT_WAIT``
    seconds, say what is lost, then end the process as the default disposition does (no
    exit handler runs, the status says SIGTERM). A second SIGTERM ends it at once."""
    global _sigterm_installed
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _sigterm_installed = False
    writers = list(_AT_RISK)
    _AT_RISK.clear()
    if writers:
        deadline = time.monotonic() + min(w._exit_wait for w in writers)
        for w in writers:
            w._drain_for_signal("SIGTERM", deadline)
    os.kill(os.getpid(), signal.SIGTERM)


def _forget_in_child() -> None:
    """After ``os.fork()``, in the child: the parent's writers are not its own; SIGTERM's
    default again (the child's disposition before the monitor stood in for it)."""
    global _sigterm_installed
    _AT_RISK.clear()
    if not _sigterm_installed:
        return
    _sigterm_installed = False
    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except (ValueError, OSError):
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
