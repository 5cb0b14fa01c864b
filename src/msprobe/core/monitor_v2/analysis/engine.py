"""The columnar analysis engine: the findings of :func:`.reference.analyse`, computed on
Polars frames, batch by batch, in bounded memory.

:func:`.reference.analyse` (the reference, pure Python, one row at a time) defines the
answers; this module gives the same ones, much faster:

- **runs**: a batch holds whole windows (a window's plain file and its ``.run<k>`` files);
  :func:`.columnar.mark_runs` tells their runs apart as :class:`.report.WindowRuns` does,
  and marks the rows of a step that a later run wrote again (``_old``: an earlier run's);
  every count and finding below is of the latest rows, the earlier runs' apart;
- **collected** (steps, tensors, scopes, micro-steps, rows, files): group-bys per batch;
- **non-finite values**: one vectorised test per row; the first of each rank is the
  smallest order key (:mod:`.order`) among them, over the latest rows of each step (the
  earlier runs' reported apart, as in the reference);
- **spikes**: per tensor (of each run: ``_label``) and statistic, rows are sorted by (tensor, row order) and a
  rolling minimum of the previous ``window`` values selects the *candidates*, the rows
  that pass the rule's first tests ``x > floor`` and ``x > ratio * min(history)`` (exact: a minimum has no
  rounding). Only candidates get the median and MAD, computed in Python with the
  reference's own arithmetic on the same values in the same order, so findings are
  identical. A tensor whose history holds a NaN (an empty tensor's ``max``), where
  ``min()`` depends on order, is replayed in Python row by row. Between batches each
  tensor's last ``window`` values are carried over;
- **rank disagreement**: the first pass keeps, per (monitor, step, rank), two 40-bit
  sums of hashes of the checked latest rows (name, scope, micro_step and values).
  Where every rank of a chunk has the same sums, the rows are bitwise identical and
  nothing can differ; only the other (window, steps) are compared by the reference code
  (:func:`.blocks.compare_window` on re-read files), as are windows where a step's latest
  rows repeat a row.

Memory: two batches (about :data:`.columnar.BATCH_ROWS` rows each: the one analysed and
the next, read meanwhile on a second thread, see :class:`_ReadAhead`) plus, per tensor,
``window`` values and, per (rank, monitor, step), a few integers.
"""

from bisect import bisect_left, bisect_right
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO, Tuple

from .blocks import compare_window, rank_windows
from .columnar import (DP_RANK, Batch, WindowInfo, batches, filter_steps, frame_rows, mark_runs, open_layout, polars,
                       read_batch, row_of)
from .localise import localise
from ..rows import REDUCED, SCOPE, WEIGHT_GRAD
from .order import LAST, order_key, phase
from .reader import MONITORS, OPS, Layout, Problems, StepRange
from .report import (INF, MAD_SCALE, RANK_CHECKED_MONITORS, Collected, FirstN, RankCheckSettings, Report, RowVisitor,
                     RunLabel, SpikeSettings, appended_item, files_to_read, finding, median, rank_check_note, relabel,
                     runs_item)
from .text import Progress

_HASH_MOD = 1 << 40


class ColumnarEngine:
    """The :class:`.report.AnalysisEngine` of this module; it reads CSV output and
    exported Parquet datasets. A missing Polars is an :class:`.reader.InputError`
    naming what to install, raised here, before anything is read."""

    def __init__(self, batch_rows: Optional[int] = None) -> None:
        polars()
        self.batch_rows = batch_rows

    def open_layout(self, root: str, ranks: Optional[Sequence[int]] = None,
                    monitors: Optional[Sequence[str]] = None, steps: Optional[StepRange] = None) -> Layout:
        return open_layout(root, ranks=ranks, monitors=monitors, steps=steps)

    def analyse(self, layout: Layout, problems: Problems, spikes: SpikeSettings, rank_check: RankCheckSettings,
                steps: Optional[StepRange] = None, limit: Optional[int] = 50,
                progress: Optional[bool] = None, visitors: Sequence[RowVisitor] = (),
                progress_stream: Optional[TextIO] = None) -> Report:
        return analyse_columnar(layout, problems, spikes, rank_check, steps=steps, limit=limit, progress=progress,
                                visitors=visitors, progress_stream=progress_stream, batch_rows=self.batch_rows)


def analyse_columnar(layout: Layout, problems: Problems, spikes: SpikeSettings, rank_check: RankCheckSettings,
                     steps: Optional[StepRange] = None, limit: Optional[int] = 50,
                     progress: Optional[bool] = None, visitors: Sequence[RowVisitor] = (),
                     progress_stream: Optional[TextIO] = None, batch_rows: Optional[int] = None) -> Report:
    """The :class:`.report.Report` of :func:`.reference.analyse`, computed with Polars."""
    pl = polars()
    collected: Dict[str, Collected] = {m: Collected() for m in layout.monitors}
    rank_files: Dict[int, int] = {}
    rank_rows: Dict[int, int] = {}
    first_nonfinite: Dict[int, Tuple[Any, Dict[str, Any]]] = {}
    nonfinite_by: Counter = Counter()
    nonfinite_count = 0
    earlier_nonfinite: Dict[int, Tuple[Any, Dict[str, Any]]] = {}
    earlier_count = 0
    found = _Spikes(FirstN(limit), Counter(), FirstN(limit), Counter())
    do_rank_check = rank_check.enabled and len(layout.ranks) > 1
    prog = Progress(files_to_read(layout, rank_check), "reading", enabled=progress, stream=progress_stream)
    hashes: Dict[str, Dict[int, Dict[int, Tuple[int, int, int]]]] = {}  # monitor -> step -> rank -> sums
    irregular: Dict[str, Dict[int, set]] = {}  # monitor -> step -> ranks whose rows need the row-by-row check
    kw = {} if batch_rows is None else {"max_rows": batch_rows}
    appended: List[Dict[str, Any]] = []
    run_windows: List[Dict[str, Any]] = []
    steps_repeated = 0
    tensor_ids: Dict[str, Dict[str, Any]] = {}  # monitor -> carry of _tensor_ids: one id space for all ranks

    plan = [(rank, monitor, list(batches(layout.files_of(rank, monitor), **kw)))
            for rank in layout.ranks for monitor in MONITORS if layout.files_of(rank, monitor)]

    def read(group: List[Any], monitor: str) -> Tuple[Batch, Any, Any]:
        # on the reading thread: the rows, their tensor ids and their non-finite kind; every
        # row, whatever --steps selects (which run wrote a step last does not depend on it)
        batch = read_batch(group, problems, None)
        fr = batch.frame
        if not len(fr):
            return batch, fr, None
        gid, ids = _tensor_ids(pl, fr, tensor_ids.setdefault(monitor, {}))
        fr = fr.with_columns(gid)
        return batch, fr.with_columns(_nonfinite_kind(pl, fr).alias("kind")), ids

    read_ahead = _ReadAhead([(g, m) for _r, m, groups in plan for g in groups], read)
    try:
        for rank in layout.ranks:
            n_rows = n_files = 0
            for _rank, monitor, groups in (p for p in plan if p[0] == rank):
                col = collected[monitor]
                col.ranks.add(rank)
                spike_stats = spikes.stats if (spikes.enabled and monitor in spikes.monitors) else ()
                carry: Dict[str, Any] = {}
                labels: Dict[RunLabel, int] = {}  # the runs' spike histories: one id each (the first met is 0)
                seq0 = 0
                for group in groups:
                    batch, fr, ids = read_ahead.next()
                    n_files += len(group)
                    col.files += len(group)
                    for ops in batch.headers:
                        if any(op not in col.ops for op in ops):
                            col.ops[:] = [op for op in OPS if op in col.ops or op in ops]
                    if len(fr):
                        fr, infos = mark_runs(pl, fr, batch.files, batch.file_ops,
                                              [pl.col("step"), pl.col("_gid"), pl.col("micro_step").fill_null(-1)],
                                              lambda label: labels.setdefault(label, len(labels)))
                        _appended(pl, fr, rank, monitor, batch, appended)
                        repeated = _repeated(pl, fr, infos)
                        steps_repeated += sum(len(v) for v in repeated.values())
                        if steps is not None:
                            fr = filter_steps(pl, fr.lazy(), steps).collect()
                        _run_windows(pl, fr, infos, repeated, rank, monitor, batch, run_windows)
                    if len(fr):
                        fr = fr.with_columns(pl.int_range(seq0, seq0 + len(fr), dtype=pl.Int64).alias("seq"))
                        seq0 += len(fr)
                        latest = fr.filter(~pl.col("_old")) if fr["_old"].any() else fr
                        n_rows += len(latest)
                        _collect(pl, fr, latest, col, ids)
                        n_latest, n_earlier = _nonfinite(pl, fr, rank, monitor, batch, first_nonfinite, nonfinite_by,
                                                         earlier_nonfinite)
                        nonfinite_count += n_latest
                        earlier_count += n_earlier
                        if spike_stats:
                            _spikes(pl, _per_run_tensors(pl, fr), rank, monitor, batch, spikes, spike_stats, carry,
                                    found)
                        if do_rank_check and monitor in RANK_CHECKED_MONITORS:
                            _hash_steps(pl, latest, rank, monitor, hashes, irregular)
                        for visit in visitors:
                            want = getattr(visit, "rank", None)
                            if want is not None and want != rank:
                                continue
                            for row, fidx in zip(frame_rows(latest), latest["fidx"]):
                                visit(rank, monitor, row, group[fidx])
                    for _ in group:
                        prog.advance(f"rank {rank} {monitor}")
            rank_files[rank] = n_files
            rank_rows[rank] = n_rows
    finally:
        read_ahead.close()

    note = rank_check_note(rank_check, layout)
    mismatches = {} if note else _check_ranks(layout, problems, rank_check, steps, hashes, irregular, prog)
    prog.close()
    report = Report(layout, collected, rank_files, rank_rows, first_nonfinite, nonfinite_count, nonfinite_by,
                    found.items, found.steps, spikes, mismatches, rank_check, note, problems, appended,
                    earlier_nonfinite=earlier_nonfinite, earlier_nonfinite_count=earlier_count,
                    earlier_spikes=found.earlier_items, earlier_spike_steps=found.earlier_steps,
                    run_windows=run_windows, steps_repeated=steps_repeated)
    relabel(report)
    localise(report, steps)
    return report


@dataclass
class _Spikes:
    """The spikes found: of each step's latest rows, and of the earlier runs' rows."""

    items: FirstN
    steps: Counter
    earlier_items: FirstN
    earlier_steps: Counter


class _ReadAhead:
    """Runs ``read(group, monitor)`` for each of ``tasks`` in order on one worker thread,
    one task ahead of the analysis: Polars parses the next batch (releasing the GIL)
    while the main thread analyses the current one, so both cores work. One worker
    keeps the order of the reads, hence of the problems reported, and of the tensor
    ids given; memory holds at most two batches."""

    def __init__(self, tasks: List[Tuple[List[Any], str]], read: Callable[[List[Any], str], Any]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._tasks = iter(tasks)
        self._read = read
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="msprobe-read")
        self._next = self._submit()

    def _submit(self):
        task = next(self._tasks, None)
        return None if task is None else self._pool.submit(self._read, *task)

    def next(self) -> Any:
        result = self._next.result()  # a read error (``--strict``) is raised here, in order
        self._next = self._submit()
        return result

    def close(self) -> None:
        if self._next is not None:
            self._next.cancel()
        self._pool.shutdown(wait=True)


# ------------------------------------------------------------------ collected
def _collect(pl, fr, latest, col: Collected, ids) -> None:
    """``ids``: the (module_name, scope, _gid) table of :func:`_tensor_ids`; ``latest``: the
    rows of ``fr`` that are their step's latest (rows and scopes count those, as the
    reference does; steps, tensors and micro-steps are those of every row)."""
    col.steps.update(fr["step"].unique().to_list())
    per_gid = fr.group_by("_gid").agg(pl.len().alias("n"), pl.col("seq").min().alias("first"))
    per_gid = per_gid.join(ids, on="_gid", how="left")
    col.tensors.update(per_gid.select("module_name", "scope").iter_rows())
    if latest is not fr:
        per_gid = latest.group_by("_gid").agg(pl.len().alias("n"), pl.col("seq").min().alias("first"))
        per_gid = per_gid.join(ids, on="_gid", how="left")
    scopes = per_gid.group_by("scope").agg(pl.col("n").sum(), pl.col("first").min()).sort("first")
    for scope, n, _first in scopes.iter_rows():  # in order of first appearance, as the reference counts
        col.scopes[scope] += n
    col.rows += len(latest)
    col.earlier_rows += len(fr) - len(latest)
    col.micro_steps.update(fr["micro_step"].drop_nulls().unique().to_list())


def _repeated(pl, fr, infos: List[WindowInfo]) -> Dict[int, List[int]]:
    """Window (``_win``) -> the steps more than one of its runs wrote (every row of the batch)."""
    if all(w.runs < 2 for w in infos):
        return {}
    many = (fr.group_by("_win", "step").agg(pl.col("_pos").n_unique().alias("n")).filter(pl.col("n") > 1)
            .group_by("_win").agg(pl.col("step").sort()))
    return {w: list(steps) for w, steps in many.iter_rows()}


def _run_windows(pl, fr, infos: List[WindowInfo], repeated: Dict[int, List[int]], rank: int, monitor: str,
                 batch: Batch, out: List[Dict[str, Any]]) -> None:
    """The report's items of the windows whose rows lie in several files (as
    :meth:`.report.WindowRuns.item`); ``fr``: the rows within --steps."""
    several = [(w, info) for w, info in enumerate(infos) if sum(1 for n in info.segments if n) > 1]
    if not several:
        return
    earlier = dict(fr.filter(pl.col("_old")).group_by("_win").len().iter_rows()) if len(fr) else {}
    for w, info in several:
        paths = [batch.files[i].path for i, n in zip(info.fidx, info.segments) if n]
        out.append(runs_item(rank, monitor, paths, info.runs, repeated.get(w, []), earlier.get(w, 0), info.by_time))


def _appended(pl, fr, rank: int, monitor: str, batch: Batch, out: List[Dict[str, Any]]) -> None:
    """Files holding several runs (``fr`` carries ``_run``, see :func:`.columnar.file_segments`)."""
    if not (fr["_run"] > 0).any():
        return
    fr = fr.select("fidx", "step", "line", "_run")
    files = fr.filter(pl.col("_run") > 0)["fidx"].unique().to_list()
    fr = fr.filter(pl.col("fidx").is_in(files))
    restart = (pl.col("_run") != pl.col("_run").shift(1).over("fidx")).fill_null(False)
    # a step is repeated when a later run writes it again (its first run is not the current one)
    repeated = (fr.with_columns(pl.col("_run").first().over("fidx", "step").alias("_first"))
                .filter(pl.col("_run") != pl.col("_first")).group_by("fidx").agg(pl.col("step").unique().sort()))
    rep = {f: steps for f, steps in repeated.iter_rows()}
    restarts = fr.filter(restart).group_by("fidx", maintain_order=True).agg(pl.col("line")).sort("fidx")
    for fidx, lines in restarts.iter_rows():
        out.append(appended_item(rank, monitor, batch.files[fidx].path, list(lines), list(rep.get(fidx, []))))


def _per_run_tensors(pl, fr):
    """``fr`` whose ``_gid`` also names the run (``_label``, see :func:`.columnar.mark_runs`):
    each run has its own spike history, as in :func:`.reference.analyse` (ids of the first
    run met are unchanged)."""
    if not (fr["_label"] > 0).any():
        return fr
    return fr.with_columns((pl.col("_gid").cast(pl.Int64) + pl.col("_label") * (1 << 32)).alias("_gid"))


# ------------------------------------------------------------------ non-finite
def _nonfinite_kind(pl, fr):
    """``"nan"``/``"inf"``/null per row: :func:`.reference.nonfinite_kind` as an expression."""
    empty = (pl.col("norm") == 0.0).fill_null(False)
    nan = (pl.col("nans") > 0).fill_null(False)
    inf = pl.lit(False)
    for op in ("norm", "min", "max", "mean"):
        c = pl.col(op)
        nan = nan | (c.is_nan().fill_null(False) & ~empty)
        inf = inf | c.is_infinite().fill_null(False)
    return pl.when(nan).then(pl.lit("nan")).when(inf).then(pl.lit("inf")).otherwise(pl.lit(None, dtype=pl.String))


def _order_columns(pl, monitor: str, scopes: Sequence[str]):
    """Expressions for the order key's (micro key, phase) of rows of ``monitor``."""
    phases = {s: phase(monitor, s) for s in scopes}
    ph = pl.col("scope").replace_strict(list(phases), list(phases.values()), return_dtype=pl.Int64)
    mk = (pl.when(ph <= 2).then(pl.lit(0, dtype=pl.Int64))
          .when(ph == 3).then(pl.col("micro_step").fill_null(LAST))
          .otherwise(pl.lit(LAST, dtype=pl.Int64)))
    return ph.alias("_phase"), mk.alias("_mk")


def _nonfinite(pl, fr, rank: int, monitor: str, batch: Batch, first_nonfinite: Dict, nonfinite_by: Counter,
               earlier_nonfinite: Dict) -> Tuple[int, int]:
    """The non-finite rows of a batch (``fr`` carries ``_old``, see :func:`.columnar.mark_runs`):
    ``(latest, earlier)`` counts; a row whose step a later run wrote again is an earlier
    run's (:class:`.report.WindowRuns`)."""
    if not fr["kind"].is_not_null().any():
        return 0, 0
    bad = fr.filter(pl.col("kind").is_not_null())
    latest = bad.filter(~pl.col("_old"))
    earlier = bad.filter(pl.col("_old"))
    for scope, n in latest.group_by("scope", maintain_order=True).len().iter_rows():
        nonfinite_by[(monitor, scope)] += n
    for part, into in ((latest, first_nonfinite), (earlier, earlier_nonfinite)):
        if not len(part):
            continue
        ph, mk = _order_columns(pl, monitor, part["scope"].unique().to_list())
        first = part.with_columns(ph, mk).sort("step", "_mk", "_phase", "line", maintain_order=True).row(0, named=True)
        row = row_of(first)
        key = order_key(row.step, monitor, row.scope, row.micro, row.line, rank)
        best = into.get(rank)
        if best is None or key < best[0]:
            into[rank] = (key, finding(rank, monitor, row, batch.files[first["fidx"]].path,
                                       kind=first["kind"], values=dict(row.vals)))
    return len(latest), len(earlier)


# ------------------------------------------------------------------ spikes
def _spike_value(pl, stat: str, has_min: bool):
    """The checked magnitude ``x`` (as in the reference: ``max`` becomes
    ``max(|min|, |max|)`` where the row has ``min``; a NaN on either side keeps |max|)."""
    if stat != "max" or not has_min:
        return pl.col(stat).abs()
    ax, am = pl.col("max").abs(), pl.col("min").abs()
    return (pl.when(pl.col("min").is_null() | ax.is_nan() | am.is_nan()).then(ax)
            .when(am > ax).then(am).otherwise(ax))


def _spikes(pl, fr, rank: int, monitor: str, batch: Batch, settings: SpikeSettings, stats: Sequence[str],
            carry: Dict[str, Any], found: _Spikes) -> None:
    """The spikes of a batch (``fr`` carries ``_old``: a spike of an earlier run's row is
    counted as theirs)."""
    import numpy as np

    W, min_hist, ratio, mad_k, floor = settings.window, settings.min_history, settings.ratio, settings.mad_k, settings.floor
    hits: Dict[int, Dict[str, Tuple[str, float, float, float]]] = {}  # seq -> {stat: (label, x, median, mad)}
    g = "_gid"
    need = [c for c in dict.fromkeys([g, "seq", "min", "max", *stats]) if c in fr.columns]
    finite = fr.lazy().filter(pl.col("kind").is_null()).select(need).collect()  # not the names: no string copy
    has_min = "min" in finite.columns and finite["min"].null_count() < len(finite)
    g = "_gid"
    # The statistics share their rows (one sort, one carry) while no row lacks one of them;
    # after a batch where one does, each has its own history from then on.
    joint = len(stats) > 1 and not carry.get("_split") and all(finite[st].null_count() == 0 for st in stats)
    if len(stats) > 1 and not joint and not carry.get("_split"):
        carry["_split"] = True
        old = carry.pop(tuple(stats), None)
        if old is not None:
            for st in stats:
                carry[(st,)] = old.select(g, "seq", f"x_{st}", "_absmax", "pos0", "_new")
    for unit in ([tuple(stats)] if joint else [(st,) for st in stats]):
        sel = finite if joint else finite.filter(pl.col(unit[0]).is_not_null())
        old = carry.get(unit)
        if not len(sel) and old is None:
            continue
        new = sel.select(g, "seq", *[_spike_value(pl, st, has_min).alias(f"x_{st}") for st in unit],
                         (pl.col("min").is_not_null() if "max" in unit else pl.lit(False)).alias("_absmax"),
                         pl.lit(None, dtype=pl.Int64).alias("pos0"), pl.lit(True).alias("_new"))
        comb = new if old is None else pl.concat([old, new], how="vertical")  # in row order (seq)
        if not len(comb):
            continue
        # group the rows by tensor (a stable sort keeps each tensor's rows in row order)
        gid = comb[g].to_numpy()
        # (a stable sort of small integers is a radix sort in NumPy: linear)
        narrow = gid.astype(np.uint16) if len(gid) and 0 <= gid.min() and gid.max() < 1 << 16 else gid
        order = np.argsort(narrow, kind="stable")
        gs = gid[order]
        n = len(gs)
        first = np.ones(n, dtype=bool)
        first[1:] = gs[1:] != gs[:-1]
        starts = np.flatnonzero(first)
        grp = np.cumsum(first) - 1
        cidx = np.arange(n) - starts[grp]
        glen = np.diff(np.append(starts, n))[grp]
        pos0 = comb["pos0"].fill_null(0).to_numpy()[order]
        pos = pos0[starts][grp] + cidx  # the carried rows know their position in the tensor's history
        isnew = comb["_new"].to_numpy()[order]
        seq = comb["seq"].to_numpy()[order]
        absmax = comb["_absmax"].to_numpy()[order]
        for st in unit:
            x = comb[f"x_{st}"].to_numpy()[order]
            nan = np.isnan(x)
            odd = np.logical_or.reduceat(nan, starts)[grp]  # NaN in the history: min() depends on order
            xc = np.where(nan, 0.0, x)
            # minimum of the previous min(cidx, W) values of the same tensor (= min(pos, W) values:
            # the carry holds the last W of each tensor)
            # (Polars' rolling minimum of the W values ending at i-1, in one pass)
            pmin = np.full(n, np.inf)
            if n > W:
                pmin[W:] = pl.Series(xc).rolling_min(W).to_numpy()[W - 1:-1]
            # new rows with fewer than W earlier rows of their tensor: only those rows (the
            # carried rows are never candidates)
            short = np.flatnonzero((cidx < W) & isnew)
            if len(short):
                pm = np.full(len(short), np.inf)
                cs = cidx[short]
                for k in range(1, W):
                    ok = cs >= k
                    if not ok.any():
                        break
                    pm[ok] = np.minimum(pm[ok], xc[short[ok] - k])
                pmin[short] = pm
            with np.errstate(invalid="ignore"):
                cand = isnew & (x > floor) & ((~odd & (pos >= min_hist) & (x > ratio * pmin)) | odd)
            for i in np.flatnonzero(cand).tolist():
                m = min(int(pos[i]), W)
                if m < min_hist:
                    continue
                h = x[i - m:i].tolist()
                xv = float(x[i])
                if xv > ratio * min(h):  # the reference's rule, on the same values in the same order
                    srt = sorted(h)
                    med = median(srt)
                    if xv > ratio * med:
                        mad = median(sorted(abs(y - med) for y in srt))
                        if xv > med + mad_k * MAD_SCALE * mad:
                            label = ("absmax" if absmax[i] else "max") if st == "max" else st
                            hits.setdefault(int(seq[i]), {})[st] = (label, xv, med, mad)
        keep = np.flatnonzero(cidx >= glen - W)
        carry[unit] = (comb[order[keep]].with_columns(pl.Series("pos0", pos[keep], dtype=pl.Int64),
                                                      pl.lit(False).alias("_new"))
                       .sort("seq"))
    if not hits:
        return
    rows = fr.filter(pl.col("seq").is_in(list(hits))).sort("seq")
    for rec in rows.iter_rows(named=True):
        of_row = [hits[rec["seq"]][st] for st in stats if st in hits[rec["seq"]]]  # the reference's order
        label, xv, med, mad = of_row[0]
        row = row_of(rec)
        spiked = finding(rank, monitor, row, batch.files[rec["fidx"]].path, stat=label, value=xv, median=med,
                         mad=mad, ratio=(xv / med) if med > 0 else INF, stats=[t[0] for t in of_row])
        steps, items = (found.earlier_steps, found.earlier_items) if rec["_old"] else (found.steps, found.items)
        steps[row.step] += 1
        items.add(order_key(row.step, monitor, row.scope, row.micro, row.line, rank), spiked)


def _tensor_ids(pl, fr, carry: Dict[str, Any]):
    """An integer id per tensor (module_name, scope, dp_rank: a merged view's rows of each
    data-parallel rank are tensors of their own), the same in every batch and on every rank
    of a monitor (``carry`` is per monitor): sorting and hashing integers is much
    cheaper than strings. Returns the ``_gid`` column and the (module_name, scope, _gid)
    table of the batch's tensors.

    The rows are matched to their tensor by a 64-bit hash of the names (a join on
    integers); every row's names are then compared with its tensor's, so a hash
    collision cannot merge two tensors: the batch then takes the exact join on names."""
    by_name: Dict[Tuple[str, str, Optional[int]], int] = carry.setdefault("by_name", {})
    by_hash: Dict[int, Tuple[int, str, str, Optional[int]]] = carry.setdefault("by_hash", {})
    key = ["module_name", "scope"]
    if fr[DP_RANK].null_count() < len(fr):  # a merged view's per-dp rows (else: no column to hash)
        key.append(DP_RANK)
    hashed = fr.select(*key, pl.struct(*key).hash(seed=7).alias("_h"))
    keys = hashed.unique(subset="_h", keep="first", maintain_order=True)
    gids: List[int] = []
    exact = True
    for rec in keys.iter_rows():
        name, scope, h = rec[0], rec[1], rec[-1]
        dp = rec[2] if len(key) == 3 else None
        got = by_hash.get(h)
        if got is None:
            gid = by_name.setdefault((name, scope, dp), len(by_name))
            got = by_hash[h] = (gid, name, scope, dp)
        elif got[1] != name or got[2] != scope or got[3] != dp:
            exact = False
            break
        gids.append(got[0])
    if exact:
        keys = keys.with_columns(pl.Series("_gid", gids, dtype=pl.Int64))
        joined = hashed.join(keys, on="_h", how="left", maintain_order="left", suffix="_k")
        same = (pl.col("module_name") == pl.col("module_name_k")) & (pl.col("scope") == pl.col("scope_k"))
        if len(key) == 3:
            same = same & pl.col(DP_RANK).eq_missing(pl.col(DP_RANK + "_k"))
        exact = joined.select(same.all()).item()
        if exact:
            return joined["_gid"], keys.select("module_name", "scope", "_gid")
    # a hash collision: ids by the names themselves (a null dp_rank joins as -1)
    cols = [pl.col("module_name"), pl.col("scope"), pl.col(DP_RANK).fill_null(-1)][:len(key)]
    names = fr.select(*cols).unique(maintain_order=True)
    ids = names.with_columns(pl.Series("_gid", [by_name.setdefault((k[0], k[1], _dp_of(k)), len(by_name))
                                                for k in names.iter_rows()], dtype=pl.Int64))
    gid = fr.select(*cols).join(ids, on=key, how="left", maintain_order="left")["_gid"]
    return gid, ids.select("module_name", "scope", "_gid")


def _dp_of(k: Tuple[Any, ...]) -> Optional[int]:
    return None if len(k) < 3 or k[2] == -1 else k[2]


# ------------------------------------------------------------------ rank agreement
def _hash_steps(pl, fr, rank: int, monitor: str, hashes: Dict, irregular: Dict) -> None:
    """Per step, the sums of hashes of ``fr``'s checked rows (each step's latest rows: they
    lie in one file, see :class:`.report.WindowRuns`)."""
    checked = fr.filter(pl.col(SCOPE) == REDUCED) if monitor == WEIGHT_GRAD else fr
    if not len(checked):
        return
    # a step that repeats a row: compare it the reference way
    dup = checked.group_by("step").agg((pl.struct("_gid", "micro_step").n_unique() < pl.len()).alias("dup"))
    for step, is_dup in dup.iter_rows():
        if is_dup:
            irregular.setdefault(monitor, {}).setdefault(step, set()).add(rank)
    # the tensor by its id (one id space per monitor, shared by all ranks)
    cols = ["_gid", "micro_step"] + [op for op in OPS if op in checked.columns]
    h = pl.struct(cols)
    hv = h.hash(seed=1)  # 64 bits, summed as a 40-bit and a 24-bit part (no overflow below 2**24 rows)
    sums = checked.group_by("step").agg(
        (hv // _HASH_MOD).sum().alias("h1"), (hv % _HASH_MOD).sum().alias("h2"), pl.len().alias("n"))
    per_monitor = hashes.setdefault(monitor, {})
    for step, h1, h2, n in sums.iter_rows():
        per_monitor.setdefault(step, {})[rank] = (int(h1), int(h2), int(n))


def _check_ranks(layout: Layout, problems: Problems, settings: RankCheckSettings, steps: Optional[StepRange],
                 hashes: Dict, irregular: Dict, prog: Progress) -> Dict[int, Dict[str, Any]]:
    """:func:`.reference.check_ranks`, comparing only what the hashes cannot clear."""
    result: Dict[int, Dict[str, Any]] = {}
    sorted_steps = {m: sorted(per) for m, per in hashes.items()}
    for w in rank_windows(layout, settings):
        for _ in range(w.reads):  # the same count as the reference's second read
            prog.advance(f"rank agreement, {w.monitor}")
        if len(w.files) < 2:
            continue
        known = sorted_steps.get(w.monitor, [])
        in_window = known[bisect_left(known, w.window[0]):bisect_right(known, w.window[1])]
        todo = _steps_to_compare(hashes.get(w.monitor, {}), irregular.get(w.monitor, {}), in_window, set(w.chunk),
                                 w.window)
        if todo is None:
            continue
        lo, hi = todo
        if steps is not None:
            lo = lo if steps[0] is None else max(lo, steps[0])
            hi = hi if steps[1] is None else min(hi, steps[1])
        compare_window(w.monitor, w.files, problems, (lo, hi), settings, result)
    return result


def _steps_to_compare(per_step: Dict[int, Dict[int, Tuple[int, int, int]]], irregular: Dict[int, set],
                      in_window: List[int], chunk: set, window: Tuple[int, int]) -> Optional[Tuple[int, int]]:
    """The step range of a window that must be compared row by row, or None."""
    if any(irregular.get(step, set()) & chunk for step in in_window):
        return window
    differing = []
    for step in in_window:
        sums = {v for r, v in per_step[step].items() if r in chunk}
        if len(sums) > 1:
            differing.append(step)
    if not differing:
        return None
    return min(differing), max(differing)
