"""One pass over an output directory: what was collected, and the anomalies.

**Runs.** A window's files (its plain file and its ``.run<k>`` files, see
:func:`.reader.window_groups`) are read together, one window at a time, and their runs
told apart (:class:`.report.WindowRuns`): each step's latest rows (those of the latest run
that wrote it) are the report's; rows that a later run wrote again (a run resumed from a
checkpoint, or re-run, into the same output_dir writes their step once more, in the same
file or beside it) are the earlier runs', counted and reported apart, never with them.
Only the rows of one window are held in memory.

Three detectors:

**Non-finite values.** A row is non-finite when ``nans > 0``, or ``norm`` is NaN/Inf,
or ``min``/``max``/``mean`` is NaN/Inf. An empty tensor (``nan`` min/max/mean with
``norm`` 0) is not an anomaly. The first one in execution order (see :mod:`.order`)
over all ranks and monitors is *the* first non-finite value; the first one of each rank
is reported too, of the latest rows; the earlier runs' first one is reported as theirs.

**Spikes.** For each rank and tensor (monitor, name, scope) of ``SpikeSettings.monitors``
(default: every monitor but ``optimizer``, whose state is a smoothed, lagging image of
the gradients, and whose ``exp_avg_sq`` grows from zero during early training), the
absolute value ``x``
of each statistic in ``SpikeSettings.stats`` (default ``norm`` and ``max``; ``max`` is
checked as the largest magnitude ``absmax = max(|min|, |max|)`` when the file has
``min``, so that a value crossing zero is not mistaken for a jump) is compared
with the tensor's own previous ``window`` finite values (micro-batch rows of a step
count as separate values) of the same run: each run (:meth:`.report.WindowRuns.label`:
the k-th run of each file of a ``.run<k>`` series and column set) has a history of its
own, and a spike is the latest run's or an earlier run's as its row is. It is a spike when at least ``min_history`` values precede
it and both ``x > median + k * 1.4826 * MAD`` (robust z-score above ``k``; MAD is the
median absolute deviation, 1.4826 * MAD estimates a standard deviation) and
``x > ratio * median`` and ``x > floor`` (an absolute floor, default 1e-6: a value that
converged to exactly 0 and then reads 1.5e-8 is rounding noise, not a spike). The value then joins the history, so a lasting change of level
stops being flagged once it is the median.

**Rank disagreement.** Rows that data-parallel ranks must agree on: ``weight_grad``
``reduced``, ``param`` (both scopes) and ``optimizer`` state. For each (step, tensor,
statistic) present on several ranks, values within ``rtol``/``atol`` of each other are
grouped; the largest group is the consensus (a tie goes to the group holding the lowest
rank) and every other rank is reported, on each step's latest rows. NaN equals NaN here. Sharded runs (FSDP, ZeRO,
tensor or pipeline parallelism) hold different shards or layers under the same names
on different ranks: turn the check off (``--no-rank-check``) or restrict it to ranks
that replicate each other (``--rank-groups``). Ranks are compared in chunks of at most
``CHUNK`` ranks, each including the group's lowest rank, to bound memory.
"""

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Hashable, List, Optional, Sequence, TextIO, Tuple

from .blocks import compare_window, rank_windows
from .localise import localise
from .order import OrderKey, order_key
from .reader import MONITORS, OPS, CsvFile, Layout, Problems, Row, StepRange, in_steps, scan, window_groups
from .report import (INF, MAD_SCALE, Collected, FirstN, RankCheckSettings, Report, RowVisitor, SpikeSettings,
                     files_to_read, finding, median, nonfinite_kind, rank_check_note, read_window, relabel)
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
    """Read every file of ``layout`` once, a window at a time (plus a second read of the
    rank-checked files when there are several ranks), and return the :class:`.report.Report`."""
    tally = _Tally({m: Collected() for m in layout.monitors}, FirstN(limit), FirstN(limit))
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
                    earlier_nonfinite=tally.earlier_nonfinite, earlier_nonfinite_count=tally.earlier_count,
                    earlier_spikes=tally.earlier_spike_items, earlier_spike_steps=tally.earlier_spike_steps,
                    run_windows=tally.run_windows, steps_repeated=tally.steps_repeated)
    relabel(report)
    localise(report, steps)
    return report


@dataclass
class _Tally:
    """What the first pass accumulates, over all ranks and monitors."""

    collected: Dict[str, Collected]
    spike_items: FirstN
    earlier_spike_items: FirstN
    rank_files: Dict[int, int] = field(default_factory=dict)
    rank_rows: Dict[int, int] = field(default_factory=dict)
    first_nonfinite: Dict[int, Tuple[OrderKey, Dict[str, Any]]] = field(default_factory=dict)
    nonfinite_by: Counter = field(default_factory=Counter)
    nonfinite_count: int = 0
    spike_steps: Counter = field(default_factory=Counter)
    earlier_spike_steps: Counter = field(default_factory=Counter)
    appended: List[Dict[str, Any]] = field(default_factory=list)
    earlier_nonfinite: Dict[int, Tuple[OrderKey, Dict[str, Any]]] = field(default_factory=dict)
    earlier_count: int = 0
    run_windows: List[Dict[str, Any]] = field(default_factory=list)
    steps_repeated: int = 0

    def nonfinite(self, rank: int, monitor: str, row: Row, path: str, kind: str, earlier: bool) -> None:
        """A non-finite row: the latest of its step, or an earlier run's."""
        if earlier:
            self.earlier_count += 1
            into = self.earlier_nonfinite
        else:
            self.nonfinite_count += 1
            self.nonfinite_by[(monitor, row.scope)] += 1
            into = self.first_nonfinite
        key = order_key(row.step, monitor, row.scope, row.micro, row.line, rank)
        best = into.get(rank)
        if best is None or key < best[0]:
            into[rank] = (key, finding(rank, monitor, row, path, kind=kind, values=dict(row.vals)))

    def spike(self, rank: int, monitor: str, row: Row, item: Dict[str, Any], earlier: bool) -> None:
        steps, items = (self.earlier_spike_steps, self.earlier_spike_items) if earlier else \
            (self.spike_steps, self.spike_items)
        steps[row.step] += 1
        items.add(order_key(row.step, monitor, row.scope, row.micro, row.line, rank), item)


class _Reading:
    """The first pass: in rank and monitor order, each window's files read, their runs told
    apart (:class:`.report.WindowRuns`), then its rows analysed in file and line order."""

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
        return sum(self.window(rank, monitor, group, col, detector) for group in window_groups(files))

    def window(self, rank: int, monitor: str, files: Sequence[CsvFile], col: Collected,
               detector: "SpikeDetector") -> int:
        """One window's rows (the latest of each step counted; the earlier runs' apart);
        returns the count of its latest rows."""
        col.files += len(files)
        # every row of the window, whatever --steps selects: which run wrote a step last
        # does not depend on the selection
        win, read = read_window(files, self.problems, on_header=lambda _fi, ops: merge_ops(col, ops))
        for _ in files:
            self.prog.advance(f"rank {rank} {monitor}")
        n_rows = n_earlier = 0
        for fi, seg, row in read:
            if self.steps is not None and not in_steps(row.step, self.steps):
                continue
            earlier = win.several and win.earlier(fi, seg, row.step)
            f = files[fi]
            collect_row(col, row, earlier)
            if earlier:
                n_earlier += 1
            else:
                n_rows += 1
            kind = nonfinite_kind(row.vals)
            if kind is not None:
                self.tally.nonfinite(rank, monitor, row, f.path, kind, earlier)
            elif detector.stats:
                # each run against its own history: a re-run is never compared with the run before it
                spiked = detector.check(rank, monitor, row, f.path, win.label(fi, seg))
                if spiked is not None:
                    self.tally.spike(rank, monitor, row, spiked, earlier)
            if not earlier:
                for visit in self.visitors:
                    visit(rank, monitor, row, f)
        for f, runs in zip(files, win.runs):
            if runs.restarts:
                self.tally.appended.append(runs.item(rank, monitor, f.path))
        item = win.item(rank, monitor, n_earlier)
        if item is not None:
            self.tally.run_windows.append(item)
        self.tally.steps_repeated += len(win.repeated)
        return n_rows


def merge_ops(col: Collected, ops: Tuple[str, ...]) -> None:
    """A file's header joins the statistics of its monitor (in the order of :data:`.reader.OPS`)."""
    if any(op not in col.ops for op in ops):
        col.ops[:] = [op for op in OPS if op in col.ops or op in ops]


def collect_row(col: Collected, row: Row, earlier: bool = False) -> None:
    """What a row adds to its monitor's collection: rows and scopes count each step's
    latest rows (an earlier run's row is counted apart); steps, tensors and micro-steps
    are those of every row."""
    col.steps.add(row.step)
    col.tensors.add((row.name, row.scope))
    if earlier:
        col.earlier_rows += 1
    else:
        col.rows += 1
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
        # view's row kept per data-parallel rank, else None; run: WindowRuns.label)
        self.history: Dict[Tuple[str, str, Optional[int], Hashable], Dict[str, Deque[float]]] = {}

    def check(self, rank: int, monitor: str, row: Row, path: str, run: Hashable) -> Optional[Dict[str, Any]]:
        """The row's finding when one of its statistics is a spike (None otherwise); every
        value then joins its history.

        Each run (:meth:`.report.WindowRuns.label`) has its own history, so that a re-run is
        never compared with the end of the run before it, whether it was appended to the
        same files or written beside them (nor do its repeated values shrink the MAD)."""
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
