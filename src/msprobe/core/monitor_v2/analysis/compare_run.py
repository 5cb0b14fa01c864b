"""``compare``'s run: the two (or three) sides opened, merged where their layouts differ,
read by one of the two engines (:mod:`.compare` in the standard library, or
:mod:`.compare_columnar` with Polars) and judged. A module of its own because the
columnar engine builds on :mod:`.compare`'s rules, and this is the one place that
chooses between them."""

import os
from typing import Any, Dict, Optional, Tuple

from . import compare_columnar as cc
from .compare import (CompareReport, CompareSettings, FLOOR, TOLERANCE, aggregate, config_differences, merge_side,
                      needs_merge, score, worse, choose_dtype, collapse_dp, migration_verdict, open_side,
                      polars_available, read_loss_log, read_rows)
from .reader import Problems, StepRange


def compare_runs(ref_root: str, cand_root: str, settings: CompareSettings, problems: Problems,
                 baseline_root: Optional[str] = None, steps: Optional[StepRange] = None,
                 loss_logs: Optional[Tuple[str, str]] = None, engine: str = "auto") -> CompareReport:
    """``engine``: ``columnar`` (Polars), ``python`` (standard library only) or ``auto``
    (Polars where it is installed)."""
    if engine == "auto":
        engine = "columnar" if polars_available() else "python"
    ref = open_side("REF", ref_root, problems)
    cand = open_side("CAND", cand_root, problems)
    base = open_side("REF2", baseline_root, problems) if baseline_root else None
    report = CompareReport(ref=ref, cand=cand, settings=settings)
    if needs_merge(ref, cand) or (base is not None and (needs_merge(ref, base))):
        merged = []
        for s in [ref, cand] + ([base] if base is not None else []):
            if s.layout.merged is None:
                dest = os.path.join(settings.out_dir, f"merged_{s.label.lower()}")
                merged.append(s.label)
                new = merge_side(s, dest, problems)
                if s is ref:
                    ref = new
                elif s is cand:
                    cand = new
                else:
                    base = new
        report.ref, report.cand, report.baseline = ref, cand, base
        report.merged = merged
        if merged:
            report.notes.append(f"different parallel layouts: {', '.join(merged)} merged into "
                                f"{settings.out_dir}/merged_<side> and compared under global names")
    report.baseline = base
    report.engine = engine
    frames: Dict[str, Any] = {}
    if engine == "columnar":
        frames["ref"] = cc.read_frame(ref, problems, steps)
        frames["cand"] = cc.read_frame(cand, problems, steps, settings.rename, settings.step_offset)
        if base is not None:
            frames["base"] = cc.read_frame(base, problems, steps)
    else:
        read_rows(ref, problems, settings, steps)
        read_rows(cand, problems, settings, steps, settings.rename, settings.step_offset)
        if base is not None:
            read_rows(base, problems, settings, steps)
    if loss_logs is not None:
        # the user named these files: they win over the scalars rows the runs have (said in a note)
        for side, path, off in ((ref, loss_logs[0], 0), (cand, loss_logs[1], settings.step_offset)):
            if side.scalars:
                report.notes.append(f"--loss-log: {side.label}'s loss and grad norm are read from {path}; its "
                                    f"scalars rows ({', '.join(sorted(side.scalars))}) are set aside")
            side.scalars = {name: {st: v for st, v in per.items() if steps is None or (
                (steps[0] is None or st >= steps[0]) and (steps[1] is None or st <= steps[1]))}
                for name, per in read_loss_log(path, off).items()}
            side.provenance["scalars"] = {"source": "--loss-log", "path": os.path.abspath(path),
                                          "names": sorted(side.scalars)}
    dp_differs = ref.dp_size is not None and cand.dp_size is not None and ref.dp_size != cand.dp_size
    report.collapse_dp = settings.collapse_dp if settings.collapse_dp is not None else dp_differs
    if report.collapse_dp:
        if engine == "columnar":
            n = 0
            for k in list(frames):
                frames[k], pooled = cc.collapse_dp(frames[k])
                n += pooled
        else:
            n = sum(collapse_dp(s) for s in (ref, cand) + ((base,) if base is not None else ()))
        report.notes.append(f"--collapse-dp: {n} row(s) kept per data-parallel rank pooled into one per tensor"
                            + (" (on: the data-parallel sizes differ)" if settings.collapse_dp is None else ""))
    report.dtype, report.dtype_source = choose_dtype(settings, ref, cand)
    report.tolerance = settings.tolerance if settings.tolerance is not None else TOLERANCE[report.dtype]
    report.floor = settings.floor if settings.floor is not None else FLOOR[report.dtype]
    report.config_differences = config_differences(ref, cand)
    # per-micro-batch scopes are not comparable when the two runs cut the batch differently
    per_micro_differs = (ref.provenance.get("micro_batches") != cand.provenance.get("micro_batches")
                         or dp_differs)
    if per_micro_differs:
        why = (f"per micro-batch rows: micro-batches per step {ref.provenance.get('micro_batches')} vs "
               f"{cand.provenance.get('micro_batches')}, data-parallel sizes {ref.dp_size} vs {cand.dp_size}")
    if engine == "columnar":
        cc.score(report, frames, per_micro_differs and why or None)
    else:
        score(report, per_micro_differs and why or None)
        aggregate(report)
    report.scalars = migration_verdict(ref.scalars, cand.scalars)
    if report.scalars is not None:
        report.scalars["source"] = {"ref": (ref.provenance.get("scalars") or {}).get("source"),
                                    "cand": (cand.provenance.get("scalars") or {}).get("source")}
        report.verdict = worse(report.verdict, report.scalars["level"])
    elif ref.scalars or cand.scalars:
        report.notes.append("no loss or grad norm verdict: " + "; ".join(
            f"{s.label} has {', '.join(sorted(s.scalars)) or 'no scalars'}" for s in (ref, cand))
            + " (the verdict needs the loss or grad_norm of both runs at common steps)")
    return report


