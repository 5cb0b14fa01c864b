"""Comparing two output directories (two runs) row by row.

Rows are matched by (rank, monitor, step, tensor name, scope, micro_step). For each
statistic present in both, two values differ when
``|a - b| > atol + rtol * max(|a|, |b|)``; NaN equals NaN, Inf equals an Inf of the same
sign. Both runs are streamed in step order, one step of one (rank, monitor) at a time.
The *first* difference is the smallest in execution order (see :mod:`.order`) over all
ranks and monitors; the *largest* differences are ranked by relative difference, one
entry per tensor (its worst step).
"""

from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, TextIO, Tuple

from .blocks import Block, latest_blocks, merge_steps
from ..rows import WEIGHT_GRAD
from .order import OrderKey, order_key, where
from .reader import MONITORS, CsvFile, InputError, Layout, Problems, Row, StepRange, window_groups
from .text import Progress

INF = float("inf")


@dataclass
class DiffSettings:
    rtol: float = 1e-5
    atol: float = 0.0
    stats: Optional[Tuple[str, ...]] = None  # None: every statistic both runs have
    top: int = 20


@dataclass
class MonitorDiff:
    compared_rows: int = 0
    differing_rows: int = 0
    first_step: Optional[int] = None
    only_a: int = 0
    only_b: int = 0

    def to_json(self) -> Dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class DiffReport:
    a: Layout
    b: Layout
    settings: DiffSettings
    per_monitor: Dict[str, MonitorDiff] = field(default_factory=dict)
    first: Optional[Dict[str, Any]] = None
    first_key: Optional[OrderKey] = None
    first_only: Optional[Dict[str, Any]] = None
    first_only_key: Optional[OrderKey] = None
    largest: Dict[Tuple, Tuple[float, float, OrderKey, Dict[str, Any]]] = field(default_factory=dict)
    not_compared: List[str] = field(default_factory=list)
    micro_steps: set = field(default_factory=set)  # weight_grad micro_step values met (see order.where)

    @property
    def compared_rows(self) -> int:
        return sum(m.compared_rows for m in self.per_monitor.values())

    @property
    def differing_rows(self) -> int:
        return sum(m.differing_rows for m in self.per_monitor.values())

    @property
    def only_rows(self) -> Tuple[int, int]:
        return (sum(m.only_a for m in self.per_monitor.values()), sum(m.only_b for m in self.per_monitor.values()))

    @property
    def differs(self) -> bool:
        """Values beyond the tolerance, or rows, monitors or ranks present in one run only."""
        return bool(self.differing_rows or sum(self.only_rows) or self.not_compared)

    def top(self) -> List[Dict[str, Any]]:
        """Largest relative difference first; ties (e.g. NaN against a number) in execution order."""
        items = sorted(self.largest.values(), key=lambda t: (-t[0], -t[1], t[2]))
        return [t[3] for t in items[: self.settings.top]]


def _sortable(x: float) -> float:
    return INF if x != x else x


def value_diff(a: float, b: float) -> Tuple[float, float]:
    """``(absolute, relative)`` difference; NaN against a number, or Infs of different
    signs, count as infinitely different."""
    if a != a or b != b:
        return (0.0, 0.0) if (a != a and b != b) else (INF, INF)
    if a == b:
        return 0.0, 0.0
    d = abs(a - b)
    if d != d or d == INF:
        return INF, INF
    scale = max(abs(a), abs(b))
    return d, (d / scale if scale > 0 else INF)


def _chain(files: Sequence[CsvFile], problems: Problems, steps: Optional[StepRange], prog: Progress) -> Iterator[Block]:
    """A run's blocks of one rank and monitor, a file window at a time: each step's latest
    rows (:class:`.report.WindowRuns`: a step that several runs wrote into the same
    output_dir is compared as its latest run left it)."""
    for window in window_groups(files):
        for step, (_path, block) in latest_blocks(window, problems, steps):
            yield step, block
        for f in window:
            prog.advance(f"rank {f.rank} {f.monitor}")


def diff_runs(a: Layout, b: Layout, problems: Problems, settings: DiffSettings,
              steps: Optional[StepRange] = None, progress: Optional[bool] = None,
              progress_stream: Optional[TextIO] = None) -> DiffReport:
    if (a.merged is None) != (b.merged is None):
        merged, other = (a, b) if a.merged is not None else (b, a)
        raise InputError(f"{merged.root} is a merged view (merge.json) and {other.root} is not: their rows do not "
                         f"line up (global names, whole tensors); merge the other run too "
                         f"(msprobe-monitor merge {other.root} DEST) and compare the two merged views")
    report = DiffReport(a, b, settings)
    ranks = [r for r in a.ranks if r in b.files]
    for r in a.ranks:
        if r not in b.files:
            report.not_compared.append(f"rank {r} only in A")
    for r in b.ranks:
        if r not in a.files:
            report.not_compared.append(f"rank {r} only in B")
    pairs = []
    for r in ranks:
        for m in MONITORS:
            fa, fb = a.files_of(r, m), b.files_of(r, m)
            if fa and fb:
                pairs.append((r, m, fa, fb))
            elif fa or fb:
                report.not_compared.append(f"rank {r} {m} only in {'A' if fa else 'B'}")
    total = sum(len(fa) + len(fb) for _, _, fa, fb in pairs)
    prog = Progress(total, "comparing", enabled=progress, stream=progress_stream)
    for rank, monitor, fa, fb in pairs:
        md = report.per_monitor.setdefault(monitor, MonitorDiff())
        streams = {"a": _chain(fa, problems, steps, prog), "b": _chain(fb, problems, steps, prog)}
        for step, blocks in merge_steps(streams):
            ba, bb = blocks.get("a", {}), blocks.get("b", {})
            if monitor == WEIGHT_GRAD:
                report.micro_steps.update(k[2] for k in ba)
            for key, ra in ba.items():
                rb = bb.get(key)
                if rb is None:
                    md.only_a += 1
                    _note_only(report, rank, monitor, ra, "A", fa)
                    continue
                md.compared_rows += 1
                _compare_rows(report, md, rank, monitor, ra, rb, fa, fb)
            for key, rb in bb.items():
                if key not in ba:
                    md.only_b += 1
                    _note_only(report, rank, monitor, rb, "B", fb)
    prog.close()
    per_micro = len(report.micro_steps) > 1
    for item in [report.first] + [t[3] for t in report.largest.values()]:
        if item is not None and item["monitor"] == WEIGHT_GRAD:
            item["where"] = where(item["monitor"], item["scope"], item["micro_step"], per_micro)
    return report


def _path_of(files: Sequence[CsvFile], step: int) -> str:
    for f in files:
        if f.first <= step <= f.last:
            return f.path
    return files[0].path


def _note_only(report: DiffReport, rank: int, monitor: str, row: Row, side: str, files: Sequence[CsvFile]) -> None:
    key = order_key(row.step, monitor, row.scope, row.micro, row.line, rank)
    if report.first_only_key is None or key < report.first_only_key:
        report.first_only_key = key
        report.first_only = {
            "rank": rank, "step": row.step, "micro_step": row.micro, "monitor": monitor, "scope": row.scope,
            "tensor": row.name, "only_in": side, "file": _path_of(files, row.step), "line": row.line,
        }
        if row.dp is not None:
            report.first_only["dp_rank"] = row.dp


def _compare_rows(report: DiffReport, md: Any, rank: int, monitor: str, ra: Row, rb: Row,
                  fa: Sequence[CsvFile], fb: Sequence[CsvFile]) -> None:
    s = report.settings
    ops = [op for op in ra.vals if op in rb.vals and (s.stats is None or op in s.stats)]
    worst: Optional[Tuple[float, float, str]] = None
    first_op = None
    for op in ops:
        x, y = float(ra.vals[op]), float(rb.vals[op])
        ad, rd = value_diff(x, y)
        if ad == 0.0 or ad <= s.atol + s.rtol * max(abs(x), abs(y)):
            continue
        if first_op is None:
            first_op = op
        if worst is None or (rd, ad) > (worst[0], worst[1]):
            worst = (rd, ad, op)
    if first_op is None:
        return
    md.differing_rows += 1
    if md.first_step is None or ra.step < md.first_step:
        md.first_step = ra.step
    key = order_key(ra.step, monitor, ra.scope, ra.micro, ra.line, rank)
    if report.first_key is None or key < report.first_key:
        report.first_key = key
        report.first = _entry(rank, monitor, ra, rb, first_op, fa, fb)
    tkey = (rank, monitor, ra.name, ra.scope, ra.micro, ra.dp)
    rd, ad, op = worst
    prev = report.largest.get(tkey)
    if prev is None or (rd, ad) > (prev[0], prev[1]):
        report.largest[tkey] = (rd, ad, key, _entry(rank, monitor, ra, rb, op, fa, fb))


def _entry(rank: int, monitor: str, ra: Row, rb: Row, op: str, fa: Sequence[CsvFile],
           fb: Sequence[CsvFile]) -> Dict[str, Any]:
    x, y = float(ra.vals[op]), float(rb.vals[op])
    ad, rd = value_diff(x, y)
    dp = {} if ra.dp is None else {"dp_rank": ra.dp}  # a merged view's row kept per data-parallel rank
    return {**dp,
        "rank": rank, "step": ra.step, "micro_step": ra.micro, "monitor": monitor, "scope": ra.scope,
        "tensor": ra.name, "where": where(monitor, ra.scope, ra.micro), "stat": op, "a": x, "b": y,
        "abs_diff": ad, "rel_diff": rd, "file_a": _path_of(fa, ra.step), "line_a": ra.line,
        "file_b": _path_of(fb, rb.step), "line_b": rb.line,
    }
