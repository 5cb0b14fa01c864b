"""``compare`` with Polars: the per-row work of :mod:`.compare` (alignment, errors, levels,
counts, heat maps, pooled curves, grows-after-reduce) as frame operations, for runs of
millions of rows. The rows of the earliest (step, phase) with a row beyond tolerance,
few, go back to :func:`.compare.locate` as :class:`.compare.RowResult` objects, so that
where they part, the worst layers and the module rule are one code for both paths.

Reading is the columnar engine's (:func:`.columnar.read_batch`, each step's latest run
only, :func:`.columnar.mark_runs`). The results equal the pure-Python path's
(tests/analysis/test_compare.py runs both)."""

from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import rows
from .columnar import batches, mark_runs, polars, read_batch, row_key
from .compare import (COMPARED, ERROR, ERROR_FACTOR, ERROR_RATIO, MIN_NOISE, NEAR_ZERO, NONFINITE, PASS,
                      PER_MICRO_SCOPES, VALUE_OPS, WARNING, WARNING_RATIO, CompareReport, RowResult, Side, finish_side,
                      locate)
from .reader import Problems, StepRange

def _enums(pl):
    """Classes and levels as Polars enums (one byte a row, not a string)."""
    return pl.Enum([COMPARED, NEAR_ZERO, NONFINITE]), pl.Enum([PASS, WARNING, ERROR])


def _cls(pl, name: str):
    return pl.lit(name, dtype=_enums(pl)[0])


def _lvl(pl, name: str):
    return pl.lit(name, dtype=_enums(pl)[1])


KEY = ("rank", "monitor", "step", "module_name", "scope", "micro_step", "dp_rank")
NONE = -1  # a null micro_step / dp_rank in the join key
_OPS = VALUE_OPS + ("nans",)


def read_frame(side: Side, problems: Problems, steps: Optional[StepRange], rename: Sequence[Tuple[str, str]] = (),
               offset: int = 0):
    """One frame of every rank's and monitor's latest rows, keyed as compare aligns them."""
    pl = polars()
    parts = []
    ops_of: Dict[str, List[str]] = {}
    for r in side.layout.ranks:
        for m in side.layout.monitors:
            files = side.layout.files_of(r, m)
            for group in batches(files):
                batch = read_batch(group, problems, None)
                fr = batch.frame
                if not len(fr):
                    continue
                fr, _ = mark_runs(pl, fr, group, batch.file_ops, row_key(pl))
                fr = fr.filter(~pl.col("_old"))
                for ops in batch.headers:
                    ops_of.setdefault(m, [op for op in rows.ALL_OPS if op in ops])
                parts.append(fr.select(
                    pl.lit(r, dtype=pl.Int64).alias("rank"), pl.lit(m).alias("monitor"),
                    (pl.col("step") + offset).alias("step"), "module_name", "scope",
                    pl.col("micro_step"), pl.col("dp_rank"), "line",
                    *[pl.col(op).cast(pl.Float64) for op in _OPS]))
    if parts:
        fr = pl.concat(parts, how="vertical")
    else:
        fr = pl.DataFrame(schema={"rank": pl.Int64, "monitor": pl.String, "step": pl.Int64, "module_name": pl.String,
                                  "scope": pl.String, "micro_step": pl.Int64, "dp_rank": pl.Int64, "line": pl.Int64,
                                  **{op: pl.Float64 for op in _OPS}})
    if steps is not None:
        if steps[0] is not None:
            fr = fr.filter(pl.col("step") >= steps[0])
        if steps[1] is not None:
            fr = fr.filter(pl.col("step") <= steps[1])
    micro = fr.filter(pl.col("monitor") == rows.WEIGHT_GRAD).select(pl.col("micro_step").drop_nulls().unique())
    side.micro_batches = set(micro.to_series().to_list())
    n_rows = dict(fr.group_by("monitor").len().iter_rows())
    if rename:
        name = pl.col("module_name")
        expr = name
        for old, new in reversed(list(rename)):  # the longest prefix wins: applied last
            hit = (name == old) | name.str.starts_with(old + ".") | name.str.starts_with(old + rows.CHUNK_SEP)
            expr = pl.when(hit).then(pl.lit(new) + name.str.slice(len(old))).otherwise(expr)
        fr = fr.with_columns(expr.alias("module_name"))
    fr = fr.with_columns(
        pl.when(pl.col("scope") == rows.REDUCED).then(pl.lit(NONE)).otherwise(pl.col("micro_step").fill_null(NONE))
        .cast(pl.Int64).alias("micro_step"),
        pl.col("dp_rank").fill_null(NONE).cast(pl.Int64))
    side.provenance["monitors"] = sorted(ops_of, key=rows.MONITORS.index)
    side.provenance["ops"] = ops_of
    side.provenance["rows"] = {m: n_rows[m] for m in rows.MONITORS if m in n_rows}
    side.provenance["micro_batches"] = max(side.micro_batches) if side.micro_batches else None
    span = fr.select(pl.col("step").min().alias("a"), pl.col("step").max().alias("b")).row(0)
    side.provenance["steps"] = None if span[0] is None else [span[0], span[1]]
    finish_side(side, offset, steps)
    return fr


def collapse_dp(fr):
    """Rows kept per data-parallel rank pooled into one (as :func:`.compare.pool_values`)."""
    pl = polars()
    per = fr.filter(pl.col("dp_rank") != NONE)
    if not len(per):
        return fr, 0
    pooled = per.group_by([k for k in KEY if k != "dp_rank"]).agg(
        pl.col("line").min(),
        pl.when(pl.col("min").is_nan().any()).then(float("nan")).otherwise(pl.col("min").min()).alias("min"),
        pl.when(pl.col("max").is_nan().any()).then(float("nan")).otherwise(pl.col("max").max()).alias("max"),
        pl.col("mean").mean(), (pl.col("norm") ** 2).sum().sqrt().alias("norm"), pl.col("nans").sum())
    pooled = pooled.with_columns(pl.lit(NONE, dtype=pl.Int64).alias("dp_rank")).select(fr.columns)
    return pl.concat([fr.filter(pl.col("dp_rank") == NONE), pooled], how="vertical"), len(per)


def _phase(pl):
    table = {"param/param_origin": 0, "module/forward": 1, "module/eval_forward": 1, "module/generate": 1,
             "module/backward": 2, "weight_grad/unreduced": 3, "weight_grad/reduced": 5, "param/param_updated": 7}
    ms = pl.concat_str([pl.col("monitor"), pl.lit("/"), pl.col("scope")])
    other = (pl.when(pl.col("monitor") == rows.OPTIMIZER).then(6).when(pl.col("monitor") == rows.CC).then(4)
             .otherwise(8))
    return ms.replace_strict(list(table), list(table.values()), default=None, return_dtype=pl.Int64) \
        .fill_null(other).cast(pl.Int64)


def layer_expr(pl, col: str = "module_name"):
    """:func:`.compare._layer_of` as an expression."""
    base = pl.col(col).str.replace(r"^\d+:", "").str.replace(r"\.(?:input|output|grad_input|grad_output)\.[^.]*$", "")
    return pl.coalesce(base.str.extract(r"^(.*?(?:^|\.)\d+)(?:\.|$)", 1), base.str.extract(r"^([^.]*)", 1))


def _errors(pl, op: str, floor: float):
    r, c = pl.col(f"ref_{op}"), pl.col(f"cand_{op}")
    d = c - r
    rf, cf = r.is_finite(), c.is_finite()
    same_nf = (r.is_nan() & c.is_nan()) | (~rf & ~cf & (r == c))
    both = rf & cf
    scale = pl.max_horizontal(r.abs(), c.abs())
    near = both & (scale <= floor)
    cls = (pl.when(both).then(pl.when(near).then(_cls(pl, NEAR_ZERO)).otherwise(_cls(pl, COMPARED)))
           .when(same_nf).then(_cls(pl, COMPARED)).otherwise(_cls(pl, NONFINITE)))
    nan = pl.lit(float("nan"))
    signed = pl.when(both).then(d).when(same_nf).then(0.0).otherwise(nan)
    ab = signed.abs()
    rel = pl.when(both).then(d.abs() / pl.max_horizontal(r.abs(), pl.lit(floor))).when(same_nf).then(0.0).otherwise(nan)
    scaled = (pl.when(near).then(d.abs() / floor).when(both).then(d.abs() / pl.max_horizontal(scale, pl.lit(floor)))
              .when(same_nf).then(0.0).otherwise(nan))
    return [cls.alias(f"{op}_class"), signed.alias(f"{op}_signed"), ab.alias(f"{op}_abs"), rel.alias(f"{op}_rel"),
            scaled.alias(f"{op}_scaled")]


def score(report: CompareReport, frames: Dict[str, Any], not_comparable_why: Optional[str]) -> None:
    pl = polars()
    ref, cand, base = frames["ref"], frames["cand"], frames.get("base")
    stats = report.settings.stats
    tol, floor = report.tolerance, report.floor
    if not_comparable_why:
        nc_scope = pl.concat_str([pl.col("monitor"), pl.lit("/"), pl.col("scope")])
        names = [f"{m}/{s}" for m, s in PER_MICRO_SCOPES]
        for label, fr in (("ref", ref), ("cand", cand)):
            for k, n in fr.filter(nc_scope.is_in(names)).group_by(nc_scope.alias("k")).len().iter_rows():
                report.not_comparable.setdefault(k, {"ref": 0, "cand": 0, "why": not_comparable_why})[label] += n
        ref, cand = ref.filter(~nc_scope.is_in(names)), cand.filter(~nc_scope.is_in(names))
        if base is not None:
            base = base.filter(~nc_scope.is_in(names))
    a = ref.rename({op: f"ref_{op}" for op in _OPS})
    b = cand.rename({**{op: f"cand_{op}" for op in _OPS}, "line": "cand_line"})
    # the reference's row order (rank, monitor, file order); its rows only the candidate has after
    joined = a.join(b, on=list(KEY), how="full", coalesce=True, maintain_order="left")
    only_ref = joined.filter(pl.col("cand_line").is_null())
    only_cand = joined.filter(pl.col("line").is_null())
    for label, fr in (("ref", only_ref), ("cand", only_cand)):
        for m, s, n in fr.group_by("monitor", "scope").len().iter_rows():
            report.only.setdefault(m, {}).setdefault(s, {"ref": 0, "cand": 0})[label] += n
    al = joined.filter(pl.col("line").is_not_null() & pl.col("cand_line").is_not_null())
    present = [op for op in VALUE_OPS if al.select(pl.col(f"ref_{op}").is_not_null().any()).item()]
    al = al.with_columns(*[e for op in present for e in _errors(pl, op, floor)])
    judged = [s for s in stats if s in present]
    nan_mismatch = ((pl.col("ref_nans") > 0) != (pl.col("cand_nans") > 0)).fill_null(False)
    any_nf = pl.any_horizontal(*[pl.col(f"{s}_class") == NONFINITE for s in judged]) if judged else pl.lit(False)
    all_near = pl.all_horizontal(*[pl.col(f"{s}_class") == NEAR_ZERO for s in judged]) if judged else pl.lit(False)
    cmp_err = pl.max_horizontal(*[pl.when(pl.col(f"{s}_class") == COMPARED).then(pl.col(f"{s}_scaled"))
                                  for s in judged]) if judged else pl.lit(None)
    al = al.with_columns(
        pl.when(nan_mismatch | any_nf).then(_cls(pl, NONFINITE)).when(all_near).then(_cls(pl, NEAR_ZERO))
        .otherwise(_cls(pl, COMPARED)).alias("class"))
    al = al.with_columns(
        pl.when(pl.col("class") == NONFINITE).then(float("nan")).when(pl.col("class") == NEAR_ZERO).then(0.0)
        .otherwise(cmp_err).cast(pl.Float64).alias("error"))
    by_tol = (pl.when(pl.col("error").is_nan() | (pl.col("error") > ERROR_FACTOR * tol)).then(_lvl(pl, ERROR))
              .when(pl.col("error") > tol).then(_lvl(pl, WARNING)).otherwise(_lvl(pl, PASS)))
    counts = {"no_baseline": 0}
    if base is not None:
        bn = base.select(*KEY, *[pl.col(s).alias(f"base_{s}") for s in judged])
        al = al.join(bn, on=list(KEY), how="left")
        noise_parts = []
        for s in judged:
            r, q = pl.col(f"ref_{s}"), pl.col(f"base_{s}")
            both = r.is_finite() & q.is_finite()
            scale = pl.max_horizontal(r.abs(), q.abs())
            e = (pl.when(both & (scale > floor)).then((q - r).abs() / pl.max_horizontal(scale, pl.lit(floor)))
                 .when(both).then(0.0)
                 .when((r.is_nan() & q.is_nan()) | (~r.is_finite() & ~q.is_finite() & (r == q))).then(0.0)
                 .when(q.is_null()).then(None).otherwise(float("inf")))
            noise_parts.append(e)
        has_base = pl.col(f"base_{judged[0]}").is_not_null() if judged else pl.lit(False)
        al = al.with_columns(pl.when(has_base).then(pl.max_horizontal(*noise_parts)).alias("noise"))
        al = al.with_columns(pl.when(pl.col("class") == COMPARED).then(pl.col("noise")).alias("noise"))
        al = al.with_columns(pl.when(pl.col("noise").is_not_null()).then(
            pl.col("error") / pl.max_horizontal(pl.col("noise"), pl.lit(MIN_NOISE[report.dtype]))).alias("ratio"))
        by_ratio = (pl.when(pl.col("ratio").is_nan() | (pl.col("ratio") > ERROR_RATIO)).then(_lvl(pl, ERROR))
                    .when(pl.col("ratio") > WARNING_RATIO).then(_lvl(pl, WARNING)).otherwise(_lvl(pl, PASS)))
        level = (pl.when(pl.col("class") == NONFINITE).then(_lvl(pl, ERROR)).when(pl.col("class") == NEAR_ZERO)
                 .then(_lvl(pl, PASS)).when(pl.col("noise").is_null()).then(by_tol).otherwise(by_ratio))
        counts["no_baseline"] = al.filter((pl.col("class") == COMPARED) & pl.col("noise").is_null()).height
    else:
        level = (pl.when(pl.col("class") == NONFINITE).then(_lvl(pl, ERROR)).when(pl.col("class") == NEAR_ZERO)
                 .then(_lvl(pl, PASS)).otherwise(by_tol))
    al = al.with_columns(level.alias("level"), _phase(pl).alias("phase"))
    for c, n in al.group_by("class").len().iter_rows():
        counts[c] = n
    for c, n in al.group_by("level").len().iter_rows():
        counts[c] = n
    for c in (COMPARED, NEAR_ZERO, NONFINITE, PASS, WARNING, ERROR):
        counts.setdefault(c, 0)
    report.counts = counts
    report.verdict = ERROR if counts[ERROR] else WARNING if counts[WARNING] else PASS
    report.frame = al
    report.present_ops = present
    _aggregate(report, al)


def _aggregate(report: CompareReport, al) -> None:
    pl = polars()
    beyond = pl.col("level") != PASS
    for lvl, cond in ((WARNING, beyond), (ERROR, pl.col("level") == ERROR)):
        report.first_step[lvl] = al.filter(cond).select(pl.col("step").min()).item()
    eff = (pl.when(pl.col("class") == COMPARED).then(pl.col("error")).when(pl.col("class") == NONFINITE)
           .then(float("inf")).otherwise(0.0))
    al = al.with_columns(eff.alias("_e"))
    for ms, rank, step, e in al.group_by(pl.concat_str([pl.col("monitor"), pl.lit("/"), pl.col("scope")]).alias("ms"),
                                         "rank", "step").agg(pl.col("_e").max()).iter_rows():
        report.rank_steps[(ms, rank, step)] = e
    # names repeat every step: the layer of each distinct name, then joined
    names = al.select(pl.col("module_name").unique()).with_columns(layer_expr(pl).alias("layer"))
    per_name = al.group_by("module_name", "step").agg(pl.col("_e").max())
    for layer, step, e in per_name.join(names, on="module_name").group_by("layer", "step") \
            .agg(pl.col("_e").max()).iter_rows():
        report.layer_steps[(layer, step)] = e
    fin = al.filter(pl.col("ref_norm").is_finite() & pl.col("cand_norm").is_finite())
    pooled = (fin.group_by("monitor", "scope", "step", "phase")
              .agg((pl.col("ref_norm") ** 2).sum().sqrt().alias("a"),
                   (pl.col("cand_norm") ** 2).sum().sqrt().alias("b"),
                   pl.len().alias("n"))
              .sort("step", "phase", "monitor", "scope"))
    for monitor, scope, step, _p, a, b, n in pooled.iter_rows():
        report.pooled.append({"monitor": monitor, "scope": scope, "step": step, "ref_norm": a, "cand_norm": b,
                              "scaled_error": abs(b - a) / max(a, b, report.floor), "rows": n})
    # grows after reduce
    wg = al.filter((pl.col("monitor") == rows.WEIGHT_GRAD) & (pl.col("class") != NEAR_ZERO))
    unred = wg.filter(pl.col("scope") == rows.UNREDUCED).group_by("rank", "step", "module_name") \
        .agg(pl.col("_e").max().alias("u"))
    red = wg.filter((pl.col("scope") == rows.REDUCED) & beyond)
    grown = red.join(unred, on=["rank", "step", "module_name"], how="inner") \
        .filter(pl.col("u") <= report.tolerance) \
        .select("rank", "step", "module_name", "u", "_e", "level").sort(
            "step", pl.col("_e"), "rank", "module_name", descending=[False, True, False, False])
    report.grows_after_reduce = [{"rank": r, "step": s, "tensor": n, "unreduced_error": u, "reduced_error": e,
                                  "level": lv} for r, s, n, u, e, lv in grown.iter_rows()]
    first = al.filter(beyond).select(pl.col("step"), pl.col("phase")).sort("step", "phase").head(1)
    if not len(first):
        return
    step, phase = first.row(0)
    at = al.filter((pl.col("step") == step) & (pl.col("phase") == phase))
    unr = al.filter((pl.col("step") == step) & (pl.col("phase") == 3))
    locate(report, to_results(report, at), step, phase, len(unr), bool(len(unr.filter(beyond))))


def to_results(report: CompareReport, fr) -> List[RowResult]:
    out = []
    ops = getattr(report, "present_ops", list(VALUE_OPS))
    has_ratio = "ratio" in fr.columns
    for rec in fr.iter_rows(named=True):
        key = (rec["rank"], rec["monitor"], rec["step"], rec["module_name"], rec["scope"],
               None if rec["micro_step"] == NONE else rec["micro_step"],
               None if rec["dp_rank"] == NONE else rec["dp_rank"])
        rv = {op: rec[f"ref_{op}"] for op in ops + ["nans"] if rec.get(f"ref_{op}") is not None}
        cv = {op: rec[f"cand_{op}"] for op in ops + ["nans"] if rec.get(f"cand_{op}") is not None}
        errs = {op: (rec[f"{op}_class"], rec[f"{op}_signed"], rec[f"{op}_abs"], rec[f"{op}_rel"], rec[f"{op}_scaled"])
                for op in ops}
        out.append(RowResult(key=key, ref=rv, cand=cv, line=rec["line"], errors=errs, cls=rec["class"],
                             error=rec["error"], noise=rec["noise"] if has_ratio else None,
                             ratio=rec["ratio"] if has_ratio else None, level=rec["level"]))
    return out


def write_csv(report: CompareReport, path: str) -> int:
    """compare.csv from the frame: the columns of :func:`.compare.write_csv`."""
    pl = polars()
    al = report.frame
    ops = list(report.present_ops) + ["nans"]
    cols: List[Any] = [pl.col("rank"), pl.col("monitor"), pl.col("step"), pl.col("module_name"), pl.col("scope"),
                       pl.when(pl.col("micro_step") == NONE).then(None).otherwise(pl.col("micro_step"))
                       .alias("micro_step"),
                       pl.when(pl.col("dp_rank") == NONE).then(None).otherwise(pl.col("dp_rank")).alias("dp_rank")]
    for op in ops:
        cols += [pl.col(f"ref_{op}").cast(pl.Int64) if op == "nans" else pl.col(f"ref_{op}"),
                 pl.col(f"cand_{op}").cast(pl.Int64) if op == "nans" else pl.col(f"cand_{op}")]
    for op in report.present_ops:
        cols += [pl.col(f"{op}_signed"), pl.col(f"{op}_abs"), pl.col(f"{op}_rel"), pl.col(f"{op}_scaled")]
    cols += [pl.col("class"), pl.col("error"), pl.col("level")]
    if report.baseline is not None:
        cols += [pl.col("noise"), pl.col("ratio")]
    out = al.select(cols)
    out.write_csv(path, float_precision=None, null_value="")
    return out.height
