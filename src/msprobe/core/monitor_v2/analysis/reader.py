"""Finding and streaming the monitor's CSV files, with precise messages for bad input.

Layout: ``<output_dir>/rank_<r>/<monitor>_step<a>-<b>.csv``, and
``<monitor>_step<a>-<b>.run<k>.csv`` for the same window written by another run (a re-run
with other columns, or a second job that wrote while the first one ran): a file of its
own, listed after the plain one (by ``k``). The files whose steps overlap are one
*window* (:func:`window_groups`): the runs in it are told apart by :class:`.report.WindowRuns`.
Files are read one row at a time with the ``csv`` module.

A **merged view** (the ``DEST`` of ``msprobe-monitor merge``, recognised by its
``merge.json``) is read the same way: ``DEST/<monitor>.csv``, columns
``step,module_name,scope[,micro_step][,dp_rank],<ops>``, is one file of one pseudo-rank
(:data:`MERGED_RANK`, shown as ``merged``) whose window holds every step; rows have no
``vpp_stage`` (names are global: 0 here) and carry ``dp_rank`` (``Row.dp``; None where the
row is combined over data parallelism). Its rows are in execution order across pipeline
stages, so a row's line is its place in the step (see :mod:`.order`).

Bad input never raises a traceback. Every problem is reported as
``<file>:<line>: <what is wrong>``; by default the offending line (or, for a header that
cannot be understood, the whole file) is skipped with a warning on stderr and the
analysis goes on; with ``strict`` the first problem stops the command (exit code 2).
The last line of a file that does not end with a newline is never used: the write was
cut short, so its last value may be incomplete.
"""

import csv
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, TextIO, Tuple

from .. import rows
from ..errors import UnsafePathError
from ..rows import BASE_COLUMNS, COUNT_OPS, FILE_RE, MICRO_STEP, MICRO_STEP_MONITORS, MONITORS, file_run
from ..safe_fs import open_regular

# Every statistic a file can have, in the order of the columns in every file: the five
# of the user document (``rows.DEFAULT_OPS``, what a monitor writes when its ops are not
# given), then the optional ``zeros``.
OPS: Tuple[str, ...] = rows.ALL_OPS
RANK_RE = re.compile(r"^rank_(?P<rank>\d+)$")
# the merged view (analysis/merge.py): DEST/merge.json names it, DEST/<monitor>.csv holds it
MERGE_FILE = "merge.json"
MERGE_FORMAT = "msprobe-monitor-merged"
MERGED_RANK = 0  # the one pseudo-rank of a merged view
MERGED_FILE_RE = re.compile(r"^(?P<monitor>[a-z_]+)\.csv$")
DP_RANK = "dp_rank"
_NO_LAST_STEP = (1 << 62)  # a merged file's window: every step


class InputError(Exception):
    """Input the command cannot work with (a missing directory, a bad flag value, or a
    malformed file in ``--strict`` mode): reported in one line, exit code 2."""


# ------------------------------------------------------------------------ problems
@dataclass
class Problem:
    path: str
    line: Optional[int]
    message: str

    def __str__(self) -> str:
        where = self.path if self.line is None else f"{self.path}:{self.line}"
        return f"{where}: {self.message}"

    def to_json(self) -> Dict[str, object]:
        return {"file": self.path, "line": self.line, "message": self.message}


class Problems:
    """Collects malformed-input problems: a warning on ``stream`` for each of the first
    ``show`` ones (then one line saying how many more), or, when ``strict``, an
    :class:`InputError` at the first one."""

    KEEP = 200

    def __init__(self, strict: bool = False, stream: Optional[TextIO] = None, show: int = 20) -> None:
        self.strict = strict
        self.stream = stream
        self.show = show
        self.count = 0
        self.items: List[Problem] = []

    def report(self, path: str, line: Optional[int], message: str, skipped: str = "line") -> None:
        """``skipped``: what is left out and the analysis goes on without: ``line`` or ``file``."""
        if self.strict:
            raise InputError(f"{Problem(path, line, message)} (--strict: stopping at the first malformed input)")
        problem = Problem(path, line, f"{message}; {skipped} skipped")
        self.count += 1
        if len(self.items) < self.KEEP:
            self.items.append(problem)
        stream = self.stream if self.stream is not None else sys.stderr
        if self.count <= self.show:
            print(f"msprobe-monitor: warning: {problem}", file=stream)
        elif self.count == self.show + 1:
            print("msprobe-monitor: warning: more malformed input; only the first "
                  f"{self.show} problems are shown here (all are counted)", file=stream)

    def summary(self) -> str:
        return f"{self.count} malformed line(s)/file(s) skipped" if self.count else ""


# ------------------------------------------------------------------------ layout
@dataclass(frozen=True)
class CsvFile:
    rank: int
    monitor: str
    first: int  # first step of the file's window
    last: int   # last step of the file's window
    path: str
    merged: bool = False  # a merged view's <monitor>.csv (no vpp_stage, optional dp_rank)
    run: int = 1  # the run series of the name: 1 plain, k for <monitor>_step<a>-<b>.run<k>.csv
    # when the file was last written (0: not known, as in an exported dataset): says which of
    # a window's files holds the latest run where their names cannot (.report.segment_order)
    mtime_ns: int = 0


@dataclass
class Layout:
    root: str
    files: Dict[int, Dict[str, List[CsvFile]]] = field(default_factory=dict)
    # the merged view's merge.json (None for a monitor output_dir): one pseudo-rank, MERGED_RANK
    merged: Optional[Dict[str, Any]] = None

    @property
    def ranks(self) -> List[int]:
        return sorted(self.files)

    @property
    def monitors(self) -> List[str]:
        present = {m for per_rank in self.files.values() for m in per_rank}
        return [m for m in MONITORS if m in present]

    def files_of(self, rank: int, monitor: str) -> List[CsvFile]:
        return self.files.get(rank, {}).get(monitor, [])

    def all_files(self) -> List[CsvFile]:
        return [f for r in self.ranks for m in MONITORS for f in self.files_of(r, m)]

    @property
    def n_files(self) -> int:
        return sum(len(v) for per_rank in self.files.values() for v in per_rank.values())


StepRange = Tuple[Optional[int], Optional[int]]


def parse_steps(text: Optional[str]) -> Optional[StepRange]:
    """``"10:20"`` (inclusive), ``"10:"``, ``":20"`` or ``"7"``."""
    if text is None:
        return None
    t = text.strip()
    try:
        if ":" in t:
            lo_s, hi_s = t.split(":", 1)
            lo = int(lo_s) if lo_s.strip() else None
            hi = int(hi_s) if hi_s.strip() else None
        else:
            lo = hi = int(t)
    except ValueError:
        raise InputError(f"--steps {text!r}: expected FIRST:LAST (inclusive, either may be omitted) or one step") from None
    if lo is not None and hi is not None and hi < lo:
        raise InputError(f"--steps {text!r}: the last step is before the first")
    return lo, hi


def parse_int_list(text: Optional[str], flag: str) -> Optional[List[int]]:
    """``"0,1,4-7"`` -> [0, 1, 4, 5, 6, 7]."""
    if text is None:
        return None
    out: List[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part:
                a, b = part.split("-", 1)
                out.extend(range(int(a), int(b) + 1))
            else:
                out.append(int(part))
    except ValueError:
        raise InputError(f"{flag} {text!r}: expected integers, e.g. 0,1,4-7") from None
    if not out:
        raise InputError(f"{flag} {text!r}: empty list")
    return sorted(set(out))


def parse_monitor_list(text: Optional[str]) -> Optional[List[str]]:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in MONITORS]
    if bad or not names:
        raise InputError(f"--monitors {text!r}: unknown monitor {', '.join(bad) or '(none)'}; "
                         f"choose among {', '.join(MONITORS)}")
    return names


def in_steps(step: int, steps: Optional[StepRange]) -> bool:
    if steps is None:
        return True
    lo, hi = steps
    return (lo is None or step >= lo) and (hi is None or step <= hi)


def scan(root: str, ranks: Optional[Sequence[int]] = None, monitors: Optional[Sequence[str]] = None,
         steps: Optional[StepRange] = None) -> Layout:
    """The CSV files under ``root`` (a monitor ``output_dir``, or one of its ``rank_<r>``
    directories), filtered by rank, monitor and step range; files sorted by window."""
    if not os.path.exists(root):
        raise InputError(f"{root}: no such directory")
    if not os.path.isdir(root):
        raise InputError(f"{root}: not a directory (expected a monitor output_dir holding rank_<r>/ directories)")
    if is_merged_view(root):
        return scan_merged(root, ranks, monitors, steps)
    root_norm = os.path.normpath(root)
    m = RANK_RE.match(os.path.basename(root_norm))
    if m and not any(RANK_RE.match(n) for n in _listdir(root)):
        # a rank directory given directly
        rank = int(m.group("rank"))
        rank_dirs = {rank: root_norm}
        root_norm = os.path.dirname(root_norm) or "."
    else:
        rank_dirs = {}
        for name in _listdir(root):
            rm = RANK_RE.match(name)
            path = os.path.join(root, name)
            if rm and os.path.isdir(path):
                rank_dirs[int(rm.group("rank"))] = path
    if not rank_dirs:
        raise InputError(
            f"{root}: no rank_<r> directories; expected a monitor output_dir laid out as "
            f"<output_dir>/rank_<r>/<monitor>_step<a>-<b>.csv"
        )
    layout = Layout(root=root_norm)
    wanted_ranks = None if ranks is None else set(ranks)
    wanted_monitors = None if monitors is None else set(monitors)
    seen_any = False
    for rank in sorted(rank_dirs):
        if wanted_ranks is not None and rank not in wanted_ranks:
            continue
        per_monitor: Dict[str, List[CsvFile]] = {}
        for name in _listdir(rank_dirs[rank]):
            fm = FILE_RE.match(name)
            if not fm or fm.group("monitor") not in MONITORS:
                continue
            seen_any = True
            monitor = fm.group("monitor")
            a, b = int(fm.group("a")), int(fm.group("b"))
            if wanted_monitors is not None and monitor not in wanted_monitors:
                continue
            if steps is not None:
                lo, hi = steps
                if (lo is not None and b < lo) or (hi is not None and a > hi):
                    continue
            path = os.path.join(rank_dirs[rank], name)
            per_monitor.setdefault(monitor, []).append(
                CsvFile(rank, monitor, a, b, path, run=file_run(fm), mtime_ns=_mtime_ns(path)))
        for files in per_monitor.values():
            files.sort(key=lambda f: (f.first, f.last, f.run))
        if per_monitor:
            layout.files[rank] = per_monitor
    if not layout.files:
        if not seen_any:
            raise InputError(f"{root}: the rank_<r> directories hold no <monitor>_step<a>-<b>[.run<k>].csv files")
        raise InputError(f"{root}: no CSV file matches the --ranks/--monitors/--steps selection")
    return layout


def _mtime_ns(path: str) -> int:
    """The file's modification time (of the name itself: a link is refused when read)."""
    try:
        return os.lstat(path).st_mtime_ns
    except OSError:
        return 0


def window_groups(files: Sequence[CsvFile]) -> List[List[CsvFile]]:
    """``files`` of one rank and monitor (in :func:`scan`'s order) cut into windows: the
    files whose steps overlap, i.e. a window's plain file and its ``.run<k>`` files (and
    files of windows that another ``step_count_per_record`` or a monitor turned on mid-window
    cut otherwise), each window in scan order. A step's rows of all runs lie in one window."""
    groups: List[List[CsvFile]] = []
    end = 0
    for f in files:
        if groups and f.first <= end:
            groups[-1].append(f)
            end = max(end, f.last)
        else:
            groups.append([f])
            end = f.last
    return groups


def is_merged_view(root: str) -> bool:
    """``root`` holds a merged view (``msprobe-monitor merge``'s DEST: a ``merge.json``)."""
    return os.path.isfile(os.path.join(root, MERGE_FILE))


def read_merge_json(root: str) -> Dict[str, Any]:
    """``root/merge.json``, checked (an :class:`InputError` naming what is wrong)."""
    import json

    from ..safe_fs import read_regular_file

    path = os.path.join(root, MERGE_FILE)
    try:
        doc = json.loads(read_regular_file(path, 16 << 20, "merge report").decode("utf-8"))
    except UnsafePathError as exc:
        raise InputError(f"{path}: not read: {exc.why}") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read the file: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != MERGE_FORMAT:
        raise InputError(f"{path}: not a merged view of msprobe-monitor (no \"format\": \"{MERGE_FORMAT}\")")
    if doc.get("version") != 1:
        raise InputError(f"{path}: merged view version {doc.get('version')!r}, this version reads 1")
    return doc


def scan_merged(root: str, ranks: Optional[Sequence[int]] = None, monitors: Optional[Sequence[str]] = None,
                steps: Optional[StepRange] = None) -> Layout:
    """The :class:`Layout` of a merged view: one pseudo-rank (:data:`MERGED_RANK`), one
    file per monitor whose window is every step (``steps`` filters rows, not files)."""
    doc = read_merge_json(root)
    if ranks is not None and MERGED_RANK not in ranks:
        raise InputError(f"{root}: a merged view has one pseudo-rank, {MERGED_RANK} (--ranks {ranks_list(ranks)} "
                         f"selects none); its rows of each data-parallel rank are told apart by dp_rank")
    wanted = None if monitors is None else set(monitors)
    per_monitor: Dict[str, List[CsvFile]] = {}
    for name in _listdir(root):
        fm = MERGED_FILE_RE.match(name)
        if not fm or fm.group("monitor") not in MONITORS:
            continue
        monitor = fm.group("monitor")
        if wanted is not None and monitor not in wanted:
            continue
        per_monitor[monitor] = [CsvFile(MERGED_RANK, monitor, 0, _NO_LAST_STEP, os.path.join(root, name), True)]
    if not per_monitor:
        raise InputError(f"{root}: a merged view (merge.json) with no <monitor>.csv "
                         + ("matching --monitors" if wanted is not None else "file"))
    return Layout(root=os.path.normpath(root), files={MERGED_RANK: per_monitor}, merged=doc)


def refuse_merged(layout: Layout, what: str) -> None:
    """An :class:`InputError` when ``layout`` is a merged view, which ``what`` does not read
    (its rows per data-parallel rank would lose their ``dp_rank``)."""
    if layout.merged is not None:
        raise InputError(f"{layout.root}: a merged view (merge.json); {what} reads a monitor output_dir "
                         f"(rank_<r>/ directories): give it the directory that was merged, "
                         f"{layout.merged.get('source', 'OUTPUT_DIR')}")


def ranks_list(ranks: Sequence[int]) -> str:
    return ",".join(str(r) for r in ranks)


def _listdir(path: str) -> List[str]:
    try:
        return sorted(os.listdir(path))
    except OSError as exc:
        raise InputError(f"{path}: cannot list the directory: {exc.strerror or exc}") from None


# ------------------------------------------------------------------------ rows
class Row:
    """One CSV row. ``vals`` maps each op of the file to its value (``nans``, ``zeros`` ints);
    ``micro`` is None outside ``weight_grad`` files; ``line`` is the line number; ``dp``:
    the ``dp_rank`` of a merged view's row kept per data-parallel rank (None elsewhere).
    A tensor is ``(name, scope, dp)``: the rows of each dp rank have their own history."""

    __slots__ = ("step", "vpp", "name", "scope", "micro", "vals", "line", "dp")

    def __init__(self, step: int, vpp: int, name: str, scope: str, micro: Optional[int],
                 vals: Dict[str, float], line: int, dp: Optional[int] = None) -> None:
        self.step = step
        self.vpp = vpp
        self.name = name
        self.scope = scope
        self.micro = micro
        self.vals = vals
        self.line = line
        self.dp = dp


def merged_columns(monitor: str, header: List[str]) -> Tuple[Optional[List[str]], str]:
    """The leading (non-statistic) columns of a merged view's header,
    ``step,module_name,scope[,micro_step][,dp_rank]`` (``micro_step`` in ``weight_grad``
    only, ``dp_rank`` in ``weight_grad`` and ``module`` only), or ``(None, why)``."""
    cols = [rows.STEP, rows.MODULE_NAME, rows.SCOPE]
    want = ",".join(cols) + ("[,micro_step]" if monitor in MICRO_STEP_MONITORS else "") + \
        ("[,dp_rank]" if monitor in MERGED_DP_MONITORS else "") + ",<ops>"
    if header[:3] != cols:
        return None, f"unrecognised header {','.join(header)!r} of a merged view: expected {want}"
    i = 3
    if monitor in MICRO_STEP_MONITORS and i < len(header) and header[i] == MICRO_STEP:
        cols.append(MICRO_STEP)
        i += 1
    if monitor in MERGED_DP_MONITORS and i < len(header) and header[i] == DP_RANK:
        cols.append(DP_RANK)
    return cols, ""


# the monitors whose merged files have a dp_rank column (rows kept per data-parallel rank)
MERGED_DP_MONITORS: Tuple[str, ...] = (rows.WEIGHT_GRAD, rows.MODULE)


def header_ops(monitor: str, header: List[str], merged: bool = False) -> Tuple[Optional[Tuple[str, ...]], str]:
    """``(ops, "")`` for a header this version writes (``merged``: of a merged view), else
    ``(None, why)``."""
    if merged:
        lead, why = merged_columns(monitor, header)
        if lead is None:
            return None, why
        return _ops_of(header, lead)
    with_micro = monitor in MICRO_STEP_MONITORS
    expected = rows.header((), with_micro)
    want = ",".join(expected) + ",<ops>"
    if header[:len(expected)] != expected:
        with_micro_columns = rows.header((), True)
        if not with_micro and header[:len(with_micro_columns)] == with_micro_columns:
            why = f"a micro_step column, which only weight_grad files have (expected {want})"
        elif with_micro and header[:len(BASE_COLUMNS)] == list(BASE_COLUMNS):
            why = f"no micro_step column (written by another version?); expected {want}"
        else:
            why = f"expected {want}"
        return None, f"unrecognised header {','.join(header)!r}: {why}"
    return _ops_of(header, expected)


def _ops_of(header: List[str], expected: List[str]) -> Tuple[Optional[Tuple[str, ...]], str]:
    ops = header[len(expected):]
    unknown = [op for op in ops if op not in OPS]
    if not ops:
        return None, f"header {','.join(header)!r} has no statistic column (expected some of {','.join(OPS)})"
    if unknown:
        return None, (f"header {','.join(header)!r} has unknown column(s) {','.join(unknown)} "
                      f"(written by another version?); statistics are {','.join(OPS)}")
    order = [OPS.index(op) for op in ops]
    if order != sorted(set(order)):
        return None, f"header {','.join(header)!r}: statistics repeated or out of the order {','.join(OPS)}"
    return tuple(ops), ""


def text_cell(cell: str) -> str:
    """A ``module_name`` or ``scope`` cell as the monitor meant it: the writer puts one
    single quote in front of a name that starts with ``=``, ``+``, ``-``, ``@`` or ``'``
    (so that a spreadsheet never runs it as a formula); exactly one is removed here."""
    return cell[1:] if cell.startswith("'") else cell


def iter_rows(f: CsvFile, problems: Problems, steps: Optional[StepRange] = None,
              on_header: Optional[Callable[[Tuple[str, ...]], None]] = None) -> Iterator[Row]:
    """Stream the valid rows of ``f``; report every bad line to ``problems`` and skip it.
    ``on_header(ops)`` is called once the header is known to be good."""
    path = f.path
    try:
        # never blocks on a FIFO, never shows a file another user linked here
        fh = open(open_regular(path), newline="", encoding="utf-8", errors="replace")
    except UnsafePathError as exc:
        problems.report(path, None, f"not read: {exc.why}", "file")
        return
    except OSError as exc:
        problems.report(path, None, f"cannot read the file: {exc.strerror or exc}", "file")
        return
    with fh:
        last = [""]

        def lines(src: Iterable[str]) -> Iterator[str]:
            for text in src:
                last[0] = text
                yield text

        reader = csv.reader(lines(fh))
        try:
            header = next(reader)
        except StopIteration:
            problems.report(path, None, "empty file (not even a header line; the job may have died "
                                        "while creating it)", "file")
            return
        except csv.Error as exc:
            problems.report(path, 1, f"cannot parse the header: {exc}", "file")
            return
        if not last[0].endswith("\n"):
            problems.report(path, 1, "the file ends in the middle of its header line (a write cut short)", "file")
            return
        ops, why = header_ops(f.monitor, [h.strip() for h in header], f.merged)
        if ops is None:
            problems.report(path, 1, f"{why}", "file")
            return
        if on_header is not None:
            on_header(ops)
        if f.merged:
            yield from _merged_rows(f, reader, last, header, ops, problems, steps)
            return
        with_micro = f.monitor in MICRO_STEP_MONITORS
        ncol = len(header)
        first_op = 5 if with_micro else 4
        op_cols = [(op, first_op + i) for i, op in enumerate(ops)]
        a, b = f.first, f.last
        while True:
            try:
                cells = next(reader)
            except StopIteration:
                break
            except csv.Error as exc:
                problems.report(path, reader.line_num, f"cannot parse the line: {exc}")
                continue
            line = reader.line_num
            if not last[0].endswith("\n"):
                problems.report(path, line, "the file ends in the middle of this line (a write cut short, "
                                            "e.g. the job was killed)")
                break
            if len(cells) != ncol:
                problems.report(path, line, _column_count_message(cells, header, ncol))
                continue
            try:
                vpp = int(cells[0])
                step = int(cells[1])
                micro = int(cells[4]) if with_micro else None
                vals = {op: (int(cells[i]) if op in COUNT_OPS else float(cells[i])) for op, i in op_cols}
            except ValueError:
                if [c.strip() for c in cells[:len(BASE_COLUMNS)]] == list(BASE_COLUMNS):
                    problems.report(path, line, _second_header(cells))
                else:
                    problems.report(path, line, _value_message(cells, header, with_micro, op_cols))
                continue
            if not a <= step <= b:
                problems.report(path, line, f"step {step} is outside this file's steps {a}-{b} "
                                            f"(file renamed or mixed up?)")
                continue
            if steps is not None and not in_steps(step, steps):
                continue
            yield Row(step, vpp, text_cell(cells[2]), text_cell(cells[3]), micro, vals, line)


def _merged_rows(f: CsvFile, reader: Any, last: List[str], header: List[str], ops: Tuple[str, ...],
                 problems: Problems, steps: Optional[StepRange]) -> Iterator[Row]:
    """The rows of a merged view's file after its header (see :func:`merged_columns`):
    no vpp_stage (0: names are global), an empty ``micro_step``/``dp_rank`` is None."""
    path = f.path
    lead, _why = merged_columns(f.monitor, [h.strip() for h in header])
    assert lead is not None  # header_ops accepted it
    micro_i = lead.index(MICRO_STEP) if MICRO_STEP in lead else None
    dp_i = lead.index(DP_RANK) if DP_RANK in lead else None
    ncol = len(header)
    op_cols = [(op, len(lead) + i) for i, op in enumerate(ops)]
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            problems.report(path, reader.line_num, f"cannot parse the line: {exc}")
            continue
        line = reader.line_num
        if not last[0].endswith("\n"):
            problems.report(path, line, "the file ends in the middle of this line (a write cut short)")
            break
        if len(cells) != ncol:
            if not cells or cells == [""]:
                problems.report(path, line, "empty line")
            else:
                problems.report(path, line, f"{len(cells)} fields where the header ({','.join(header)}) has {ncol}")
            continue
        try:
            step = int(cells[0])
            micro = int(cells[micro_i]) if micro_i is not None and cells[micro_i] != "" else None
            dp = int(cells[dp_i]) if dp_i is not None and cells[dp_i] != "" else None
            vals = {op: (int(cells[i]) if op in COUNT_OPS else float(cells[i])) for op, i in op_cols}
        except ValueError:
            bad = next((lead[i] for i in range(len(lead)) if lead[i] in (rows.STEP, MICRO_STEP, DP_RANK)
                        and cells[i] != "" and not _is_int(cells[i])), None)
            if bad is not None:
                problems.report(path, line, f"column '{bad}' = {cells[lead.index(bad)]!r} is not an integer")
            else:
                problems.report(path, line, _value_message(cells, header, None, op_cols))
            continue
        if steps is not None and not in_steps(step, steps):
            continue
        yield Row(step, 0, text_cell(cells[1]), text_cell(cells[2]), micro, vals, line, dp)


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _column_count_message(cells: List[str], header: List[str], ncol: int) -> str:
    if not cells or cells == [""]:
        return "empty line"
    if [c.strip() for c in cells[:len(BASE_COLUMNS)]] == list(BASE_COLUMNS):
        return _second_header(cells)
    return (f"{len(cells)} fields where the header ({','.join(header)}) has {ncol} (mixed versions: a run "
            f"with other ops or another version appended to this file?)")


def _second_header(cells: List[str]) -> str:
    return (f"a second header line {','.join(cells)!r} (files concatenated, or a run with another "
            f"config or version appended to this file?)")


def _value_message(cells: List[str], header: List[str], with_micro: Optional[bool],
                   op_cols: List[Tuple[str, int]]) -> str:
    """``with_micro`` None: a merged view's row, whose integer columns were checked."""
    int_cols = [] if with_micro is None else [0, 1] + ([4] if with_micro else [])
    for i in int_cols:
        try:
            int(cells[i])
        except ValueError:
            return f"column '{header[i]}' = {cells[i]!r} is not an integer"
    for op, i in op_cols:
        try:
            int(cells[i]) if op in COUNT_OPS else float(cells[i])
        except ValueError:
            kind = "an integer" if op in COUNT_OPS else "a number"
            return f"column '{op}' = {cells[i]!r} is not {kind}"
    return "unreadable value"  # pragma: no cover
