"""Reading the monitor's output into Polars DataFrames: the fast path of every command,
the notebook API (:func:`load`) and ``msprobe-monitor export`` (:func:`export`).

Polars is imported only here (and by modules that call this one), never by the training
side: the error names this interpreter's ``python -m pip install`` for it.

**CSV, fast and exact.** Files of a (rank, monitor) are read in batches: the bytes of
every file of a batch with the same header are joined and parsed by Polars in one call,
with a fixed schema. A file takes the fast path only when the result is certain to be
what the ``csv`` module reader (:func:`.reader.iter_rows`) would produce: it ends with a
newline, holds no quote, carriage return or NUL byte, its header is one this version
writes, every line parses with no missing value, and its steps lie in its window. Line
numbers are then exact (row *i* is line *i + 2*). Any other file is read by
:func:`.reader.iter_rows`, which reports every malformed line with its message and
skips it (or stops, with ``--strict``): same rows, same messages as before.

**Parquet.** :func:`export` writes one dataset partitioned by monitor and rank
(``<dest>/monitor=<m>/rank=<r>/part-<n>.parquet``, hive style), one row per CSV row plus
the columns ``file_first``/``file_last`` (the step window of the CSV file it came from),
``file_run`` (its run series: 1 for ``<monitor>_step<a>-<b>.csv``, k for its ``.run<k>``
file; absent from datasets exported before it existed: 1) and ``line`` (its line in that
file). Every command reads such a dataset wherever it
reads an output directory; a finding's ``file`` is then the Parquet file, its ``line``
the line of the CSV row it was exported from.
"""

import os
import re
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from .command import pip_command
from ..rows import (BASE_COLUMNS, COUNT_OPS, DEFAULT_OPS, MICRO_STEP, MICRO_STEP_MONITORS, MODULE_NAME, MONITORS,
                    SCOPE, STEP, TEXT_COLUMNS, VPP_STAGE, header)
from ..safe_fs import SafeDir, open_regular
from .reader import (DP_RANK, OPS, CsvFile, InputError, Layout, Problems, Row, StepRange, header_ops, iter_rows,
                     merged_columns, refuse_merged, window_groups)
from .runs import FileMeta, RunLabel, segment_order

INSTALL_HINT = pip_command("polars>=1.20", "matplotlib>=3.5") + " (what the 'analysis' extra of msprobe-monitor installs)"
PARQUET_GLOB = "part-*.parquet"
PARQUET_PART = re.compile(r"^part-\d+\.parquet$")
_HIVE_MONITOR = re.compile(r"^monitor=(?P<monitor>[a-z_]+)$")
_HIVE_RANK = re.compile(r"^rank=(?P<rank>\d+)$")
# rows per batch: bounds the memory of a command (about 100 bytes per row in a batch)
BATCH_ROWS = 1_000_000
_BYTES_PER_ROW_GUESS = 60
_PARQUET_ROWS: Dict[Tuple[str, int, int, int], int] = {}  # (path, first, last, run) -> rows of that file

COLUMNS: Tuple[str, ...] = BASE_COLUMNS + (MICRO_STEP,) + OPS
# the columns of load() on a merged view (analysis/merge.py): no rank, no vpp_stage, a dp_rank
MERGED_COLUMNS: Tuple[str, ...] = (STEP, MODULE_NAME, SCOPE, MICRO_STEP, DP_RANK) + OPS


def polars():
    """The ``polars`` module, or an :class:`InputError` saying what to install."""
    try:
        import polars as pl
    except ImportError:
        raise InputError("the analysis engine needs Polars, which is not installed: " + INSTALL_HINT) from None
    return pl


def _schema(pl) -> Dict[str, Any]:
    return {VPP_STAGE: pl.Int64, STEP: pl.Int64, MODULE_NAME: pl.String, SCOPE: pl.String, MICRO_STEP: pl.Int64,
            **{op: pl.Int64 if op in COUNT_OPS else pl.Float64 for op in OPS}, DP_RANK: pl.Int64}


def empty_frame(pl):
    """A batch frame with no row: :data:`COLUMNS`, ``line``, ``fidx`` and ``dp_rank``
    (null outside a merged view)."""
    s = _schema(pl)
    s.update(line=pl.Int64, fidx=pl.Int64)
    return pl.DataFrame(schema=s).select(*COLUMNS, "line", "fidx", DP_RANK)


# ------------------------------------------------------------------ parquet layout
def is_parquet_dataset(root: str) -> bool:
    try:
        return any(_HIVE_MONITOR.match(n) for n in os.listdir(root))
    except OSError:
        return False


def scan_parquet_dataset(root: str, ranks: Optional[Sequence[int]] = None,
                         monitors: Optional[Sequence[str]] = None, steps: Optional[StepRange] = None) -> Layout:
    """The :class:`Layout` of an exported dataset: one entry per CSV file window it holds,
    each pointing at the (monitor, rank) Parquet file."""
    pl = polars()
    layout = Layout(root=os.path.normpath(root))
    wanted_ranks = None if ranks is None else set(ranks)
    for mname in sorted(os.listdir(root)):
        mm = _HIVE_MONITOR.match(mname)
        if not mm or mm.group("monitor") not in MONITORS:
            continue
        monitor = mm.group("monitor")
        if monitors is not None and monitor not in monitors:
            continue
        for rname in sorted(os.listdir(os.path.join(root, mname))):
            rm = _HIVE_RANK.match(rname)
            part_dir = os.path.join(root, mname, rname)
            if not rm or not os.path.isdir(part_dir) or not any(PARQUET_PART.match(n) for n in os.listdir(part_dir)):
                continue
            path = os.path.join(part_dir, PARQUET_GLOB)
            rank = int(rm.group("rank"))
            if wanted_ranks is not None and rank not in wanted_ranks:
                continue
            lf = pl.scan_parquet(path)
            windows = (_with_file_run(pl, lf).group_by("file_first", "file_last", "file_run").agg(pl.len().alias("n"))
                       .sort("file_first", "file_last", "file_run").collect())
            for a, b, k, n in windows.iter_rows():
                _PARQUET_ROWS[(path, a, b, k)] = n
                if steps is not None:
                    lo, hi = steps
                    if (lo is not None and b < lo) or (hi is not None and a > hi):
                        continue
                layout.files.setdefault(rank, {}).setdefault(monitor, []).append(
                    CsvFile(rank, monitor, a, b, path, run=k))
    if not layout.files:
        raise InputError(f"{root}: no Parquet data matches the --ranks/--monitors/--steps selection")
    return layout


def _with_file_run(pl, lf):
    """An exported dataset's rows with ``file_run`` (1 where it was exported before it existed)."""
    if "file_run" in lf.collect_schema().names():
        return lf
    return lf.with_columns(pl.lit(1, dtype=pl.Int64).alias("file_run"))


def _read_parquet_windows(pl, files: Sequence[CsvFile], steps: Optional[StepRange]):
    """Rows of the given CSV files (windows and run series) of one Parquet file (all
    ``files`` share the path), in file order."""
    path = files[0].path
    windows = pl.DataFrame({"file_first": [f.first for f in files], "file_last": [f.last for f in files],
                            "file_run": [f.run for f in files], "fidx": list(range(len(files)))},
                           schema={"file_first": pl.Int64, "file_last": pl.Int64, "file_run": pl.Int64,
                                   "fidx": pl.Int64})
    lf = _with_file_run(pl, pl.scan_parquet(path)).filter(
        pl.col("file_first").is_between(min(f.first for f in files), max(f.first for f in files)))
    lf = lf.join(windows.lazy(), on=["file_first", "file_last", "file_run"], how="inner", maintain_order="left")
    lf = lf.sort("fidx", maintain_order=True)
    lf = filter_steps(pl, lf, steps)
    df = lf.collect()
    # a dataset exported before a statistic existed (zeros) lacks its column: all null
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        schema = _schema(pl)
        df = df.with_columns(*[pl.lit(None, dtype=schema[c]).alias(c) for c in missing])
    ops = tuple(op for op in OPS if op in df.columns and df[op].null_count() < len(df)) or DEFAULT_OPS
    return df.with_columns(pl.lit(None, dtype=pl.Int64).alias(DP_RANK)).select(
        *[c for c in COLUMNS], "line", "fidx", DP_RANK), ops


def filter_steps(pl, lf, steps: Optional[StepRange]):
    if steps is None:
        return lf
    lo, hi = steps
    if lo is not None:
        lf = lf.filter(pl.col("step") >= lo)
    if hi is not None:
        lf = lf.filter(pl.col("step") <= hi)
    return lf


# ------------------------------------------------------------------ CSV reading
class Batch:
    """Rows of some files of one (rank, monitor): ``frame`` (the columns of
    :data:`COLUMNS` plus ``line``, ``fidx``, the file's index in ``files``, and
    ``dp_rank``, null outside a merged view), in file then line order; ``headers``: the op
    lists of the good headers met; ``file_ops``: the ops of each file (by ``fidx``) whose
    header is good."""

    def __init__(self, files: List[CsvFile], frame, headers: List[Tuple[str, ...]],
                 file_ops: Optional[Dict[int, Tuple[str, ...]]] = None) -> None:
        self.files = files
        self.frame = frame
        self.headers = headers
        self.file_ops = file_ops if file_ops is not None else {}


def _estimated_rows(f: CsvFile) -> int:
    if f.path.endswith(".parquet"):
        return _PARQUET_ROWS.get((f.path, f.first, f.last, f.run), 1)
    try:
        return os.path.getsize(f.path) // _BYTES_PER_ROW_GUESS + 1
    except OSError:
        return 1


def batches(files: Sequence[CsvFile], max_rows: int = BATCH_ROWS) -> Iterator[List[CsvFile]]:
    """Consecutive groups of ``files`` (of one rank and monitor, in scan order) of about
    ``max_rows`` rows (by file size); a window's files (:func:`.reader.window_groups`) stay
    in one group, so that its runs are told apart in one batch (:func:`mark_runs`)."""
    group: List[CsvFile] = []
    rows = 0
    for window in window_groups(files):
        est = sum(_estimated_rows(f) for f in window)
        f = window[0]
        if group and (rows + est > max_rows or (f.path.endswith(".parquet") != group[0].path.endswith(".parquet"))
                      or (f.path.endswith(".parquet") and f.path != group[0].path)):
            yield group
            group, rows = [], 0
        group.extend(window)
        rows += est
    if group:
        yield group


def read_batch(files: List[CsvFile], problems: Problems, steps: Optional[StepRange]) -> Batch:
    """The rows of ``files`` (one rank, one monitor), exactly as :func:`.reader.iter_rows`
    gives them, problems reported the same way."""
    pl = polars()
    if files and files[0].path.endswith(".parquet"):
        frame, ops = _read_parquet_windows(pl, files, steps)
        return Batch(files, frame, [ops], {i: ops for i in range(len(files))})
    file_ops: Dict[int, Tuple[str, ...]] = {}
    fast: Dict[Tuple[Tuple[str, ...], Tuple[str, ...]], List[Tuple[int, memoryview, int]]] = {}
    # (leading columns, ops) -> [(fidx, body, rows)]
    slow: List[int] = []
    headers: List[Tuple[str, ...]] = []
    for i, f in enumerate(files):
        got = _fast_candidate(f)
        if got is None:
            slow.append(i)
            continue
        lead, ops, body, rows = got
        fast.setdefault((lead, ops), []).append((i, body, rows))
    frames: List[Any] = []
    for (lead, ops), items in fast.items():
        ok_frames, bad = _parse_fast(pl, files, lead, ops, items)
        frames.extend(ok_frames)
        if len(bad) < len(items):
            headers.append(ops)
        file_ops.update((i, ops) for i, _body, _rows in items if i not in bad)
        slow.extend(bad)
    for i in sorted(slow):
        frames.append(_read_reference(pl, files[i], i, problems, headers, file_ops))
    frames = [fr for fr in frames if len(fr)]
    if not frames:
        return Batch(files, empty_frame(pl), headers, file_ops)
    frame = pl.concat(frames, how="vertical").sort("fidx", "line", maintain_order=True) if len(frames) > 1 \
        else frames[0]
    if steps is not None:
        frame = filter_steps(pl, frame.lazy(), steps).collect()
    return Batch(files, frame, headers, file_ops)


def _fast_candidate(f: CsvFile) -> Optional[Tuple[Tuple[str, ...], Tuple[str, ...], memoryview, int]]:
    """``(leading columns, ops, body, rows)`` of a file that may take the fast path, else None."""
    try:
        with open(open_regular(f.path), "rb") as fh:
            data = fh.read()
    except OSError:  # refused or unreadable: the reference reader reports why
        return None
    if not data.endswith(b"\n") or b'"' in data or b"\r" in data or b"\x00" in data:
        return None
    end = data.index(b"\n")
    try:
        columns = data[:end].decode("utf-8").split(",")
    except UnicodeDecodeError:
        return None
    columns = [h.strip() for h in columns]
    ops, _why = header_ops(f.monitor, columns, f.merged)
    if ops is None:
        return None
    if f.merged:
        lead = tuple(merged_columns(f.monitor, columns)[0] or ())
    else:
        lead = tuple(header((), f.monitor in MICRO_STEP_MONITORS))
    body = memoryview(data)[end + 1:]  # joined into the batch's buffer later: no copy here
    return lead, ops, body, data.count(b"\n") - 1


def _parse_fast(pl, files: List[CsvFile], lead: Tuple[str, ...], ops: Tuple[str, ...],
                items: List[Tuple[int, memoryview, int]]) -> Tuple[List[Any], List[int]]:
    """Parse the bodies of ``items`` in one call; on any doubt, file by file; the files
    that still fail are returned for the reference reader."""
    frame = _parse_bodies(pl, files, lead, ops, items)
    if frame is not None:
        return [frame], []
    if len(items) == 1:
        return [], [items[0][0]]
    good, bad = [], []
    for item in items:
        fr = _parse_bodies(pl, files, lead, ops, [item])
        if fr is None:
            bad.append(item[0])
        else:
            good.append(fr)
    return good, bad


_CSV_OPTIONS: Dict[str, Any] = {}


def _csv_options(pl) -> Dict[str, Any]:
    """An empty name or scope is an empty string, as the ``csv`` module reads it (the
    option was renamed in Polars 2)."""
    if not _CSV_OPTIONS:
        import inspect

        params = inspect.signature(pl.read_csv).parameters
        if "empty_string_is_null" in params:
            _CSV_OPTIONS["empty_string_is_null"] = False
        else:
            _CSV_OPTIONS["missing_utf8_is_empty_string"] = True
        if "raise_if_empty" in params:
            _CSV_OPTIONS["raise_if_empty"] = False
    return _CSV_OPTIONS


def _parse_bodies(pl, files: List[CsvFile], lead: Tuple[str, ...], ops: Tuple[str, ...],
                  items: List[Tuple[int, memoryview, int]]):
    import numpy as np

    names = list(lead) + list(ops)
    merged = VPP_STAGE not in lead  # a merged view's file: may leave micro_step and dp_rank empty
    full = _schema(pl)
    schema = {n: full[n] for n in names}
    total = sum(n for _, _, n in items)
    data = b"".join(body for _, body, _ in items)
    if total == 0:
        return None if data else empty_frame(pl)
    try:
        df = pl.read_csv(data, has_header=False, schema=schema, encoding="utf8", **_csv_options(pl))
    except Exception:  # any parse problem: the reference reader says exactly what and where
        return None
    if len(df) != total:
        return None
    numeric = [n for n in names if n not in TEXT_COLUMNS and not (merged and n in (MICRO_STEP, DP_RANK))]
    if any(df[n].null_count() for n in numeric):
        return None
    counts = np.array([n for _, _, n in items], dtype=np.int64)
    fidx = np.repeat(np.array([i for i, _, _ in items], dtype=np.int64), counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    line = np.arange(total, dtype=np.int64) - starts + 2
    first = np.repeat(np.array([files[i].first for i, _, _ in items], dtype=np.int64), counts)
    last = np.repeat(np.array([files[i].last for i, _, _ in items], dtype=np.int64), counts)
    step = df["step"].to_numpy()
    if ((step < first) | (step > last)).any():
        return None  # the reference reader names the line and the file's window
    # (a merged view has no vpp_stage: its names are global, as reader.iter_rows gives 0)
    missing = [pl.lit(0 if c == VPP_STAGE else None, dtype=full[c]).alias(c)
               for c in COLUMNS + (DP_RANK,) if c not in names]
    # the writer's formula escape (reader.text_cell): one leading quote is not part of the name
    unquoted = [pl.col(c).str.strip_prefix("'") for c in TEXT_COLUMNS]
    return df.with_columns(*unquoted, *missing, pl.Series("line", line), pl.Series("fidx", fidx)).select(
        *COLUMNS, "line", "fidx", DP_RANK)


def _read_reference(pl, f: CsvFile, fidx: int, problems: Problems, headers: List[Tuple[str, ...]],
                    file_ops: Dict[int, Tuple[str, ...]]):
    """One file through the ``csv`` module reader (problems reported as before)."""
    cols: Dict[str, List[Any]] = {c: [] for c in COLUMNS}
    line: List[int] = []
    dp: List[Optional[int]] = []
    seen: List[Tuple[str, ...]] = []
    for row in iter_rows(f, problems, None, on_header=seen.append):
        dp.append(row.dp)
        cols["vpp_stage"].append(row.vpp)
        cols["step"].append(row.step)
        cols["module_name"].append(row.name)
        cols["scope"].append(row.scope)
        cols["micro_step"].append(row.micro)
        for op in OPS:
            cols[op].append(row.vals.get(op))
        line.append(row.line)
    headers.extend(seen)
    if seen:
        file_ops[fidx] = seen[0]
    schema = _schema(pl)
    df = pl.DataFrame({c: pl.Series(c, cols[c], dtype=schema[c]) for c in COLUMNS})
    return df.with_columns(pl.Series("line", line, dtype=pl.Int64), pl.lit(fidx, dtype=pl.Int64).alias("fidx"),
                           pl.Series(DP_RANK, dp, dtype=pl.Int64))


# ------------------------------------------------------------------ runs
class WindowInfo:
    """What :func:`mark_runs` found in one window of a batch (the columnar twin of
    :class:`.report.WindowRuns`): its files (indices in the batch), the runs each holds,
    and whether modification times said their order."""

    __slots__ = ("fidx", "segments", "runs", "by_time")

    def __init__(self, fidx: List[int], segments: List[int], by_time: bool) -> None:
        self.fidx = fidx
        self.segments = segments
        self.runs = sum(segments)
        self.by_time = by_time


def file_segments(pl, fr, key: Sequence[Any]):
    """``fr`` (rows in file then line order) with ``_run``: each row's run within its file
    (0, or k for the k-th run appended to it), as :class:`.report.FileRuns` cuts a file: a
    run starts over at a lower step, or at the row its file's current run began with
    (``key``: the expressions of (step, tensor, micro_step) that tell rows apart)."""
    back = (pl.col("step").diff().over("fidx") < 0).fill_null(False)
    # cheap test first: no step goes back and each file's first row occurs once
    heads = fr.select(pl.col("fidx").unique(maintain_order=True).len()).item()
    quick = fr.select(back.any().alias("b"), pl.all_horizontal(*[k == k.first().over("fidx") for k in key]).sum()
                      .alias("h")).row(0)
    if not quick[0] and quick[1] == heads:
        return fr.with_columns(pl.lit(0, dtype=pl.Int64).alias("_run"))
    seg1 = back.cast(pl.Int64).cum_sum().over("fidx")
    same_head = pl.all_horizontal(*[(k == k.first()).over("fidx", seg1) for k in key])
    first_row = pl.int_range(pl.len()).over("fidx", seg1) == 0
    restart = (back | (same_head & ~first_row)).alias("_restart")
    return (fr.with_columns(restart)
            .with_columns(pl.col("_restart").cast(pl.Int64).cum_sum().over("fidx").alias("_run"))
            .drop("_restart"))


def row_key(pl) -> List[Any]:
    """:func:`file_segments`'s key on a batch frame's own columns (tensor names)."""
    return [pl.col("step"), pl.col(MODULE_NAME), pl.col(SCOPE), pl.col(MICRO_STEP).fill_null(-1),
            pl.col(DP_RANK).fill_null(-1)]


def mark_runs(pl, fr, files: Sequence[CsvFile], file_ops: Dict[int, Tuple[str, ...]], key: Sequence[Any],
              label_id: Optional[Callable[[RunLabel], int]] = None):
    """The runs of a batch's windows told apart, as :class:`.report.WindowRuns` does: ``fr``
    (every row of the batch's files, whose windows are whole) with ``_run`` (the row's
    segment in its file), ``_win`` (its window), ``_pos`` (its run's place in the window,
    in the order of writing), ``_old`` (an earlier run's row: a later run of its window wrote
    its step again) and, with ``label_id``, ``_label`` (``label_id`` of the run's
    :meth:`.report.WindowRuns.label`). Returns ``(frame, [WindowInfo])``."""
    fr = file_segments(pl, fr, key)
    nseg = dict(fr.group_by("fidx").agg(pl.col("_run").max() + 1).iter_rows())
    index = {f: i for i, f in enumerate(files)}
    table: Dict[str, List[int]] = {"fidx": [], "_run": [], "_win": [], "_pos": [], "_label": []}
    infos: List[WindowInfo] = []
    several = False
    for w, window in enumerate(window_groups(files)):
        fis = [index[f] for f in window]
        metas = [FileMeta(f.first, f.last, f.run, file_ops.get(i, ()), nseg.get(i, 0), f.mtime_ns)
                 for f, i in zip(window, fis)]
        order, by_time = segment_order(metas)
        infos.append(WindowInfo(fis, [m.segments for m in metas], by_time))
        several = several or len(order) > 1
        for p, (j, seg) in enumerate(order):
            table["fidx"].append(fis[j])
            table["_run"].append(seg)
            table["_win"].append(w)
            table["_pos"].append(p)
            table["_label"].append(0 if label_id is None else label_id((window[j].run, metas[j].ops, seg)))
    if not several and len(set(table["_label"])) <= 1:  # one run a window, all of one label: no join
        label = table["_label"][0] if table["_label"] else 0
        return fr.with_columns(pl.lit(0, dtype=pl.Int64).alias("_win"), pl.lit(0, dtype=pl.Int64).alias("_pos"),
                               pl.lit(False).alias("_old"), pl.lit(label, dtype=pl.Int64).alias("_label")), infos
    runs = pl.DataFrame(table, schema={c: pl.Int64 for c in table})
    fr = fr.join(runs, on=["fidx", "_run"], how="left", maintain_order="left")
    if several:
        fr = fr.with_columns((pl.col("_pos") < pl.col("_pos").max().over("_win", "step")).alias("_old"))
    else:
        fr = fr.with_columns(pl.lit(False).alias("_old"))
    return fr, infos


def frame_rows(frame, ops_present: Optional[Sequence[str]] = None) -> Iterator[Row]:
    """:class:`.reader.Row` objects of a batch frame (the interface of the row visitors)."""
    ops = [op for op in OPS if op in frame.columns]
    for rec in frame.select("step", "vpp_stage", "module_name", "scope", "micro_step", "line", DP_RANK,
                            *ops).iter_rows():
        vals = {op: v for op, v in zip(ops, rec[7:]) if v is not None}
        yield Row(rec[0], rec[1], rec[2], rec[3], rec[4], vals, rec[5], rec[6])


def parquet_rows(f: CsvFile, steps: Optional[StepRange]) -> Iterator[Row]:
    """The rows of one window of an exported dataset, in their CSV order."""
    frame, _ops = _read_parquet_windows(polars(), [f], steps)
    return frame_rows(frame)


def row_of(rec: Dict[str, Any]) -> Row:
    vals = {op: rec[op] for op in OPS if rec.get(op) is not None}
    return Row(rec["step"], rec["vpp_stage"], rec["module_name"], rec["scope"], rec["micro_step"], vals, rec["line"],
               rec.get(DP_RANK))


# ------------------------------------------------------------------ public API
def open_layout(path: str, ranks: Optional[Sequence[int]] = None, monitors: Optional[Sequence[str]] = None,
                steps: Optional[StepRange] = None) -> Layout:
    """The layout of a monitor output directory or of an exported Parquet dataset."""
    from .reader import scan

    if os.path.isdir(path) and is_parquet_dataset(path):
        return scan_parquet_dataset(path, ranks, monitors, steps)
    return scan(path, ranks=ranks, monitors=monitors, steps=steps)


def load(path: str, ranks: Optional[Sequence[int]] = None, monitors: Optional[Sequence[str]] = None,
         steps: Optional[Tuple[Optional[int], Optional[int]]] = None, strict: bool = False,
         with_source: bool = False):
    """An output directory (or an exported Parquet dataset) as one Polars DataFrame.

    Columns: ``rank``, ``monitor``, ``vpp_stage``, ``step``, ``module_name``, ``scope``,
    ``micro_step`` (null outside ``weight_grad``), ``min``, ``max``, ``mean``, ``norm``,
    ``nans``, ``zeros`` (null where a file does not have the statistic); with ``with_source``
    also ``file`` and ``line`` (where each row comes from). A merged view (``msprobe-monitor
    merge``'s DEST) has neither ranks nor chunks: its columns are ``monitor``, ``step``,
    ``module_name``, ``scope``, ``micro_step``, ``dp_rank`` (null where a row is combined over
    data parallelism) and the statistics (:data:`MERGED_COLUMNS`), in the merged files'
    row order (execution order). ``ranks``/``monitors``
    select, ``steps`` is an inclusive ``(first, last)`` (either may be None). Malformed
    lines are skipped with a warning on stderr (``strict``: an :class:`InputError`).
    ``.to_pandas()`` gives a pandas DataFrame (needs pandas and pyarrow).
    """
    pl = polars()
    layout = open_layout(path, ranks, monitors, steps)
    problems = Problems(strict=strict)
    parts = []
    columns = ["monitor", *MERGED_COLUMNS] if layout.merged is not None else ["rank", "monitor", *COLUMNS]
    for rank in layout.ranks:
        for monitor in MONITORS:
            files = layout.files_of(rank, monitor)
            for group in batches(files, max_rows=10 ** 12):
                batch = read_batch(group, problems, steps)
                fr = batch.frame
                extra = [pl.lit(rank, dtype=pl.Int64).alias("rank"), pl.lit(monitor).alias("monitor")]
                if with_source:
                    paths = pl.Series("file", [f.path for f in group])
                    extra.append(pl.col("fidx").replace_strict(list(range(len(group))), paths,
                                                               return_dtype=pl.String).alias("file"))
                fr = fr.with_columns(*extra)
                keep = columns + (["file", "line"] if with_source else [])
                parts.append(fr.select(keep))
    if problems.count:
        print(f"msprobe-monitor: {problems.summary()}", file=sys.stderr)
    if not parts:
        keep = columns + (["file", "line"] if with_source else [])
        return empty_frame(pl).with_columns(pl.lit(0, dtype=pl.Int64).alias("rank"), pl.lit("").alias("monitor"),
                                            pl.lit("").alias("file")).select(keep)
    return pl.concat(parts, how="vertical")


def export(path: str, dest: str, ranks: Optional[Sequence[int]] = None, monitors: Optional[Sequence[str]] = None,
           steps: Optional[StepRange] = None, problems: Optional[Problems] = None,
           progress: Optional[Callable[[str, int], None]] = None) -> Dict[str, int]:
    """Write the CSV output under ``path`` as one Parquet dataset under ``dest``,
    partitioned by monitor and rank; returns ``{"files": ..., "rows": ...}``. Memory
    stays bounded: each batch of about :data:`BATCH_ROWS` rows becomes one Parquet part."""
    pl = polars()
    from .reader import scan

    layout = scan(path, ranks=ranks, monitors=monitors, steps=steps)
    refuse_merged(layout, "export")
    problems = problems if problems is not None else Problems()
    written = rows = 0
    root = SafeDir(dest, link_ok=False)
    for rank in layout.ranks:
        for monitor in MONITORS:
            files = layout.files_of(rank, monitor)
            if not files:
                continue
            # opened once, never through a link; parts are replaced by rename, not truncated
            with root.subdir(f"monitor={monitor}") as mdir, mdir.subdir(f"rank={rank}") as out_dir:
                written, rows = _export_files(pl, out_dir, files, problems, steps, progress, rank, monitor,
                                              written, rows)
    root.close()
    return {"files": written, "rows": rows}


def _export_files(pl, out_dir: "SafeDir", files: List[CsvFile], problems: Problems, steps: Optional[StepRange],
                  progress: Optional[Callable[[str, int], None]], rank: int, monitor: str, written: int,
                  rows: int) -> Tuple[int, int]:
    """One partition of :func:`export`: its old parts removed, its batches written."""
    for old in out_dir.listdir():
        if PARQUET_PART.match(old):
            out_dir.remove(old)
    part = 0
    for group in batches(files):
        fr = read_batch(group, problems, steps).frame
        first = pl.Series([f.first for f in group], dtype=pl.Int64)
        last = pl.Series([f.last for f in group], dtype=pl.Int64)
        run = pl.Series([f.run for f in group], dtype=pl.Int64)
        fr = fr.with_columns(
            pl.col("fidx").replace_strict(list(range(len(group))), first, return_dtype=pl.Int64)
            .alias("file_first"),
            pl.col("fidx").replace_strict(list(range(len(group))), last, return_dtype=pl.Int64)
            .alias("file_last"),
            pl.col("fidx").replace_strict(list(range(len(group))), run, return_dtype=pl.Int64)
            .alias("file_run"),
        ).select(*COLUMNS, "file_first", "file_last", "file_run", "line")
        with out_dir.replace(f"part-{part:05d}.parquet") as fh:
            fr.write_parquet(fh, compression="zstd", row_group_size=256 * 1024)
        part += 1
        rows += len(fr)
        if progress is not None:
            progress(f"rank {rank} {monitor}", len(group))
    return written + part, rows
