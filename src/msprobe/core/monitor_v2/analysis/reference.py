"""One streaming pass over an output directory: what was collected, and the anomalies.

Three detectors:

**Non-finite values.** A row is non-finite when ``nans > 0``, or ``norm`` is NaN/Inf,
or ``min``/``max``/``mean`` is NaN/Inf. An empty tensor (``nan`` min/max/mean with
``norm`` 0) is not an anomaly. The first one in execution order (see :mod:`.order`)
over all ranks and monitors is *the* first non-finite value; the first one of each rank
is reported too. Rows that a later run wrote again (a run resumed from a checkpoint, or
re-run, into the same files writes their step once more, see :class:`FileRuns`) are the
earlier runs' and are kept apart: the first non-finite value is that of the latest rows
of each step, and the earlier runs' first one is reported as theirs.

**Spikes.** For each rank and tensor (monitor, name, scope) of ``SpikeSettings.monitors``
(default: every monitor but ``optimizer``, whose state is a smoothed, lagging image of
the gradients, and whose ``exp_avg_sq`` grows from zero during early training), the
absolute value ``x``
of each statistic in ``SpikeSettings.stats`` (default ``norm`` and ``max``; ``max`` is
checked as the largest magnitude ``absmax = max(|min|, |max|)`` when the file has
``min``, so that a value crossing zero is not mistaken for a jump) is compared
with the tensor's own previous ``window`` finite values (micro-batch rows of a step
count as separate values) of the same run: in files that hold several runs (a script
re-run with the same output_dir, see :class:`FileRuns`), the k-th run of each file has
a history of its own. It is a spike when at least ``min_history`` values precede
it and both ``x > median + k * 1.4826 * MAD`` (robust z-score above ``k``; MAD is the
median absolute deviation, 1.4826 * MAD estimates a standard deviation) and
``x > ratio * median`` and ``x > floor`` (an absolute floor, default 1e-6: a value that
converged to exactly 0 and then reads 1.5e-8 is rounding noise, not a spike). The value then joins the history, so a lasting change of level
stops being flagged once it is the median.

**Rank disagreement.** Rows that data-parallel ranks must agree on: ``weight_grad``
``reduced``, ``param`` (both scopes) and ``optimizer`` state. For each (step, tensor,
statistic) present on several ranks, values within ``rtol``/``atol`` of each other are
grouped; the largest group is the consensus (a tie goes to the group holding the lowest
rank) and every other rank is reported. NaN equals NaN here. Sharded runs (FSDP, ZeRO,
tensor or pipeline parallelism) hold different shards or layers under the same names
on different ranks: turn the check off (``--no-rank-check``) or restrict it to ranks
that replicate each other (``--rank-groups``). Ranks are compared in chunks of at most
``CHUNK`` ranks, each including the group's lowest rank, to bound memory.
"""

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Sequence, TextIO, Tuple

from .blocks import compare_window, rank_windows
from .localise import localise
from .order import OrderKey, order_key
from .reader import MONITORS, OPS, CsvFile, Layout, Problems, Row, StepRange, iter_rows, scan
from .report import (INF, MAD_SCALE, Collected, FileRuns, FirstN, RankCheckSettings, Report, RowVisitor,
                     SpikeSettings, files_to_read, finding, median, nonfinite_kind, rank_check_note, relabel)
from .text import Progress


class ReferenceEngine:
    """The :class:`.report.AnalysisEngine` of this module: pure Python, CSV only (kept as
    the reference of the tests and the benchmark, ``--engine reference``)."""

    def open_layout(self, root: str, ranks: Optional[Sequence[int]] = None,
                    monitors: Optional[Sequence[str]] = None, steps: Optional[StepRange] = None) -> Layout:
        return scan(root, ranks=ranks, monitors=monitors, steps=steps)

    def analyse(self, layout: Layout, problems: Problems, spikes: SpikeSettings, rank_check: RankCheckSettings,
                steps: Optional[StepRange] = None, limit: Optional[int] = 50,
                progress: Optional[bool] = None, visitors: Sequence[RowVisitor] = (),
                progress_stream: Optional[TextIO] = None) -> Report:
        return analyse(layout, problems, spikes, rank_check, steps=steps, limit=limit, progress=progress,
                       visitors=visitors, progress_stream=progress_stream)


def analyse(layout: Layout, problems: Problems, spikes: SpikeSettings, rank_check: RankCheckSettings,
            steps: Optional[StepRange] = None, limit: Optional[int] = 50,
            progress: Optional[bool] = None, visitors: Sequence[RowVisitor] = (),
            progress_stream: Optional[TextIO] = None) -> Report:
    """Stream every file of ``layout`` once (plus a second read of the rank-checked files
    when there are several ranks) and return the :class:`.report.Report`."""
    tally = _Tally({m: Collected() for m in layout.monitors}, FirstN(limit))
    prog = Progress(files_to_read(layout, rank_check), "reading", enabled=progress, stream=progress_stream)
    read = _Reading(tally, problems, spikes, steps, visitors, prog)
    for rank in layout.ranks:
        read.rank(layout, rank)
    note = rank_check_note(rank_check, layout)
    mismatches = {} if note else check_ranks(layout, problems, rank_check, steps, prog)
    prog.close()
    report = Report(layout, tally.collected, tally.rank_files, tally.rank_rows, tally.first_nonfinite,
                    tally.nonfinite_count, tally.nonfinite_by, tally.spike_items, tally.spike_steps, spikes,
                    mismatches, rank_check, note, problems, tally.appended,
                    earlier_nonfinite=tally.earlier_nonfinite, earlier_nonfinite_count=tally.earlier_count)
    relabel(report)
    localise(report, steps)
    return report


@dataclass
class _Tally:
    """What the first pass accumulates, over all ranks and monitors."""

    collected: Dict[str, Collected]
    spike_items: FirstN
    rank_files: Dict[int, int] = field(default_factory=dict)
    rank_rows: Dict[int, int] = field(default_factory=dict)
    first_nonfinite: Dict[int, Tuple[OrderKey, Dict[str, Any]]] = field(default_factory=dict)
    nonfinite_by: Counter = field(default_factory=Counter)
    nonfinite_count: int = 0
    spike_steps: Counter = field(default_factory=Counter)
    appended: List[Dict[str, Any]] = field(default_factory=list)
    earlier_nonfinite: Dict[int, Tuple[OrderKey, Dict[str, Any]]] = field(default_factory=dict)
    earlier_count: int = 0

    def nonfinite(self, rank: int, monitor: str, found: "_FileNonfinite", runs: "FileRuns") -> None:
        """A file's non-finite rows, once the file is read: a row whose step a later run
        of the file wrote again is an earlier run's."""
        for (seg, step, scope), n in found.counts.items():
            if runs.rewritten(step, seg):
                self.earlier_count += n
            else:
                self.nonfinite_count += n
                self.nonfinite_by[(monitor, scope)] += n
        for (seg, step), (key, row, kind) in found.first.items():
            into = self.earlier_nonfinite if runs.rewritten(step, seg) else self.first_nonfinite
            best = into.get(rank)
            if best is None or key < best[0]:
                into[rank] = (key, finding(rank, monitor, row, found.path, kind=kind, values=dict(row.vals)))

    def spike(self, rank: int, monitor: str, row: Row, item: Dict[str, Any]) -> None:
        self.spike_steps[row.step] += 1
        self.spike_items.add(order_key(row.step, monitor, row.scope, row.micro, row.line, rank), item)


class _FileNonfinite:
    """The non-finite rows of one file, by the run of the file that wrote them (its
    segment, see :class:`FileRuns`) and step: how many per scope, and the first one in
    execution order."""

    __slots__ = ("path", "counts", "first")

    def __init__(self, path: str) -> None:
        self.path = path
        self.counts: Dict[Tuple[int, int, str], int] = {}  # in the order the rows came
        self.first: Dict[Tuple[int, int], Tuple[OrderKey, Row, str]] = {}

    def add(self, rank: int, monitor: str, row: Row, kind: str, seg: int) -> None:
        ck = (seg, row.step, row.scope)
        self.counts[ck] = self.counts.get(ck, 0) + 1
        key = order_key(row.step, monitor, row.scope, row.micro, row.line, rank)
        best = self.first.get((seg, row.step))
        if best is None or key < best[0]:
            self.first[(seg, row.step)] = (key, row, kind)


class _Reading:
    """The first pass: each file once, row by row, in rank and monitor order."""

    def __init__(self, tally: _Tally, problems: Problems, spikes: SpikeSettings, steps: Optional[StepRange],
                 visitors: Sequence[RowVisitor], prog: Progress) -> None:
        self.tally = tally
        self.problems = problems
        self.spikes = spikes
        self.steps = steps
        self.visitors = visitors
        self.prog = prog

    def rank(self, layout: Layout, rank: int) -> None:
        n_files = n_rows = 0
        for monitor in MONITORS:
            files = layout.files_of(rank, monitor)
            if files:
                n_files += len(files)
                n_rows += self.monitor(rank, monitor, files)
        self.tally.rank_files[rank] = n_files
        self.tally.rank_rows[rank] = n_rows

    def monitor(self, rank: int, monitor: str, files: Sequence[CsvFile]) -> int:
        col = self.tally.collected[monitor]
        col.ranks.add(rank)
        checked = self.spikes.enabled and monitor in self.spikes.monitors
        detector = SpikeDetector(self.spikes, self.spikes.stats if checked else ())
        return sum(self.file(rank, monitor, f, col, detector) for f in files)

    def file(self, rank: int, monitor: str, f: CsvFile, col: Collected, detector: "SpikeDetector") -> int:
        runs = FileRuns()
        bad = _FileNonfinite(f.path)
        col.files += 1
        n_rows = 0
        for row in iter_rows(f, self.problems, self.steps, on_header=lambda ops: merge_ops(col, ops)):
            n_rows += 1
            # first: the row's run (a re-run appended to the file) chooses its spike history
            runs.add(row.step, row.line, row.name, row.scope, row.micro, row.dp)
            collect_row(col, row)
            kind = nonfinite_kind(row.vals)
            if kind is not None:
                bad.add(rank, monitor, row, kind, runs.seg)
            elif detector.stats:
                spiked = detector.check(rank, monitor, row, f.path, runs.seg)
                if spiked is not None:
                    self.tally.spike(rank, monitor, row, spiked)
            col.rows += 1
            for visit in self.visitors:
                visit(rank, monitor, row, f)
        if bad.counts:
            self.tally.nonfinite(rank, monitor, bad, runs)
        if runs.restarts:
            self.tally.appended.append(runs.item(rank, monitor, f.path))
        self.prog.advance(f"rank {rank} {monitor}")
        return n_rows


def merge_ops(col: Collected, ops: Tuple[str, ...]) -> None:
    """A file's header joins the statistics of its monitor (in the order of :data:`.reader.OPS`)."""
    if any(op not in col.ops for op in ops):
        col.ops[:] = [op for op in OPS if op in col.ops or op in ops]


def collect_row(col: Collected, row: Row) -> None:
    col.steps.add(row.step)
    col.tensors.add((row.name, row.scope))
    col.scopes[row.scope] += 1
    if row.micro is not None:
        col.micro_steps.add(row.micro)


# ------------------------------------------------------------------ spikes
class SpikeDetector:
    """The spike rule over the rows of one (rank, monitor), each tensor of each run
    against its own history."""

    def __init__(self, settings: SpikeSettings, stats: Sequence[str]) -> None:
        self.s = settings
        self.stats = stats
        # (name, scope, dp_rank, run) -> stat -> the previous values (dp_rank: of a merged
        # view's row kept per data-parallel rank, else None)
        self.history: Dict[Tuple[str, str, Optional[int], int], Dict[str, Deque[float]]] = {}

    def check(self, rank: int, monitor: str, row: Row, path: str, run: int) -> Optional[Dict[str, Any]]:
        """The row's finding when one of its statistics is a spike (None otherwise); every
        value then joins its history.

        The k-th run of every file is the k-th run of the script: each run has its own
        history, so that a re-run is never compared with the end of the run before it (nor
        do its repeated values shrink the MAD)."""
        hist = self.history.setdefault((row.name, row.scope, row.dp, run), {})
        spiked = None
        for stat in self.stats:
            v = row.vals.get(stat)
            if v is None:
                continue
            label, x = checked_magnitude(stat, v, row.vals)
            h = hist.get(stat)
            if h is None:
                h = hist[stat] = deque(maxlen=self.s.window)
            found = self.spike(x, h)
            if found is not None:
                med, mad = found
                if spiked is None:
                    spiked = finding(rank, monitor, row, path, stat=label, value=x, median=med, mad=mad,
                                     ratio=(x / med) if med > 0 else INF, stats=[label])
                else:
                    spiked["stats"].append(label)
            h.append(x)
        return spiked

    def spike(self, x: float, h: Deque[float]) -> Optional[Tuple[float, float]]:
        """``(median, MAD)`` of the history ``h`` when ``x`` is a spike against it."""
        s = self.s
        # the cheap tests first: most values fail them
        if len(h) < s.min_history or not (x > s.floor and x > s.ratio * min(h)):
            return None
        srt = sorted(h)
        med = median(srt)
        if not x > s.ratio * med:
            return None
        mad = median(sorted(abs(y - med) for y in srt))
        if not x > med + s.mad_k * MAD_SCALE * mad:
            return None
        return med, mad


def checked_magnitude(stat: str, value: float, vals: Dict[str, float]) -> Tuple[str, float]:
    """``(label, x)``: ``|value|``, but ``max`` is the largest magnitude ``absmax`` where the
    row has ``min``, so that a value crossing zero is not mistaken for a jump."""
    x = abs(value)
    if stat != "max" or "min" not in vals:
        return stat, x
    m = abs(vals["min"])
    return "absmax", (m if m > x else x)


# ------------------------------------------------------------------ rank agreement
def check_ranks(layout: Layout, problems: Problems, settings: RankCheckSettings,
                steps: Optional[StepRange], prog: Progress) -> Dict[int, Dict[str, Any]]:
    """The second pass: rank -> its count of rows off the consensus and its first one."""
    result: Dict[int, Dict[str, Any]] = {}
    for w in rank_windows(layout, settings):
        for _ in range(w.reads):
            prog.advance(f"rank agreement, {w.monitor}")
        if len(w.files) >= 2:
            compare_window(w.monitor, w.files, problems, steps, settings, result)
    return result
