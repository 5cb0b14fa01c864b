"""What ``msprobe-monitor compare`` prints and writes: the text summary (verdict first,
then where the runs part, then the worst layers), the JSON document (``--json`` and
``compare.json``) and ``compare.html`` (self-contained: inline SVG heat maps of the scaled
error, rank x step per monitor and scope, layer x step, and the pooled norm curves of both
runs; no script, no image file, no third-party package)."""

import html
import math
from typing import Any, Dict, List, Sequence, Tuple

from .compare import ERROR, ERROR_FACTOR, ERROR_RATIO, MODULE_WARNING_FACTOR, PASS, WARNING, WARNING_RATIO, CompareReport
from .text import json_safe, table

VERDICT_TEXT = {PASS: "within tolerance", WARNING: "beyond tolerance (warning)", ERROR: "beyond tolerance (error)"}


def _e(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if x != x:
            return "NaN"
        if x == math.inf:
            return "inf"
        return f"{x:.3g}"
    return str(x)


def level_rule(report: CompareReport) -> str:
    if report.baseline is not None:
        return (f"scaled error / run-to-run noise (REF vs REF2, at least {report.dtype}'s minimum error): "
                f"warning > {WARNING_RATIO:g}, error > {ERROR_RATIO:g} (msProbe's benchmark ratio limits)")
    return (f"scaled {'/'.join(report.settings.stats)} error {_e(report.tolerance)} ({report.dtype}): "
            f"warning beyond it, error beyond {ERROR_FACTOR:g} x it")


def report_json(report: CompareReport, code: int) -> Dict[str, Any]:
    doc = {
        "command": "compare", "exit_code": code, "verdict": report.verdict,
        "verdict_text": f"{report.dtype} {VERDICT_TEXT[report.verdict]}",
        "settings": {"stats": list(report.settings.stats), "dtype": report.dtype, "dtype_source": report.dtype_source,
                     "tolerance": report.tolerance, "floor": report.floor, "fail_on": report.settings.fail_on,
                     "collapse_dp": report.collapse_dp, "step_offset": report.settings.step_offset,
                     "rename": [list(p) for p in report.settings.rename], "rule": level_rule(report),
                     "baseline": report.baseline.root if report.baseline is not None else None},
        "provenance": {"ref": {"path": report.ref.root, **report.ref.provenance},
                       "cand": {"path": report.cand.root, **report.cand.provenance},
                       "config_differences": report.config_differences},
        "counts": report.counts,
        "only_in_one": report.only,
        "not_comparable": report.not_comparable,
        "first_step": report.first_step,
        "where_they_part": report.part,
        "worst_layers": report.worst,
        "module_rule": report.module_rule[:50],
        "grows_after_reduce": report.grows_after_reduce[:50],
        "n_grows_after_reduce": len(report.grows_after_reduce),
        "scalars": report.scalars,
        "pooled": report.pooled,
        "notes": report.notes,
        "files": report.files,
    }
    if report.baseline is not None:
        doc["provenance"]["ref2"] = {"path": report.baseline.root, **report.baseline.provenance}
    return json_safe(doc)


def _where_text(report: CompareReport) -> List[str]:
    p = report.part
    if p is None:
        return ["Where they part: nowhere (no row beyond tolerance)"]
    fr = p["first_row"]
    lines = [f"Where they part: step {p['step']}, {p['phase']} ({p['rows_beyond']} of {p['rows']} row(s) beyond "
             f"tolerance there)",
             f"  first row there (execution order): rank {fr['rank']} {fr['monitor']} {fr['scope']} {fr['tensor']}: "
             f"scaled error {_e(fr['error'])} ({fr['level']})"]
    born = p.get("born_at")
    if p["phase"] in ("forward", "backward"):
        if born is not None:
            lines.append(f"  born at module {born['module']} (rank {born['rank']}): output error "
                         f"{_e(born['output_error'])} vs input error {_e(born['input_error'])} "
                         f"({'input < 0.1 and output > 0.5' if born['level'] == ERROR else 'output > 10 x input'}: "
                         f"{born['level']}, msProbe's input/output rule)")
        else:
            lines.append("  no module's output error exceeds 10 x its input error there: the error comes in "
                         "with the inputs (or rows of a module's input and output are missing)")
    if p["phase"] == "reduced":
        if p.get("reduced_not_unreduced"):
            lines.append(f"  reduced, not unreduced: the local gradients agree ({p.get('unreduced_rows')} "
                         "unreduced row(s) within tolerance) and the reduced ones do not: the error grows after "
                         "the reduce (check communication, post-reduce processing, clipping)")
        elif not p.get("unreduced_rows"):
            lines.append("  no unreduced rows at that step to tell whether the error was there before the reduce")
    return lines


def report_text(report: CompareReport, code: int, limit: int) -> str:
    out: List[str] = []
    out.append(f"Verdict: {report.dtype} {VERDICT_TEXT[report.verdict]} (exit {code}, --fail-on "
               f"{report.settings.fail_on})")
    out.append(f"  judged: {level_rule(report)}")
    out.append(f"  dtype: {report.dtype_source}")
    c = report.counts
    out.append(f"  rows compared: {c.get('compared', 0)}, near zero (both within {_e(report.floor)}): "
               f"{c.get('near_zero', 0)}, non-finite mismatches: {c.get('nonfinite_mismatch', 0)}; "
               f"pass {c.get(PASS, 0)}, warning {c.get(WARNING, 0)}, error {c.get(ERROR, 0)}")
    fs = report.first_step
    out.append(f"  first step beyond tolerance: {_e(fs.get(WARNING))}; first step at error level: "
               f"{_e(fs.get(ERROR))}")
    if report.scalars is not None:
        out.extend(_scalars_text(report.scalars))
    out.append("")
    # what was compared, before what it says: a difference of setup explains many errors
    out.extend(_provenance_text(report))
    out.append("")
    out.extend(_where_text(report))
    if report.worst:
        out.append("")
        out.append(f"Worst layers at step {report.part['step']}, {report.part['phase']} (by their largest row):")
        rows_ = [[w["layer"], _e(w["max_error"]), _e(w["p95_error"]), f"{w['rows_beyond']}/{w['rows']}",
                  f"{w['worst_row']['monitor']} {w['worst_row']['scope']} {w['worst_row']['tensor']}"]
                 for w in report.worst[: limit or None]]
        out.append(table(["layer", "max error", "p95", "beyond", "worst row"], rows_))
    if report.module_rule and len(report.module_rule) > 1:
        out.append("")
        out.append(f"Modules whose output error exceeds {MODULE_WARNING_FACTOR:g} x their input's there "
                   f"(call order): " + ", ".join(f"{m['module']} ({m['level']})" for m in report.module_rule[:8])
                   + (" ..." if len(report.module_rule) > 8 else ""))
    if report.grows_after_reduce:
        g = report.grows_after_reduce[0]
        out.append("")
        out.append(f"Grows after reduce: {len(report.grows_after_reduce)} gradient row(s) beyond tolerance after the "
                   f"reduce and within it before; first: step {g['step']} rank {g['rank']} {g['tensor']} "
                   f"(unreduced {_e(g['unreduced_error'])}, reduced {_e(g['reduced_error'])})")
    if report.only or report.not_comparable:
        out.append("")
        for m, scopes in report.only.items():
            for s, n in scopes.items():
                out.append(f"Rows in one run only: {m} {s}: {n['ref']} only in REF, {n['cand']} only in CAND")
        for k, v in report.not_comparable.items():
            out.append(f"Not comparable: {k} ({v['ref']} REF, {v['cand']} CAND rows): {v['why']}")
    for n in report.notes:
        out.append(f"Note: {n}")
    if report.pooled:
        out.append("")
        out.append("Pooled error per step (sqrt(sum norm^2) of the rows both runs have; trend only):")
        by: Dict[Tuple[str, str], List[Tuple[int, float]]] = {}
        for p in report.pooled:
            by.setdefault((p["monitor"], p["scope"]), []).append((p["step"], p["scaled_error"]))
        rows_ = [[f"{m} {s}", " ".join(f"{st}:{_e(e)}" for st, e in v[-8:])] for (m, s), v in by.items()]
        out.append(table(["monitor scope", "step:scaled error (last 8 steps)"], rows_))
    if report.files:
        out.append("")
        for k in ("csv", "json", "html"):
            if k in report.files:
                out.append(f"Wrote {report.files[k]}")
    return "\n".join(out)


def _scalars_text(s: Dict[str, Any]) -> List[str]:
    src = s.get("source") or {}
    where = src.get("ref") if src.get("ref") == src.get("cand") else f"{src.get('ref')} (REF), {src.get('cand')} (CAND)"
    out = [f"  loss and grad norm (migration standard, from {where or 'the runs'}; scalars are judged here only, "
           f"not as rows of compare.csv): {s['level']}"]
    loss = s.get("loss")
    if loss:
        out.append(f"    loss: first (step {loss['first_step']}) |d| {_e(loss['first_abs'])} "
                   f"({_e(100 * loss['first_rel'])} %): {'ok' if loss['first_ok'] else 'beyond'}; "
                   f"all {loss['steps']} steps: {'ok' if loss['all_ok'] else str(loss['n_beyond']) + ' beyond'} "
                   f"(largest |d| {_e(loss['max_abs'])} at step {loss['max_abs_step']}); {loss['rule']}")
    gn = s.get("grad_norm")
    if gn:
        out.append(f"    grad norm: mean signed relative error {_e(100 * gn['mean_signed_rel'])} % over "
                   f"{gn['steps']} steps: {'ok' if gn['ok'] else 'beyond'} ({gn['rule']})")
    return out


def _side_text(label: str, side: Any) -> str:
    p = side.provenance
    parts = [f"{label} {side.root}: {p.get('kind')}"]
    if p.get("merged_from"):
        parts.append(f"merged from {p['merged_from']}")
    if p.get("world_size") is not None:
        parts.append(f"world size {p['world_size']}")
    if p.get("groups"):
        parts.append("groups " + ",".join(f"{g}={n}" for g, n in p["groups"].items()))
    if p.get("stack"):
        parts.append(f"stack {p['stack']}")
    parts.append(f"micro-batches {_e(p.get('micro_batches'))}")
    d = p.get("dtypes")
    parts.append("dtypes " + (",".join(f"{k}:{v}" for k, v in sorted(d.items())) if d else "not recorded"))
    parts.append("monitors " + ",".join(p.get("monitors") or []))
    ops = p.get("ops") or {}
    uniq = sorted({",".join(v) for v in ops.values()})
    parts.append("ops " + ("; ".join(uniq) if uniq else "-"))
    st = p.get("steps")
    if st:
        parts.append(f"steps {st[0]}-{st[1]}")
    return "; ".join(parts)


def _provenance_text(report: CompareReport) -> List[str]:
    out = ["Provenance:", "  " + _side_text("REF ", report.ref), "  " + _side_text("CAND", report.cand)]
    if report.baseline is not None:
        out.append("  " + _side_text("REF2", report.baseline))
    if report.config_differences:
        out.append("  differences: " + "; ".join(report.config_differences))
    else:
        out.append("  differences: none in layout, monitors, ops, micro-batches, steps")
    return out


# ------------------------------------------------------------------ HTML
def _colour(value: float, tol: float) -> str:
    """White at zero, yellow at the tolerance, red at 10 x it and beyond; grey-black for
    non-finite."""
    if value != value or value == math.inf:
        return "#222"
    if value <= 0:
        return "#ffffff"
    x = math.log10(max(value / tol, 1e-3))  # -3 .. 1+
    if x <= 0:
        t = (x + 3) / 3  # 0 .. 1: white to yellow
        return f"rgb(255,255,{int(255 - 175 * t)})"
    t = min(x, 1.0)
    return f"rgb(255,{int(255 - 200 * t)},{int(80 - 80 * t)})"


MAX_COLUMNS, MAX_ROWS = 200, 300  # of a heat map: a page a browser opens at once


def _binned(rows_: Sequence[str], cols: Sequence[int], cells: Dict[Tuple[str, int], float]
            ) -> Tuple[Sequence[str], List[int], Dict[Tuple[str, int], float], int]:
    """At most MAX_COLUMNS columns: consecutive steps taken together (the largest error of
    the bin, labelled by its first step); at most MAX_ROWS rows (the worst kept)."""
    per = max(1, math.ceil(len(cols) / MAX_COLUMNS))
    first = {c: cols[(i // per) * per] for i, c in enumerate(cols)}
    out: Dict[Tuple[str, int], float] = {}
    for (r, c), v in cells.items():
        k = (r, first.get(c, c))
        old = out.get(k)
        out[k] = v if old is None or _rank_value(v) > _rank_value(old) else old
    if len(rows_) > MAX_ROWS:
        worst = {r: max(_rank_value(v) for (rr, _), v in out.items() if rr == r) for r in rows_}
        keep = set(sorted(rows_, key=lambda r: -worst.get(r, 0.0))[:MAX_ROWS])
        rows_ = [r for r in rows_ if r in keep]
    return rows_, sorted(set(first.values())), out, per


def _rank_value(v: float) -> float:
    return math.inf if v != v else v


def _heat(title: str, rows_: Sequence[str], cols: Sequence[int], cells: Dict[Tuple[str, int], float],
          tol: float) -> str:
    n_rows = len(rows_)
    rows_, cols, cells, per = _binned(rows_, cols, cells)
    if per > 1 or len(rows_) < n_rows:
        title += (f" ({per} steps a column" if per > 1 else " (") + \
            (f", the {len(rows_)} worst of {n_rows} rows)" if len(rows_) < n_rows else ")")
    cw, ch, left, top = 28, 16, 230, 30
    w, h = left + cw * len(cols) + 10, top + ch * len(rows_) + 10
    out = [f'<h3>{html.escape(title)}</h3><svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           f'font-family="sans-serif" font-size="11">']
    for j, c in enumerate(cols):
        out.append(f'<text x="{left + j * cw + cw / 2}" y="{top - 8}" text-anchor="middle">{c}</text>')
    for i, r in enumerate(rows_):
        y = top + i * ch
        out.append(f'<text x="{left - 6}" y="{y + 12}" text-anchor="end">{html.escape(r)}</text>')
        for j, c in enumerate(cols):
            v = cells.get((r, c))
            if v is None:
                continue
            out.append(f'<rect x="{left + j * cw}" y="{y}" width="{cw - 1}" height="{ch - 1}" fill="{_colour(v, tol)}" '
                       f'stroke="#ccc"><title>{html.escape(r)} step {c}: {_e(v)}</title></rect>')
    out.append("</svg>")
    return "".join(out)


def _curve(title: str, pts_a: List[Tuple[int, float]], pts_b: List[Tuple[int, float]]) -> str:
    w, h, pad = 420, 180, 40
    allp = pts_a + pts_b
    if not allp:
        return ""
    xs = [p[0] for p in allp]
    ys = [p[1] for p in allp]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1

    def path(pts: List[Tuple[int, float]]) -> str:
        return " ".join(f"{pad + (x - x0) / (x1 - x0) * (w - 2 * pad):.1f},"
                        f"{h - pad - (y - y0) / (y1 - y0) * (h - 2 * pad):.1f}" for x, y in pts)

    return (f'<div class="curve"><h4>{html.escape(title)}</h4><svg xmlns="http://www.w3.org/2000/svg" width="{w}" '
            f'height="{h}" font-family="sans-serif" font-size="10"><rect x="{pad}" y="{pad}" width="{w - 2 * pad}" '
            f'height="{h - 2 * pad}" fill="none" stroke="#999"/>'
            f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{path(pts_a)}"/>'
            f'<polyline fill="none" stroke="#9467bd" stroke-width="2" stroke-dasharray="5,3" points="{path(pts_b)}"/>'
            f'<text x="{pad}" y="{h - 8}">step {x0}</text>'
            f'<text x="{w - pad}" y="{h - 8}" text-anchor="end">step {x1}</text>'
            f'<text x="4" y="{pad}">{_e(y1)}</text><text x="4" y="{h - pad}">{_e(y0)}</text>'
            f'<text x="{w - pad}" y="{pad - 6}" text-anchor="end" fill="#1f77b4">REF</text>'
            f'<text x="{w - pad - 40}" y="{pad - 6}" text-anchor="end" fill="#9467bd">CAND</text></svg></div>')


def write_html(report: CompareReport, path: str, code: int, limit: int) -> None:
    tol = report.tolerance if report.baseline is None else report.tolerance
    parts = ["<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>msprobe-monitor compare</title>",
             "<style>body{font-family:sans-serif;margin:20px}pre{background:#f6f6f6;padding:8px;overflow-x:auto}"
             ".curve{display:inline-block;margin:4px}</style></head><body>",
             f"<h1>compare: {html.escape(report.dtype)} {html.escape(VERDICT_TEXT[report.verdict])}</h1>",
             f"<pre>{html.escape(report_text(report, code, limit))}</pre>",
             f"<p>Colour: the largest scaled error of the judged statistic in the cell; white = 0, yellow = the "
             f"tolerance {_e(tol)}, red = {ERROR_FACTOR:g} x it or more, black = a non-finite mismatch.</p>"]
    # rank x step, one row per (monitor/scope, rank)
    cells: Dict[Tuple[str, int], float] = {}
    labels: List[str] = []
    steps = sorted({k[2] for k in report.rank_steps} | {k[1] for k in report.layer_steps})
    from .. import rows as _rows

    def phase_of(ms: str) -> int:
        m, s = ms.split("/", 1)
        return _rows.execution_phase(m, s)

    keys = sorted({(k[0], k[1]) for k in report.rank_steps}, key=lambda t: (phase_of(t[0]), t[0], t[1]))
    for ms, rank in keys:
        lab = f"{ms} rank {rank}"
        labels.append(lab)
    for (ms, rank, step), v in report.rank_steps.items():
        cells[(f"{ms} rank {rank}", step)] = v
    parts.append(_heat("rank x step (per monitor and scope)", labels, steps, cells, tol))
    layers = sorted({k[0] for k in report.layer_steps}, key=_layer_sort)
    parts.append(_heat("layer x step (every monitor)", layers, steps,
                       {k: v for k, v in report.layer_steps.items()}, tol))
    parts.append("<h3>Pooled norms of both runs (sqrt(sum norm^2) of the rows both have)</h3>")
    by: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    for p in report.pooled:
        by.setdefault((p["monitor"], p["scope"]), []).append(p)
    for (m, s), ps in by.items():
        parts.append(_curve(f"{m} {s}", [(p["step"], p["ref_norm"]) for p in ps],
                            [(p["step"], p["cand_norm"]) for p in ps]))
    parts.append("</body></html>")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(parts))


def _layer_sort(name: str) -> Tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))
