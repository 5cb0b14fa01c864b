"""CSV output: ``<output_dir>/rank_<r>/<monitor>_step<a>-<b>.csv``.

``CsvWriter`` appends the rows of one step to the file of the step's window in one write
(so a crash loses at most the steps not yet handed to the writer). ``AsyncCsvWriter``
does the merging, formatting and writing on a background thread; ``close()`` (called by
``stop()`` and at interpreter exit) drains it.

Output problems while training never reach the training code and never make ``stop()``
raise. A step whose write fails (a full disk, a quota) is rolled back, so a file never
holds half a step and no empty file is left behind; the first failure and the recovery
are logged once each, and ``close()`` logs what was lost, with counts. A removed output
directory (or a deleted file) is re-created and writing goes on. Names that a CSV cannot
hold on one line (control characters) or that UTF-8 cannot encode (lone surrogates) are
written escaped: see ``csv_text``.
"""

import atexit
import csv
import functools
import io
import logging
import os
import queue
import threading
import unicodedata
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from .alert import Alerter
from .errors import OutputError
from .schedule import StepSchedule
from .stats import Record, Row, format_value, merge_records

if TYPE_CHECKING:
    from .sinks import SinkHub

logger = logging.getLogger("msprobe.monitor_v2")

# After this many fail/recover episodes the transitions are no longer logged one by one
# (a disk that fills and frees every step must not flood the log); close() still counts all.
_EPISODES_LOGGED = 5


def header(ops: Sequence[str], with_micro_step: bool) -> List[str]:
    cols = ["vpp_stage", "step", "module_name", "scope"]
    if with_micro_step:
        cols.append("micro_step")
    return cols + list(ops)


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


def _write_all(fd: int, data: bytes) -> None:
    """The writer's only write to the file system (a full disk shows up here)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _describe_os_error(exc: BaseException) -> str:
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


class MonitorOutput:
    """What the writer needs to know about one monitor's file."""

    def __init__(self, name: str, ops: Sequence[str], with_micro_step: bool) -> None:
        self.name = name
        self.ops = tuple(ops)
        self.with_micro_step = with_micro_step
        self.header = header(self.ops, with_micro_step)


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
        self._files: Dict[str, _OpenFile] = {}
        self._warned_append = False
        self._warned_recreated = False
        # losses: steps with rows that never reached the disk, how many rows, the first error
        self.lost_steps: Set[int] = set()
        self.lost_rows = 0
        self._first_error: Optional[str] = None
        self._failing = False
        self._episodes = 0
        self._lost_in_episode: Set[int] = set()
        self._make_rank_dir()

    def _make_rank_dir(self) -> None:
        if os.path.isdir(self.rank_dir):
            return
        if os.path.lexists(self.rank_dir):
            raise OutputError(
                f"monitor_v2: cannot write the output: {self.rank_dir!r} exists and is not a directory; "
                f"this rank writes its CSV files there. Move or delete that file, or choose another output_dir."
            )
        try:
            os.makedirs(self.rank_dir, exist_ok=True)
        except OSError as exc:
            raise OutputError(
                f"monitor_v2: cannot create the output directory {self.rank_dir!r}: {_describe_os_error(exc)}. "
                f"Check that output_dir is a writable directory, or choose another output_dir."
            ) from None

    def path(self, monitor: str, step: int) -> str:
        a, b = self.schedule.window(step)
        return os.path.join(self.rank_dir, f"{monitor}_step{a}-{b}.csv")

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
        if not self._warned_recreated:
            self._warned_recreated = True
            logger.warning(
                "monitor_v2: %s while the run was writing to %s; writing goes on in re-created files "
                "(and directories). Rows written to the deleted files are gone. Logged once.",
                what, self.rank_dir,
            )

    def _open_fd(self, path: str) -> int:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        try:
            return os.open(path, flags, 0o644)
        except FileNotFoundError:  # the directory was removed: re-create it, once per removal
            os.makedirs(self.rank_dir, exist_ok=True)
            self._note_recreated("the output directory was removed")
            return os.open(path, flags, 0o644)

    def _open(self, monitor: str, step: int) -> Tuple[_OpenFile, bool]:
        """The file of the step's window and whether it still needs its header."""
        window = self.schedule.window(step)
        current = self._current(monitor, window)
        if current is not None:
            return current, False
        path = self.path(monitor, step)
        fd = self._open_fd(path)
        opened = _OpenFile(window, path, fd)
        existing = os.fstat(fd).st_size > 0
        if existing:
            self._check_existing(monitor, path)
        self._files[monitor] = opened
        return opened, not existing

    def _check_existing(self, monitor: str, path: str) -> None:
        if not self._warned_append:
            self._warned_append = True
            logger.warning(
                "monitor_v2: %s already holds CSV files (e.g. %s); appending to them. Use another "
                "output_dir to keep runs apart.", self.rank_dir, os.path.basename(path),
            )
        expected = ",".join(self.outputs[monitor].header)
        try:
            with open(path, encoding="utf-8", errors="replace") as r:
                first = r.readline().strip()
        except OSError:
            return
        if first != expected:
            logger.warning("monitor_v2: %s has header %r, this run writes %r", path, first, expected)

    # ------------------------------------------------------------------ rows
    def _format(self, monitor: str, rows: Sequence[Row], with_header: bool) -> bytes:
        out = self.outputs[monitor]
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        if with_header:
            writer.writerow(out.header)
        for row in rows:
            cells = [row.vpp_stage, row.step, csv_text(row.name), csv_text(row.scope)]
            if out.with_micro_step:
                cells.append(row.micro_step)
            cells.extend(format_value(op, row.stat.value(op)) for op in out.ops)
            writer.writerow(cells)
        return buf.getvalue().encode("utf-8", errors="backslashreplace")

    def write_rows(self, monitor: str, step: int, rows: Sequence[Row]) -> None:
        """Append ``rows`` in one write; on failure the file is left as it was (a new file
        is removed again) and the error is raised."""
        if not rows:
            return
        opened, new = self._open(monitor, step)
        data = self._format(monitor, rows, new)
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

    def write_step(self, step: int, records: Dict[str, List[Record]]) -> None:
        """Records carry host vectors; merge them into rows and write each monitor's file.
        Never raises for an output problem: it is logged and counted (see ``close``)."""
        merged = [(monitor, merge_records(step, recs)) for monitor, recs in records.items()]
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
        failure: Optional[BaseException] = None
        for monitor, rows in merged:
            try:
                self.write_rows(monitor, step, rows)
            except Exception as exc:  # noqa: BLE001 - output problems are counted, never raised
                failure = failure or exc
                self.lost_rows += len(rows)
                if not isinstance(exc, OSError) and self._first_error is None:
                    logger.error("monitor_v2: writing %s rows of step %s failed", monitor, step, exc_info=exc)
        if failure is not None:
            self._on_failure(step, failure)
        elif self._failing:
            self._on_recovery(step)

    def _on_failure(self, step: int, exc: BaseException) -> None:
        self.lost_steps.add(step)
        self._lost_in_episode.add(step)
        if self._first_error is None:
            self._first_error = _describe_os_error(exc)
        if self._failing:
            return
        self._failing = True
        self._episodes += 1
        if self._episodes <= _EPISODES_LOGGED:
            logger.warning(
                "monitor_v2: cannot write step %d to %s: %s. Training goes on; the rows of the steps that "
                "cannot be written are lost (a step is written whole or not at all). Logged once until "
                "writing works again.%s", step, self.rank_dir, _describe_os_error(exc),
                " Later episodes are only counted (see the summary at stop())." if self._episodes == _EPISODES_LOGGED
                else "",
            )

    def _on_recovery(self, step: int) -> None:
        self._failing = False
        lost, self._lost_in_episode = self._lost_in_episode, set()
        if self._episodes <= _EPISODES_LOGGED:
            logger.warning("monitor_v2: writing to %s works again from step %d; %d step(s) were lost (%s).",
                           self.rank_dir, step, len(lost), _ranges(lost))

    def report_lost(self, step: int, exc: BaseException) -> None:
        """A step that never reached ``write_step`` (its statistics failed to reach the host)."""
        self.lost_steps.add(step)
        if self._first_error is None:
            self._first_error = repr(exc)

    def close(self) -> None:
        """Close the files; log what was lost. Never raises."""
        for opened in self._files.values():
            opened.close()
        self._files.clear()
        if self.sinks is not None:
            self.sinks.close()
        if self.lost_steps:
            logger.warning(
                "monitor_v2: %d step(s) of output were lost (%d row(s)) in %s: steps %s. First error: %s.",
                len(self.lost_steps), self.lost_rows, self.rank_dir, _ranges(self.lost_steps),
                self._first_error,
            )


class AsyncCsvWriter:
    """Same interface as ``CsvWriter``; the work happens on a daemon thread."""

    _STOP = object()

    def __init__(self, writer: CsvWriter) -> None:
        self._writer = writer
        self._queue: "queue.Queue" = queue.Queue()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="msprobe-monitor-writer", daemon=True)
        self._thread.start()
        self._closed = False
        atexit.register(self.close)

    @property
    def lost_steps(self) -> Set[int]:
        return self._writer.lost_steps

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is self._STOP:
                self._queue.task_done()
                return
            try:
                self._writer.write_step(*item)
            except Exception as exc:  # noqa: BLE001 - counted and reported by close(), never lost
                self._writer.report_lost(item[0], exc)
                if self._error is None:
                    self._error = exc
                    logger.error("monitor_v2: writing step %s failed: %r", item[0], exc)
            self._queue.task_done()

    def drain(self) -> None:
        """Wait until every step handed over so far has been written (or counted as lost)."""
        self._queue.join()

    def write_step(self, step: int, records: Dict[str, List[Record]]) -> None:
        self._queue.put((step, records))

    def report_lost(self, step: int, exc: BaseException) -> None:
        self._writer.report_lost(step, exc)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._queue.put(self._STOP)
        self._thread.join()
        self._writer.close()
