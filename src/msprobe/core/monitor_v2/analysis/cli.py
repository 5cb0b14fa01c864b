"""``msprobe-monitor``: read the monitor's CSV output.

    msprobe-monitor summary   OUT_DIR          what was collected + headline anomalies
    msprobe-monitor anomalies OUT_DIR          first NaN/Inf, spikes, rank disagreement
    msprobe-monitor plot      OUT_DIR          PNG trends + report.html
    msprobe-monitor diff      OUT_A OUT_B      first difference between two runs
    msprobe-monitor export    OUT_DIR DEST     the output as one Parquet dataset (read by all commands)
    msprobe-monitor export    --tensorboard TB_DIR OUT_DIR   the output as TensorBoard event files
    msprobe-monitor validate  CONFIG           check a monitor_v2 config file
    msprobe-monitor struct    OUT_DIR          module/parameter names; what --targets selects

Exit codes: 0 = ok (no anomaly / no difference / valid config), 1 = anomalies found
(``anomalies``) or the runs differ (``diff``), 2 = usage or input error (bad flag, missing
directory, invalid config, malformed CSV with ``--strict``), 3 = internal error (a bug:
rerun with ``--debug`` for the traceback). ``summary`` and ``plot`` exit 0 whatever they
find. Results go to stdout (text tables, or one JSON object with ``--json``); warnings
and progress go to stderr.
"""

import argparse
import io
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, TextIO, Tuple

from .command import command_line, tensorboard_command
from ..errors import ConfigError, UnsafePathError
from .detect import RankCheckSettings, Report, SpikeSettings, analyse
from .reader import (OPS, InputError, Layout, Problems, parse_int_list, parse_monitor_list, parse_steps, scan)
from .text import compact_steps, dump_json, fmt_num, table

EXIT_OK, EXIT_FOUND, EXIT_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
ORDER_TEXT = ("execution order: step, micro-batch, parameters at step start, forward (module call order), "
              "backward, gradients, then optimizer state and updated parameters")


# ----------------------------------------------------------------------- arguments
def _number(kind: type, minimum: float) -> Any:
    """An argparse type: a finite ``kind`` (int or float) >= ``minimum``."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not v >= minimum or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= {minimum}")
        return v
    return parse


_positive_int = _number(int, 1)
_nonneg_int = _number(int, 0)
_nonneg_float = _number(float, 0.0)


def _stat_list(allowed: Sequence[str]):
    def parse(text: str) -> Tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: choose among {','.join(allowed)}")
        return names
    return parse


def _monitor_list(text: str) -> Tuple[str, ...]:
    try:
        return tuple(parse_monitor_list(text) or ())
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("--monitors ", "")) from None


def _stat(text: str) -> str:
    if text not in OPS:
        raise argparse.ArgumentTypeError(f"{text!r}: choose among {','.join(OPS)}")
    return text


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action)


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("selection and input")
    g.add_argument("--ranks", help="only these ranks, e.g. 0,1,4-7")
    g.add_argument("--monitors", help="only these monitors, e.g. weight_grad,param")
    g.add_argument("--steps", help="only these steps: FIRST:LAST (inclusive; either may be omitted) or one step")
    g.add_argument("--strict", action="store_true",
                   help="stop at the first malformed CSV line or file (exit 2) instead of skipping it with a warning")
    g.add_argument("--progress", action="store_true",
                   help="show progress on stderr even when it is not a terminal (on a terminal it is always shown)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text tables")
    g.add_argument("--limit", type=_nonneg_int, default=20, help="rows per table (0 = all)")
    g.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    # the previous pure-Python implementation, kept as the reference of the tests and the benchmark
    g.add_argument("--engine", choices=("columnar", "reference"), default="columnar", help=argparse.SUPPRESS)


def _detectors(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "spikes", "a value is a spike when |value| > median + K * 1.4826 * MAD and |value| > RATIO * median of "
                  "the same tensor's previous WINDOW values on the same rank and |value| > FLOOR (the first "
                  "MIN_HISTORY values of each tensor are never flagged)")
    g.add_argument("--spike-stats", type=_stat_list(("min", "max", "mean", "norm")), default="norm,max",
                   help="statistics checked for spikes (comma-separated); max is checked as max(|min|,|max|)")
    g.add_argument("--spike-monitors", type=_monitor_list, default="module,weight_grad,param,cc",
                   help="monitors checked for spikes (optimizer state lags the gradients and grows from zero "
                        "early on: add it explicitly)")
    g.add_argument("--spike-window", type=_positive_int, default=20, help="WINDOW: values of history")
    g.add_argument("--spike-min-history", type=_positive_int, default=10,
                   help="MIN_HISTORY (per-micro-batch gradients: N values per step)")
    g.add_argument("--spike-mad-k", type=_nonneg_float, default=10.0, help="K: robust z-score threshold")
    g.add_argument("--spike-ratio", type=_nonneg_float, default=5.0, help="RATIO: minimum factor over the median")
    g.add_argument("--spike-floor", type=_nonneg_float, default=1e-6,
                   help="FLOOR: a value not above it is never a spike (values near zero are rounding noise)")
    g.add_argument("--no-spikes", action="store_true", help="do not look for spikes")
    r = p.add_argument_group(
        "rank agreement", "under data parallelism, reduced gradients, parameters and optimizer state must be the "
                          "same on every rank; sharded runs (FSDP, ZeRO, tensor/pipeline parallel) legitimately "
                          "differ: use --no-rank-check, or --rank-groups to compare only replicas")
    r.add_argument("--no-rank-check", action="store_true", help="do not compare ranks")
    r.add_argument("--rank-groups", help="compare only within these groups of ranks, e.g. '0,2;1,3' "
                                         "(default: all ranks form one group)")
    r.add_argument("--rank-rtol", type=_nonneg_float, default=1e-5, help="relative tolerance between ranks")
    r.add_argument("--rank-atol", type=_nonneg_float, default=0.0, help="absolute tolerance between ranks")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="msprobe-monitor", formatter_class=_Formatter,
        description="Read the CSV output of msprobe Monitor V2: a summary, anomalies (first NaN/Inf, spikes, "
                    "ranks that disagree), trend plots with an HTML report, a comparison of two runs, export to "
                    "Parquet, and config validation.",
        epilog="exit codes: 0 ok, 1 anomalies found (anomalies) or runs differ (diff), 2 usage/input error, "
               "3 internal error",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    s = sub.add_parser("summary", formatter_class=_Formatter,
                       help="what was collected (ranks, monitors, steps, tensors) and the headline anomalies",
                       description="What was collected (ranks, monitors, steps, tensors) and the headline "
                                   "anomalies. Exit 0 unless the input cannot be read (2).")
    s.add_argument("out_dir", metavar="OUT_DIR", help="the monitor's output_dir (holding rank_<r>/)")
    _common(s)
    _detectors(s)

    a = sub.add_parser("anomalies", formatter_class=_Formatter,
                       help="first NaN/Inf in execution order, spikes, ranks that disagree (exit 1 if any)",
                       description=f"The first non-finite value ({ORDER_TEXT}) over all ranks and monitors, "
                                   "spikes against each tensor's own history, and ranks whose statistics "
                                   "differ where they should agree. Exit 1 when anything is found, 0 otherwise.")
    a.add_argument("out_dir", metavar="OUT_DIR")
    _common(a)
    _detectors(a)

    pl = sub.add_parser("plot", formatter_class=_Formatter,
                        help="PNG trends of a statistic over steps and an HTML report with the anomaly table",
                        description="Trends of one statistic over steps: an overview per monitor and one figure "
                                    "per layer (or tensor), as PNG files, plus report.html (plots and the "
                                    "anomaly tables; open it in a browser).")
    pl.add_argument("out_dir", metavar="OUT_DIR")
    pl.add_argument("--stat", type=_stat, default="norm", help="statistic to plot")
    pl.add_argument("--by", choices=("layer", "tensor"), default="layer",
                    help="one figure per (monitor, scope, layer) with a line per tensor, or per (monitor, tensor) "
                         "with a line per scope")
    pl.add_argument("--rank", type=_nonneg_int, default=None, help="rank to plot (default: the lowest)")
    pl.add_argument("--match", help="only tensors whose name matches this regular expression")
    pl.add_argument("--layer-depth", type=_positive_int, default=None,
                    help="a layer is the first N components of a name (default: up to the first number)")
    pl.add_argument("--max-plots", type=_positive_int, default=48, help="at most this many figures (plus overviews)")
    pl.add_argument("--lines-per-plot", type=_positive_int, default=12,
                    help="at most this many lines per figure (a layer with more continues in another figure)")
    pl.add_argument("--module-io", choices=("outputs", "all"), default="outputs",
                    help="module monitor: draw only output/grad_output rows, or every row")
    pl.add_argument("--yscale", choices=("auto", "linear", "log"), default="auto",
                    help="auto: log when all values are > 0 and span more than 3 decades, or the lines' "
                         "medians differ more than 20x (forward and backward on one axis)")
    pl.add_argument("--out", default=None, help="directory for the PNG files and report.html "
                                                "(default: OUT_DIR/analysis_report)")
    pl.add_argument("--embed", action="store_true", help="embed the images in report.html (one self-contained file)")
    pl.add_argument("--no-html", action="store_true", help="write the PNG files only")
    _common(pl)
    _detectors(pl)

    d = sub.add_parser("diff", formatter_class=_Formatter,
                       help="first (step, tensor, statistic) where two runs differ, and the largest differences",
                       description="Compare two output directories row by row. Two values differ when "
                                   "|a - b| > ATOL + RTOL * max(|a|, |b|) (NaN equals NaN). Exit 1 when the runs "
                                   "differ (a value, or rows, monitors or ranks present in only one run), 0 "
                                   "otherwise.")
    d.add_argument("out_a", metavar="OUT_A")
    d.add_argument("out_b", metavar="OUT_B")
    d.add_argument("--rtol", type=_nonneg_float, default=1e-5, help="relative tolerance")
    d.add_argument("--atol", type=_nonneg_float, default=0.0, help="absolute tolerance")
    d.add_argument("--stats", type=_stat_list(OPS), default=None,
                   help="statistics to compare (default: all that both runs have)")
    _common(d)

    e = sub.add_parser("export", formatter_class=_Formatter,
                       help="write the CSV output as one Parquet dataset (DEST), or as TensorBoard event files "
                            "(--tensorboard)",
                       description="Write OUT_DIR's CSV files as one Parquet dataset under DEST "
                                   "(DEST/monitor=<m>/rank=<r>/part-<n>.parquet, hive style). Every other "
                                   "command reads DEST like an output directory, faster; so do Polars, DuckDB, "
                                   "pandas/pyarrow. With --tensorboard TB_DIR, write TensorBoard event files "
                                   "there instead (or as well, when DEST is given too): one run per rank "
                                   "(TB_DIR/rank_<r>), one scalar series per tensor, scope and statistic, tagged "
                                   "<monitor>/<scope>/<tensor>/<stat>, over the monitor's steps; OUT_DIR may be an "
                                   "exported Parquet dataset. Malformed lines are skipped with a warning, as "
                                   "everywhere.")
    e.add_argument("out_dir", metavar="OUT_DIR")
    e.add_argument("dest", metavar="DEST", nargs="?", default=None,
                   help="the Parquet dataset to write (optional with --tensorboard)")
    e.add_argument("--tensorboard", metavar="TB_DIR", default=None,
                   help="write TensorBoard event files under TB_DIR (replaces the event files of the ranks it "
                        "writes); view them with: tensorboard --logdir TB_DIR")
    _common(e)

    v = sub.add_parser("validate", formatter_class=_Formatter,
                       help="check a monitor_v2 config file with the library's own validation",
                       description="Check a config with the library's validation (load_config) without creating "
                                   "anything: output_dir is checked to be writable, or creatable, but not created. "
                                   "Prints OK (exit 0) or the ConfigError message (exit 2).")
    v.add_argument("config", metavar="CONFIG")
    v.add_argument("--framework", default=None, help="the fr argument of TrainerMonitorV2 (overrides 'framework')")
    v.add_argument("--create-output-dir", action="store_true",
                   help="run the real load_config(CONFIG), which creates output_dir as training would")
    v.add_argument("--json", action="store_true", help="print one JSON object")
    v.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    st = sub.add_parser("struct", formatter_class=_Formatter,
                        help="the model's module and parameter names (rank_<r>/structure.txt) and what a "
                             "targets list selects",
                        description="Print the module names (exactly as monitors.module.targets matches them) "
                                    "and parameter names (as weight_grad, param and optimizer rows carry them) "
                                    "that start() wrote to rank_<r>/structure.txt with \"structure\": true. With "
                                    "--targets, count the modules each target and the whole list select. Exit 1 "
                                    "when a target selects nothing, 0 otherwise.")
    st.add_argument("out_dir", metavar="OUT_DIR",
                    help="the monitor's output_dir, a rank_<r> directory, or a structure.txt file")
    st.add_argument("--rank", type=_nonneg_int, default=None, help="rank to read (default: the lowest with the file)")
    st.add_argument("--targets", nargs="+", default=None, metavar="TARGET",
                    help="a targets list to count (each a substring of module names, as in the config)")
    st.add_argument("--json", action="store_true", help="print one JSON object")
    st.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return p


# ----------------------------------------------------------------------- helpers
def _rel(path: str, root: str) -> str:
    try:
        rel = os.path.relpath(path, root)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def _where(item: Dict[str, Any], root: str, key: str = "file", line: str = "line") -> str:
    return f"{_rel(item[key], root)}:{item[line]}"


def _vals(values: Dict[str, Any]) -> str:
    return " ".join(f"{k}={fmt_num(v)}" for k, v in values.items())


def _ranks_text(ranks: Sequence[int]) -> str:
    if not ranks:
        return "-"
    rs = sorted(ranks)
    if rs == list(range(rs[0], rs[-1] + 1)) and len(rs) > 2:
        return f"{rs[0]}-{rs[-1]}"
    return ",".join(map(str, rs))


def _limit(items: List[Any], n: int) -> List[Any]:
    return items if n == 0 else items[:n]


def _columnar(args: argparse.Namespace) -> bool:
    """The columnar engine (Polars), unless the reference one is asked for; a missing
    Polars is an input error naming what to install."""
    if getattr(args, "engine", "columnar") == "reference":
        return False
    from .columnar import polars

    polars()
    return True


def _load(args: argparse.Namespace, root: str, problems: Problems) -> Layout:
    ranks, monitors, steps = (parse_int_list(args.ranks, "--ranks"), parse_monitor_list(args.monitors),
                              parse_steps(args.steps))
    if _columnar(args):
        from .columnar import open_layout

        return open_layout(root, ranks=ranks, monitors=monitors, steps=steps)
    return scan(root, ranks=ranks, monitors=monitors, steps=steps)


def _analyse(args: argparse.Namespace):
    if _columnar(args):
        from .engine import analyse_columnar

        return analyse_columnar
    return analyse


def _settings(args: argparse.Namespace) -> Tuple[SpikeSettings, RankCheckSettings]:
    if args.spike_min_history > args.spike_window:
        raise InputError(f"--spike-min-history ({args.spike_min_history}) cannot exceed --spike-window "
                         f"({args.spike_window}): nothing would ever be flagged")
    spikes = SpikeSettings(enabled=not args.no_spikes, stats=tuple(args.spike_stats),
                           monitors=tuple(args.spike_monitors), window=args.spike_window,
                           min_history=args.spike_min_history, mad_k=args.spike_mad_k, ratio=args.spike_ratio,
                           floor=args.spike_floor)
    groups = None
    if args.rank_groups:
        groups = [parse_int_list(g, "--rank-groups") for g in args.rank_groups.split(";") if g.strip()]
        if not groups:
            raise InputError(f"--rank-groups {args.rank_groups!r}: no group")
    return spikes, RankCheckSettings(enabled=not args.no_rank_check, groups=groups, rtol=args.rank_rtol,
                                     atol=args.rank_atol)


def _run_analysis(args: argparse.Namespace, err: TextIO, visitors=()) -> Report:
    problems = Problems(strict=args.strict, stream=err)
    layout = _load(args, args.out_dir, problems)
    spikes, rank_check = _settings(args)
    return _analyse(args)(layout, problems, spikes, rank_check, steps=parse_steps(args.steps),
                   limit=None if args.limit == 0 else args.limit,
                   progress=True if args.progress else None, visitors=visitors, progress_stream=err)


# ----------------------------------------------------------------------- anomaly tables
NF_HEADERS = ["rank", "step", "micro_step", "monitor", "scope", "tensor", "kind", "values", "file:line"]
SPIKE_HEADERS = ["rank", "step", "micro_step", "monitor", "scope", "tensor", "stats", "value", "median",
                 "x median", "file:line"]
RANK_HEADERS = ["rank", "step", "micro_step", "monitor", "scope", "tensor", "stat", "value", "consensus",
                "agreeing ranks", "rows differing", "file:line"]


def _nf_row(item: Dict[str, Any], root: str) -> List[Any]:
    return [item["rank"], item["step"], item["micro_step"], item["monitor"], item["scope"], item["tensor"],
            item["kind"], _vals(item["values"]), _where(item, root)]


def anomaly_tables(report: Report, limit: int) -> Dict[str, Tuple[List[str], List[List[Any]], str]]:
    """title -> (headers, rows, note): shared by the text output and the HTML report."""
    root = report.layout.root
    out: Dict[str, Tuple[List[str], List[List[Any]], str]] = {}
    first = report.first
    out["First non-finite value (NaN/Inf)"] = (
        NF_HEADERS, [_nf_row(first, root)] if first else [], ORDER_TEXT + "; over all ranks and monitors")
    per_rank = [report.first_nonfinite[r][1] for r in sorted(report.first_nonfinite)]
    by = ", ".join(f"{m} {s} {n}" for (m, s), n in sorted(report.nonfinite_by.items(), key=lambda kv: -kv[1]))
    out["First non-finite value of each rank"] = (
        NF_HEADERS, _limit([_nf_row(i, root) for i in per_rank], limit),
        f"{report.nonfinite_count} non-finite row(s) in total" + (f": {by}" if by else ""))
    sp = report.spikes
    spike_rows = [[i["rank"], i["step"], i["micro_step"], i["monitor"], i["scope"], i["tensor"], ",".join(i["stats"]),
                   i["value"], i["median"], i["ratio"], _where(i, root)] for i in sp.items()]
    note = (report.spike_settings.describe() if report.spike_settings.enabled else "off (--no-spikes)")
    if sp.count:
        steps = sorted(report.spike_steps)
        shown = ", ".join(f"{st} ({report.spike_steps[st]})" for st in steps[:10]) + (", ..." if len(steps) > 10 else "")
        note += f"; {sp.count} row(s) with a spike, at steps: {shown}"
        if sp.count > min(len(spike_rows), limit or len(spike_rows)):
            note += f"; the first {min(len(spike_rows), limit or len(spike_rows))} in execution order shown"
    out["Spikes"] = (SPIKE_HEADERS, _limit(spike_rows, limit), note)
    mm = report.mismatch_list()
    rank_rows = [[i["rank"], i["step"], i["micro_step"], i["monitor"], i["scope"], i["tensor"], i["stat"],
                  i["value"], i["consensus"], _ranks_text(i["consensus_ranks"]), i["rows_differing"],
                  _where(i, root)] for i in mm]
    out["Ranks that disagree (first difference of each rank)"] = (
        RANK_HEADERS, _limit(rank_rows, limit), report.rank_check_note or report.mismatch_settings.describe())
    return out


def report_json(report: Report, limit: int) -> Dict[str, Any]:
    layout = report.layout
    lim = None if limit == 0 else limit
    per_rank = [report.first_nonfinite[r][1] for r in sorted(report.first_nonfinite)]
    return {
        "out_dir": os.path.abspath(layout.root),
        "ranks": layout.ranks,
        "monitors": {m: c.to_json() for m, c in report.collected.items()},
        "per_rank": {str(r): {"files": report.rank_files.get(r, 0), "rows": report.rank_rows.get(r, 0)}
                     for r in layout.ranks},
        "nonfinite": {
            "count": report.nonfinite_count,
            "by_monitor_scope": {f"{m} {s}": n for (m, s), n in report.nonfinite_by.items()},
            "first": report.first,
            "first_per_rank": per_rank[:lim],
            "order": ORDER_TEXT,
        },
        "spikes": {"enabled": report.spike_settings.enabled, "rule": report.spike_settings.describe(),
                   "settings": dict(report.spike_settings.__dict__), "count": report.spikes.count,
                   "per_step": {str(k): v for k, v in sorted(report.spike_steps.items())},
                   "items": report.spikes.items()[:lim]},
        "rank_check": {"enabled": report.mismatch_settings.enabled and not report.rank_check_note,
                       "note": report.rank_check_note or report.mismatch_settings.describe(),
                       "ranks_differing": len(report.mismatches), "items": report.mismatch_list()[:lim]},
        "appended": {"files": len(report.appended), "note": APPENDED_NOTE, "items": report.appended[:lim]},
        "problems": {"count": report.problems.count, "items": [p.to_json() for p in report.problems.items]},
        "anomalies_found": report.anomalies_found,
    }


APPENDED_NOTE = ("a file whose steps start over holds several runs: a script re-run with the same output_dir "
                 "appends to the files of the earlier run, so those steps are counted more than once; "
                 "use a new output_dir per run, or delete the old files")


def _appended_text(item: Dict[str, Any], root: str) -> str:
    runs = item["runs"]
    return (f"{_rel(item['file'], root)}: {runs} runs (run {2 if runs == 2 else '2..' + str(runs)} starts at line "
            f"{', '.join(map(str, item['restart_lines'][:5]))}{', ...' if len(item['restart_lines']) > 5 else ''}); "
            f"repeated step(s): {compact_steps(item['steps_repeated']) if item['steps_repeated'] else 'none'}")


def _appended_rows(report: Report, limit: int) -> List[List[Any]]:
    root = report.layout.root
    return [[i["rank"], i["monitor"], _rel(i["file"], root), i["runs"], ",".join(map(str, i["restart_lines"][:5])),
             compact_steps(i["steps_repeated"]) if i["steps_repeated"] else "-"] for i in _limit(report.appended, limit)]


def _collected_text(report: Report) -> List[str]:
    layout = report.layout
    steps = sorted({s for c in report.collected.values() for s in c.steps})
    rows = sum(c.rows for c in report.collected.values())
    lines = [f"  {len(layout.ranks)} rank(s) ({_ranks_text(layout.ranks)}), {layout.n_files} file(s), {rows} rows, "
             f"steps {compact_steps(steps)}"]
    trows = []
    for m, c in report.collected.items():
        scopes = ", ".join(f"{s}" for s in sorted(c.scopes, key=lambda s: -c.scopes[s])[:6])
        if len(c.scopes) > 6:
            scopes += f", ... ({len(c.scopes)})"
        micro = _ranks_text(sorted(c.micro_steps)) if c.micro_steps else "-"
        trows.append([m, _ranks_text(sorted(c.ranks)), c.files, c.rows, compact_steps(sorted(c.steps)),
                      len(c.tensors), ",".join(c.ops), micro, scopes])
    lines.append(table(["monitor", "ranks", "files", "rows", "steps", "tensors", "ops", "micro_step", "scopes"],
                       trows, right=[False, False, True, True, False, True, False, False, False]))
    return lines


# ----------------------------------------------------------------------- commands
def cmd_summary(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    report = _run_analysis(args, err)
    if args.json:
        data = report_json(report, args.limit)
        data["command"] = "summary"
        dump_json(data, out)
        return EXIT_OK
    root = report.layout.root
    lines = [f"msprobe-monitor summary {root}", "", "Collected:"]
    lines += _collected_text(report)
    if len(report.layout.ranks) > 1:
        per = [f"rank {r}: {report.rank_files[r]} files, {report.rank_rows[r]} rows" for r in report.layout.ranks]
        shown = per if len(per) <= 8 else per[:4] + [f"... ({len(per) - 6} more)"] + per[-2:]
        lines.append("  " + "; ".join(shown))
    lines += ["", "Headline anomalies:"]
    first = report.first
    if first:
        lines.append(f"  first NaN/Inf:     rank {first['rank']}, step {first['step']}, {first['where']}: "
                     f"{first['tensor']} ({first['monitor']} {first['scope']}) is {first['kind']} "
                     f"[{_where(first, root)}]; {report.nonfinite_count} non-finite row(s) in total")
    else:
        lines.append("  first NaN/Inf:     none (every value is finite)")
    if not report.spike_settings.enabled:
        lines.append("  spikes:            not checked (--no-spikes)")
    elif report.spikes.count:
        s0 = report.spikes.items()[0]
        lines.append(f"  spikes:            {report.spikes.count} row(s); first: rank {s0['rank']}, step {s0['step']}, "
                     f"{s0['tensor']} ({s0['monitor']} {s0['scope']}) {s0['stat']} {fmt_num(s0['value'])} = "
                     f"{fmt_num(s0['ratio'], 3)} x its median; steps: "
                     + compact_steps(sorted(report.spike_steps)))
    else:
        lines.append("  spikes:            none")
    if report.rank_check_note:
        lines.append(f"  rank disagreement: {report.rank_check_note}")
    elif report.mismatches:
        mm = report.mismatch_list()
        m0 = mm[0]
        lines.append(f"  rank disagreement: rank(s) {_ranks_text([m['rank'] for m in mm])}; first: rank "
                     f"{m0['rank']}, step {m0['step']}, {m0['tensor']} ({m0['monitor']} {m0['scope']}) "
                     f"{m0['stat']} {fmt_num(m0['value'])} vs {fmt_num(m0['consensus'])}")
    else:
        lines.append("  rank disagreement: none")
    if report.appended:
        repeated = sum(len(i["steps_repeated"]) for i in report.appended)
        lines.append(f"  appended re-runs:  {len(report.appended)} file(s) hold several runs (a re-run appended to "
                     f"the same output_dir), {repeated} step(s) written more than once; first: "
                     f"{_appended_text(report.appended[0], root)}")
    if report.problems.count:
        lines.append(f"  malformed input:   {report.problems.summary()} (see the warnings above)")
    lines += ["", f"Details: {command_line('anomalies', root)}"]
    print("\n".join(lines), file=out)
    return EXIT_OK


def cmd_anomalies(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    report = _run_analysis(args, err)
    code = EXIT_FOUND if report.anomalies_found else EXIT_OK
    if args.json:
        data = report_json(report, args.limit)
        data["command"] = "anomalies"
        data["exit_code"] = code
        dump_json(data, out)
        return code
    root = report.layout.root
    lines = [f"msprobe-monitor anomalies {root}"]
    lines += _collected_text(report)[:1]
    first = report.first
    lines += ["", "FIRST NON-FINITE VALUE (in execution order, over all ranks and monitors)"]
    if first:
        lines.append(f"  rank {first['rank']}, step {first['step']}, {first['where']}: {first['tensor']} "
                     f"({first['monitor']}, scope {first['scope']}) is {first['kind']}")
        lines.append(f"  values: {_vals(first['values'])}")
        lines.append(f"  at {_where(first, root)}")
    else:
        lines.append("  none: every value is finite")
    for title, (headers, rows, note) in anomaly_tables(report, args.limit).items():
        if title.startswith("First non-finite value (NaN"):
            continue
        if title.startswith("First non-finite value of each"):
            if report.nonfinite_count:
                lines.append(f"  ({note})")
            if len(report.layout.ranks) < 2 or not rows:
                continue
            note = ""
        lines += ["", title.upper()]
        if note:
            lines.append(f"  ({note})")
        lines.append(table(headers, rows) if rows else "  none")
    if report.appended:
        lines += ["", "STEPS WRITTEN MORE THAN ONCE (runs appended to the same files)", f"  ({APPENDED_NOTE})",
                  table(["rank", "monitor", "file", "runs", "later runs start at line", "steps written again"],
                        _appended_rows(report, args.limit))]
    if report.problems.count:
        lines += ["", f"MALFORMED INPUT: {report.problems.summary()} (see the warnings on stderr)"]
    verdict = "anomalies found" if report.anomalies_found else "no anomaly"
    lines += ["", f"Result: {verdict} (exit {code})"]
    print("\n".join(lines), file=out)
    return code


def cmd_plot(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .plot import PlotCollector, PlotSettings, _import_matplotlib, render, write_html

    _import_matplotlib()  # fail early, before reading anything, when matplotlib is missing
    settings = PlotSettings(stat=args.stat, by=args.by, rank=args.rank, match=args.match,
                            max_plots=args.max_plots, lines_per_plot=args.lines_per_plot,
                            layer_depth=args.layer_depth, module_io=args.module_io, out_dir=args.out,
                            embed=args.embed,
                            html=not args.no_html, yscale=args.yscale)
    if args.match:
        import re

        try:
            re.compile(args.match)
        except re.error as exc:
            raise InputError(f"--match {args.match!r}: not a regular expression ({exc})") from None
    problems = Problems(strict=args.strict, stream=err)
    layout = _load(args, args.out_dir, problems)
    rank = args.rank if args.rank is not None else layout.ranks[0]
    if rank not in layout.files:
        raise InputError(f"--rank {rank}: no such rank in {args.out_dir} (ranks: {_ranks_text(layout.ranks)})")
    collector = PlotCollector(settings, rank)
    spikes, rank_check = _settings(args)
    report = _analyse(args)(layout, problems, spikes, rank_check, steps=parse_steps(args.steps),
                     limit=None if args.limit == 0 else args.limit,
                     progress=True if args.progress else None, visitors=[collector], progress_stream=err)
    out_dir = args.out or os.path.join(layout.root, "analysis_report")
    figures = render(collector, report, out_dir)
    html_path = None
    if settings.html:
        html_path = os.path.join(out_dir, "report.html")
        write_html(html_path, report, collector, figures, settings.embed, anomaly_tables(report, args.limit))
    if args.json:
        data = report_json(report, args.limit)
        data.update(command="plot", plot_dir=os.path.abspath(out_dir),
                    images=[os.path.join(os.path.abspath(out_dir), n) for _, _, n in figures],
                    html=os.path.abspath(html_path) if html_path else None,
                    lines_not_plotted=collector.omitted_lines)
        dump_json(data, out)
        return EXIT_OK
    lines = [f"msprobe-monitor plot {layout.root}: {args.stat} of rank {rank}",
             f"  {len(figures)} image(s) in {out_dir}"]
    if collector.omitted_lines:
        lines.append(f"  {collector.omitted_lines} tensor line(s) not drawn (--max-plots {args.max_plots}); "
                     f"choose with --match, --monitors or --steps")
    if html_path:
        lines.append(f"  report: {html_path}")
        lines.append(f"  open:   file://{os.path.abspath(html_path)}")
    if report.anomalies_found:
        lines.append("  anomalies found: see the report, or " + command_line("anomalies", layout.root))
    print("\n".join(lines), file=out)
    return EXIT_OK


def cmd_diff(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .diff import DiffSettings, diff_runs

    problems = Problems(strict=args.strict, stream=err)
    steps = parse_steps(args.steps)
    la = _load(args, args.out_a, problems)
    lb = _load(args, args.out_b, problems)
    settings = DiffSettings(rtol=args.rtol, atol=args.atol, stats=args.stats,
                            top=10 ** 9 if args.limit == 0 else args.limit)
    rep = diff_runs(la, lb, problems, settings, steps=steps, progress=True if args.progress else None,
                    progress_stream=err)
    code = EXIT_FOUND if rep.differs else EXIT_OK
    only_a, only_b = rep.only_rows
    if args.json:
        dump_json({
            "command": "diff", "a": os.path.abspath(la.root), "b": os.path.abspath(lb.root),
            "rtol": args.rtol, "atol": args.atol, "stats": list(args.stats) if args.stats else "all",
            "compared_rows": rep.compared_rows, "differing_rows": rep.differing_rows,
            "rows_only_in_a": only_a, "rows_only_in_b": only_b, "first": rep.first,
            "first_only_in_one_run": rep.first_only, "per_monitor": {m: d.to_json() for m, d in rep.per_monitor.items()},
            "largest": rep.top(), "not_compared": rep.not_compared,
            "problems": {"count": problems.count, "items": [p.to_json() for p in problems.items]},
            "differ": rep.differs, "exit_code": code,
        }, out)
        return code
    lines = [f"msprobe-monitor diff {la.root} {lb.root}  (|a-b| > {args.atol:g} + {args.rtol:g} * max(|a|,|b|); "
             f"stats: {','.join(args.stats) if args.stats else 'all'})",
             f"  compared {rep.compared_rows} rows; {rep.differing_rows} differ; rows only in A: {only_a}, "
             f"only in B: {only_b}"]
    for note in rep.not_compared:
        lines.append(f"  not compared: {note}")
    lines += ["", "FIRST DIFFERENCE (in execution order, over all ranks and monitors)"]
    f = rep.first
    if f:
        lines.append(f"  rank {f['rank']}, step {f['step']}, {f['where']}: {f['tensor']} ({f['monitor']}, "
                     f"scope {f['scope']}) {f['stat']}: A={fmt_num(f['a'], 9)} B={fmt_num(f['b'], 9)} "
                     f"(abs {fmt_num(f['abs_diff'], 3)}, rel {fmt_num(f['rel_diff'], 3)})")
        lines.append(f"  A: {_where(f, la.root, 'file_a', 'line_a')}   B: {_where(f, lb.root, 'file_b', 'line_b')}")
    else:
        lines.append("  none within the tolerance")
    if rep.first_only:
        o = rep.first_only
        lines.append(f"  first row present only in {o['only_in']}: rank {o['rank']}, step {o['step']}, "
                     f"{o['tensor']} ({o['monitor']} {o['scope']})")
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
                           [[t["rank"], t["step"], t["micro_step"], t["monitor"], t["scope"], t["tensor"],
                             t["stat"], t["a"], t["b"], t["abs_diff"], t["rel_diff"]] for t in top]))
    if problems.count:
        lines += ["", f"MALFORMED INPUT: {problems.summary()} (see the warnings on stderr)"]
    lines += ["", f"Result: {'the runs differ' if rep.differs else 'no difference'} (exit {code})"]
    print("\n".join(lines), file=out)
    return code


def cmd_export(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .text import Progress

    if args.dest is None and args.tensorboard is None:
        raise InputError("give DEST (a Parquet dataset to write) or --tensorboard TB_DIR, or both")
    for flag, target in (("DEST", args.dest), ("--tensorboard", args.tensorboard)):
        if target is not None and os.path.abspath(target) == os.path.abspath(args.out_dir):
            raise InputError(f"{flag} {target!r}: must differ from OUT_DIR")
    if args.tensorboard is not None:
        from .tensorboard import _writer_class

        _writer_class()  # a missing TensorBoard is said before anything is read
    problems = Problems(strict=args.strict, stream=err)
    result: Dict[str, Any] = {"command": "export", "out_dir": os.path.abspath(args.out_dir)}
    lines: List[str] = []
    if args.dest is not None:
        from .columnar import export, polars

        polars()
        layout = _load(args, args.out_dir, problems)
        prog = Progress(layout.n_files, "exporting", enabled=True if args.progress else None, stream=err)

        def advance(what: str, files: int) -> None:
            for _ in range(files):
                prog.advance(what)

        res = export(args.out_dir, args.dest, ranks=parse_int_list(args.ranks, "--ranks"),
                     monitors=parse_monitor_list(args.monitors), steps=parse_steps(args.steps), problems=problems,
                     progress=advance)
        prog.close()
        result.update(dest=os.path.abspath(args.dest), parquet_files=res["files"], rows=res["rows"])
        lines += [f"msprobe-monitor export {args.out_dir}: {res['rows']} rows from {layout.n_files} CSV file(s) -> "
                  f"{res['files']} Parquet file(s) in {args.dest}",
                  f"  read it with any command, e.g. {command_line('summary', args.dest)}"]
    if args.tensorboard is not None:
        from .tensorboard import export_tensorboard

        steps = parse_steps(args.steps)
        ranks, monitors = parse_int_list(args.ranks, "--ranks"), parse_monitor_list(args.monitors)
        if os.path.isdir(args.out_dir) and _is_parquet(args.out_dir):
            from .columnar import open_layout

            layout = open_layout(args.out_dir, ranks=ranks, monitors=monitors, steps=steps)
        else:  # CSV needs no Polars here
            layout = scan(args.out_dir, ranks=ranks, monitors=monitors, steps=steps)
        # the Parquet export above already warned about the same malformed lines
        tb_problems = Problems(strict=args.strict, stream=io.StringIO()) if args.dest is not None else problems
        prog = Progress(layout.n_files, "exporting to TensorBoard", enabled=True if args.progress else None,
                        stream=err)

        def advance_tb(what: str, files: int) -> None:
            for _ in range(files):
                prog.advance(what)

        res = export_tensorboard(args.out_dir, args.tensorboard, layout, tb_problems, steps=steps,
                                 progress=advance_tb)
        prog.close()
        result.update(tensorboard=os.path.abspath(args.tensorboard), tensorboard_runs=res["runs"],
                      scalars=res["scalars"], tags=res["tags"])
        lines += [f"msprobe-monitor export {args.out_dir}: {res['scalars']} scalars in {res['tags']} series "
                  f"(tensor, scope, statistic), {res['runs']} run(s) (one per rank) -> {args.tensorboard}",
                  f"  view them: {tensorboard_command(args.tensorboard)}"]
    if args.json:
        result["problems"] = {"count": problems.count, "items": [p.to_json() for p in problems.items]}
        dump_json(result, out)
        return EXIT_OK
    if problems.count:
        lines.append(f"  malformed input: {problems.summary()} (see the warnings above)")
    print("\n".join(lines), file=out)
    return EXIT_OK


def _is_parquet(path: str) -> bool:
    from .columnar import is_parquet_dataset

    return is_parquet_dataset(path)


def cmd_validate(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .validate import validate

    res = validate(args.config, fr=args.framework, create_output_dir=args.create_output_dir)
    code = EXIT_OK if res.ok else EXIT_INPUT
    if args.json:
        data = res.to_json()
        data["exit_code"] = code
        dump_json(data, out)
        return code
    for w in res.warnings:
        print(f"warning: {w}", file=err)
    if res.ok:
        d = res.details
        where = "exists" if d["output_dir_exists"] else "will be created"
        # a config that validates but would write nothing is not a plain OK
        status = ("VALID BUT WRITES NOTHING (no monitor is enabled)" if not d["monitors"]
                  else f"OK with {len(res.warnings)} warning(s) (above)" if res.warnings else "OK")
        print(f"{status}: {args.config}: monitors {', '.join(d['monitors']) or '(none enabled)'}; output_dir "
              f"{d['output_dir']} ({where}); steps from {d['start_step']}"
              + (f" to {d['stop_step'] - 1}" if d["stop_step"] is not None else "")
              + f" every {d['step_interval']}, {d['step_count_per_record']} per file", file=out)
    else:
        print(f"INVALID: {args.config}: {res.message}", file=err)
    return code


def cmd_struct(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .struct import run_struct

    return run_struct(args.out_dir, args.rank, args.targets, args.json, out)


COMMANDS = {"summary": cmd_summary, "anomalies": cmd_anomalies, "plot": cmd_plot, "diff": cmd_diff,
            "export": cmd_export, "validate": cmd_validate, "struct": cmd_struct}


def main(argv: Optional[Sequence[str]] = None, out: Optional[TextIO] = None, err: Optional[TextIO] = None) -> int:
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed by argparse
        return int(exc.code) if isinstance(exc.code, int) else EXIT_INPUT
    try:
        return COMMANDS[args.command](args, out, err)
    except InputError as exc:
        print(f"msprobe-monitor {args.command}: error: {exc}", file=err)
        return EXIT_INPUT
    except KeyboardInterrupt:
        print("msprobe-monitor: interrupted", file=err)
        return 130
    except BrokenPipeError:
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_OK
    except (UnsafePathError, ConfigError) as exc:  # a link, a FIFO, a shared directory, a bad mode setting
        print(f"msprobe-monitor {args.command}: error: {exc}", file=err)
        return EXIT_INPUT
    except OSError as exc:  # e.g. a report directory that cannot be written
        name = f" {exc.filename}" if getattr(exc, "filename", None) else ""
        print(f"msprobe-monitor {args.command}: error:{name}: {exc.strerror or exc}", file=err)
        return EXIT_INPUT
    except Exception as exc:  # a bug: one line, the traceback only on request
        if getattr(args, "debug", False):
            raise
        print(f"msprobe-monitor {args.command}: internal error: {type(exc).__name__}: {exc} "
              f"(rerun with --debug for the traceback, and please report it)", file=err)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
