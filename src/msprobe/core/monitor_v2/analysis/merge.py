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
  (``layout.PER_DP_SCOPES``: ``unreduced``, ``forward``, ``eval_forward``, ``generate``,
  ``backward``)
  are merged per data-parallel coordinate and keep a ``dp_rank`` column;
- rows describing the same piece (same ``(group, index)`` pairs in its ``split``) are
  replicas: they must agree within ``rtol`` (counts exactly). A disagreement is
  reported, never averaged away: the lowest rank's values are used;
- distinct pieces are combined exactly: norm from the summed squares, min of the
  mins, max of the maxes (NaN wins, as in the monitor), NaN and zero counts summed,
  mean weighted by element count (module pieces are equal-sized). A row is written
  only when its pieces add up to the whole tensor; otherwise, or when a piece is
  ``"unknown"`` or ``partial``, it is left out and counted, never guessed.

``cc`` rows are per-rank communication calls: not merged, counted. ``moe`` rows are a
rank's statistics of the tokens it routed: not merged, counted (``left_out["moe"]``); the
global ``tokens_per_expert`` rows come from the ``per_expert`` sidecars
(``merge_moe.py``: ``DEST/moe.csv``, the routers' E and top-k in merge.json's ``moe``). A rank without a
readable ``layout.json`` has its rows counted as ``no_layout``.

Runs: a step that several runs wrote (a run resumed or re-run into the same output_dir,
in the same file or beside it in a ``.run<k>`` file) is merged from its latest rows, as
the other commands read it (:class:`.report.WindowRuns`); the earlier runs' rows are set
aside and counted (``earlier_rows`` in merge.json, one note), never merged with them.

Two implementations write the same files: with Polars (``engine="polars"``, the default
where it is installed) each monitor is read a batch of about a million rows at a time
from every rank (the columnar engine's reader) and combined with integer group and
piece ids; in pure Python (``engine="python"``, standard library only, used without
Polars) it is read a file window at a time from every rank at once. Both hand the rows of
a step to one writer (:class:`_Emitter`) as the same items, sorted in execution order.
Memory stays bounded either way: one batch (or one file window) of one monitor over all
ranks, plus one small descriptor per (rank, row name, scope). No torch and no NumPy.
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
from ..safe_fs import SafeDir, open_regular, read_regular_file
from ..writer import csv_cell
from .reader import DP_RANK, RANK_RE, CsvFile, InputError, Problems, Row, header_ops, scan, window_groups
from ..experts import EXPERT_INFIX, NORMS_SUFFIX, split_row_name
from .merge_moe import COUNTS_FILE, TOKENS_FILE, merge_token_counts
from .report import read_window
from .text import compact_steps
from .reader import MERGE_FILE as REPORT_FILE
from .reader import MERGE_FORMAT as MERGED_FORMAT

MERGED_VERSION = 1
DISAGREEMENTS_FILE = "disagreements.csv"
# The monitors whose merged file has a dp_rank column (rows that differ per data-parallel rank).
DP_RANK_MONITORS: Tuple[str, ...] = (rows.MODULE, rows.WEIGHT_GRAD)
MERGED_MONITORS: Tuple[str, ...] = (rows.MODULE, rows.WEIGHT_GRAD, rows.OPTIMIZER, rows.PARAM)
DISAGREEMENT_COLUMNS: Tuple[str, ...] = ("step", "monitor", "module_name", "scope", "micro_step", DP_RANK, "stat",
                                         "ranks", "values")

# What a merged row can be left out for (the keys of merge.json's "left_out").
UNKNOWN, PARTIAL, INCOMPLETE, CC, NO_LAYOUT = "unknown", "partial", "incomplete", "cc", "no_layout"
# the moe monitor's rows: each rank's statistics of the tokens it routed (see merge_run)
MOE_PER_RANK = "moe"
LEFT_OUT_KINDS: Tuple[str, ...] = (UNKNOWN, PARTIAL, INCOMPLETE, CC, NO_LAYOUT, MOE_PER_RANK)
EXAMPLES = 5  # examples kept per kind of left-out row, and disagreements kept for the report

# phases (rows.execution_phase) ordered by virtual pipeline stage descending: backward, unreduced
# gradients (the stage that runs them first is the last); every other phase ascending (forward-like:
# param_origin, forward, eval_forward, generate run from stage 0 on)
_BACKWARD_PHASES = frozenset({2, 3})


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
    try:  # never blocks on a FIFO planted at the name
        data = read_regular_file(os.path.join(path, REPORT_FILE), 16 << 20, "merge report")
        return json.loads(data.decode("utf-8")).get("format") == MERGED_FORMAT
    except (OSError, UnsafePathError, ValueError, AttributeError):
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
    # rows of steps that a later run wrote again, set aside: monitor -> {"rows", "ranks", "steps"}
    earlier: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    missing_ranks: List[int] = field(default_factory=list)  # below world_size, with no rank directory
    layout_unknown: List[str] = field(default_factory=list)  # the layouts' "unknown" lines, each once
    # the routers of the merged moe.csv under their global names: num_experts, top_k, score
    # (what summary/anomalies read from a rank's layout.json, for the merged view)
    moe: Dict[str, Dict[str, Any]] = field(default_factory=dict)
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
            "layout_unknown": self.layout_unknown, "earlier_rows": self.earlier_rows, "moe": self.moe,
        }

    @property
    def earlier_rows(self) -> int:
        """Rows of earlier runs set aside (each step is merged from its latest rows)."""
        return sum(e["rows"] for e in self.earlier.values())

    def set_aside(self, monitor: str, rank: int, steps: Sequence[int]) -> None:
        """Earlier runs' rows of ``monitor`` on ``rank``, one step per row."""
        if not steps:
            return
        e = self.earlier.setdefault(monitor, {"rows": 0, "ranks": set(), "steps": set()})
        e["rows"] += len(steps)
        e["ranks"].add(rank)
        e["steps"].update(steps)

    def earlier_note(self) -> Optional[str]:
        """The one note on the earlier runs' rows set aside (None when there are none)."""
        if not self.earlier:
            return None
        parts = [f"{m} {e['rows']} on rank(s) {','.join(map(str, sorted(e['ranks'])))}, step(s) "
                 f"{compact_steps(sorted(e['steps']))}" for m, e in self.earlier.items()]
        return (f"{self.earlier_rows} row(s) of earlier runs set aside ({'; '.join(parts)}): a later run wrote "
                "these steps again (a run resumed or re-run into the same output_dir, appended to the same files or "
                "beside them in .run<k> files); each step is merged from its latest rows")

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
    if math.isinf(a) or math.isinf(b):  # an infinity equals only itself (inf - x <= rtol * inf otherwise)
        return False
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

    __slots__ = ("status", "gname", "dp", "ident", "numel", "whole", "vkey", "why", "assumed")

    def __init__(self, status: str, gname: str, dp: Optional[int], ident: Tuple[Tuple[str, int], ...] = (),
                 numel: int = 0, whole: int = 0, vkey: int = 0, why: str = "", assumed: bool = False) -> None:
        self.status = status  # "ok", UNKNOWN or PARTIAL
        self.gname = gname
        self.dp = dp          # the dp coordinate for per-dp scopes, else None
        self.ident = ident    # the piece's identity: ((group, index), ...) sorted
        self.numel = numel    # the piece's element count (module pieces: 1)
        self.whole = whole    # what the distinct pieces must add up to
        self.vkey = vkey      # the virtual pipeline stage v = chunk * pp_size + pp_rank
        self.why = why
        # a module row layout.json does not describe, taken for a replica: where its
        # replicas differ it is left out as unknown (a sharded or summed activation the
        # stack could not name), not reported as a disagreement
        self.assumed = assumed


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
            entry = lay.module_entry(self.doc, name)
            assumed = entry is lay.IMPLICIT_REPLICA
            if not isinstance(entry, dict):
                return _Desc(UNKNOWN, gname, dp, vkey=vkey, why=f"rank {self.rank}: module row's split is {entry!r}")
            if entry.get("partial"):
                return _Desc(PARTIAL, gname, dp, vkey=vkey, why=f"rank {self.rank}: partial (a sum over the split "
                                                                  "groups, not combinable from statistics)")
            split = entry.get("split")
            if not isinstance(split, list):
                return _Desc(UNKNOWN, gname, dp, vkey=vkey, why=f"rank {self.rank}: module row's split is unknown")
            ident = tuple(sorted((str(g), int(i)) for g, i, _ in split))
            return _Desc("ok", gname, dp, ident, 1, _prod(n for _, _, n in split), vkey, assumed=assumed)
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
        base, kind, expert = split_row_name(name)
        if kind:
            return self._describe_expert_row(base, kind, expert, entry, p, shape, numel, dp, vkey, pclass)
        return _Desc("ok", gname, dp, ident, numel, whole, vkey)

    def _describe_expert_row(self, base: str, kind: str, expert: Optional[int], entry: Dict[str, Any],
                             p: Dict[str, Any], shape: List[int], numel: int, dp: Optional[int], vkey: int,
                             pclass: str) -> _Desc:
        """A grouped-expert tensor's ``expert_norms`` row (a piece of the vector of the E
        per-expert norms: this rank's local experts, combinable only where the tensor is
        split along ``ep`` alone) or per-expert row (a whole expert, or its piece along the
        groups that split within experts; named with the global expert index)."""
        gbase = lay.rename(base, self.rename)
        # a group of one rank cuts nothing (TorchTitan's "efsdp" of size 1 beside "ep")
        split = [(str(g), int(i), int(n)) for g, i, n in p.get("split", ()) if int(n) > 1]
        by_ep = [s for s in split if s[0] == lay.EP]
        within = [s for s in split if s[0] != lay.EP]
        ep_count = by_ep[0][2] if by_ep else 1
        experts = int(shape[0]) if shape else 0
        local = experts // max(1, ep_count)
        inner = _prod(shape[1:])
        if local <= 0 or inner <= 0:
            return _Desc(UNKNOWN, gbase, dp, vkey=vkey, why=f"rank {self.rank}: no experts in the shape {shape}")
        if kind == "norms":
            gname = gbase + NORMS_SUFFIX
            if within:
                return _Desc(UNKNOWN, gname, dp, vkey=vkey, why=(
                    f"rank {self.rank}: the {pclass} piece is split within the experts (along "
                    f"{', '.join(g for g, _, _ in within)}): per-expert norms of parts do not combine"))
            ident = tuple(sorted((g, i) for g, i, _ in by_ep))
            return _Desc("ok", gname, dp, ident, numel // inner, experts, vkey)
        start = by_ep[0][1] * local if by_ep else 0  # local expert i of ep rank r is r * E_local + i
        gname = f"{gbase}{EXPERT_INFIX}{start + int(expert or 0)}"
        ident = tuple(sorted((g, i) for g, i, _ in within))
        return _Desc("ok", gname, dp, ident, numel // local, inner, vkey)


# ----------------------------------------------------------------------- streaming
class _Stream:
    """One rank's rows of one monitor, a file window at a time (its files read together and
    each step's latest rows kept, :class:`.report.WindowRuns`; the earlier runs' rows are
    set aside), a step at a time."""

    def __init__(self, rank: int, monitor: str, files: Sequence[CsvFile], problems: Problems, report: MergeReport,
                 file_done: Optional[Callable[[str], None]] = None) -> None:
        self.rank = rank
        self._rows = self._chain(monitor, files, problems, report, file_done)
        self.head: Optional[Row] = next(self._rows, None)

    def _chain(self, monitor: str, files: Sequence[CsvFile], problems: Problems, report: MergeReport,
               file_done: Optional[Callable[[str], None]]) -> Iterator[Row]:
        for window in window_groups(files):
            win, read = read_window(window, problems)
            if file_done is not None:
                for f in window:
                    file_done(f"rank {f.rank} {f.monitor}")
            earlier = [row.step for fi, seg, row in read if win.several and win.earlier(fi, seg, row.step)]
            report.rows_read += len(earlier)
            report.set_aside(monitor, self.rank, earlier)
            latest = [row for fi, seg, row in read if not (win.several and win.earlier(fi, seg, row.step))]
            latest.sort(key=lambda row: row.step)  # stable: a step's rows stay in their file's order
            yield from latest

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
        raise InputError(f"DEST {dest}: is OUTPUT_DIR itself; give another directory, e.g. "
                         f"{os.path.join(source, 'merged')}")
    rel = os.path.relpath(real, src)
    if not rel.startswith(os.pardir) and RANK_RE.match(rel.split(os.sep)[0]):
        raise InputError(f"DEST {dest}: lies inside the rank directory {os.path.join(source, rel.split(os.sep)[0])}, "
                         "which holds the monitor's own files; give a directory outside rank_<r>/")
    if os.path.isdir(dest) and os.listdir(dest) and not is_merged_dir(dest):
        raise InputError(f"DEST {dest}: holds files and is not a merged view (no {REPORT_FILE}); give a new or an "
                         "empty directory, so that nothing else is overwritten")


# ----------------------------------------------------------------------- merge_run
ENGINES = ("auto", "python", "polars")


def merge_run(source: str, dest: str, rtol: float = 1e-5, *, problems: Optional[Problems] = None,
              progress: Optional[Callable[[str], None]] = None, engine: str = "auto") -> MergeReport:
    """Merge the ranks' rows under ``source`` (a monitor ``output_dir``) into ``dest``.

    Raises :class:`InputError` for input it cannot work with (no such directory, no
    ``layout.json`` in any rank directory, a ``dest`` that is a file, a link, inside a
    rank directory, or a directory of other files). Malformed CSV lines are reported to
    ``problems`` (a warning each, by default) and skipped. ``progress(what)`` is called
    once per CSV file read (``count_files(source)`` of them).

    ``engine``: ``"polars"`` combines a batch of steps at a time with Polars (about three
    times the rows per second), ``"python"`` a step at a time in pure Python (the
    reference the tests compare it with; no dependency), ``"auto"`` Polars where it is
    installed. Both write the same files."""
    if engine not in ENGINES:
        raise InputError(f"merge engine {engine!r}: choose among {', '.join(ENGINES)}")
    if engine == "auto":
        engine = "polars" if polars_available() else "python"
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
                    n = _count_rows(monitor, per_rank, problems, report, progress)
                    report.rows_read += n
                    report._leave_out(MOE_PER_RANK if monitor == rows.MOE else CC, n, None)
                    continue
                _merge_monitor(out, dis, monitor, per_rank, layouts, rtol, problems, report, progress, engine)
        for monitor in MERGED_MONITORS:
            name = merged_file(monitor)
            if monitor not in report.rows_per_monitor and name in out.listdir():
                out.remove(name)  # a previous merge's file this run has no rows for
        report.files = [merged_file(m) for m in MERGED_MONITORS if m in report.rows_per_monitor]
        rank_dirs = {r: os.path.join(_root_of(source, files.ranks), f"rank_{r}") for r in files.ranks}
        tokens = merge_token_counts(rank_dirs, {r: rl.doc for r, rl in layouts.items()}, out, report.notes,
                                    report.moe)
        if tokens is not None:
            report.files += [COUNTS_FILE, TOKENS_FILE]
            report.rows_per_monitor[rows.MOE] = tokens
            report.rows_written += tokens
            report.notes.append(f"{tokens} global tokens_per_expert row(s) in {TOKENS_FILE} (the routers' counts "
                                f"summed over the groups whose ranks route different tokens; vectors in {COUNTS_FILE})")
        else:
            for stale in (COUNTS_FILE, TOKENS_FILE):  # a previous merge's, of a run that now has no sidecar
                if stale in out.listdir():
                    out.remove(stale)
        report.files += [DISAGREEMENTS_FILE, REPORT_FILE]
        if report.left_out[CC]:
            report.notes.append(f"{report.left_out[CC]} cc row(s) not merged: communication calls are per rank")
        if report.left_out[MOE_PER_RANK]:
            report.notes.append(
                f"{report.left_out[MOE_PER_RANK]} moe row(s) not merged: each is a rank's statistics of the tokens it "
                "routed (entropy, logits, lse are per-token statistics whose pieces no layout describes; a rank's "
                "tokens_per_expert is one piece of the global count) and weight_cosine is the router weight's; the "
                f"global token counts come from the per_expert sidecars"
                + (f", in {TOKENS_FILE}" if tokens is not None else " (none written: set monitors.moe.per_expert to true)"))
        note = report.earlier_note()
        if note is not None:
            report.notes.append(note)
        out.write_bytes(REPORT_FILE, (json.dumps(report.to_json(), indent=1) + "\n").encode("utf-8"))
    finally:
        out.close()
    return report


def _root_of(source: str, ranks: Sequence[int]) -> str:
    """The directory holding the rank directories (scan() accepts a rank directory given directly)."""
    if RANK_RE.match(os.path.basename(os.path.normpath(source))) and len(ranks) == 1 \
            and not os.path.isdir(os.path.join(source, f"rank_{ranks[0]}")):
        return os.path.dirname(os.path.normpath(source)) or "."
    return source


def _load_layouts(source: str, ranks: Sequence[int], problems: Problems, report: MergeReport) -> Dict[int, _RankLayout]:
    root = _root_of(source, ranks)
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


def _count_rows(monitor: str, per_rank: Dict[int, List[CsvFile]], problems: Problems, report: MergeReport,
                progress: Optional[Callable[[str], None]]) -> int:
    """The latest rows of a monitor that is not merged (the earlier runs' set aside)."""
    n = 0
    for rank, fs in per_rank.items():
        for window in window_groups(fs):
            win, read = read_window(window, problems)
            earlier = [row.step for fi, seg, row in read if win.several and win.earlier(fi, seg, row.step)]
            report.rows_read += len(earlier)
            report.set_aside(monitor, rank, earlier)
            n += len(read) - len(earlier)
            if progress is not None:
                for f in window:
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


# ----------------------------------------------------------------------- per step: what is emitted
# An item of a step: (sort key, kind, payload). The sort key is the merged row's place in
# execution order (``_order_key``) plus two numbers that order a row's disagreements
# after it (the piece's lowest rank, the statistic's index). kind: "row" (payload: global
# name, scope, micro, dp, values in ops order), "dis" (a disagreement) or a left-out kind
# (payload: the example). Both producers (pure Python, Polars) make the same items, so
# the files they write are the same.
Item = Tuple[Tuple[int, ...], str, Any]


def _order_key(monitor: str, scope: str, micro: Optional[int], vkey: int, line: int, rank: int) -> Tuple[int, ...]:
    phase = rows.execution_phase(monitor, scope)
    mk = 0 if phase <= 2 else (micro if (phase == 3 and micro is not None) else rows.LAST_MICRO)
    v = -vkey if phase in _BACKWARD_PHASES else vkey
    return (mk, phase, v, line, rank)


class _Emitter:
    """Writes one monitor's merged rows and disagreements, a step at a time."""

    def __init__(self, fh: Any, dis: Any, report: MergeReport, monitor: str, ops: Sequence[str]) -> None:
        self.fh, self.dis, self.report, self.monitor, self.ops = fh, dis, report, monitor, tuple(ops)
        self.with_micro = monitor in MICRO_STEP_MONITORS
        self.with_dp = monitor in DP_RANK_MONITORS
        self.written = 0
        # the statistic cells in one str.format call, as the monitor's writer formats them
        self.stats = ",".join("{%d}" % i if op in COUNT_OPS else "{%d:.9g}" % i for i, op in enumerate(ops)).format

    def step(self, step: int, items: List[Item]) -> None:
        items.sort(key=lambda t: t[0])
        lines = []
        stats, with_micro, with_dp = self.stats, self.with_micro, self.with_dp
        head = f"{step},"
        for _, kind, p in items:
            if kind == "row":
                gname, scope, micro, dp, vals = p
                line = head + _name_cell(gname) + "," + _name_cell(scope) + ","
                if with_micro:
                    line += ("" if micro is None else str(micro)) + ","
                if with_dp:
                    line += ("" if dp is None else str(dp)) + ","
                lines.append(line + stats(*vals) + "\n")
            elif kind == "dis":
                self._disagreement(step, *p)
            else:
                self.report._leave_out(kind, 1, p)
        if lines:
            self.fh.write("".join(lines).encode("utf-8", errors="backslashreplace"))
            self.written += len(lines)

    def _disagreement(self, step: int, gname: str, scope: str, micro: Optional[int], dp: Optional[int], op: str,
                      ranks: List[int], values: List[float], differing: List[int]) -> None:
        """One row of disagreements.csv: every replica of the piece and its value of ``op``."""
        fmt = (lambda x: str(int(x))) if op in COUNT_OPS else _num
        line = ",".join([str(step), self.monitor, _name_cell(gname), _name_cell(scope),
                         "" if micro is None else str(micro), "" if dp is None else str(dp), op,
                         ";".join(map(str, ranks)), ";".join(fmt(x) for x in values)])
        self.dis.write((line + "\n").encode("utf-8", errors="backslashreplace"))
        report = self.report
        report.disagreements += 1
        if len(report.first_disagreements) < EXAMPLES:
            report.first_disagreements.append({"step": step, "monitor": self.monitor, "module_name": gname,
                                               "scope": scope, "micro_step": micro, DP_RANK: dp, "stat": op,
                                               "ranks": ranks, "values": values, "differing_ranks": differing})


def _no_layout_example(step: int, monitor: str, rank: int, name: str, scope: str) -> Dict[str, Any]:
    return {"step": step, "monitor": monitor, "module_name": name, "scope": scope,
            "why": f"rank {rank} has no readable {lay.FILE_NAME}"}


def _incomplete_why(monitor: str, ranks: Sequence[int], have: int, whole: int) -> str:
    return (f"the pieces of ranks {','.join(map(str, ranks))} hold {have} of {whole} "
            f"{'parts' if monitor == rows.MODULE else 'elements'}")


def _undescribed_why(ranks: Sequence[int]) -> str:
    return (f"ranks {','.join(map(str, ranks))} wrote different values for a module row their layout.json does not "
            "describe (an activation split or summed across them, which the stack did not name)")


def _example(step: int, monitor: str, gname: str, scope: str, why: str) -> Dict[str, Any]:
    return {"step": step, "monitor": monitor, "module_name": gname, "scope": scope, "why": why}


# ----------------------------------------------------------------------- the pure-Python producer
def _merge_monitor(out: SafeDir, dis: Any, monitor: str, per_rank: Dict[int, List[CsvFile]],
                   layouts: Dict[int, _RankLayout], rtol: float, problems: Problems, report: MergeReport,
                   progress: Optional[Callable[[str], None]], engine: str) -> None:
    ops, dropped = _monitor_ops(per_rank)
    if dropped:
        report.notes.append(f"{monitor}: statistic(s) {', '.join(dropped)} are not in every file (the ops changed "
                            "during the run): left out of the merged file")
    if not ops:
        return
    with out.replace(merged_file(monitor)) as fh:
        fh.write((",".join(merged_header(monitor, ops)) + "\n").encode("utf-8"))
        emit = _Emitter(fh, dis, report, monitor, ops)
        if engine == "polars":
            _polars_monitor(emit, monitor, per_rank, layouts, ops, rtol, problems, report, progress)
        else:
            _python_monitor(emit, monitor, per_rank, layouts, ops, rtol, problems, report, progress)
    report.rows_per_monitor[monitor] = emit.written
    report.rows_written += emit.written


def _python_monitor(emit: _Emitter, monitor: str, per_rank: Dict[int, List[CsvFile]],
                    layouts: Dict[int, _RankLayout], ops: Sequence[str], rtol: float, problems: Problems,
                    report: MergeReport, progress: Optional[Callable[[str], None]]) -> None:
    streams = [_Stream(r, monitor, fs, problems, report, progress) for r, fs in sorted(per_rank.items())]
    last_step: Optional[int] = None
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
        emit.step(step, _merge_step(monitor, step, batch, layouts, ops, rtol, report, problems))


GroupKey = Tuple[str, str, Optional[int], Optional[int]]  # global name, scope, micro, dp


class _Group:
    __slots__ = ("pieces", "first", "bad")

    def __init__(self) -> None:
        # identity -> [(rank, row, desc), ...] in rank order
        self.pieces: Dict[Tuple[Tuple[str, int], ...], List[Tuple[int, Row, _Desc]]] = {}
        self.first: Optional[Tuple[int, Row, _Desc]] = None  # the lowest rank's row: its place in the order
        self.bad: Optional[_Desc] = None                     # an unknown or partial piece


def _merge_step(monitor: str, step: int, batch: Sequence[Tuple[int, List[Row]]], layouts: Dict[int, _RankLayout],
                ops: Sequence[str], rtol: float, report: MergeReport, problems: Problems) -> List[Item]:
    groups: Dict[GroupKey, _Group] = {}
    items: List[Item] = []
    for rank, rws in batch:
        report.rows_read += len(rws)
        rl = layouts.get(rank)
        if rl is None:
            if rws:
                report.left_out[NO_LAYOUT] += len(rws) - 1
                items.append(((-1, rank), NO_LAYOUT, _no_layout_example(step, monitor, rank, rws[0].name,
                                                                        rws[0].scope)))
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
                problems.report(f"rank_{rank}", row.line, _duplicate_message(monitor, step, row.name, row.scope))
            else:
                reps.append((rank, row, d))
    for key, g in groups.items():
        gname, scope, micro, dp = key
        assert g.first is not None
        rank0, row0, d0 = g.first
        order = _order_key(monitor, scope, micro, d0.vkey, row0.line, rank0)
        if g.bad is not None:
            items.append((order + (-1, -1), g.bad.status, _example(step, monitor, gname, scope, g.bad.why)))
            continue
        chosen: List[Tuple[Dict[str, float], int]] = []
        whole = 0
        disagree = False
        undescribed = None
        for ident, reps in g.pieces.items():
            r0, prow, pd = reps[0]
            whole = pd.whole
            v0 = prow.vals
            if len(reps) > 1 and pd.assumed and any(row.vals[op] != v0[op] and (op in COUNT_OPS or not _close(
                    v0[op], row.vals[op], rtol)) for _, row, _ in reps[1:] for op in ops):
                undescribed = sorted({rk for reps_ in g.pieces.values() for rk, _, _ in reps_})
                break
            if len(reps) > 1 and any(row.vals != v0 for _, row, _ in reps[1:]):
                for i, op in enumerate(ops):
                    a = v0[op]
                    if op in COUNT_OPS:
                        differing = [rk for rk, row, _ in reps[1:] if row.vals[op] != a]
                    else:
                        differing = [rk for rk, row, _ in reps[1:] if not _close(a, row.vals[op], rtol)]
                    if differing:
                        disagree = True
                        items.append((order + (r0, i), "dis", (gname, scope, micro, dp, op, [rk for rk, _, _ in reps],
                                                               [row.vals[op] for _, row, _ in reps], differing)))
            chosen.append((v0, pd.numel))
        if undescribed is not None:
            items.append((order + (-1, -1), UNKNOWN, _example(step, monitor, gname, scope,
                                                              _undescribed_why(undescribed))))
            continue
        if disagree:
            report.disagreeing_rows += 1
        have = sum(n for _, n in chosen)
        if not chosen or have != whole:
            ranks = sorted({rk for reps in g.pieces.values() for rk, _, _ in reps})
            items.append((order + (-1, -1), INCOMPLETE,
                          _example(step, monitor, gname, scope, _incomplete_why(monitor, ranks, have, whole))))
            continue
        vals = chosen[0][0] if len(chosen) == 1 else combine(chosen, ops)
        items.append((order + (-1, -1), "row", (gname, scope, micro, dp, tuple(vals[op] for op in ops))))
    return items


def _duplicate_message(monitor: str, step: int, name: str, scope: str) -> str:
    return f"{monitor} step {step}: {name} ({scope}) appears twice in this step; the later row is ignored"


# ----------------------------------------------------------------------- the Polars producer
def polars_available() -> bool:
    try:
        import polars  # noqa: F401
    except ImportError:
        return False
    return True


def _step_chunks(per_rank: Dict[int, List[CsvFile]], max_rows: int) -> List[Tuple[int, int]]:
    """Step ranges of about ``max_rows`` rows over all ranks, cut between file windows (files
    whose steps overlap, on any rank, stay in one range: their runs are told apart together)."""
    files = sorted((f for fs in per_rank.values() for f in fs), key=lambda f: (f.first, f.last, f.run, f.rank))
    out: List[Tuple[int, int]] = []
    start: Optional[int] = None
    end = 0
    acc = 0
    for window in window_groups(files):
        est = 0
        for f in window:
            try:
                est += os.path.getsize(f.path) // 60 + 1
            except OSError:
                est += 1
        if start is not None and acc + est > max_rows:
            out.append((start, end))
            start, acc = None, 0
        if start is None:
            start = window[0].first
        end = max(f.last for f in window)
        acc += est
    if start is not None:
        out.append((start, end))
    return out


def _polars_monitor(emit: _Emitter, monitor: str, per_rank: Dict[int, List[CsvFile]],
                    layouts: Dict[int, _RankLayout], ops: Sequence[str], rtol: float, problems: Problems,
                    report: MergeReport, progress: Optional[Callable[[str], None]]) -> None:
    """The same items as :func:`_python_monitor`, computed a batch of steps at a time with
    Polars (reading with the columnar engine's reader, which reports bad input as the
    reader does)."""
    import polars as pl

    from .columnar import BATCH_ROWS, mark_runs, read_batch, row_key

    seen: set = set()
    ids = _Ids()
    for lo, hi in _step_chunks(per_rank, BATCH_ROWS):
        frames = []
        for rank, fs in sorted(per_rank.items()):
            mine = [f for f in fs if f.last >= lo and f.first <= hi]
            if not mine:
                continue
            batch = read_batch(mine, problems, None)
            fr = batch.frame
            for f in mine:
                if progress is not None and f.path not in seen:
                    seen.add(f.path)
                    progress(f"rank {f.rank} {f.monitor}")
            if len(fr):
                # each step's latest rows (the earlier runs' set aside, counted as read)
                fr, _infos = mark_runs(pl, fr, mine, batch.file_ops, row_key(pl))
                earlier = fr.filter(pl.col("_old"))
                report.rows_read += len(earlier)
                report.set_aside(monitor, rank, earlier["step"].to_list())
                fr = fr.filter(~pl.col("_old")).drop("_run", "_win", "_pos", "_old", "_label")
            if len(fr):
                frames.append(fr.with_columns(pl.lit(rank, dtype=pl.Int64).alias("rank")))
        if not frames:
            continue
        fr = pl.concat(frames, how="vertical").with_row_index("ri")
        report.rows_read += len(fr)
        items: Dict[int, List[Item]] = {}
        _polars_chunk(pl, fr, monitor, layouts, ops, rtol, problems, report, items, ids)
        for step in sorted(items):
            emit.step(step, items[step])


class _Ids:
    """Small integers for the groups and pieces of a monitor, so that Polars groups and
    windows on integer columns (strings stay in Python, looked up when a row is emitted)."""

    def __init__(self) -> None:
        self.groups: Dict[Tuple[str, str, int], int] = {}
        self.group_info: List[Tuple[str, str, int]] = []
        self.pieces: Dict[Tuple[int, Tuple[Tuple[str, int], ...]], int] = {}
        self.descs: Dict[Tuple[int, str, str, int], Tuple[Any, ...]] = {}
        self.frame: Any = None  # the descriptors described so far, as a Polars frame

    def of(self, rl: "_RankLayout", monitor: str, name: str, scope: str, vpp: int) -> Tuple[Any, ...]:
        key = (rl.rank, name, scope, vpp)
        got = self.descs.get(key)
        if got is None:
            d = rl.describe(monitor, name, scope, vpp)
            gkey = (d.gname, scope, -1 if d.dp is None else d.dp)
            gk = self.groups.get(gkey)
            if gk is None:
                gk = self.groups[gkey] = len(self.group_info)
                self.group_info.append(gkey)
            pk = self.pieces.setdefault((gk, d.ident), len(self.pieces))
            status = {"ok": 0, PARTIAL: 1, UNKNOWN: 2}[d.status]
            got = self.descs[key] = (gk, pk, status, d.numel, d.whole, d.vkey, d.why,
                                     rows.execution_phase(monitor, scope), d.assumed)
        return got


def _polars_chunk(pl: Any, fr: Any, monitor: str, layouts: Dict[int, _RankLayout], ops: Sequence[str], rtol: float,
                  problems: Problems, report: MergeReport, items: Dict[int, List[Item]], ids: _Ids) -> None:
    col = pl.col
    known = sorted(layouts)
    # rows of ranks without a layout: counted, one example per rank and step
    nl = fr.filter(~col("rank").is_in(known))
    if len(nl):
        firsts = nl.group_by("step", "rank", maintain_order=True).agg(col("module_name").first(),
                                                                       col("scope").first(), pl.len().alias("n"))
        for step, rank, name, scope, n in firsts.iter_rows():
            report.left_out[NO_LAYOUT] += n - 1
            items.setdefault(step, []).append(((-1, rank), NO_LAYOUT,
                                               _no_layout_example(step, monitor, rank, name, scope)))
        fr = fr.filter(col("rank").is_in(known))
        if not len(fr):
            return
    # each distinct (rank, name, scope, chunk): its descriptor as integers, joined onto the rows; the
    # descriptors of earlier batches are kept (names repeat every step), only new keys are described
    on = ["rank", "module_name", "scope", "vpp_stage"]
    keys = fr.select(on).unique()
    if ids.frame is not None:
        keys = keys.join(ids.frame.select(on), on=on, how="anti")
    if len(keys):
        names = on + ["gk", "pk", "status", "numel", "whole", "vkey", "why", "phase", "assumed"]
        d_cols: Dict[str, List[Any]] = {k: [] for k in names}
        for rank, name, scope, vpp in keys.iter_rows():
            for k, v in zip(names, (rank, name, scope, vpp) + ids.of(layouts[rank], monitor, name, scope, vpp)):
                d_cols[k].append(v)
        schema = {"rank": pl.Int64, "module_name": pl.String, "scope": pl.String, "vpp_stage": pl.Int64,
                  "gk": pl.Int64, "pk": pl.Int64, "status": pl.Int8, "numel": pl.Int64, "whole": pl.Int64,
                  "vkey": pl.Int64, "why": pl.String, "phase": pl.Int64, "assumed": pl.Boolean}
        new = pl.DataFrame(d_cols, schema=schema)
        ids.frame = new if ids.frame is None else pl.concat([ids.frame, new], how="vertical")
    desc = ids.frame
    fr = fr.join(desc, on=["rank", "module_name", "scope", "vpp_stage"], how="left") \
        .with_columns(col("micro_step").fill_null(-1).alias("micro"))
    K = ["step", "micro", "gk"]
    P = ["step", "micro", "pk"]
    # groups with an unknown or partial piece: left out, with the first such row's reason
    bad_keys = fr.filter(col("status") != 0).select(K).unique()
    ok = fr.filter(col("status") == 0)
    if len(bad_keys):
        bad = fr.join(bad_keys, on=K, how="semi").sort("ri").group_by(K, maintain_order=True).agg(
            col("rank").first(), col("line").first(), col("vkey").first(),
            col("why").filter(col("status") == 2).first().alias("why_unknown"),
            col("why").filter(col("status") == 1).first().alias("why_partial"))
        for step, micro_, gk, rank0, line0, vkey0, why_u, why_p in bad.iter_rows():
            gname, scope, dp_ = ids.group_info[gk]
            micro = None if micro_ < 0 else micro_
            key = _order_key(monitor, scope, micro, vkey0, line0, rank0) + (-1, -1)
            kind, why = (UNKNOWN, why_u) if why_u is not None else (PARTIAL, why_p)
            items.setdefault(step, []).append((key, kind, _example(step, monitor, gname, scope, why)))
        ok = ok.join(bad_keys, on=K, how="anti")
    # each piece's rows together, lowest rank (then file order) first: the replicas follow their first row
    ok = ok.sort(P + ["ri"])
    new_piece = pl.any_horizontal([col(c) != col(c).shift(1) for c in P]).fill_null(True)
    # a rank's second row of the same piece in a step: reported, ignored
    dup = ~new_piece & (col("rank") == col("rank").shift(1))
    dups = ok.filter(dup)
    for rank, line, name, scope, step in dups.select("rank", "line", "module_name", "scope", "step").iter_rows():
        problems.report(f"rank_{rank}", line, _duplicate_message(monitor, step, name, scope))
    if len(dups):
        ok = ok.filter(~dup)
    ok = ok.with_columns(new_piece.alias("is_first"))
    # replicas: each row against its piece's first (lowest-rank) row
    diff_exprs = []
    for op in ops:
        a, b = pl.when(col("is_first")).then(col(op)).forward_fill(), col(op)
        if op in COUNT_OPS:
            same = a == b
        else:
            same = ((a == b) | (a.is_nan() & b.is_nan())
                    | (~a.is_infinite() & ~b.is_infinite()
                       & ((a - b).abs() <= rtol * pl.max_horizontal(a.abs(), b.abs()))))
        diff_exprs.append((~same).fill_null(True).alias(f"d_{op}"))
    ok = ok.with_columns(diff_exprs)
    flagged = ok.filter(pl.any_horizontal([col(f"d_{op}") for op in ops]))
    undescribed = flagged.filter(col("assumed")).select(K).unique()
    if len(undescribed):  # module rows taken for replicas that differ: unknown (see _Desc.assumed)
        und = ok.join(undescribed, on=K, how="semi").group_by(K).agg(
            col("rank").get(col("ri").arg_min()).alias("rank0"), col("line").get(col("ri").arg_min()).alias("line0"),
            col("vkey").get(col("ri").arg_min()).alias("vkey0"), col("rank").unique().sort().alias("ranks"))
        for step, micro_, gk, rank0, line0, vkey0, ranks in und.iter_rows():
            gname, scope, _ = ids.group_info[gk]
            micro = None if micro_ < 0 else micro_
            key = _order_key(monitor, scope, micro, vkey0, line0, rank0) + (-1, -1)
            items.setdefault(step, []).append((key, UNKNOWN, _example(step, monitor, gname, scope,
                                                                      _undescribed_why(list(ranks)))))
        ok = ok.join(undescribed, on=K, how="anti").sort(P + ["ri"])
        flagged = flagged.join(undescribed, on=K, how="anti")
    if len(flagged):
        dis_pieces = ok.join(flagged.select(P).unique(), on=P, how="semi").sort(P + ["ri"])
        agg = dis_pieces.group_by(P, maintain_order=True).agg(
            col("gk").first(), col("rank"), *[col(op) for op in ops], *[col(f"d_{op}") for op in ops])
        # the order keys of the rows they belong to: each group's first row (lowest rank, file order)
        firsts = ok.join(flagged.select(K).unique(), on=K, how="semi").group_by(K).agg(
            col("rank").get(col("ri").arg_min()), col("line").get(col("ri").arg_min()),
            col("vkey").get(col("ri").arg_min()))
        first_of = {(s, m, g): (r, ln, v) for s, m, g, r, ln, v in firsts.iter_rows()}
        rows_with = set()
        for rec in agg.iter_rows(named=True):
            step, micro_, gk = rec["step"], rec["micro"], rec["gk"]
            rows_with.add((step, micro_, gk))
            gname, scope, dp_ = ids.group_info[gk]
            micro = None if micro_ < 0 else micro_
            dp = None if dp_ < 0 else dp_
            rank0, line0, vkey0 = first_of[(step, micro_, gk)]
            order = _order_key(monitor, scope, micro, vkey0, line0, rank0)
            ranks = rec["rank"]
            for i, op in enumerate(ops):
                differing = [rk for rk, d in zip(ranks[1:], rec[f"d_{op}"][1:]) if d]
                if differing:
                    items.setdefault(step, []).append(
                        (order + (ranks[0], i), "dis", (gname, scope, micro, dp, op, list(ranks), list(rec[op]),
                                                        differing)))
        report.disagreeing_rows += len(rows_with)
    # distinct pieces (each piece's lowest rank) combined exactly
    pieces = ok.filter(col("is_first")).sort("ri")  # summed in the pure-Python order: by lowest rank
    one = pl.len() == 1
    first = col("ri").arg_min()  # the group's first row: lowest rank, file order (its place in the order)
    agg_exprs = [col("rank").get(first).alias("rank0"), col("line").get(first).alias("line0"),
                 col("vkey").get(first).alias("vkey0"), col("numel").sum().alias("have"),
                 col("whole").first().alias("whole0"), col("phase").first()]
    for op in ops:
        if op == "norm":
            e = pl.when(one).then(col(op).first()).otherwise((col(op) * col(op)).sum().sqrt())
        elif op in ("min", "max"):
            e = pl.when(col(op).is_nan().any()).then(float("nan")).otherwise(
                col(op).min() if op == "min" else col(op).max())
            e = pl.when(one).then(col(op).first()).otherwise(e)
        elif op == "mean":
            e = pl.when(one).then(col(op).first()).otherwise((col(op) * col("numel")).sum() / col("numel").sum())
        else:
            e = col(op).sum()
        agg_exprs.append(e.alias(f"m_{op}"))
    # in execution order (``_order_key``, computed here): rows.execution_order's micro key and phase, the
    # virtual stage (descending for backward-like phases), then the first row's line and rank
    ph = col("phase")
    mk = pl.when(ph <= 2).then(0).when((ph == 3) & (col("micro") >= 0)).then(col("micro")) \
        .otherwise(rows.LAST_MICRO).alias("mk")
    v = pl.when(ph.is_in(sorted(_BACKWARD_PHASES))).then(-col("vkey0")).otherwise(col("vkey0")).alias("v")
    combined = pieces.group_by(K).agg(agg_exprs).with_columns(mk, v).select(
        "step", "mk", "phase", "v", "line0", "rank0", pl.lit(-1, dtype=pl.Int64).alias("k5"),
        pl.lit(-1, dtype=pl.Int64).alias("k6"), "micro", "gk", "have", "whole0", *[f"m_{op}" for op in ops]
    ).sort("step", "mk", "phase", "v", "line0", "rank0")
    incomplete = combined.filter(col("have") != col("whole0")).select(
        col("step"), col("micro"), col("gk"))
    ranks_of: Dict[Tuple[int, int, int], List[int]] = {}
    if len(incomplete):
        for s, m, g, rks in (ok.join(incomplete, on=K, how="semi").group_by(K)
                             .agg(col("rank").unique().sort()).iter_rows()):
            ranks_of[(s, m, g)] = list(rks)
    info = ids.group_info
    out: List[Item] = []
    last = None
    for rec in combined.iter_rows():
        step = rec[0]
        if step != last:
            out = items.get(step)
            if out is None:
                out = items[step] = []
            last = step
        micro_, gk, have, whole = rec[8:12]
        gname, scope, dp_ = info[gk]
        micro = None if micro_ < 0 else micro_
        if have != whole:
            why = _incomplete_why(monitor, ranks_of.get((step, micro_, gk), []), have, whole)
            out.append((rec[1:8], INCOMPLETE, _example(step, monitor, gname, scope, why)))
        else:
            out.append((rec[1:8], "row", (gname, scope, micro, None if dp_ < 0 else dp_, rec[12:])))
