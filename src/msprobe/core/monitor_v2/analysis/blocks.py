"""Row blocks: the rows of one step, keyed by tensor, and the tools that walk several
streams of blocks in lockstep by step and compare them.

A stream is a window's files read together (its plain file and its ``.run<k>`` files), of
each step only its latest rows (:func:`latest_blocks`, :class:`.report.WindowRuns`: rows
that a later run wrote again are an earlier run's, never compared). ``diff`` matches the
blocks of two output directories; the rank check of both engines (:mod:`.reference`,
:mod:`.engine`) compares the blocks of several ranks with :func:`compare_step`.
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from .order import order_key
from .reader import CsvFile, Layout, Problems, Row, StepRange, window_groups
from .report import CHUNK, RANK_CHECKED_MONITORS, RankCheckSettings, finding, latest_rows, row_is_checked

BlockKey = Tuple[str, str, Optional[int], Optional[int]]  # (name, scope, micro_step, dp_rank of a merged view)
Block = Tuple[int, Dict[BlockKey, Row]]


class _QuietProblems(Problems):
    """Problems of a second read: already reported by the first one (or fatal in strict
    mode, where the first read already stopped)."""

    def __init__(self, parent: Problems) -> None:
        super().__init__(strict=False)

    def report(self, path: str, line: Optional[int], message: str, skipped: str = "line") -> None:
        return None


def merge_steps(iters: Dict[Any, Iterator[Block]]) -> Iterator[Tuple[int, Dict[Any, Dict]]]:
    """Lockstep over several block streams: yields ``(step, {id: block})`` for the
    smallest pending step (streams in step order; a stream whose steps go back, as where
    windows overlap, is simply merged again from there)."""
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


def values_close(a: float, b: float, rtol: float, atol: float) -> bool:
    """``|a-b| <= atol + rtol * max(|a|,|b|)``; NaN equals NaN."""
    if a == b:
        return True
    if a != a or b != b:
        return a != a and b != b
    return abs(a - b) <= atol + rtol * max(abs(a), abs(b))


def consensus(values: List[Tuple[int, float]], rtol: float, atol: float) -> Tuple[List[int], float, List[int]]:
    """``(outlier ranks, consensus value, consensus ranks)`` for ``[(rank, value)]``."""
    r0, v0 = values[0]
    if all(values_close(v, v0, 0.0, 0.0) for _, v in values):
        return [], v0, [r for r, _ in values]
    nan_group = [(r, v) for r, v in values if v != v]
    rest = sorted(((v, r) for r, v in values if v == v))
    groups: List[List[Tuple[int, float]]] = []
    for v, r in rest:
        if groups and values_close(groups[-1][-1][1], v, rtol, atol):
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


def compare_step(monitor: str, blocks: Dict[int, Dict], paths: Dict[int, str],
                 settings: RankCheckSettings, result: Dict[int, Dict[str, Any]]) -> None:
    """Compare one step's blocks of several ranks (``{rank: block}``, read from
    ``paths[rank]``); each rank off the consensus gets, in ``result[rank]``, a count of
    differing rows and its first one."""
    ranks = sorted(blocks)
    keys: Dict[BlockKey, None] = {}
    for r in ranks:
        for k in blocks[r]:
            keys.setdefault(k, None)
    for key in keys:
        rows = [(r, blocks[r][key]) for r in ranks if key in blocks[r]]
        if len(rows) < 2:
            continue
        for r, (op, value, ref, agree) in _differing(rows, settings).items():
            _record_mismatch(monitor, r, blocks[r][key], paths[r], op, value, ref, agree, result)


Differing = Tuple[str, float, float, List[int]]  # statistic, value, consensus value, agreeing ranks


def _differing(rows: List[Tuple[int, Row]], settings: RankCheckSettings) -> Dict[int, Differing]:
    """Ranks whose row of one tensor is off the consensus, with their first differing statistic."""
    differing: Dict[int, Differing] = {}
    ops = [op for op in rows[0][1].vals if all(op in row.vals for _, row in rows)]
    for op in ops:
        values = [(r, float(row.vals[op])) for r, row in rows]
        outliers, ref, agree = consensus(values, settings.rtol, settings.atol)
        for r in outliers:
            if r not in differing:
                differing[r] = (op, dict(values)[r], ref, agree)
    return differing


def _record_mismatch(monitor: str, rank: int, row: Row, path: str, op: str, value: float, ref: float,
                     agree: List[int], result: Dict[int, Dict[str, Any]]) -> None:
    okey = order_key(row.step, monitor, row.scope, row.micro, row.line, rank)
    entry = result.get(rank)
    if entry is None:
        entry = result[rank] = {"key": okey, "first": None, "rows": 0}
    entry["rows"] += 1
    if entry["first"] is None or okey <= entry["key"]:
        entry["key"] = okey
        entry["first"] = finding(rank, monitor, row, path, stat=op, value=value, consensus=ref, consensus_ranks=agree)


# ------------------------------------------------------------------ the rank check's walk
@dataclass
class RankWindow:
    """The files of one monitor and window (the steps from ``window[0]`` to ``window[1]``)
    of a chunk of ranks: per rank, its files of the window (the plain one and its
    ``.run<k>`` files, in scan order)."""

    monitor: str
    window: Tuple[int, int]
    files: Dict[int, List[CsvFile]]  # rank -> its files of the window
    chunk: List[int]
    reads: int  # files of it read for the first time (the anchor's are re-read in every chunk, counted once)


def rank_windows(layout: Layout, settings: RankCheckSettings) -> Iterator[RankWindow]:
    """What the rank check compares, in its order: per group of ranks, chunks of at most
    :data:`.report.CHUNK` ranks each holding the group's lowest (the anchor), then per
    checked monitor and file window."""
    for group in settings.groups or [layout.ranks]:
        ranks = [r for r in group if r in layout.files]
        if len(ranks) < 2:
            continue
        anchor, others = ranks[0], ranks[1:]
        for i in range(0, len(others), CHUNK - 1):
            chunk = [anchor] + others[i:i + CHUNK - 1]
            yield from _chunk_windows(layout, chunk, first_chunk=i == 0)


def _chunk_windows(layout: Layout, chunk: List[int], first_chunk: bool) -> Iterator[RankWindow]:
    anchor = chunk[0]
    for monitor in RANK_CHECKED_MONITORS:
        # the windows of all the chunk's ranks: files whose steps overlap, on any rank, are one
        files = sorted((f for r in chunk for f in layout.files_of(r, monitor)),
                       key=lambda f: (f.first, f.last, f.run, f.rank))
        for group in window_groups(files):
            per_rank: Dict[int, List[CsvFile]] = {}
            for f in group:
                per_rank.setdefault(f.rank, []).append(f)
            reads = sum(len(fs) for r, fs in per_rank.items() if r != anchor or first_chunk)
            yield RankWindow(monitor, (group[0].first, max(f.last for f in group)), per_rank, chunk, reads)


def latest_blocks(files: Sequence[CsvFile], problems: Problems, steps: Optional[StepRange],
                  keep: Optional[Callable[[Row], bool]] = None,
                  ) -> Iterator[Tuple[int, Tuple[str, Dict[BlockKey, Row]]]]:
    """The rows ``keep`` accepts of one rank's files of a window, each step's latest only
    (:class:`.report.WindowRuns`), as ``(step, (path, {(name, scope, micro, dp): row}))`` in
    step order."""
    rows = latest_rows(files, problems, steps, keep)
    current: Optional[int] = None
    path = ""
    block: Dict[BlockKey, Row] = {}
    for f, row in rows:
        if row.step != current:
            if current is not None:
                yield current, (path, block)
            current, path, block = row.step, f.path, {}
        block[(row.name, row.scope, row.micro, row.dp)] = row
    if current is not None:
        yield current, (path, block)


def compare_window(monitor: str, files: Dict[int, List[CsvFile]], problems: Problems, steps: Optional[StepRange],
                   settings: RankCheckSettings, result: Dict[int, Dict[str, Any]]) -> None:
    """Re-read the checked rows of ``files`` (per rank, its files of one window) and compare
    each step's latest rows."""
    quiet = _QuietProblems(problems)  # reported by the first read
    iters = {r: latest_blocks(fs, quiet, steps, lambda row: row_is_checked(monitor, row.scope))
             for r, fs in files.items()}
    for _step, ready in merge_steps(iters):
        if len(ready) >= 2:
            compare_step(monitor, {r: b for r, (_p, b) in ready.items()}, {r: p for r, (p, _b) in ready.items()},
                         settings, result)
