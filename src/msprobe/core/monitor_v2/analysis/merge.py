"""``msprobe-monitor merge OUTPUT_DIR DEST``: the ranks' rows of a model-parallel run
combined into the statistics of whole tensors under global names.

Every rank writes the statistics of its own piece of each tensor, and
``rank_<r>/layout.json`` (``layout.py``) says which piece that is. ``merge_run`` reads
both and writes ``DEST/<monitor>.csv`` (``module``, ``weight_grad``, ``optimizer``,
``param``; the monitors that have rows), ``DEST/merge.json`` (what was read, written
and left out) and ``DEST/disagreements.csv`` (replicas that must agree and do not).

For every (monitor, step, global name, scope, micro_step) the rows of all ranks are
gathered:

- the global name is the row name under the layout's ``rename`` rules (the chunk
  prefix dropped, global layer numbers under pipeline parallelism);
- rows of the scopes that differ per data-parallel rank by design
  (``layout.PER_DP_SCOPES``: ``unreduced``, ``forward``, ``eval_forward``, ``backward``)
  are merged per data-parallel coordinate and keep a ``dp_rank`` column;
- rows describing the same piece (same ``(group, index)`` pairs in its ``split``) are
  replicas: they must agree within ``rtol`` (counts exactly). A disagreement is
  reported, never averaged away: the lowest rank's values are used;
- distinct pieces are combined exactly: norm from the summed squares, min of the
  mins, max of the maxes (NaN wins, as in the monitor), NaN and zero counts summed,
  mean weighted by element count (module pieces are equal-sized). A row is written
  only when its pieces add up to the whole tensor; otherwise, or when a piece is
  ``"unknown"`` or ``partial``, it is left out and counted, never guessed.

``cc`` rows are per-rank communication calls: not merged, counted. A rank without a
readable ``layout.json`` has its rows counted as ``no_layout``.

Memory stays bounded: each monitor is read step by step from every rank at once (one
open file per rank), so what is held is one step of one monitor over all ranks, plus
one small descriptor per (rank, row name, scope). Standard library only (no torch,
Polars or NumPy).
"""

import csv
import functools
import io
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from .. import layout as lay
from .. import rows
from ..errors import UnsafePathError
from ..rows import ALL_OPS, COUNT_OPS, MICRO_STEP_MONITORS, MONITORS
from ..safe_fs import SafeDir, open_regular
from ..writer import csv_cell
from .reader import RANK_RE, CsvFile, InputError, Problems, Row, header_ops, iter_rows, scan

MERGED_FORMAT = "msprobe-monitor-merged"
MERGED_VERSION = 1
REPORT_FILE = "merge.json"
DISAGREEMENTS_FILE = "disagreements.csv"
DP_RANK = "dp_rank"
# The monitors whose merged file has a dp_rank column (rows that differ per data-parallel rank).
DP_RANK_MONITORS: Tuple[str, ...] = (rows.MODULE, rows.WEIGHT_GRAD)
MERGED_MONITORS: Tuple[str, ...] = (rows.MODULE, rows.WEIGHT_GRAD, rows.OPTIMIZER, rows.PARAM)
DISAGREEMENT_COLUMNS: Tuple[str, ...] = ("step", "monitor", "module_name", "scope", "micro_step", DP_RANK, "stat",
                                         "ranks", "values")

# What a merged row can be left out for (the keys of merge.json's "left_out").
UNKNOWN, PARTIAL, INCOMPLETE, CC, NO_LAYOUT = "unknown", "partial", "incomplete", "cc", "no_layout"
LEFT_OUT_KINDS: Tuple[str, ...] = (UNKNOWN, PARTIAL, INCOMPLETE, CC, NO_LAYOUT)
EXAMPLES = 5  # examples kept per kind of left-out row, and disagreements kept for the report

# phases (rows.execution_phase) ordered by virtual pipeline stage ascending / descending
_FORWARD_PHASES = frozenset({0, 1})   # param_origin, forward and eval_forward
_BACKWARD_PHASES = frozenset({2, 3})  # backward, unreduced gradients


def merged_header(monitor: str, ops: Sequence[str]) -> List[str]:
    """The header of ``DEST/<monitor>.csv``: ``step,module_name,scope[,micro_step][,dp_rank],<ops>``."""
    cols = [rows.STEP, rows.MODULE_NAME, rows.SCOPE]
    if monitor in MICRO_STEP_MONITORS:
        cols.append(rows.MICRO_STEP)
    if monitor in DP_RANK_MONITORS:
        cols.append(DP_RANK)
    return cols + list(ops)


def merged_file(monitor: str) -> str:
    return f"{monitor}.csv"


def is_merged_dir(path: str) -> bool:
    """Whether ``path`` holds a merged view (a ``merge.json`` of this format)."""
    try:
        with open(os.path.join(path, REPORT_FILE), encoding="utf-8") as fh:
            return json.load(fh).get("format") == MERGED_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


# ----------------------------------------------------------------------- the report
@dataclass
class MergeReport:
    """What :func:`merge_run` read, wrote and left out (``to_json`` is ``merge.json``)."""

    source: str
    dest: str
    rtol: float
    world_size: Optional[int] = None
    ranks: List[int] = field(default_factory=list)
    groups: Dict[str, int] = field(default_factory=dict)
    rows_read: int = 0
    rows_written: int = 0
    rows_per_monitor: Dict[str, int] = field(default_factory=dict)
    left_out: Dict[str, int] = field(default_factory=lambda: {k: 0 for k in LEFT_OUT_KINDS})
    # kind -> the first few left-out rows, each {"step", "monitor", "module_name", "scope", "why"}
    examples: Dict[str, List[Dict[str, Any]]] = field(default_factory=lambda: {k: [] for k in LEFT_OUT_KINDS})
    disagreements: int = 0          # rows of disagreements.csv (one per piece and statistic)
    disagreeing_rows: int = 0       # merged rows with at least one disagreement
    first_disagreements: List[Dict[str, Any]] = field(default_factory=list)
    files: List[str] = field(default_factory=list)  # the files written, relative to dest
    no_layout_ranks: List[int] = field(default_factory=list)
    missing_ranks: List[int] = field(default_factory=list)  # below world_size, with no rank directory
    layout_unknown: List[str] = field(default_factory=list)  # the layouts' "unknown" lines, each once
    notes: List[str] = field(default_factory=list)
    problems: Optional[Problems] = None

    def to_json(self) -> Dict[str, Any]:
        return {
            "format": MERGED_FORMAT, "version": MERGED_VERSION, "source": self.source,
            "world_size": self.world_size, "ranks": self.ranks, "groups": self.groups,
            "rows_read": self.rows_read, "rows_written": self.rows_written, "left_out": dict(self.left_out),
            "disagreements": self.disagreements,
            # beyond the fixed keys: what the CLI and a reader may want without re-reading
            "rtol": self.rtol, "monitors": dict(self.rows_per_monitor), "disagreeing_rows": self.disagreeing_rows,
            "no_layout_ranks": self.no_layout_ranks, "missing_ranks": self.missing_ranks,
            "layout_unknown": self.layout_unknown,
        }

    def _leave_out(self, kind: str, n: int, example: Optional[Dict[str, Any]]) -> None:
        self.left_out[kind] += n
        if example is not None and len(self.examples[kind]) < EXAMPLES:
            self.examples[kind].append(example)


# ----------------------------------------------------------------------- number cells
def _num(value: float) -> str:
    # the writer's format: nine significant digits; format() writes nan, inf, -inf
    return format(value, ".9g")


@functools.lru_cache(maxsize=1 << 16)
def _name_cell(text: str) -> str:
    """A text cell as the monitor's writer writes it (``writer.csv_cell``, then the csv
    module's quoting), once per name."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow([csv_cell(text), ""])
    return buf.getvalue()[:-2]


def _cells(values: Dict[str, float], ops: Sequence[str]) -> str:
    return ",".join(str(int(values[op])) if op in COUNT_OPS else _num(values[op]) for op in ops)


# ----------------------------------------------------------------------- combination
def _nan_min(a: float, b: float) -> float:
    if a != a or b != b:  # NaN wins, as when the monitor merges rows (stats._nan_min)
        return math.nan
    return a if a <= b else b


def _nan_max(a: float, b: float) -> float:
    if a != a or b != b:
        return math.nan
    return a if a >= b else b


def _close(a: float, b: float, rtol: float) -> bool:
    if a == b:
        return True
    if a != a and b != b:  # NaN equals NaN: both replicas saw the same non-finite value
        return True
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def combine(pieces: Sequence[Tuple[Dict[str, float], int]], ops: Sequence[str]) -> Dict[str, float]:
    """The statistics of the whole tensor from its distinct pieces ``(values, numel)``."""
    out: Dict[str, float] = {}
    total = sum(n for _, n in pieces)
    for op in ops:
        if op == "norm":
            out[op] = math.sqrt(sum(v["norm"] * v["norm"] for v, _ in pieces))
        elif op == "min":
            m = pieces[0][0]["min"]
            for v, _ in pieces[1:]:
                m = _nan_min(m, v["min"])
            out[op] = m
        elif op == "max":
            m = pieces[0][0]["max"]
            for v, _ in pieces[1:]:
                m = _nan_max(m, v["max"])
            out[op] = m
        elif op == "mean":
            out[op] = sum(v["mean"] * n for v, n in pieces) / total if total else math.nan
        else:  # nans, zeros: counts
            out[op] = sum(int(v[op]) for v, _ in pieces)
    return out


# ----------------------------------------------------------------------- row descriptors
class _Desc:
    """What a (rank, row name, scope, chunk) row is in the merged view (cached: names
    repeat every step)."""

    __slots__ = ("status", "gname", "dp", "ident", "numel", "whole", "vkey", "why")

    def __init__(self, status: str, gname: str, dp: Optional[int], ident: Tuple[Tuple[str, int], ...] = (),
                 numel: int = 0, whole: int = 0, vkey: int = 0, why: str = "") -> None:
        self.status = status  # "ok", UNKNOWN or PARTIAL
        self.gname = gname
        self.dp = dp          # the dp coordinate for per-dp scopes, else None
        self.ident = ident    # the piece's identity: ((group, index), ...) sorted
        self.numel = numel    # the piece's element count (module pieces: 1)
        self.whole = whole    # what the distinct pieces must add up to
        self.vkey = vkey      # the virtual pipeline stage v = chunk * pp_size + pp_rank
        self.why = why


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for n in shape:
        out *= int(n)
    return out


class _RankLayout:
    def __init__(self, rank: int, doc: Dict[str, Any]) -> None:
        self.rank = rank
        self.doc = doc
        groups = doc.get("groups") or {}
        self.dp_rank = int((groups.get(lay.DP) or {}).get("rank", 0))
        pp = groups.get(lay.PP) or {}
        self.pp_rank = int(pp.get("rank", 0))
        self.pp_size = max(1, int(pp.get("size", 1)))
        self.rename = [tuple(r) for r in (doc.get("rename") or []) if isinstance(r, (list, tuple)) and len(r) == 2]
        self.params = doc.get("params") or {}
        self.modules = doc.get("modules") or {}
        self.cache: Dict[Tuple[str, str, str, int], _Desc] = {}

    def describe(self, monitor: str, name: str, scope: str, vpp: int) -> _Desc:
        key = (monitor, name, scope, vpp)
        d = self.cache.get(key)
        if d is None:
            d = self.cache[key] = self._describe(monitor, name, scope, vpp)
        return d

    def _describe(self, monitor: str, name: str, scope: str, vpp: int) -> _Desc:
        gname = lay.rename(name, self.rename)
        dp = self.dp_rank if scope in lay.PER_DP_SCOPES else None
        vkey = vpp * self.pp_size + self.pp_rank
        if monitor == rows.MODULE:
            entry = self.modules.get(name, {"split": []})  # not named: replicated over every group but dp
            if not isinstance(entry, dict):
                return _Desc(UNKNOWN, gname, dp, vkey=vkey, why=f"rank {self.rank}: module row's split is {entry!r}")
            if entry.get("partial"):
                return _Desc(PARTIAL, gname, dp, vkey=vkey, why=f"rank {self.rank}: partial (a sum over the split "
                                                                  "groups, not combinable from statistics)")
            split = entry.get("split")
            if not isinstance(split, list):
                return _Desc(UNKNOWN, gname, dp, vkey=vkey, why=f"rank {self.rank}: module row's split is unknown")
            ident = tuple(sorted((str(g), int(i)) for g, i, _ in split))
            return _Desc("ok", gname, dp, ident, 1, _prod(n for _, _, n in split), vkey)
        pclass = lay.scope_class(monitor, scope)
        pname = lay.param_of_row(monitor, name, scope)
        entry = self.params.get(pname)
        if not isinstance(entry, dict):
            return _Desc(UNKNOWN, gname, dp, vkey=vkey, why=f"rank {self.rank}: {pname!r} is not in its layout.json")
        shape = entry.get("shape")
        p = (entry.get("pieces") or {}).get(pclass, lay.UNKNOWN)
        if not isinstance(p, dict):
            return _Desc(UNKNOWN, gname, dp, vkey=vkey, why=f"rank {self.rank}: the {pclass} piece is unknown")
        if p.get("partial"):
            return _Desc(PARTIAL, gname, dp, vkey=vkey, why=f"rank {self.rank}: the {pclass} piece is partial (a "
                                                              "sum over the split groups, not combinable)")
        if not isinstance(shape, list):
            return _Desc(UNKNOWN, gname, dp, vkey=vkey, why=f"rank {self.rank}: the full shape is unknown")
        try:
            ident = tuple(sorted((str(g), int(i)) for g, i, _ in p.get("split", ())))
            numel = int(p["numel"])
            whole = _prod(shape)
        except (KeyError, TypeError, ValueError):
            return _Desc(UNKNOWN, gname, dp, vkey=vkey, why=f"rank {self.rank}: the {pclass} piece is malformed: {p!r}")
        return _Desc("ok", gname, dp, ident, numel, whole, vkey)


# ----------------------------------------------------------------------- streaming
class _Stream:
    """One rank's rows of one monitor, over its files in step order, a step at a time."""

    def __init__(self, rank: int, files: Sequence[CsvFile], problems: Problems,
                 file_done: Optional[Callable[[str], None]] = None) -> None:
        self.rank = rank
        self._rows = self._chain(files, problems, file_done)
        self.head: Optional[Row] = next(self._rows, None)

    @staticmethod
    def _chain(files: Sequence[CsvFile], problems: Problems,
               file_done: Optional[Callable[[str], None]]) -> Iterator[Row]:
        for f in files:
            yield from iter_rows(f, problems)
            if file_done is not None:
                file_done(f"rank {f.rank} {f.monitor}")

    def take(self, step: int) -> List[Row]:
        out = []
        head = self.head
        while head is not None and head.step == step:
            out.append(head)
            head = next(self._rows, None)
        self.head = head
        return out


def _file_ops(f: CsvFile) -> Optional[Tuple[str, ...]]:
    """The ops of ``f``'s header (None when it cannot be read: ``iter_rows`` says why later)."""
    try:
        fh = open(open_regular(f.path), newline="", encoding="utf-8", errors="replace")
    except (OSError, UnsafePathError):
        return None
    with fh:
        try:
            header = next(csv.reader([fh.readline()]))
        except (StopIteration, csv.Error):
            return None
    ops, _ = header_ops(f.monitor, [h.strip() for h in header])
    return ops


# ----------------------------------------------------------------------- checks
def _check_dest(source: str, dest: str) -> None:
    src = os.path.realpath(source)
    if os.path.islink(dest):
        raise InputError(f"DEST {dest}: is a symbolic link; merge never writes through a link: give the real "
                         "directory, or a new path")
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise InputError(f"DEST {dest}: exists and is not a directory; give a new or an empty directory")
    real = os.path.realpath(dest)
    if real == src:
        raise InputError(f"DEST {dest}: is OUTPUT_DIR itself; give another directory, e.g. {os.path.join(source, 'merged')}")
    rel = os.path.relpath(real, src)
    if not rel.startswith(os.pardir) and RANK_RE.match(rel.split(os.sep)[0]):
        raise InputError(f"DEST {dest}: lies inside the rank directory {os.path.join(source, rel.split(os.sep)[0])}, "
                         "which holds the monitor's own files; give a directory outside rank_<r>/")
    if os.path.isdir(dest) and os.listdir(dest) and not is_merged_dir(dest):
        raise InputError(f"DEST {dest}: holds files and is not a merged view (no {REPORT_FILE}); give a new or an "
                         "empty directory, so that nothing else is overwritten")


# ----------------------------------------------------------------------- merge_run
def merge_run(source: str, dest: str, rtol: float = 1e-5, *, problems: Optional[Problems] = None,
              progress: Optional[Callable[[str], None]] = None) -> MergeReport:
    """Merge the ranks' rows under ``source`` (a monitor ``output_dir``) into ``dest``.

    Raises :class:`InputError` for input it cannot work with (no such directory, no
    ``layout.json`` in any rank directory, a ``dest`` that is a file, a link, inside a
    rank directory, or a directory of other files). Malformed CSV lines are reported to
    ``problems`` (a warning each, by default) and skipped. ``progress(what)`` is called
    once per CSV file read (``count_files(source)`` of them)."""
    problems = problems if problems is not None else Problems()
    files = scan(source)
    report = MergeReport(source=os.path.abspath(source), dest=os.path.abspath(dest), rtol=float(rtol),
                         problems=problems)
    _check_dest(source, dest)
    layouts = _load_layouts(source, files.ranks, problems, report)
    if not layouts:
        raise InputError(f"{source}: no rank_<r>/{lay.FILE_NAME} in any of its rank directories "
                         f"({len(files.ranks)} rank(s)); merge needs the layout the monitor writes at start(): "
                         "rerun the training with this version of the monitor")
    _describe_layouts(layouts, files.ranks, report)
    out = SafeDir(dest, link_ok=False)
    try:
        with out.replace(DISAGREEMENTS_FILE) as dis:
            dis.write((",".join(DISAGREEMENT_COLUMNS) + "\n").encode("utf-8"))
            for monitor in MONITORS:
                per_rank = {r: files.files_of(r, monitor) for r in files.ranks if files.files_of(r, monitor)}
                if not per_rank:
                    continue
                if monitor not in MERGED_MONITORS:
                    n = _count_rows(per_rank, problems, progress)
                    report.rows_read += n
                    report._leave_out(CC, n, None)
                    continue
                _merge_monitor(out, dis, monitor, per_rank, layouts, rtol, problems, report, progress)
        for monitor in MERGED_MONITORS:
            name = merged_file(monitor)
            if monitor not in report.rows_per_monitor and name in out.listdir():
                out.remove(name)  # a previous merge's file this run has no rows for
        report.files = [merged_file(m) for m in MERGED_MONITORS if m in report.rows_per_monitor]
        report.files += [DISAGREEMENTS_FILE, REPORT_FILE]
        if report.left_out[CC]:
            report.notes.append(f"{report.left_out[CC]} cc row(s) not merged: communication calls are per rank")
        out.write_bytes(REPORT_FILE, (json.dumps(report.to_json(), indent=1) + "\n").encode("utf-8"))
    finally:
        out.close()
    return report


def _load_layouts(source: str, ranks: Sequence[int], problems: Problems, report: MergeReport) -> Dict[int, _RankLayout]:
    root = source
    # scan() accepts a rank directory given directly; its layout sits in it
    if RANK_RE.match(os.path.basename(os.path.normpath(source))) and len(ranks) == 1 \
            and not os.path.isdir(os.path.join(source, f"rank_{ranks[0]}")):
        root = os.path.dirname(os.path.normpath(source)) or "."
    out: Dict[int, _RankLayout] = {}
    for r in ranks:
        path = os.path.join(root, f"rank_{r}", lay.FILE_NAME)
        if not os.path.lexists(path):
            report.no_layout_ranks.append(r)
            continue
        try:
            doc = lay.load_layout(path)
        except (ValueError, OSError, UnsafePathError) as exc:
            problems.report(path, None, f"not read: {exc}; the rank's rows are left out (no_layout)", "file")
            report.no_layout_ranks.append(r)
            continue
        out[r] = _RankLayout(r, doc)
    return out


def _describe_layouts(layouts: Dict[int, _RankLayout], ranks: Sequence[int], report: MergeReport) -> None:
    first = layouts[min(layouts)].doc
    report.world_size = int(first.get("world_size", 0)) or None
    report.ranks = list(ranks)
    report.groups = {g: int(v.get("size", 1)) for g, v in (first.get("groups") or {}).items() if isinstance(v, dict)}
    if report.world_size:
        report.missing_ranks = [r for r in range(report.world_size) if r not in ranks]
    seen = set()
    for r in sorted(layouts):
        for line in layouts[r].doc.get("unknown") or ():
            if line not in seen:
                seen.add(line)
                report.layout_unknown.append(f"rank {r}: {line}")
    if report.no_layout_ranks:
        report.notes.append(f"rank(s) {', '.join(map(str, report.no_layout_ranks))} have no readable "
                            f"{lay.FILE_NAME}: their rows are left out (no_layout)")
    if report.missing_ranks:
        report.notes.append(f"rank(s) {', '.join(map(str, report.missing_ranks))} of world_size "
                            f"{report.world_size} have no rank directory: pieces they held are missing")


def _count_rows(per_rank: Dict[int, List[CsvFile]], problems: Problems,
                progress: Optional[Callable[[str], None]]) -> int:
    n = 0
    for fs in per_rank.values():
        for f in fs:
            n += sum(1 for _ in iter_rows(f, problems))
            if progress is not None:
                progress(f"rank {f.rank} {f.monitor}")
    return n


def count_files(source: str) -> int:
    """The CSV files ``merge_run(source, ...)`` reads (for a progress display)."""
    return scan(source).n_files


def _monitor_ops(per_rank: Dict[int, List[CsvFile]]) -> Tuple[Tuple[str, ...], List[str]]:
    """The ops every readable file of the monitor has (in ``ALL_OPS`` order), and those some lack."""
    common: Optional[set] = None
    seen: set = set()
    for fs in per_rank.values():
        for f in fs:
            ops = _file_ops(f)
            if ops is None:
                continue
            seen.update(ops)
            common = set(ops) if common is None else common & set(ops)
    common = common or set()
    return tuple(op for op in ALL_OPS if op in common), [op for op in ALL_OPS if op in seen - common]


def _merge_monitor(out: SafeDir, dis: Any, monitor: str, per_rank: Dict[int, List[CsvFile]],
                   layouts: Dict[int, _RankLayout], rtol: float, problems: Problems, report: MergeReport,
                   progress: Optional[Callable[[str], None]]) -> None:
    ops, dropped = _monitor_ops(per_rank)
    if dropped:
        report.notes.append(f"{monitor}: statistic(s) {', '.join(dropped)} are not in every file (the ops changed "
                            "during the run): left out of the merged file")
    if not ops:
        return
    streams = [_Stream(r, fs, problems, progress) for r, fs in sorted(per_rank.items())]
    with_micro = monitor in MICRO_STEP_MONITORS
    with_dp = monitor in DP_RANK_MONITORS
    written = 0
    last_step: Optional[int] = None
    name = merged_file(monitor)
    with out.replace(name) as fh:
        fh.write((",".join(merged_header(monitor, ops)) + "\n").encode("utf-8"))
        while True:
            live = [s for s in streams if s.head is not None]
            if not live:
                break
            step = min(s.head.step for s in live)  # type: ignore[union-attr]
            if last_step is not None and step <= last_step:
                report.notes.append(f"{monitor}: steps go back to {step} after {last_step} in a rank's files (a "
                                    "re-run appended to the same output_dir?): merged as they come")
            last_step = step
            batch = [(s.rank, s.take(step)) for s in live]
            lines, n = _merge_step(monitor, step, batch, layouts, ops, rtol, with_micro, with_dp, dis, report,
                                   problems)
            if lines:
                fh.write("".join(lines).encode("utf-8", errors="backslashreplace"))
            written += n
    report.rows_per_monitor[monitor] = written
    report.rows_written += written


GroupKey = Tuple[str, str, Optional[int], Optional[int]]  # global name, scope, micro, dp


class _Group:
    __slots__ = ("pieces", "first", "bad")

    def __init__(self) -> None:
        # identity -> [(rank, row, desc), ...] in rank order
        self.pieces: Dict[Tuple[Tuple[str, int], ...], List[Tuple[int, Row, _Desc]]] = {}
        self.first: Optional[Tuple[int, Row, _Desc]] = None  # the lowest rank's row: its place in the order
        self.bad: Optional[_Desc] = None                     # an unknown or partial piece


def _merge_step(monitor: str, step: int, batch: Sequence[Tuple[int, List[Row]]], layouts: Dict[int, _RankLayout],
                ops: Sequence[str], rtol: float, with_micro: bool, with_dp: bool, dis: Any, report: MergeReport,
                problems: Problems) -> Tuple[List[str], int]:
    groups: Dict[GroupKey, _Group] = {}
    for rank, rws in batch:
        report.rows_read += len(rws)
        rl = layouts.get(rank)
        if rl is None:
            if rws:
                r0 = rws[0]
                report._leave_out(NO_LAYOUT, len(rws), {"step": step, "monitor": monitor, "module_name": r0.name,
                                                        "scope": r0.scope,
                                                        "why": f"rank {rank} has no readable {lay.FILE_NAME}"})
            continue
        describe = rl.describe
        for row in rws:
            d = describe(monitor, row.name, row.scope, row.vpp)
            key = (d.gname, row.scope, row.micro, d.dp)
            g = groups.get(key)
            if g is None:
                g = groups[key] = _Group()
                g.first = (rank, row, d)
            if d.status != "ok":
                if g.bad is None or (g.bad.status == PARTIAL and d.status == UNKNOWN):
                    g.bad = d
                continue
            reps = g.pieces.get(d.ident)
            if reps is None:
                g.pieces[d.ident] = [(rank, row, d)]
            elif reps[-1][0] == rank:
                problems.report(f"rank_{rank}", row.line, f"{monitor} step {step}: {row.name} ({row.scope}) appears "
                                                          "twice in this step; the later row is ignored")
            else:
                reps.append((rank, row, d))
    merged = []
    for key, g in groups.items():
        gname, scope, micro, dp = key
        assert g.first is not None
        if g.bad is not None:
            report._leave_out(g.bad.status, 1, {"step": step, "monitor": monitor, "module_name": gname,
                                                "scope": scope, "why": g.bad.why})
            continue
        chosen: List[Tuple[Dict[str, float], int]] = []
        whole = None
        disagree = False
        for ident, reps in g.pieces.items():
            r0, row0, d0 = reps[0]
            whole = d0.whole
            v0 = row0.vals
            if any(op not in v0 for op in ops):
                continue  # its file lacks a statistic (said in the notes)
            if len(reps) > 1 and any(row.vals != v0 for _, row, _ in reps[1:]):
                for op in ops:
                    a = v0[op]
                    if op in COUNT_OPS:
                        differs = any(row.vals[op] != a for _, row, _ in reps[1:])
                    else:
                        differs = any(not _close(a, row.vals[op], rtol) for _, row, _ in reps[1:])
                    if differs:
                        disagree = True
                        _disagreement(dis, report, step, monitor, gname, scope, micro, dp, op, reps, rtol)
            chosen.append((v0, d0.numel))
        if disagree:
            report.disagreeing_rows += 1
        have = sum(n for _, n in chosen)
        if not chosen or have != whole:
            ranks = sorted({rk for reps in g.pieces.values() for rk, _, _ in reps})
            report._leave_out(INCOMPLETE, 1, {"step": step, "monitor": monitor, "module_name": gname, "scope": scope,
                                              "why": f"the pieces of ranks {','.join(map(str, ranks))} hold {have} of "
                                                     f"{whole} {'parts' if monitor == rows.MODULE else 'elements'}"})
            continue
        vals = chosen[0][0] if len(chosen) == 1 else combine(chosen, ops)
        rank, row, d = g.first
        phase = rows.execution_phase(monitor, scope)
        mk = 0 if phase <= 2 else (micro if (phase == 3 and micro is not None) else rows.LAST_MICRO)
        v = -d.vkey if phase in _BACKWARD_PHASES else d.vkey
        cells = [str(step), _name_cell(gname), _name_cell(scope)]
        if with_micro:
            cells.append("" if micro is None else str(micro))
        if with_dp:
            cells.append("" if dp is None else str(dp))
        cells.append(_cells(vals, ops))
        merged.append(((mk, phase, v, row.line, rank), ",".join(cells) + "\n"))
    merged.sort(key=lambda t: t[0])
    return [line for _, line in merged], len(merged)


def _disagreement(dis: Any, report: MergeReport, step: int, monitor: str, gname: str, scope: str,
                  micro: Optional[int], dp: Optional[int], op: str, reps: Sequence[Tuple[int, Row, _Desc]],
                  rtol: float) -> None:
    """One row of disagreements.csv: every replica of the piece and its value of ``op``."""
    ranks = [r for r, _, _ in reps]
    values = [row.vals[op] for _, row, _ in reps]
    a = values[0]
    differing = [r for r, v in zip(ranks[1:], values[1:])
                 if (v != a if op in COUNT_OPS else not _close(a, v, rtol))]
    fmt = (lambda x: str(int(x))) if op in COUNT_OPS else _num
    line = ",".join([str(step), monitor, _name_cell(gname), _name_cell(scope), "" if micro is None else str(micro),
                     "" if dp is None else str(dp), op, ";".join(map(str, ranks)), ";".join(fmt(x) for x in values)])
    dis.write((line + "\n").encode("utf-8", errors="backslashreplace"))
    report.disagreements += 1
    if len(report.first_disagreements) < EXAMPLES:
        report.first_disagreements.append({"step": step, "monitor": monitor, "module_name": gname, "scope": scope,
                                           "micro_step": micro, DP_RANK: dp, "stat": op, "ranks": ranks,
                                           "values": values, "differing_ranks": differing})
