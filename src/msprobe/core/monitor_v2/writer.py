"""CSV output: ``<output_dir>/rank_<r>/<monitor>_step<a>-<b>.csv``.

``CsvWriter`` appends the rows of one step to the file of the step's window and flushes,
so a crash loses at most the steps not yet handed to the writer. ``AsyncCsvWriter`` does
the merging, formatting and writing on a background thread; ``close()`` (called by
``stop()`` and at interpreter exit) drains it, and an error on that thread is logged
and re-reported by ``close()``, never lost.
"""

import atexit
import csv
import logging
import os
import queue
import threading
from typing import Dict, List, Optional, Sequence, TextIO, Tuple

from .alert import Alerter
from .schedule import StepSchedule
from .stats import Record, Row, format_value, merge_records

logger = logging.getLogger("msprobe.monitor_v2")


def header(ops: Sequence[str], with_micro_step: bool) -> List[str]:
    cols = ["vpp_stage", "step", "module_name", "scope"]
    if with_micro_step:
        cols.append("micro_step")
    return cols + list(ops)


class MonitorOutput:
    """What the writer needs to know about one monitor's file."""

    def __init__(self, name: str, ops: Sequence[str], with_micro_step: bool) -> None:
        self.name = name
        self.ops = tuple(ops)
        self.with_micro_step = with_micro_step
        self.header = header(self.ops, with_micro_step)


class CsvWriter:
    def __init__(self, rank_dir: str, schedule: StepSchedule, outputs: Sequence[MonitorOutput],
                 alerter: Optional[Alerter] = None) -> None:
        self.rank_dir = rank_dir
        self.alerter = alerter
        self.schedule = schedule
        self.outputs = {o.name: o for o in outputs}
        self._files: Dict[str, Tuple[Tuple[int, int], TextIO, "csv._writer"]] = {}
        self._warned_append = False
        os.makedirs(rank_dir, exist_ok=True)

    def path(self, monitor: str, step: int) -> str:
        a, b = self.schedule.window(step)
        return os.path.join(self.rank_dir, f"{monitor}_step{a}-{b}.csv")

    def _open(self, monitor: str, step: int):
        window = self.schedule.window(step)
        current = self._files.get(monitor)
        if current is not None and current[0] == window:
            return current[2]
        if current is not None:
            current[1].close()
        out = self.outputs[monitor]
        path = self.path(monitor, step)
        existing = os.path.exists(path) and os.path.getsize(path) > 0
        f = open(path, "a", newline="", encoding="utf-8")
        writer = csv.writer(f, lineterminator="\n")
        if existing:
            if not self._warned_append:
                self._warned_append = True
                logger.warning(
                    "monitor_v2: %s already holds CSV files (e.g. %s); appending to them. Use another "
                    "output_dir to keep runs apart.", self.rank_dir, os.path.basename(path),
                )
            with open(path, encoding="utf-8") as r:
                first = r.readline().strip()
            if first != ",".join(out.header):
                logger.warning(
                    "monitor_v2: %s has header %r, this run writes %r", path, first, ",".join(out.header)
                )
        else:
            writer.writerow(out.header)
        self._files[monitor] = (window, f, writer)
        return writer

    def write_rows(self, monitor: str, step: int, rows: Sequence[Row]) -> None:
        if not rows:
            return
        out = self.outputs[monitor]
        writer = self._open(monitor, step)
        for row in rows:
            cells = [row.vpp_stage, row.step, row.name, row.scope]
            if out.with_micro_step:
                cells.append(row.micro_step)
            cells.extend(format_value(op, row.stat.value(op)) for op in out.ops)
            writer.writerow(cells)
        self._files[monitor][1].flush()

    def write_step(self, step: int, records: Dict[str, List[Record]]) -> None:
        """Records carry host vectors; merge them into rows and write each monitor's file."""
        merged = [(monitor, merge_records(step, recs)) for monitor, recs in records.items()]
        if self.alerter is not None:
            try:
                self.alerter.check_step(step, merged)
            except Exception as exc:  # noqa: BLE001 - an alert must never cost the rows
                logger.error("monitor_v2: alert check failed at step %s: %r", step, exc)
        for monitor, rows in merged:
            self.write_rows(monitor, step, rows)

    def close(self) -> None:
        for _, f, _ in self._files.values():
            f.close()
        self._files.clear()


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

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is self._STOP:
                return
            try:
                self._writer.write_step(*item)
            except Exception as exc:  # reported by close() and in the log, never lost
                if self._error is None:
                    self._error = exc
                    logger.error("monitor_v2: writing step %s failed: %r", item[0], exc)

    def write_step(self, step: int, records: Dict[str, List[Record]]) -> None:
        self._queue.put((step, records))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._queue.put(self._STOP)
        self._thread.join()
        self._writer.close()
        if self._error is not None:
            logger.error("monitor_v2: the background writer lost data after: %r", self._error)
