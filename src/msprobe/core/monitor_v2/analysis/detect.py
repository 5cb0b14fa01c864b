"""One streaming pass over an output directory: what was collected, and the anomalies.

Three detectors:

**Non-finite values.** A row is non-finite when ``nans > 0``, or ``norm`` is NaN/Inf,
or ``min``/``max``/``mean`` is NaN/Inf. An empty tensor (``nan`` min/max/mean with
``norm`` 0) is not an anomaly. The first one in execution order (see :mod:`.order`)
over all ranks and monitors is *the* first non-finite value; the first one of each rank
is reported too.

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
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, TextIO, Tuple

from ..rows import CC, MODULE, OPTIMIZER, PARAM, REDUCED, WEIGHT_GRAD
from .order import OrderKey, order_key, where
from .reader import MONITORS, OPS, CsvFile, Layout, Problems, Row, StepRange, iter_rows
from .text import Progress

INF = float("inf")
MAD_SCALE = 1.4826
CHUNK = 16
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
    if monitor == WEIGHT_GRAD:
        return scope == REDUCED
    return monitor in (PARAM, OPTIMIZER)


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
    rows: int = 0
    steps: Set[int] = field(default_factory=set)
    tensors: Set[Tuple[str, str]] = field(default_factory=set)
    ops: List[str] = field(default_factory=list)
    scopes: Counter = field(default_factory=Counter)
    ranks: Set[int] = field(default_factory=set)
    micro_steps: Set[int] = field(default_factory=set)

    def to_json(self) -> Dict[str, Any]:
        steps = sorted(self.steps)
        return {
            "files": self.files, "rows": self.rows, "ranks": sorted(self.ranks),
            "steps": len(steps), "first_step": steps[0] if steps else None,
            "last_step": steps[-1] if steps else None,
            "tensors": len(self.tensors), "ops": self.ops, "scopes": dict(self.scopes),
            "micro_steps": sorted(self.micro_steps),
        }


def finding(rank: int, monitor: str, row: Row, path: str, **extra: Any) -> Dict[str, Any]:
    d = {
        "rank": rank, "step": row.step, "micro_step": row.micro, "monitor": monitor,
        "scope": row.scope, "tensor": row.name, "vpp_stage": row.vpp,
        "where": where(monitor, row.scope, row.micro), "file": path, "line": row.line,
    }
    d.update(extra)
    return d


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

    @property
    def first(self) -> Optional[Dict[str, Any]]:
        if not self.first_nonfinite:
            return None
        return min(self.first_nonfinite.values(), key=lambda kv: kv[0])[1]

    @property
    def anomalies_found(self) -> bool:
        return bool(self.nonfinite_count or self.spikes.count or self.mismatches)

    def mismatch_list(self) -> List[Dict[str, Any]]:
        out = []
        for rank in sorted(self.mismatches, key=lambda r: self.mismatches[r]["key"]):
            m = self.mismatches[rank]
            item = dict(m["first"])
            item["rows_differing"] = m["rows"]
            out.append(item)
        return out


RowVisitor = Callable[[int, str, Row, CsvFile], None]


def analyse(layout: Layout, problems: Problems, spikes: SpikeSettings, rank_check: RankCheckSettings,
            steps: Optional[StepRange] = None, limit: Optional[int] = 50,
            progress: Optional[bool] = None, visitors: Sequence[RowVisitor] = (),
            progress_stream: Optional[TextIO] = None) -> Report:
    """Stream every file of ``layout`` once (plus a second read of the rank-checked files
    when there are several ranks) and return the :class:`Report`."""
    collected: Dict[str, Collected] = {m: Collected() for m in layout.monitors}
    rank_files: Dict[int, int] = {}
    rank_rows: Dict[int, int] = {}
    first_nonfinite: Dict[int, Tuple[OrderKey, Dict[str, Any]]] = {}
    nonfinite_by: Counter = Counter()
    nonfinite_count = 0
    spike_items = FirstN(limit)
    spike_steps: Counter = Counter()
    do_rank_check = rank_check.enabled and len(layout.ranks) > 1
    checked_files = sum(len(layout.files_of(r, m)) for r in layout.ranks for m in RANK_CHECKED_MONITORS)
    total = layout.n_files + (checked_files if do_rank_check else 0)
    prog = Progress(total, "reading", enabled=progress, stream=progress_stream)
    window, min_hist, mad_k, ratio, floor = spikes.window, spikes.min_history, spikes.mad_k, spikes.ratio, spikes.floor
    appended: List[Dict[str, Any]] = []

    for rank in layout.ranks:
        n_rows = 0
        n_files = 0
        for monitor in MONITORS:
            files = layout.files_of(rank, monitor)
            if not files:
                continue
            col = collected[monitor]
            col.ranks.add(rank)
            spike_stats = spikes.stats if (spikes.enabled and monitor in spikes.monitors) else ()
            history: Dict[Tuple[str, str, int], Dict[str, deque]] = {}

            def on_header(ops: Tuple[str, ...], col: Collected = col) -> None:
                if any(op not in col.ops for op in ops):
                    col.ops[:] = [op for op in OPS if op in col.ops or op in ops]

            for f in files:
                runs = FileRuns()
                n_files += 1
                col.files += 1
                steps_seen = col.steps
                for row in iter_rows(f, problems, steps, on_header=on_header):
                    n_rows += 1
                    # first: the row's run (a re-run appended to the file) chooses its spike history
                    runs.add(row.step, row.line, row.name, row.scope, row.micro)
                    steps_seen.add(row.step)
                    col.tensors.add((row.name, row.scope))
                    col.scopes[row.scope] += 1
                    if row.micro is not None:
                        col.micro_steps.add(row.micro)
                    vals = row.vals
                    kind = nonfinite_kind(vals)
                    if kind is not None:
                        nonfinite_count += 1
                        nonfinite_by[(monitor, row.scope)] += 1
                        key = order_key(row.step, monitor, row.scope, row.micro, row.line, rank)
                        best = first_nonfinite.get(rank)
                        if best is None or key < best[0]:
                            first_nonfinite[rank] = (key, finding(
                                rank, monitor, row, f.path, kind=kind, values=dict(vals)))
                    elif spike_stats:
                        # The k-th run of every file is the k-th run of the script: each run
                        # has its own history, so that a re-run is never compared with the
                        # end of the run before it (nor do its repeated values shrink the MAD).
                        hkey = (row.name, row.scope, runs.seg)
                        hist = history.get(hkey)
                        if hist is None:
                            hist = history[hkey] = {}
                        spiked = None
                        for stat in spike_stats:
                            v = vals.get(stat)
                            if v is None:
                                continue
                            x = abs(v)
                            label = stat
                            if stat == "max" and "min" in vals:  # largest magnitude, sign-free
                                label = "absmax"
                                m = abs(vals["min"])
                                if m > x:
                                    x = m
                            h = hist.get(stat)
                            if h is None:
                                h = hist[stat] = deque(maxlen=window)
                            if len(h) >= min_hist and x > floor and x > ratio * min(h):
                                s = sorted(h)
                                med = _median(s)
                                if x > ratio * med:
                                    mad = _median(sorted(abs(y - med) for y in s))
                                    if x > med + mad_k * MAD_SCALE * mad:
                                        if spiked is None:
                                            spiked = finding(rank, monitor, row, f.path, stat=label, value=x,
                                                             median=med, mad=mad,
                                                             ratio=(x / med) if med > 0 else INF, stats=[label])
                                        else:
                                            spiked["stats"].append(label)
                            h.append(x)
                        if spiked is not None:
                            spike_steps[row.step] += 1
                            spike_items.add(order_key(row.step, monitor, row.scope, row.micro, row.line, rank),
                                            spiked)
                    col.rows += 1
                    for visit in visitors:
                        visit(rank, monitor, row, f)
                if runs.restarts:
                    appended.append(runs.item(rank, monitor, f.path))
                prog.advance(f"rank {rank} {monitor}")
        rank_files[rank] = n_files
        rank_rows[rank] = n_rows

    mismatches: Dict[int, Dict[str, Any]] = {}
    note = ""
    if not rank_check.enabled:
        note = "off (--no-rank-check)"
    elif len(layout.ranks) < 2:
        note = "not applicable (one rank)"
    else:
        mismatches = check_ranks(layout, problems, rank_check, steps, prog)
    prog.close()
    report = Report(layout, collected, rank_files, rank_rows, first_nonfinite, nonfinite_count, nonfinite_by,
                    spike_items, spike_steps, spikes, mismatches, rank_check, note, problems, appended)
    relabel(report)
    return report


def relabel(report: "Report") -> None:
    """Say what a gradient row's micro_step means, now that the whole output is known:
    a micro-batch's own gradient when the run wrote one row per micro-batch (several
    micro_step values), else the number of micro-batches accumulated (see
    :func:`.order.where`)."""
    wg = report.collected.get(WEIGHT_GRAD)
    per_micro = wg is not None and len(wg.micro_steps) > 1
    items = [v[1] for v in report.first_nonfinite.values()] + report.spikes.items() + \
        [m["first"] for m in report.mismatches.values()]
    for item in items:
        if item is not None and item.get("monitor") == WEIGHT_GRAD:
            item["where"] = where(item["monitor"], item["scope"], item["micro_step"], per_micro)


class FileRuns:
    """Steps of one file that were written more than once. A run appended to the file
    of an earlier one (a script re-run with the same output_dir) starts over: at a lower
    step, or, in a file of one step, at the row the file's current run began with (same
    step, tensor, scope and micro_step)."""

    __slots__ = ("last", "seg", "restarts", "first_seg", "repeated", "head")

    def __init__(self) -> None:
        self.last: Optional[int] = None
        self.head: Optional[Tuple[int, str, str, Optional[int]]] = None  # first row of the current run
        self.seg = 0
        self.restarts: List[int] = []  # line where each appended run starts
        self.first_seg: Dict[int, int] = {}
        self.repeated: Set[int] = set()

    def add(self, step: int, line: int, name: str, scope: str, micro: Optional[int]) -> None:
        key = (step, name, scope, micro)
        if self.last is None:
            self.head = key
        elif step < self.last or key == self.head:
            self.seg += 1
            self.restarts.append(line)
            self.head = key
        self.last = step
        if self.first_seg.setdefault(step, self.seg) != self.seg:
            self.repeated.add(step)

    def item(self, rank: int, monitor: str, path: str) -> Dict[str, Any]:
        return appended_item(rank, monitor, path, self.restarts, sorted(self.repeated))


def appended_item(rank: int, monitor: str, path: str, restarts: List[int], repeated: List[int]) -> Dict[str, Any]:
    return {"rank": rank, "monitor": monitor, "file": path, "runs": len(restarts) + 1, "restart_lines": restarts,
            "steps_repeated": repeated, "line": restarts[0]}


def _median(s: List[float]) -> float:
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


# ------------------------------------------------------------------ rank agreement
Block = Tuple[int, Dict[Tuple[str, str, Optional[int]], Row]]


def step_blocks(f: CsvFile, problems: Problems, steps: Optional[StepRange],
                keep: Callable[[str, str], bool], quiet: bool = True) -> Iterator[Block]:
    """Consecutive rows of the same step, as ``(step, {(name, scope, micro): row})``.
    Rows ``keep(monitor, scope)`` rejects are dropped. ``quiet``: problems of this
    second read were already reported by the first one."""
    sink = _QuietProblems(problems) if quiet else problems
    current: Optional[int] = None
    block: Dict[Tuple[str, str, Optional[int]], Row] = {}
    if f.path.endswith(".parquet"):  # an exported dataset (see .columnar)
        from .columnar import parquet_rows

        rows: Iterator[Row] = parquet_rows(f, steps)
    else:
        rows = iter_rows(f, sink, steps)
    for row in rows:
        if not keep(f.monitor, row.scope):
            continue
        if row.step != current:
            if current is not None:
                yield current, block
            current, block = row.step, {}
        block[(row.name, row.scope, row.micro)] = row
    if current is not None:
        yield current, block


class _QuietProblems(Problems):
    """Problems of a second read: already reported by the first one (or fatal in strict
    mode, where the first read already stopped)."""

    def __init__(self, parent: Problems) -> None:
        super().__init__(strict=False)

    def report(self, path: str, line: Optional[int], message: str, skipped: str = "line") -> None:
        return None


def merge_steps(iters: Dict[Any, Iterator[Block]]) -> Iterator[Tuple[int, Dict[Any, Dict]]]:
    """Lockstep over several block streams: yields ``(step, {id: block})`` for the
    smallest pending step (streams in step order; a stream whose steps go back, as in a
    resumed run appended to its files, is simply merged again from there)."""
    heads: Dict[Any, Block] = {}
    for k, it in iters.items():
        b = next(it, None)
        if b is not None:
            heads[k] = b
    while heads:
        step = min(b[0] for b in heads.values())
        ready = {k: b[1] for k, b in heads.items() if b[0] == step}
        yield step, ready
        for k in ready:
            b = next(iters[k], None)
            if b is None:
                del heads[k]
            else:
                heads[k] = b


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    if a == b:
        return True
    if a != a or b != b:
        return a != a and b != b
    return abs(a - b) <= atol + rtol * max(abs(a), abs(b))


def consensus(values: List[Tuple[int, float]], rtol: float, atol: float) -> Tuple[List[int], float, List[int]]:
    """``(outlier ranks, consensus value, consensus ranks)`` for ``[(rank, value)]``."""
    r0, v0 = values[0]
    if all(_close(v, v0, 0.0, 0.0) for _, v in values):
        return [], v0, [r for r, _ in values]
    nan_group = [(r, v) for r, v in values if v != v]
    rest = sorted(((v, r) for r, v in values if v == v))
    groups: List[List[Tuple[int, float]]] = []
    for v, r in rest:
        if groups and _close(groups[-1][-1][1], v, rtol, atol):
            groups[-1].append((r, v))
        else:
            groups.append([(r, v)])
    if nan_group:
        groups.append(nan_group)
    lowest = min(r for r, _ in values)
    best = max(groups, key=lambda g: (len(g), any(r == lowest for r, _ in g)))
    agree = sorted(r for r, _ in best)
    ref = min(best)[1]
    return sorted(r for r, _ in values if r not in set(agree)), ref, agree


def check_ranks(layout: Layout, problems: Problems, settings: RankCheckSettings,
                steps: Optional[StepRange], prog: Progress) -> Dict[int, Dict[str, Any]]:
    groups = settings.groups or [layout.ranks]
    result: Dict[int, Dict[str, Any]] = {}
    for group in groups:
        ranks = [r for r in group if r in layout.files]
        if len(ranks) < 2:
            continue
        anchor, others = ranks[0], ranks[1:]
        for i in range(0, len(others), CHUNK - 1):
            chunk = [anchor] + others[i:i + CHUNK - 1]
            for monitor in RANK_CHECKED_MONITORS:
                windows = sorted({(f.first, f.last) for r in chunk for f in layout.files_of(r, monitor)})
                for window in windows:
                    files = {r: f for r in chunk for f in layout.files_of(r, monitor)
                             if (f.first, f.last) == window}
                    for r in files:
                        if r != anchor or i == 0:
                            prog.advance(f"rank agreement, {monitor}")
                    if len(files) < 2:
                        continue
                    iters = {r: step_blocks(f, problems, steps, row_is_checked) for r, f in files.items()}
                    for step, blocks in merge_steps(iters):
                        if len(blocks) < 2:
                            continue
                        _compare_step(monitor, blocks, files, settings, result)
    return result


def _compare_step(monitor: str, blocks: Dict[int, Dict], files: Dict[int, CsvFile],
                  settings: RankCheckSettings, result: Dict[int, Dict[str, Any]]) -> None:
    ranks = sorted(blocks)
    keys: Dict[Tuple[str, str, Optional[int]], None] = {}
    for r in ranks:
        for k in blocks[r]:
            keys.setdefault(k, None)
    for key in keys:
        rows = [(r, blocks[r][key]) for r in ranks if key in blocks[r]]
        if len(rows) < 2:
            continue
        differing: Dict[int, Tuple[str, float, float, List[int]]] = {}
        ops = [op for op in rows[0][1].vals if all(op in row.vals for _, row in rows)]
        for op in ops:
            values = [(r, float(row.vals[op])) for r, row in rows]
            outliers, ref, agree = consensus(values, settings.rtol, settings.atol)
            for r in outliers:
                if r not in differing:
                    differing[r] = (op, dict(values)[r], ref, agree)
        for r, (op, value, ref, agree) in differing.items():
            row = blocks[r][key]
            okey = order_key(row.step, monitor, row.scope, row.micro, row.line, r)
            entry = result.get(r)
            if entry is None:
                entry = result[r] = {"key": okey, "first": None, "rows": 0}
            entry["rows"] += 1
            if entry["first"] is None or okey <= entry["key"]:
                entry["key"] = okey
                entry["first"] = finding(r, monitor, row, files[r].path, stat=op, value=value,
                                         consensus=ref, consensus_ranks=agree)
