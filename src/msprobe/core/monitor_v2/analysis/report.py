"""The report model: what ``summary``, ``anomalies`` and ``plot`` are computed from.

An analysis engine (:class:`AnalysisEngine`: the reference one in :mod:`.reference`,
the columnar one in :mod:`.engine`) opens an output directory as a
:class:`.reader.Layout` and turns it into a :class:`Report`; :mod:`.render` writes
the report as text, JSON or HTML tables. The settings of the detectors, the few
numbers of their rules that both engines must share to give identical findings, and
what a run is where several runs wrote into one output_dir (:class:`WindowRuns`: each
step's latest rows, the earlier runs' apart), live here too.
"""

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Protocol, Sequence, Set, TextIO, Tuple

from ..rows import CC, MODULE, OPTIMIZER, PARAM, REDUCED, WEIGHT_GRAD
from .order import OrderKey, where
from .reader import CsvFile, Layout, Problems, Row, StepRange, in_steps, iter_rows
from .runs import FileMeta, RunLabel, names_settle, segment_order  # noqa: F401 - used here and re-exported

INF = float("inf")
MAD_SCALE = 1.4826  # 1.4826 * MAD estimates a standard deviation
CHUNK = 16  # ranks compared at once by the rank check (each chunk holds the group's lowest rank)
RANK_CHECKED_MONITORS = (WEIGHT_GRAD, PARAM, OPTIMIZER)


@dataclass
class SpikeSettings:
    enabled: bool = True
    stats: Tuple[str, ...] = ("norm", "max")
    monitors: Tuple[str, ...] = (MODULE, WEIGHT_GRAD, PARAM, CC)
    window: int = 20
    min_history: int = 10
    mad_k: float = 10.0
    ratio: float = 5.0
    floor: float = 1e-6

    def describe(self) -> str:
        names = ", ".join("absmax = max(|min|,|max|)" if s == "max" else f"|{s}|" for s in self.stats)
        return (f"{names} of {', '.join(self.monitors)} rows: a spike when > median + {self.mad_k:g} * 1.4826 * MAD "
                f"and > {self.ratio:g} x median of the tensor's previous {self.window} values on its rank and > "
                f"{self.floor:g} (absolute floor); the first "
                f"{self.min_history} values of each tensor are never flagged")


@dataclass
class RankCheckSettings:
    enabled: bool = True
    groups: Optional[List[List[int]]] = None
    rtol: float = 1e-5
    atol: float = 0.0

    def describe(self) -> str:
        return ("weight_grad reduced, param and optimizer rows compared across ranks "
                f"(|a-b| <= {self.atol:g} + {self.rtol:g} * max(|a|,|b|))")


def row_is_checked(monitor: str, scope: str) -> bool:
    """Whether the rank check compares rows of ``monitor`` and ``scope``."""
    if monitor == WEIGHT_GRAD:
        return scope == REDUCED
    return monitor in (PARAM, OPTIMIZER)


def median(s: List[float]) -> float:
    """The median of the sorted list ``s`` (the spike rule's, in both engines)."""
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


def nonfinite_kind(vals: Dict[str, float]) -> Optional[str]:
    """``"nan"``, ``"inf"`` or None (finite, or an empty tensor)."""
    nans = vals.get("nans")
    if nans is not None and nans > 0:
        return "nan"
    norm = vals.get("norm")
    empty = norm is not None and norm == 0.0
    kind = None
    for op in ("norm", "min", "max", "mean"):
        v = vals.get(op)
        if v is None:
            continue
        if v != v:
            if empty:
                continue
            return "nan"
        if v == INF or v == -INF:
            kind = "inf"
    return kind


@dataclass
class Collected:
    """What one monitor wrote (all ranks)."""

    files: int = 0
    rows: int = 0  # each step's latest rows (see WindowRuns)
    earlier_rows: int = 0  # rows of steps that a later run wrote again
    steps: Set[int] = field(default_factory=set)
    tensors: Set[Tuple[str, str]] = field(default_factory=set)
    ops: List[str] = field(default_factory=list)
    scopes: Counter = field(default_factory=Counter)
    ranks: Set[int] = field(default_factory=set)
    micro_steps: Set[int] = field(default_factory=set)

    def to_json(self) -> Dict[str, Any]:
        steps = sorted(self.steps)
        return {
            "files": self.files, "rows": self.rows, "earlier_rows": self.earlier_rows, "ranks": sorted(self.ranks),
            "steps": len(steps), "first_step": steps[0] if steps else None,
            "last_step": steps[-1] if steps else None,
            "tensors": len(self.tensors), "ops": self.ops, "scopes": dict(self.scopes),
            "micro_steps": sorted(self.micro_steps),
        }


def finding(rank: int, monitor: str, row: Row, path: str, **extra: Any) -> Dict[str, Any]:
    """One anomaly of a report: where it is, plus ``extra`` (what was found)."""
    d = {
        "rank": rank, "step": row.step, "micro_step": row.micro, "monitor": monitor,
        "scope": row.scope, "tensor": row.name, "vpp_stage": row.vpp,
        "where": where(monitor, row.scope, row.micro), "file": path, "line": row.line,
    }
    if row.dp is not None:  # a merged view's row kept per data-parallel rank
        d["dp_rank"] = row.dp
    d.update(extra)
    return d


def appended_item(rank: int, monitor: str, path: str, restarts: List[int], repeated: List[int]) -> Dict[str, Any]:
    """A file that holds several runs: ``restarts``, the line where each appended run starts."""
    return {"rank": rank, "monitor": monitor, "file": path, "runs": len(restarts) + 1, "restart_lines": restarts,
            "steps_repeated": repeated, "line": restarts[0]}


def runs_item(rank: int, monitor: str, paths: List[str], runs: int, repeated: List[int], earlier: int,
              by_time: bool) -> Dict[str, Any]:
    """A window whose rows lie in several files (its plain file and ``.run<k>`` files):
    ``runs``, the runs in them all; ``earlier``, the rows of its steps that a later run wrote
    again; ``by_time``: their files' modification times said which run is the latest."""
    return {"rank": rank, "monitor": monitor, "files": paths, "runs": runs, "steps_repeated": repeated,
            "earlier_rows": earlier, "order": "modification times" if by_time else "names"}


class FileRuns:
    """Steps of one file that were written more than once. A run appended to the file
    of an earlier one (a script re-run with the same output_dir) starts over: at a lower
    step, or, in a file of one step, at the row the file's current run began with (same
    step, tensor, scope and micro_step). Each run of the file is a *segment* of it."""

    __slots__ = ("last", "seg", "restarts", "first_seg", "repeated", "head")

    def __init__(self) -> None:
        self.last: Optional[int] = None
        self.head: Optional[Tuple[int, str, str, Optional[int], Optional[int]]] = None  # first row of the run
        self.seg = 0
        self.restarts: List[int] = []  # line where each appended run starts
        self.first_seg: Dict[int, int] = {}  # step -> the first run of the file that wrote it
        self.repeated: Set[int] = set()

    def add(self, step: int, line: int, name: str, scope: str, micro: Optional[int],
            dp: Optional[int] = None) -> None:
        key = (step, name, scope, micro, dp)
        if self.last is None:
            self.head = key
        elif step < self.last or key == self.head:
            self.seg += 1
            self.restarts.append(line)
            self.head = key
        self.last = step
        if self.first_seg.setdefault(step, self.seg) != self.seg:
            self.repeated.add(step)

    @property
    def segments(self) -> int:
        """The runs the file holds (0 for a file without a readable row)."""
        return 0 if self.last is None else self.seg + 1

    def item(self, rank: int, monitor: str, path: str) -> Dict[str, Any]:
        return appended_item(rank, monitor, path, self.restarts, sorted(self.repeated))


# ------------------------------------------------------------------ runs of a window


class WindowRuns:
    """The runs of one window of one (rank, monitor): its files (:func:`.reader.window_groups`)
    cut into runs (a file's segments, :class:`FileRuns`) and put in the order they were
    written (:func:`segment_order`). A step's **latest** rows are those of the latest run
    that wrote it; its rows of other runs are **earlier runs'** rows: a run resumed from a
    checkpoint, or re-run, into the same output_dir wrote the step again (in the same file,
    or beside it in a ``.run<k>`` file). Both engines decide this the same way.

    Use: :meth:`add` each row of each file in order (``ops`` set from the file's header),
    then :meth:`finish`, then :meth:`earlier` and :meth:`label`."""

    def __init__(self, files: Sequence[CsvFile]) -> None:
        self.files = list(files)
        self.runs = [FileRuns() for _ in self.files]
        self.ops: List[Tuple[str, ...]] = [() for _ in self.files]
        self._written: Dict[int, Set[Tuple[int, int]]] = {}  # step -> the (file, segment) that wrote it
        self._pos: Dict[Tuple[int, int], int] = {}
        self._latest: Dict[int, int] = {}  # step -> the place of the latest run that wrote it
        self.by_time = False
        self.repeated: List[int] = []

    def add(self, fi: int, row: Row) -> int:
        """The row's segment in its file (``fi``: the file's index in the window)."""
        runs = self.runs[fi]
        runs.add(row.step, row.line, row.name, row.scope, row.micro, row.dp)
        self._written.setdefault(row.step, set()).add((fi, runs.seg))
        return runs.seg

    def metas(self) -> List[FileMeta]:
        return [FileMeta(f.first, f.last, f.run, self.ops[i], self.runs[i].segments, f.mtime_ns)
                for i, f in enumerate(self.files)]

    def finish(self) -> None:
        order, self.by_time = segment_order(self.metas())
        self._pos = {key: p for p, key in enumerate(order)}
        self._latest = {step: max(self._pos[k] for k in keys) for step, keys in self._written.items()}
        self.repeated = sorted(step for step, keys in self._written.items() if len(keys) > 1)

    def earlier(self, fi: int, seg: int, step: int) -> bool:
        """Whether the row of segment ``seg`` of file ``fi`` at ``step`` is an earlier run's."""
        return self._pos[(fi, seg)] < self._latest[step]

    def label(self, fi: int, seg: int) -> RunLabel:
        """Which run a row belongs to, for a history of its own (spikes): the file's run
        series, its statistics and the segment. A run keeps its series and statistics from
        window to window (the writer keeps a monitor's series once it moved it), so its
        label is the same in every window; runs of other settings or series never share one."""
        return self.files[fi].run, self.ops[fi], seg

    @property
    def several(self) -> bool:
        """Whether the window holds more than one run."""
        return len(self._pos) > 1

    def item(self, rank: int, monitor: str, earlier: int) -> Optional[Dict[str, Any]]:
        """The report's item of a window whose rows lie in several files (None otherwise)."""
        if sum(1 for r in self.runs if r.segments) < 2:
            return None
        return runs_item(rank, monitor, [f.path for f, r in zip(self.files, self.runs) if r.segments],
                         len(self._pos), self.repeated, earlier, self.by_time)


def read_window(files: Sequence[CsvFile], problems: Problems, keep: Optional[Callable[[Row], bool]] = None,
                on_header: Optional[Callable[[int, Tuple[str, ...]], None]] = None,
                ) -> Tuple[WindowRuns, List[Tuple[int, int, Row]]]:
    """Every row of a window's files read, its runs told apart: ``(runs, [(file index,
    segment, row)])`` of the rows ``keep`` accepts (all by default), in file and line order.
    Holds those rows of one window in memory. ``on_header(file index, ops)`` for each good
    header."""
    win = WindowRuns(files)
    out: List[Tuple[int, int, Row]] = []
    for fi, f in enumerate(files):
        def header(ops: Tuple[str, ...], fi: int = fi) -> None:
            win.ops[fi] = ops
            if on_header is not None:
                on_header(fi, ops)

        if f.path.endswith(".parquet"):  # an exported dataset (see .columnar)
            from .columnar import parquet_rows

            rows: Iterable[Row] = parquet_rows(f, None)
        else:
            rows = iter_rows(f, problems, None, on_header=header)
        for row in rows:
            seg = win.add(fi, row)
            if keep is None or keep(row):
                out.append((fi, seg, row))
    win.finish()
    return win, out


def latest_rows(files: Sequence[CsvFile], problems: Problems, steps: Optional[StepRange] = None,
                keep: Optional[Callable[[Row], bool]] = None) -> List[Tuple[CsvFile, Row]]:
    """The latest rows of a window (:class:`WindowRuns`) within ``steps``, with their file,
    in step order (a step's rows in their file's order)."""
    win, read = read_window(files, problems, lambda row: in_steps(row.step, steps) and (keep is None or keep(row)))
    out = [(files[fi], row) for fi, seg, row in read if not win.earlier(fi, seg, row.step)]
    out.sort(key=lambda t: t[1].step)  # stable: a step's rows stay in their order
    return out


class FirstN:
    """The ``n`` smallest items by key (all of them when ``n`` is None), plus a count."""

    def __init__(self, n: Optional[int]) -> None:
        self.n = n
        self.count = 0
        self._items: List[Tuple[Any, int, Dict[str, Any]]] = []

    def add(self, key: Any, item: Dict[str, Any]) -> None:
        self.count += 1
        self._items.append((key, self.count, item))
        if self.n is not None and len(self._items) > 4 * self.n + 64:
            self._trim()

    def _trim(self) -> None:
        self._items.sort(key=lambda t: (t[0], t[1]))
        if self.n is not None:
            del self._items[self.n:]

    def items(self) -> List[Dict[str, Any]]:
        self._trim()
        return [t[2] for t in self._items]


@dataclass
class Report:
    layout: Layout
    collected: Dict[str, Collected]
    rank_files: Dict[int, int]
    rank_rows: Dict[int, int]
    first_nonfinite: Dict[int, Tuple[OrderKey, Dict[str, Any]]]
    nonfinite_count: int
    nonfinite_by: Counter
    spikes: FirstN
    spike_steps: Counter
    spike_settings: SpikeSettings
    mismatches: Dict[int, Dict[str, Any]]
    mismatch_settings: RankCheckSettings
    rank_check_note: str
    problems: Problems
    appended: List[Dict[str, Any]] = field(default_factory=list)
    # Rows that a later run wrote again (a run resumed, or re-run, into the same output_dir
    # wrote their step once more, in the same file or beside it in a .run<k> file, see
    # WindowRuns): the earlier runs'. ``first_nonfinite``, ``nonfinite_count``, ``spikes``
    # and the rank check hold the latest rows of each step (what the latest run left); these,
    # the earlier runs' rows, apart.
    earlier_nonfinite: Dict[int, Tuple[OrderKey, Dict[str, Any]]] = field(default_factory=dict)
    earlier_nonfinite_count: int = 0
    earlier_spikes: FirstN = field(default_factory=lambda: FirstN(None))
    earlier_spike_steps: Counter = field(default_factory=Counter)
    # windows whose rows lie in several files (runs_item), and the steps written by more than
    # one run (in all windows, one file or several)
    run_windows: List[Dict[str, Any]] = field(default_factory=list)
    steps_repeated: int = 0
    # filled by .localise.localise after the pass (the same code for both engines)
    localisation: Dict[int, Dict[str, Any]] = field(default_factory=dict)
    alerts: Dict[int, Dict[str, Any]] = field(default_factory=dict)
    dumps: List[Dict[str, Any]] = field(default_factory=list)
    # MoE findings (analysis/moe.py; the same for both engines): None where the output has no
    # moe or expert_norms rows
    moe: Optional[List[Dict[str, Any]]] = None
    moe_settings: Any = None
    # per-expert gradient rows grouped by expert index (analysis/moe.py expert_spread): None
    # where there are none
    experts: Optional[List[Dict[str, Any]]] = None

    @property
    def first(self) -> Optional[Dict[str, Any]]:
        if not self.first_nonfinite:
            return None
        return min(self.first_nonfinite.values(), key=lambda kv: kv[0])[1]

    @property
    def earlier_first(self) -> Optional[Dict[str, Any]]:
        """The first non-finite value among the rows that a later run wrote again."""
        if not self.earlier_nonfinite:
            return None
        return min(self.earlier_nonfinite.values(), key=lambda kv: kv[0])[1]

    @property
    def anomalies_found(self) -> bool:
        # a merged view: the replicas merge found disagreeing are anomalies too (merge.json)
        merged_disagreements = (self.layout.merged or {}).get("disagreements") or 0
        return bool(self.nonfinite_count or self.earlier_nonfinite_count or self.spikes.count
                    or self.earlier_spikes.count or self.mismatches or merged_disagreements or self.moe)

    @property
    def earlier_rows(self) -> int:
        """Rows of earlier runs, set aside (every monitor and rank)."""
        return sum(c.earlier_rows for c in self.collected.values())

    def mismatch_list(self) -> List[Dict[str, Any]]:
        out = []
        for rank in sorted(self.mismatches, key=lambda r: self.mismatches[r]["key"]):
            m = self.mismatches[rank]
            item = dict(m["first"])
            item["rows_differing"] = m["rows"]
            out.append(item)
        return out


def rank_check_note(settings: RankCheckSettings, layout: Layout) -> str:
    """Why the rank check did not run (empty when it did)."""
    if layout.merged is not None:  # one pseudo-rank: merge compared the replicas
        n = layout.merged.get("disagreements") or 0
        return (f"replicas compared by merge: {n} disagreement(s)"
                + (f", listed in {os.path.join(layout.root, 'disagreements.csv')}" if n else ""))
    if not settings.enabled:
        return "off (--no-rank-check)"
    if len(layout.ranks) < 2:
        return "not applicable (one rank)"
    return ""


def files_to_read(layout: Layout, rank_check: RankCheckSettings) -> int:
    """Files an analysis reads, for its progress: all of them, plus the rank-checked ones
    a second time when the rank check runs."""
    if not (rank_check.enabled and len(layout.ranks) > 1):
        return layout.n_files
    return layout.n_files + sum(len(layout.files_of(r, m)) for r in layout.ranks for m in RANK_CHECKED_MONITORS)


def relabel(report: Report) -> None:
    """Say what a gradient row's micro_step means, now that the whole output is known:
    a micro-batch's own gradient when the run wrote one row per micro-batch (several
    micro_step values), else the number of micro-batches accumulated (see
    :func:`.order.where`)."""
    wg = report.collected.get(WEIGHT_GRAD)
    per_micro = wg is not None and len(wg.micro_steps) > 1
    items = [v[1] for v in report.first_nonfinite.values()] + [v[1] for v in report.earlier_nonfinite.values()] + \
        report.spikes.items() + report.earlier_spikes.items() + [m["first"] for m in report.mismatches.values()]
    for item in items:
        if item is not None and item.get("monitor") == WEIGHT_GRAD:
            item["where"] = where(item["monitor"], item["scope"], item["micro_step"], per_micro)


RowVisitor = Callable[[int, str, Row, CsvFile], None]


class AnalysisEngine(Protocol):
    """What the commands ask of an engine: open an output directory (CSV, or an
    exported Parquet dataset where the engine reads one) and analyse it."""

    def open_layout(self, root: str, ranks: Optional[Sequence[int]] = None,
                    monitors: Optional[Sequence[str]] = None, steps: Optional[StepRange] = None) -> Layout:
        ...

    def analyse(self, layout: Layout, problems: Problems, spikes: SpikeSettings, rank_check: RankCheckSettings,
                steps: Optional[StepRange] = None, limit: Optional[int] = 50,
                progress: Optional[bool] = None, visitors: Sequence[RowVisitor] = (),
                progress_stream: Optional[TextIO] = None) -> Report:
        ...
