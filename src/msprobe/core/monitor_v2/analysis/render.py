"""Each command's result as the text tables or the JSON object it prints (and the
anomaly tables the HTML report of ``plot`` shows): what :mod:`.cli` writes to stdout,
apart from the parsing of its arguments."""

import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from .command import command_line, tensorboard_command
from .diff import DiffReport
from .reader import Layout, Problems
from .report import Report
from .text import compact_steps, fmt_num, table
from .validate import ValidateResult

if TYPE_CHECKING:  # merge imports the writer's cell format: loaded by the merge command only
    from .merge import MergeReport

ORDER_TEXT = ("execution order: step, micro-batch, parameters at step start, forward (module call order), "
              "backward, gradients, then optimizer state and updated parameters")
APPENDED_NOTE = ("a file whose steps start over holds several runs: a script re-run with the same output_dir "
                 "appends to the files of the earlier run; each step's latest rows are the report's, the rows "
                 "they replaced are the earlier runs' (counted apart); use a new output_dir per run to keep runs apart")
RUNS_NOTE = ("a window's rows lie in several files when a run wrote beside the earlier run's file, into "
             "<monitor>_step<a>-<b>.run<k>.csv (a re-run with other ops or columns, or a second job writing to the "
             "same output_dir at the same time); its runs are ordered by the file names (plain, .run2, ...) and, "
             "where those cannot say it, by the files' modification times; each step's latest rows are the "
             "report's, the rows they replaced are the earlier runs' (counted apart)")
NF_HEADERS = ["rank", "step", "micro_step", "monitor", "scope", "tensor", "kind", "values", "file:line"]
SPIKE_HEADERS = ["rank", "step", "micro_step", "monitor", "scope", "tensor", "stats", "value", "median",
                 "x median", "file:line"]
RANK_HEADERS = ["rank", "step", "micro_step", "monitor", "scope", "tensor", "stat", "value", "consensus",
                "agreeing ranks", "rows differing", "file:line"]
EARLIER_NOTE = ("rows that a later run wrote again: a run resumed from a checkpoint (or re-run) into the same "
                "output_dir appends the steps it trains again to the files; the latest rows of each step are the "
                "report's, the rows they replaced are the earlier runs'")
LOCALISATION_NOTE = ("per rank, in its first bad step: the phases whose every row went non-finite at once (they "
                     "cannot say which layer started it), the earliest evidence in execution order, and the last "
                     "clean step written before it")
AnomalyTables = Dict[str, Tuple[List[str], List[List[Any]], str]]


# ----------------------------------------------------------------------- pieces
def rel_path(path: str, root: str) -> str:
    """``path`` relative to ``root`` when it lies under it."""
    try:
        rel = os.path.relpath(path, root)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def where_text(item: Dict[str, Any], root: str, key: str = "file", line: str = "line") -> str:
    return f"{rel_path(item[key], root)}:{item[line]}"


def ranks_text(ranks: Sequence[int]) -> str:
    """``0-7`` for a range of more than two ranks, else ``0,2,5``."""
    if not ranks:
        return "-"
    rs = sorted(ranks)
    if rs == list(range(rs[0], rs[-1] + 1)) and len(rs) > 2:
        return f"{rs[0]}-{rs[-1]}"
    return ",".join(map(str, rs))


def rank_label(layout: Layout, rank: Any) -> Any:
    """How a finding's rank is shown: ``merged`` for the one pseudo-rank of a merged view."""
    return "merged" if layout.merged is not None else rank


def _who(layout: Layout, rank: Any) -> str:
    return "merged view" if layout.merged is not None else f"rank {rank}"


def tensor_label(item: Dict[str, Any]) -> str:
    """A finding's tensor, with the data-parallel rank of a merged view's per-dp row."""
    dp = item.get("dp_rank")
    return item["tensor"] if dp is None else f"{item['tensor']} [dp_rank {dp}]"


def _vals(values: Dict[str, Any]) -> str:
    return " ".join(f"{k}={fmt_num(v)}" for k, v in values.items())


def _limit(items: List[Any], n: int) -> List[Any]:
    return items if n == 0 else items[:n]


def _problems_json(problems: Problems) -> Dict[str, Any]:
    return {"count": problems.count, "items": [p.to_json() for p in problems.items]}


# ----------------------------------------------------------------------- the analysis report
def _nf_row(item: Dict[str, Any], root: str, layout: Layout) -> List[Any]:
    return [rank_label(layout, item["rank"]), item["step"], item["micro_step"], item["monitor"], item["scope"],
            tensor_label(item), item["kind"], _vals(item["values"]), where_text(item, root)]


def anomaly_tables(report: Report, limit: int) -> AnomalyTables:
    """title -> (headers, rows, note): shared by the text output and the HTML report."""
    root = report.layout.root
    out: AnomalyTables = {}
    first = report.first
    out["First non-finite value (NaN/Inf)"] = (
        NF_HEADERS, [_nf_row(first, root, report.layout)] if first else [], ORDER_TEXT + "; over all ranks and monitors")
    per_rank = [report.first_nonfinite[r][1] for r in sorted(report.first_nonfinite)]
    by = ", ".join(f"{m} {s} {n}" for (m, s), n in sorted(report.nonfinite_by.items(), key=lambda kv: -kv[1]))
    out["First non-finite value of each rank"] = (
        NF_HEADERS, _limit([_nf_row(i, root, report.layout) for i in per_rank], limit),
        f"{report.nonfinite_count} non-finite row(s) in total" + (f": {by}" if by else ""))
    if report.earlier_nonfinite:
        earlier = [report.earlier_nonfinite[r][1] for r in sorted(report.earlier_nonfinite)]
        out["First non-finite value of earlier runs (rows a later run wrote again)"] = (
            NF_HEADERS, _limit([_nf_row(i, root, report.layout) for i in earlier], limit),
            f"{report.earlier_nonfinite_count} non-finite row(s) of earlier runs; " + EARLIER_NOTE)
    out["Spikes"] = _spike_table(report, limit)
    if report.earlier_spikes.count:
        out["Spikes of earlier runs (rows a later run wrote again)"] = _spike_table(report, limit, earlier=True)
    mm = report.mismatch_list()
    rank_rows = [[i["rank"], i["step"], i["micro_step"], i["monitor"], i["scope"], i["tensor"], i["stat"],
                  i["value"], i["consensus"], ranks_text(i["consensus_ranks"]), i["rows_differing"],
                  where_text(i, root)] for i in mm]
    out["Ranks that disagree (first difference of each rank)"] = (
        RANK_HEADERS, _limit(rank_rows, limit), report.rank_check_note or report.mismatch_settings.describe())
    if report.moe is not None:
        from .moe import moe_table

        headers, moe_rows = moe_table(report.moe)
        moe_rows = [[rank_label(report.layout, r[0])] + r[1:] for r in moe_rows]  # 'merged' on a merged view
        out["MoE routing (dead experts, imbalance, collapse, logit growth, duplicates)"] = (
            headers, _limit(moe_rows, limit), report.moe_settings.describe() if report.moe_settings else "")
    if report.experts:
        from .moe import spread_table

        headers, spread_rows = spread_table(report.experts)
        spread_rows = [[rank_label(report.layout, r[0])] + r[1:] for r in spread_rows]
        out["Experts side by side (gradient norm per expert, latest step)"] = (
            headers, _limit(spread_rows, limit), "the rows of one parameter of every expert of a layer, grouped by "
            "expert index: the quietest and the loudest expert (information, not a finding)")
    return out


def _spike_table(report: Report, limit: int, earlier: bool = False) -> Tuple[List[str], List[List[Any]], str]:
    """The spikes of each step's latest rows, or (``earlier``) of the earlier runs' rows."""
    root = report.layout.root
    sp = report.earlier_spikes if earlier else report.spikes
    per_step = report.earlier_spike_steps if earlier else report.spike_steps
    spike_rows = [[rank_label(report.layout, i["rank"]), i["step"], i["micro_step"], i["monitor"], i["scope"],
                   tensor_label(i), ",".join(i["stats"]),
                   i["value"], i["median"], i["ratio"], where_text(i, root)] for i in sp.items()]
    note = (report.spike_settings.describe() if report.spike_settings.enabled else "off (--no-spikes)")
    if earlier:
        note = "each run against its own history; " + EARLIER_NOTE
    if sp.count:
        steps = sorted(per_step)
        shown = (", ".join(f"{st} ({per_step[st]})" for st in steps[:10])
                 + (", ..." if len(steps) > 10 else ""))
        note += f"; {sp.count} row(s) with a spike, at steps: {shown}"
        if sp.count > min(len(spike_rows), limit or len(spike_rows)):
            note += f"; the first {min(len(spike_rows), limit or len(spike_rows))} in execution order shown"
    return SPIKE_HEADERS, _limit(spike_rows, limit), note


def report_json(report: Report, limit: int) -> Dict[str, Any]:
    """The JSON object of ``summary`` and ``anomalies`` (less ``command``)."""
    layout = report.layout
    lim = None if limit == 0 else limit
    per_rank = [report.first_nonfinite[r][1] for r in sorted(report.first_nonfinite)]
    return {
        "out_dir": os.path.abspath(layout.root),
        "ranks": layout.ranks,
        **({} if layout.merged is None else {"merged": layout.merged}),
        "monitors": {m: c.to_json() for m, c in report.collected.items()},
        "per_rank": {str(r): {"files": report.rank_files.get(r, 0), "rows": report.rank_rows.get(r, 0)}
                     for r in layout.ranks},
        "nonfinite": {
            "count": report.nonfinite_count,
            "by_monitor_scope": {f"{m} {s}": n for (m, s), n in report.nonfinite_by.items()},
            "first": report.first,
            "first_per_rank": per_rank[:lim],
            "order": ORDER_TEXT,
            "earlier_runs": {
                "note": EARLIER_NOTE,
                "count": report.earlier_nonfinite_count,
                "first": report.earlier_first,
                "first_per_rank": [report.earlier_nonfinite[r][1] for r in sorted(report.earlier_nonfinite)][:lim],
            },
        },
        "spikes": {"enabled": report.spike_settings.enabled, "rule": report.spike_settings.describe(),
                   "settings": dict(report.spike_settings.__dict__), "count": report.spikes.count,
                   "per_step": {str(k): v for k, v in sorted(report.spike_steps.items())},
                   "items": report.spikes.items()[:lim],
                   "earlier_runs": {
                       "note": EARLIER_NOTE, "count": report.earlier_spikes.count,
                       "per_step": {str(k): v for k, v in sorted(report.earlier_spike_steps.items())},
                       "items": report.earlier_spikes.items()[:lim]}},
        "rank_check": {"enabled": report.mismatch_settings.enabled and not report.rank_check_note,
                       "note": report.rank_check_note or report.mismatch_settings.describe(),
                       "ranks_differing": len(report.mismatches), "items": report.mismatch_list()[:lim]},
        "appended": {"files": len(report.appended), "note": APPENDED_NOTE, "items": report.appended[:lim]},
        "runs": {"run_files": _run_files(layout), "windows": len(report.run_windows),
                 "steps_repeated": report.steps_repeated, "earlier_rows": report.earlier_rows, "note": RUNS_NOTE,
                 "items": report.run_windows[:lim]},
        "localisation": {"note": LOCALISATION_NOTE,
                         "per_rank": [report.localisation[r] for r in sorted(report.localisation)][:lim]},
        "alerts": {"per_rank": [report.alerts[r] for r in sorted(report.alerts)][:lim]},
        "dumps": report.dumps[:lim],
        **({} if report.moe is None else {"moe": {
            "count": len(report.moe), "items": report.moe[:lim],
            "rule": report.moe_settings.describe() if report.moe_settings else "",
            "settings": dict(report.moe_settings.__dict__) if report.moe_settings else {}}}),
        **({} if not report.experts else {"experts": {"count": len(report.experts),
                                                       "items": report.experts[:lim]}}),
        "problems": _problems_json(report.problems),
        "anomalies_found": report.anomalies_found,
    }


def _appended_text(item: Dict[str, Any], root: str) -> str:
    runs = item["runs"]
    return (f"{rel_path(item['file'], root)}: {runs} runs (run {2 if runs == 2 else '2..' + str(runs)} starts at line "
            f"{', '.join(map(str, item['restart_lines'][:5]))}{', ...' if len(item['restart_lines']) > 5 else ''}); "
            f"repeated step(s): {compact_steps(item['steps_repeated']) if item['steps_repeated'] else 'none'}")


def _run_files(layout: Layout) -> int:
    """The ``<monitor>_step<a>-<b>.run<k>.csv`` files read."""
    return sum(1 for f in layout.all_files() if f.run > 1)


def _runs_text(item: Dict[str, Any], root: str) -> str:
    """A window whose rows lie in several files: its files, the latest run's last."""
    files = [rel_path(p, root) for p in item["files"]]
    return (f"{files[0]} and beside it {', '.join(os.path.basename(p) for p in files[1:])}: {item['runs']} runs"
            + (" (ordered by modification time)" if item["order"] != "names" else "")
            + f"; repeated step(s): {compact_steps(item['steps_repeated']) if item['steps_repeated'] else 'none'}")


def _runs_rows(report: Report, limit: int) -> List[List[Any]]:
    return [[i["rank"], i["monitor"], " ".join(os.path.basename(p) for p in i["files"]), i["runs"], i["order"],
             compact_steps(i["steps_repeated"]) if i["steps_repeated"] else "-", i["earlier_rows"]]
            for i in _limit(report.run_windows, limit)]


def _appended_rows(report: Report, limit: int) -> List[List[Any]]:
    root = report.layout.root
    return [[i["rank"], i["monitor"], rel_path(i["file"], root), i["runs"], ",".join(map(str, i["restart_lines"][:5])),
             compact_steps(i["steps_repeated"]) if i["steps_repeated"] else "-"]
            for i in _limit(report.appended, limit)]


def merged_text(doc: Dict[str, Any]) -> str:
    """One line on a merged view (its merge.json): what was merged and what was left out."""
    groups = " ".join(f"{g}={n}" for g, n in (doc.get("groups") or {}).items())
    left = {k: v for k, v in (doc.get("left_out") or {}).items() if v}
    left_text = ", ".join(f"{k} {v}" for k, v in left.items()) or "none"
    return (f"merged view of {doc.get('world_size', '?')} rank(s) ({groups or 'groups unknown'}) from "
            f"{doc.get('source', '?')}: whole tensors under global names, one pseudo-rank ('merged'), "
            f"per-dp rows by dp_rank; rows left out: {left_text}; replica disagreements: "
            f"{doc.get('disagreements', 0)} (disagreements.csv)")


def _collected_text(report: Report) -> List[str]:
    layout = report.layout
    steps = sorted({s for c in report.collected.values() for s in c.steps})
    rows = sum(c.rows for c in report.collected.values())
    if layout.merged is not None:
        lines = [f"  {merged_text(layout.merged)}",
                 f"  {layout.n_files} file(s), {rows} rows, steps {compact_steps(steps)}"]
    else:
        lines = [f"  {len(layout.ranks)} rank(s) ({ranks_text(layout.ranks)}), {layout.n_files} file(s), {rows} rows, "
                 f"steps {compact_steps(steps)}"]
    if report.earlier_rows:
        lines[-1] += (f" (each step's latest rows; {report.earlier_rows} row(s) of earlier runs, which a later run "
                      "wrote again, counted apart)")
    trows = []
    for m, c in report.collected.items():
        scopes = ", ".join(f"{s}" for s in sorted(c.scopes, key=lambda s: -c.scopes[s])[:6])
        if len(c.scopes) > 6:
            scopes += f", ... ({len(c.scopes)})"
        micro = ranks_text(sorted(c.micro_steps)) if c.micro_steps else "-"
        trows.append([m, ranks_text(sorted(c.ranks)), c.files, c.rows, compact_steps(sorted(c.steps)),
                      len(c.tensors), ",".join(c.ops), micro, scopes])
    lines.append(table(["monitor", "ranks", "files", "rows", "steps", "tensors", "ops", "micro_step", "scopes"],
                       trows, right=[False, False, True, True, False, True, False, False, False]))
    return lines


# ----------------------------------------------------------------------- summary
def summary_json(report: Report, limit: int) -> Dict[str, Any]:
    data = report_json(report, limit)
    data["command"] = "summary"
    return data


def summary_text(report: Report) -> str:
    root = report.layout.root
    lines = [f"msprobe-monitor summary {root}", "", "Collected:"]
    lines += _collected_text(report)
    if len(report.layout.ranks) > 1:
        per = [f"rank {r}: {report.rank_files[r]} files, {report.rank_rows[r]} rows" for r in report.layout.ranks]
        shown = per if len(per) <= 8 else per[:4] + [f"... ({len(per) - 6} more)"] + per[-2:]
        lines.append("  " + "; ".join(shown))
    lines += ["", "Headline anomalies:"]
    lines += _headline_nonfinite(report) + _headline_localisation(report) + _headline_spikes(report)
    lines += _headline_ranks(report) + _headline_evidence(report)
    lines += _headline_moe(report)
    lines += _headline_experts(report)
    lines += _headline_runs(report)
    if report.problems.count:
        lines.append(f"  malformed input:   {report.problems.summary()} (see the warnings above)")
    lines += ["", f"Details: {command_line('anomalies', root)}"]
    return "\n".join(lines)


def _headline_moe(report: Report) -> List[str]:
    if report.moe is None:
        return []
    if not report.moe:
        return ["  moe routing:       none (no dead expert, imbalance, collapse, logit growth or duplicate)"]
    kinds: Dict[str, int] = {}
    for f in report.moe:
        kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
    first = report.moe[0]
    return [f"  moe routing:       {len(report.moe)} finding(s) ("
            + ", ".join(f"{k} {n}" for k, n in kinds.items())
            + f"); first: rank {rank_label(report.layout, first['rank'])} {first['router']}: {first['detail']}"]


def _headline_experts(report: Report) -> List[str]:
    if not report.experts:
        return []
    widest = max(report.experts, key=lambda s: math.inf if s["ratio"] is None else s["ratio"])
    where = "" if report.layout.merged is not None else f"rank {widest['rank']} "
    return [f"  experts:           {len(report.experts)} group(s) of per-expert gradient rows; widest spread: "
            f"{where}{widest['group']} ({widest['scope']}, step {widest['step']}): expert {widest['quietest']} "
            f"quietest ({widest['quietest_norm']:.4g}), expert {widest['loudest']} loudest "
            f"({widest['loudest_norm']:.4g})"]


def _headline_runs(report: Report) -> List[str]:
    """Several runs in the output: appended to the same files, or written beside them."""
    root = report.layout.root
    run_files = _run_files(report.layout)
    if not (report.appended or run_files or report.run_windows):
        return []
    held = []
    if report.appended:
        held.append(f"{len(report.appended)} file(s) with runs appended to them (a re-run into the same files)")
    if run_files:
        held.append(f"{run_files} .run<k> file(s) written beside earlier files (a re-run with other ops, or a second "
                    "job at the same time)")
    first = (_runs_text(report.run_windows[0], root) if report.run_windows else
             _appended_text(report.appended[0], root) if report.appended else "")
    return [f"  several runs:      {' and '.join(held)}; {report.steps_repeated} step(s) written more than once, "
            f"{report.earlier_rows} row(s) of earlier runs set aside (each step's latest rows are the report's)"
            + (f"; first: {first}" if first else "")]


def _nf_text(report: Report, item: Dict[str, Any]) -> str:
    return (f"{_who(report.layout, item['rank'])}, step {item['step']}, {item['where']}: {tensor_label(item)} "
            f"({item['monitor']} {item['scope']}) is {item['kind']} [{where_text(item, report.layout.root)}]")


def _headline_nonfinite(report: Report) -> List[str]:
    first, earlier = report.first, report.earlier_first
    if not first:
        lines = ["  first NaN/Inf:     none (every value is finite)" if earlier is None else
                 "  first NaN/Inf:     none in the latest run (every step's latest rows are finite)"]
    else:
        lines = [f"  first NaN/Inf:     {_nf_text(report, first)}; {report.nonfinite_count} non-finite row(s) in total"]
    if earlier is not None:
        lines.append(f"  earlier runs:      {_nf_text(report, earlier)}; {report.earlier_nonfinite_count} non-finite "
                     f"row(s) among the rows that a later run wrote again (a run resumed or re-run into the same output_dir)")
    return lines


def _first_localisation(report: Report) -> Optional[Dict[str, Any]]:
    first = report.first
    return None if first is None else report.localisation.get(first["rank"])


def _headline_localisation(report: Report) -> List[str]:
    loc = _first_localisation(report)
    if loc is None:
        return []
    lines = []
    if loc["message"]:
        lines.append(f"  localisation:      {loc['message']}")
    if loc["bracket"]:
        lines.append(f"  began:             {loc['bracket']}")
    others = [r for r, o in report.localisation.items() if o is not loc and (o["message"] or o["bracket"])]
    if others:
        details = command_line("anomalies", report.layout.root)
        lines.append(f"  (rank(s) {ranks_text(sorted(others))} too: see {details})")
    return lines


def _headline_evidence(report: Report) -> List[str]:
    root = report.layout.root
    lines = []
    if report.alerts:
        rank = min(report.alerts, key=lambda r: (_alert_step(report.alerts[r]), r))
        alert = report.alerts[rank]
        lines.append(f"  online alert:      rank {rank}: {alert['explanation']} "
                     f"[{rel_path(alert['file'], root)}:{alert['first']['line']}]"
                     + (f" ({_run_text(alert)})" if alert.get("run_started") and alert.get("earlier_runs") else "")
                     + (f"; {len(report.alerts)} rank(s) wrote one" if len(report.alerts) > 1 else ""))
        earlier = alert.get("earlier_runs") or []
        if earlier:
            lines.append(f"  earlier alerts:    rank {rank}: {_earlier_alert_text(earlier[0], root)}"
                         + (f"; {len(earlier)} earlier run(s) wrote a block" if len(earlier) > 1 else ""))
    if report.dumps:
        shown = _dumps_latest_first(report.dumps)
        d = shown[0]
        others = [rel_path(o["dir"], root) for o in shown[1:]]
        lines.append(f"  dump:              {_dump_text(d, root, with_run=bool(others))}"
                     + (f"; {len(report.dumps)} dump(s) in all (also {', '.join(others[:3])}"
                        f"{', ...' if len(others) > 3 else ''})" if others else ""))
    return lines


def _run_text(item: Dict[str, Any]) -> str:
    return f"run {item['run']} started {item['run_started']}" if item.get("run") else \
        f"run started {item['run_started']}"


def _earlier_alert_text(block: Dict[str, Any], root: str) -> str:
    """An earlier run's block of anomalies.jsonl: its first anomaly, where it is."""
    f = block["first"]
    who = _run_text(block) if block.get("run_started") else "an earlier run"
    return (f"{who}: step {f.get('step')}, {f.get('kind')} {f.get('module_name')} ({f.get('monitor')}, "
            f"{_alert_where_text(f)}) [{rel_path(block['file'], root)}:{f['line']}]")


def _alert_where_text(rec: Dict[str, Any]) -> str:
    from .order import where

    micro = rec.get("micro_step")
    return where(str(rec.get("monitor")), str(rec.get("scope")), micro if isinstance(micro, int) else None)


def _dumps_latest_first(dumps: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The dumps, the latest run's first (by the start time its manifest names; a dump of
    an older version, which names none, after them, in step order)."""
    dated = sorted((d for d in dumps if isinstance(d.get("run_started"), str)),
                   key=lambda d: (d["run_started"], d["dump"]), reverse=True)
    return dated + [d for d in dumps if not isinstance(d.get("run_started"), str)]


def _alert_step(alert: Dict[str, Any]) -> int:
    step = alert["first"].get("step")
    return step if isinstance(step, int) else 1 << 62


def byte_size(n: Any) -> str:
    """``2.1 KiB``, ``256 MiB``: a size to read, not to compute with (JSON keeps the bytes)."""
    if not isinstance(n, (int, float)):
        return "? bytes"
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "bytes" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} GiB"


def _dump_text(d: Dict[str, Any], root: str, with_run: bool = False) -> str:
    """One dump; ``with_run``: its run too (where there are several dumps to tell apart)."""
    budget = f" of a {byte_size(d['max_bytes'])} budget" if isinstance(d.get("max_bytes"), int) else ""
    return (f"rank {d['rank']} step {d['step']}: {rel_path(d['dir'], root)}, {d['tensors']} tensor(s), "
            f"{byte_size(d['bytes'])}{budget}, {d['skipped']} skipped"
            + (f" ({d['reason']})" if d.get("reason") else "")
            + (f"; {_run_text(d)}" if with_run and d.get("run_started") else ""))


def _headline_spikes(report: Report) -> List[str]:
    if not report.spike_settings.enabled:
        return ["  spikes:            not checked (--no-spikes)"]
    lines = []
    if not report.spikes.count:
        lines.append("  spikes:            none" + (" in the latest run" if report.earlier_spikes.count else ""))
    else:
        lines.append(f"  spikes:            {report.spikes.count} row(s); first: {_spike_text(report, report.spikes)}; "
                     "steps: " + compact_steps(sorted(report.spike_steps)))
    if report.earlier_spikes.count:
        lines.append(f"  earlier spikes:    {report.earlier_spikes.count} row(s) among the rows that a later run wrote "
                     f"again; first: {_spike_text(report, report.earlier_spikes)}; steps: "
                     + compact_steps(sorted(report.earlier_spike_steps)))
    return lines


def _spike_text(report: Report, spikes: Any) -> str:
    s0 = spikes.items()[0]
    return (f"{_who(report.layout, s0['rank'])}, step {s0['step']}, {tensor_label(s0)} ({s0['monitor']} {s0['scope']}) "
            f"{s0['stat']} {fmt_num(s0['value'])} = {fmt_num(s0['ratio'], 3)} x its median")


def _headline_ranks(report: Report) -> List[str]:
    if report.rank_check_note:
        return [f"  rank disagreement: {report.rank_check_note}"]
    if not report.mismatches:
        return ["  rank disagreement: none"]
    mm = report.mismatch_list()
    m0 = mm[0]
    return [f"  rank disagreement: rank(s) {ranks_text([m['rank'] for m in mm])}; first: rank "
            f"{m0['rank']}, step {m0['step']}, {m0['tensor']} ({m0['monitor']} {m0['scope']}) "
            f"{m0['stat']} {fmt_num(m0['value'])} vs {fmt_num(m0['consensus'])}"]


# ----------------------------------------------------------------------- anomalies
def anomalies_json(report: Report, limit: int, code: int) -> Dict[str, Any]:
    data = report_json(report, limit)
    data["command"] = "anomalies"
    data["exit_code"] = code
    return data


def anomalies_text(report: Report, limit: int, code: int) -> str:
    root = report.layout.root
    lines = [f"msprobe-monitor anomalies {root}"]
    lines += _collected_text(report)[:1]
    first = report.first
    lines += ["", "FIRST NON-FINITE VALUE (in execution order, over all ranks and monitors)"]
    if first:
        lines.append(f"  {_who(report.layout, first['rank'])}, step {first['step']}, {first['where']}: "
                     f"{tensor_label(first)} "
                     f"({first['monitor']}, scope {first['scope']}) is {first['kind']}")
        lines.append(f"  values: {_vals(first['values'])}")
        lines.append(f"  at {where_text(first, root)}")
    else:
        lines.append("  none: every value is finite" if report.earlier_first is None else
                     "  none in the latest run: every step's latest rows are finite")
    for title, (headers, rows, note) in anomaly_tables(report, limit).items():
        lines += _anomaly_section(report, title, headers, rows, note)
        if title.startswith("First non-finite value of each"):
            lines += _localisation_section(report, limit) + _evidence_section(report, limit)
    if report.appended:
        lines += ["", "STEPS WRITTEN MORE THAN ONCE (runs appended to the same files)", f"  ({APPENDED_NOTE})",
                  table(["rank", "monitor", "file", "runs", "later runs start at line", "steps written again"],
                        _appended_rows(report, limit))]
    if report.run_windows:
        lines += ["", "WINDOWS WRITTEN BY SEVERAL RUNS INTO SEVERAL FILES (.run<k> files beside the earlier ones)",
                  f"  ({RUNS_NOTE})",
                  table(["rank", "monitor", "files (by name)", "runs", "ordered by", "steps written again",
                         "earlier rows"], _runs_rows(report, limit))]
    if report.earlier_rows:
        lines.append(f"  {report.earlier_rows} row(s) of earlier runs counted apart; every finding above is of each "
                     "step's latest rows unless it says earlier runs")
    if report.problems.count:
        lines += ["", f"MALFORMED INPUT: {report.problems.summary()} (see the warnings on stderr)"]
    verdict = "anomalies found" if report.anomalies_found else "no anomaly"
    lines += ["", f"Result: {verdict} (exit {code})"]
    return "\n".join(lines)


def _localisation_section(report: Report, limit: int) -> List[str]:
    locs = [report.localisation[r] for r in sorted(report.localisation)]
    said = [o for o in locs if o["message"] or o["bracket"]]
    if not said:
        return []
    lines = ["", "WHAT THE FIRST NON-FINITE VALUE CAN SAY (per rank, its first bad step)"]
    for loc in _limit(said, limit):
        who = f"  rank {loc['rank']}: " if len(report.layout.ranks) > 1 else "  "
        for text in (loc["message"], loc["bracket"]):
            if text:
                lines.append(who + text)
    if len(said) > len(_limit(said, limit)):
        lines.append(f"  ... {len(said) - len(_limit(said, limit))} more rank(s) (--limit)")
    return lines


def _evidence_section(report: Report, limit: int) -> List[str]:
    root = report.layout.root
    lines: List[str] = []
    if report.alerts:
        lines += ["", "ONLINE ALERT (rank_<r>/anomalies.jsonl: the first anomaly the trainer recorded)"]
        rows = []
        for r in sorted(report.alerts):
            a = report.alerts[r]
            f = a["first"]
            rows.append([r, f.get("step"), f.get("micro_step"), f.get("monitor"), f.get("scope"), f.get("module_name"),
                         f.get("kind"), a["records"] + a["truncated"], f"{rel_path(a['file'], root)}:{f['line']}"])
        lines.append(table(["rank", "step", "micro_step", "monitor", "scope", "tensor", "kind", "records", "file:line"],
                           _limit(rows, limit)))
        for r in _limit(sorted(report.alerts), limit):
            a = report.alerts[r]
            lines.append(f"  rank {r}: {a['explanation']}"
                         + (f" ({_run_text(a)})" if a.get("run_started") and a.get("earlier_runs") else ""))
        earlier = [(r, b) for r in sorted(report.alerts) for b in report.alerts[r].get("earlier_runs") or []]
        if earlier:
            lines += ["", "ONLINE ALERTS OF EARLIER RUNS (their blocks of anomalies.jsonl, the latest first: a run "
                          "resumed into the same output_dir appends its own)"]
            lines += [f"  rank {r}: {_earlier_alert_text(b, root)}" for r, b in _limit(earlier, limit)]
    if report.dumps:
        lines += ["", "DUMPS (tensors kept to replay a step offline: see docs/output-format.md)"]
        several = len(report.dumps) > 1
        lines += [f"  {_dump_text(d, root, with_run=several)}" for d in _limit(report.dumps, limit)]
    return lines


def _anomaly_section(report: Report, title: str, headers: List[str], rows: List[List[Any]], note: str) -> List[str]:
    """One table of ``anomaly_tables`` in the text of ``anomalies``: the overall first
    non-finite value is written above, and the per-rank one only with several ranks."""
    lines: List[str] = []
    if title.startswith("First non-finite value (NaN"):
        return lines
    if title.startswith("First non-finite value of each"):
        if report.nonfinite_count:
            lines.append(f"  ({note})")
        if len(report.layout.ranks) < 2 or not rows:
            return lines
        note = ""
    lines += ["", title.upper()]
    if note:
        lines.append(f"  ({note})")
    lines.append(table(headers, rows) if rows else "  none")
    return lines


# ----------------------------------------------------------------------- plot
def plot_json(report: Report, limit: int, out_dir: str, image_names: Sequence[str], html_path: Optional[str],
              omitted_lines: int) -> Dict[str, Any]:
    data = report_json(report, limit)
    data.update(command="plot", plot_dir=os.path.abspath(out_dir),
                images=[os.path.join(os.path.abspath(out_dir), n) for n in image_names],
                html=os.path.abspath(html_path) if html_path else None,
                lines_not_plotted=omitted_lines)
    return data


def plot_text(report: Report, stat: str, rank: int, out_dir: str, n_images: int, html_path: Optional[str],
              omitted_lines: int, max_plots: int) -> str:
    root = report.layout.root
    lines = [f"msprobe-monitor plot {root}: {stat} of {'the ' if report.layout.merged is not None else ''}"
             f"{_who(report.layout, rank)}",
             f"  {n_images} image(s) in {out_dir}"]
    if omitted_lines:
        lines.append(f"  {omitted_lines} tensor line(s) not drawn (--max-plots {max_plots}); "
                     f"choose with --match, --monitors or --steps")
    if report.earlier_rows:
        lines.append(f"  {report.earlier_rows} row(s) of earlier runs not drawn (a later run wrote their steps again: "
                     "each step's latest rows are drawn)")
    if html_path:
        lines.append(f"  report: {html_path}")
        lines.append(f"  open:   file://{os.path.abspath(html_path)}")
    if report.anomalies_found:
        lines.append("  anomalies found: see the report, or " + command_line("anomalies", root))
    return "\n".join(lines)


# ----------------------------------------------------------------------- diff
def diff_json(rep: DiffReport, problems: Problems, code: int) -> Dict[str, Any]:
    s = rep.settings
    only_a, only_b = rep.only_rows
    return {
        "command": "diff", "a": os.path.abspath(rep.a.root), "b": os.path.abspath(rep.b.root),
        "rtol": s.rtol, "atol": s.atol, "stats": list(s.stats) if s.stats else "all",
        "compared_rows": rep.compared_rows, "differing_rows": rep.differing_rows,
        "rows_only_in_a": only_a, "rows_only_in_b": only_b, "first": rep.first,
        "first_only_in_one_run": rep.first_only, "per_monitor": {m: d.to_json() for m, d in rep.per_monitor.items()},
        "largest": rep.top(), "not_compared": rep.not_compared,
        "problems": _problems_json(problems),
        "differ": rep.differs, "exit_code": code,
    }


def diff_text(rep: DiffReport, problems: Problems, code: int) -> str:
    s = rep.settings
    only_a, only_b = rep.only_rows
    lines = [f"msprobe-monitor diff {rep.a.root} {rep.b.root}  (|a-b| > {s.atol:g} + {s.rtol:g} * max(|a|,|b|); "
             f"stats: {','.join(s.stats) if s.stats else 'all'})",
             f"  compared {rep.compared_rows} rows; {rep.differing_rows} differ; rows only in A: {only_a}, "
             f"only in B: {only_b}"]
    for note in rep.not_compared:
        lines.append(f"  not compared: {note}")
    lines += ["", "FIRST DIFFERENCE (in execution order, over all ranks and monitors)"]
    lines += _diff_first(rep)
    if rep.per_monitor:
        lines += ["", "PER MONITOR"]
        lines.append(table(["monitor", "compared rows", "differing rows", "first differing step", "only in A",
                            "only in B"],
                           [[m, d.compared_rows, d.differing_rows, d.first_step, d.only_a, d.only_b]
                            for m, d in rep.per_monitor.items()]))
    top = rep.top()
    if top:
        lines += ["", "LARGEST DIFFERENCES (one row per tensor: its largest relative difference)"]
        lines.append(table(["rank", "step", "micro_step", "monitor", "scope", "tensor", "stat", "A", "B",
                            "abs diff", "rel diff"],
                           [[rank_label(rep.a, t["rank"]), t["step"], t["micro_step"], t["monitor"], t["scope"],
                             tensor_label(t),
                             t["stat"], t["a"], t["b"], t["abs_diff"], t["rel_diff"]] for t in top]))
    if problems.count:
        lines += ["", f"MALFORMED INPUT: {problems.summary()} (see the warnings on stderr)"]
    lines += ["", f"Result: {'the runs differ' if rep.differs else 'no difference'} (exit {code})"]
    return "\n".join(lines)


def _diff_first(rep: DiffReport) -> List[str]:
    lines = []
    f = rep.first
    if f:
        lines.append(f"  {_who(rep.a, f['rank'])}, step {f['step']}, {f['where']}: {tensor_label(f)} ({f['monitor']}, "
                     f"scope {f['scope']}) {f['stat']}: A={fmt_num(f['a'], 9)} B={fmt_num(f['b'], 9)} "
                     f"(abs {fmt_num(f['abs_diff'], 3)}, rel {fmt_num(f['rel_diff'], 3)})")
        lines.append(f"  A: {where_text(f, rep.a.root, 'file_a', 'line_a')}   "
                     f"B: {where_text(f, rep.b.root, 'file_b', 'line_b')}")
    else:
        lines.append("  none within the tolerance")
    if rep.first_only:
        o = rep.first_only
        lines.append(f"  first row present only in {o['only_in']}: {_who(rep.a, o['rank'])}, step {o['step']}, "
                     f"{tensor_label(o)} ({o['monitor']} {o['scope']})")
    return lines


# ----------------------------------------------------------------------- export
ParquetExport = Tuple[str, Dict[str, Any], int]  # DEST, what .columnar.export returned, CSV files read
TensorBoardExport = Tuple[str, Dict[str, Any]]  # TB_DIR, what .tensorboard.export_tensorboard returned


def export_json(out_dir: str, parquet: Optional[ParquetExport], tensorboard: Optional[TensorBoardExport],
                problems: Problems) -> Dict[str, Any]:
    """``parquet``, ``tensorboard``: None where that export did not run."""
    result: Dict[str, Any] = {"command": "export", "out_dir": os.path.abspath(out_dir)}
    if parquet is not None:
        dest, res, _n_files = parquet
        result.update(dest=os.path.abspath(dest), parquet_files=res["files"], rows=res["rows"])
    if tensorboard is not None:
        tb_dir, res = tensorboard
        result.update(tensorboard=os.path.abspath(tb_dir), tensorboard_runs=res["runs"],
                      scalars=res["scalars"], tags=res["tags"])
    result["problems"] = _problems_json(problems)
    return result


def export_text(out_dir: str, parquet: Optional[ParquetExport], tensorboard: Optional[TensorBoardExport],
                problems: Problems) -> str:
    lines: List[str] = []
    if parquet is not None:
        dest, res, n_files = parquet
        lines += [f"msprobe-monitor export {out_dir}: {res['rows']} rows from {n_files} CSV file(s) -> "
                  f"{res['files']} Parquet file(s) in {dest}",
                  f"  read it with any command, e.g. {command_line('summary', dest)}"]
    if tensorboard is not None:
        tb_dir, res = tensorboard
        lines += [f"msprobe-monitor export {out_dir}: {res['scalars']} scalars in {res['tags']} series "
                  f"(tensor, scope, statistic), {res['runs']} run(s) (one per rank) -> {tb_dir}",
                  f"  view them: {tensorboard_command(tb_dir)}"]
    if problems.count:
        lines.append(f"  malformed input: {problems.summary()} (see the warnings above)")
    return "\n".join(lines)


# ----------------------------------------------------------------------- merge
MERGE_LEFT_OUT_WHY = {
    "unknown": "the layout does not say how the tensor is split (or does not name it)",
    "partial": "a piece is a partial sum over its split groups, not combinable from statistics",
    "incomplete": "the pieces present do not add up to the whole tensor",
    "cc": "communication calls are per rank: not merged",
    "no_layout": "rows of a rank without a readable layout.json",
    "moe": "a rank's routing statistics of its own tokens: not merged (global token counts from the per_expert "
           "sidecars, in moe.csv)",
}


def merge_json(rep: "MergeReport", limit: int, code: int) -> Dict[str, Any]:
    data: Dict[str, Any] = {"command": "merge", "dest": rep.dest}
    data.update(rep.to_json())
    data.update(files=[os.path.join(rep.dest, f) for f in rep.files],
                left_out_examples={k: _limit(v, limit) for k, v in rep.examples.items() if v},
                first_disagreements=_limit(rep.first_disagreements, limit), notes=rep.notes,
                problems=_problems_json(rep.problems) if rep.problems is not None else {"count": 0, "items": []},
                exit_code=code)
    return data


def _groups_text(groups: Dict[str, int]) -> str:
    return " ".join(f"{g}={n}" for g, n in groups.items()) or "-"


def merge_text(rep: "MergeReport", out_dir: str, dest: str, limit: int, code: int) -> str:
    world = f"world size {rep.world_size}" if rep.world_size else "world size unknown"
    lines = [f"msprobe-monitor merge {out_dir} -> {dest}: {rep.rows_read:,} rows read from {len(rep.ranks)} rank(s) "
             f"({world}; groups {_groups_text(rep.groups)}), {rep.rows_written:,} merged rows written"]
    lines.append(f"  wrote in {dest}: " + ", ".join(
        f"{f} ({rep.rows_per_monitor[f[:-4]]:,} rows)" if f[:-4] in rep.rows_per_monitor else f for f in rep.files))
    left = sum(rep.left_out.values())
    lines += ["", f"LEFT OUT: {left:,} row(s)" + (" (none)" if not left else "")]
    if left:
        tab = []
        for kind, n in rep.left_out.items():
            if not n:
                continue
            ex = rep.examples.get(kind) or []
            first = ex[0] if ex else None
            example = (f"step {first['step']} {first['monitor']} {first['module_name']} ({first['scope']}): "
                       f"{first['why']}") if first else ""
            tab.append([kind, n, MERGE_LEFT_OUT_WHY[kind], example])
        lines.append(table(["kind", "rows", "why", "first example"], tab))
        more = [e for kind in rep.examples for e in rep.examples[kind][1:]]
        for e in _limit(more, max(limit - 1, 0) if limit else 0):
            lines.append(f"  also: step {e['step']} {e['monitor']} {e['module_name']} ({e['scope']}): {e['why']}")
        lines.append("  (rows counted: merged rows for unknown/partial/incomplete, input rows for cc/no_layout/moe; "
                     "all in merge.json)")
    if rep.layout_unknown:
        lines += ["", "WHAT THE LAYOUTS COULD NOT SAY"]
        lines += [f"  {u}" for u in _limit(rep.layout_unknown, limit)]
        if limit and len(rep.layout_unknown) > limit:
            lines.append(f"  ... and {len(rep.layout_unknown) - limit} more (merge.json: layout_unknown)")
    if rep.notes:
        lines += ["", "NOTES"] + [f"  {note}" for note in rep.notes]
    lines += ["", f"DISAGREEMENTS between replicas that must agree (beyond rtol {rep.rtol:g}; counts exactly): "
                  f"{rep.disagreements} statistic(s) in {rep.disagreeing_rows} merged row(s)"]
    if rep.first_disagreements:
        lines.append(table(["step", "monitor", "scope", "tensor", "stat", "ranks", "differ from the lowest", "values"],
                           [[d["step"], d["monitor"], d["scope"], d["module_name"], d["stat"],
                             ",".join(map(str, d["ranks"])), ",".join(map(str, d["differing_ranks"])),
                             " ".join(fmt_num(v, 9) for v in d["values"])]
                            for d in _limit(rep.first_disagreements, limit)]))
        lines.append(f"  all in {os.path.join(dest, 'disagreements.csv')}; the merged rows hold the lowest rank's "
                     "values")
    else:
        lines.append("  none")
    if rep.problems is not None and rep.problems.count:
        lines += ["", f"MALFORMED INPUT: {rep.problems.summary()} (see the warnings on stderr)"]
    lines += ["", f"Result: {'replicas disagree' if rep.disagreements else 'replicas agree'} (exit {code})",
              f"  read it with: {command_line('summary', dest)}"]
    return "\n".join(lines)


# ----------------------------------------------------------------------- validate
def validate_json(res: ValidateResult, code: int) -> Dict[str, Any]:
    data = res.to_json()
    data["exit_code"] = code
    return data


def validate_text(res: ValidateResult, config: str) -> Tuple[List[str], str]:
    """``(warnings, verdict)``: the warnings go to stderr, the verdict to stdout when the
    config is valid (OK), else to stderr (INVALID)."""
    warnings = [f"warning: {w}" for w in res.warnings]
    if not res.ok:
        return warnings, f"INVALID: {config}: {res.message}"
    d = res.details
    where = "exists" if d["output_dir_exists"] else "will be created"
    # a config that validates but would write nothing is not a plain OK
    status = ("VALID BUT WRITES NOTHING (no monitor is enabled)" if not d["monitors"]
              else f"OK with {len(res.warnings)} warning(s) (above)" if res.warnings else "OK")
    return warnings, (f"{status}: {config}: monitors {', '.join(d['monitors']) or '(none enabled)'}; output_dir "
                      f"{d['output_dir']} ({where}); steps from {d['start_step']}"
                      + (f" to {d['stop_step'] - 1}" if d["stop_step"] is not None else "")
                      + f" every {d['step_interval']}, {d['step_count_per_record']} per file")
