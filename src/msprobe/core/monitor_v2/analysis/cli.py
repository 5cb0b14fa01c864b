"""``msprobe-monitor``: read the monitor's CSV output.

    msprobe-monitor summary   OUT_DIR          what was collected + headline anomalies
    msprobe-monitor anomalies OUT_DIR          first NaN/Inf, spikes, rank disagreement
    msprobe-monitor plot      OUT_DIR          PNG trends + report.html
    msprobe-monitor diff      OUT_A OUT_B      first difference between two runs
    msprobe-monitor compare   REF CAND         do two runs agree within their precision; where they part
    msprobe-monitor export    OUT_DIR DEST     the output as one Parquet dataset (read by all commands)
    msprobe-monitor export    --tensorboard TB_DIR OUT_DIR   the output as TensorBoard event files
    msprobe-monitor merge     OUT_DIR DEST     a model-parallel run as whole tensors under global names
    msprobe-monitor validate  CONFIG           check a monitor_v2 config file
    msprobe-monitor struct    OUT_DIR          module/parameter names; what --targets selects
    msprobe-monitor control   CONFIG ...       edit a running job's config ("dynamic": true) safely

Exit codes: 0 = ok (no anomaly / no difference / valid config / replicas agree), 1 =
anomalies found (``anomalies``), the runs differ (``diff``), rows beyond tolerance (``compare``) or data-parallel replicas
disagree (``merge``), 2 = usage or input error (bad flag, missing
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

from ..errors import ConfigError, UnsafePathError
from .reader import (OPS, InputError, Layout, Problems, StepRange, parse_int_list, parse_monitor_list, parse_steps,
                     refuse_merged, scan)
from .reference import ReferenceEngine
from .render import (ORDER_TEXT, anomalies_json, anomalies_text, anomaly_tables, diff_json, diff_text, export_json,
                     export_text, merge_json, merge_text, plot_json, plot_text, ranks_text, summary_json,
                     summary_text, validate_json, validate_text)
from .report import AnalysisEngine, RankCheckSettings, Report, RowVisitor, SpikeSettings
from .text import dump_json

EXIT_OK, EXIT_FOUND, EXIT_INPUT, EXIT_INTERNAL = 0, 1, 2, 3


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
    m = p.add_argument_group(
        "moe", "mixture-of-experts routers (moe rows, and expert_norms gradient rows): dead experts, load "
               "imbalance, routing collapse, logit growth, near-duplicate experts (docs/moe.md)")
    m.add_argument("--moe-steps", type=_positive_int, default=3,
                   help="N: a dead expert, an imbalance or a collapse is reported when it lasts N consecutive "
                        "written steps")
    m.add_argument("--moe-maxvio", type=_nonneg_float, default=1.0,
                   help="imbalance when MaxVio = max/mean - 1 of the tokens per expert exceeds this")
    m.add_argument("--moe-cv", type=_nonneg_float, default=1.0,
                   help="imbalance when the coefficient of variation of the tokens per expert exceeds this")
    m.add_argument("--moe-entropy", type=_nonneg_float, default=0.5,
                   help="collapse when the mean token entropy is below this fraction of log(top_k)")
    m.add_argument("--moe-logit-growth", type=_nonneg_float, default=10.0,
                   help="logit growth when the latest max |logit| is this many times the first written step's "
                        "(and above 10)")
    m.add_argument("--moe-cosine", type=_nonneg_float, default=0.99,
                   help="near-duplicate experts when two router weight rows have a cosine at least this")


def _compare_parser(sub: Any) -> None:
    from .compare import DTYPES, ERROR_FACTOR, ERROR_RATIO, TOLERANCE, WARNING_RATIO

    tols = ", ".join(f"{d} {TOLERANCE[d]:g}" for d in DTYPES)
    c = sub.add_parser("compare", formatter_class=_Formatter,
                       help="do two runs (GPU vs NPU, bf16 vs fp32, before/after) agree within their precision, and "
                            "where do they part (exit 1 beyond tolerance)",
                       description="Score every row both runs have (scaled error |d| / max(|ref|, |cand|, floor) of "
                                   "the judged statistics) against the tolerance of the runs' precision, say where "
                                   "they part (the earliest step and phase with a row beyond it, the worst layers, "
                                   "the module where the error is born) and write compare.csv, compare.json and "
                                   "compare.html to --out. Without --baseline: warning beyond the tolerance, error "
                                   f"beyond {ERROR_FACTOR:g} x it (tolerances: {tols}); with --baseline REF2: the "
                                   "error divided by the REF-vs-REF2 noise, warning above "
                                   f"{WARNING_RATIO:g}, error above {ERROR_RATIO:g}. Exit 0 within tolerance, 1 "
                                   "beyond (--fail-on), 2 on bad input.")
    c.add_argument("ref", metavar="REF", help="the reference run: an output_dir or a merged view")
    c.add_argument("cand", metavar="CAND", help="the candidate run: an output_dir or a merged view")
    c.add_argument("--baseline", metavar="REF2", default=None,
                   help="a second reference run (same setting as REF): errors become ratios to the run-to-run noise")
    c.add_argument("--dtype", default=None,
                   help="the precision the runs computed in (bfloat16, float16, float32, float64; bf16 etc.); "
                        "default: the lowest recorded in layout.json, else float32")
    c.add_argument("--tolerance", type=_nonneg_float, default=None, help="scaled-error tolerance (overrides the dtype's)")
    c.add_argument("--floor", type=_nonneg_float, default=None,
                   help="values within it of zero are near zero (default: by dtype)")
    c.add_argument("--stats", type=_stat_list(("min", "max", "mean", "norm")), default=("norm",),
                   help="statistics judged (min/max and means near zero are poor relative measures)")
    c.add_argument("--collapse-dp", dest="collapse_dp", action="store_true", default=None,
                   help="pool rows kept per data-parallel rank (on automatically when the DP sizes differ)")
    c.add_argument("--no-collapse-dp", dest="collapse_dp", action="store_false", help=argparse.SUPPRESS)
    c.add_argument("--map", metavar="FILE", default=None,
                   help="rename candidate rows: lines 'CANDIDATE_PREFIX REFERENCE_PREFIX'")
    c.add_argument("--step-offset", type=int, default=0, help="candidate step s is compared with reference step s+N")
    c.add_argument("--loss-log", nargs=2, metavar=("REF_LOG", "CAND_LOG"), default=None,
                   help="loss (and grad norm) per step of each run: lines 'STEP LOSS [GRAD_NORM]' "
                        "(given, they win over the runs' scalars rows)")
    c.add_argument("--fail-on", choices=("warning", "error"), default="warning",
                   help="exit 1 when a row (or the loss standard) reaches this level")
    c.add_argument("--out", default="compare_out", help="directory for compare.csv, compare.json, compare.html")
    c.add_argument("--steps", help="only these (reference) steps: FIRST:LAST or one step")
    c.add_argument("--strict", action="store_true", help="stop at the first malformed CSV line (exit 2)")
    c.add_argument("--json", action="store_true", help="print the JSON document instead of the text summary")
    c.add_argument("--limit", type=_nonneg_int, default=10, help="rows per table (0 = all)")
    c.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    # auto: Polars where installed; python: the standard-library path (the tests compare both)
    c.add_argument("--compare-engine", choices=("auto", "columnar", "python"), default="auto", help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="msprobe-monitor", formatter_class=_Formatter,
        description="Read the CSV output of msprobe Monitor V2: a summary, anomalies (first NaN/Inf, spikes, "
                    "ranks that disagree), trend plots with an HTML report, a comparison of two runs, export to "
                    "Parquet, and config validation.",
        epilog="exit codes: 0 ok, 1 anomalies found (anomalies), runs differ (diff) or replicas disagree (merge), "
               "2 usage/input error, 3 internal error",
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

    _compare_parser(sub)

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

    mg = sub.add_parser("merge", formatter_class=_Formatter,
                        help="combine the ranks' rows of a model-parallel run into whole tensors under global names "
                             "(exit 1 if replicas disagree)",
                        description="Read every rank_<r>/layout.json and CSV file of OUT_DIR and write DEST/<monitor>"
                                    ".csv: one row per step, tensor and scope for the whole (unsharded) tensor, "
                                    "combined exactly from the ranks' pieces (TP, FSDP/ZeRO shards), under global "
                                    "layer names (pipeline stages, virtual chunks), in execution order. unreduced and "
                                    "module rows keep one row per data-parallel rank (dp_rank). Replicas that must "
                                    "agree (reduced gradients, parameters, optimizer state) are compared within "
                                    "--rtol: a disagreement goes to DEST/disagreements.csv and makes the exit status 1 "
                                    "(0 otherwise). Rows that cannot be combined (a piece the layout calls unknown or "
                                    "partial, pieces that do not add up to the tensor, a rank without layout.json, "
                                    "cc rows) are left out and counted in DEST/merge.json, never guessed. Every other "
                                    "command reads DEST like an output directory.")
    mg.add_argument("out_dir", metavar="OUT_DIR", help="the monitor's output_dir (holding rank_<r>/)")
    mg.add_argument("dest", metavar="DEST", help="the directory to write (new, empty, or an earlier merge's)")
    mg.add_argument("--rtol", type=_nonneg_float, default=1e-5,
                    help="relative tolerance between replicas (counts must be equal)")
    mg.add_argument("--strict", action="store_true",
                    help="stop at the first malformed CSV line or file (exit 2) instead of skipping it with a warning")
    mg.add_argument("--progress", action="store_true",
                    help="show progress on stderr even when it is not a terminal (on a terminal it is always shown)")
    mg.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    mg.add_argument("--limit", type=_nonneg_int, default=5, help="examples and disagreements shown (0 = all kept)")
    mg.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    # Polars where installed, else pure Python (the same files); the benchmark and the tests pick one
    mg.add_argument("--merge-engine", choices=("auto", "python", "polars"), default="auto", help=argparse.SUPPRESS)

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

    c = sub.add_parser("control", formatter_class=_Formatter,
                       help="edit the config of a running job (\"dynamic\": true) safely",
                       description="Apply an edit to CONFIG, validate it with the library's load_config (exit 2 "
                                   "with its message when invalid; the file is then left as it was), and replace "
                                   "the file atomically. A job running with \"dynamic\": true applies it from its "
                                   "next step boundary, on every rank at the same step. Example: turn module on for "
                                   "blocks.3 for the next 20 steps: msprobe-monitor control monitor_config.json "
                                   "--enable module --targets blocks.3 --steps 20")
    c.add_argument("config", metavar="CONFIG")
    c.add_argument("--enable", metavar="MONITOR", default=None, help="turn this monitor on")
    c.add_argument("--disable", metavar="MONITOR", action="append", default=[], help="turn this monitor off")
    c.add_argument("--targets", nargs="+", metavar="T", default=None, help="the targets of the --enable monitor")
    c.add_argument("--ops", nargs="+", metavar="OP", default=None, help="the ops of the --enable monitor")
    c.add_argument("--steps", type=_nonneg_int, default=None, metavar="N",
                   help="the --enable monitor is on for N steps from the step the job reads the edit")
    c.add_argument("--set", action="append", default=[], metavar="FIELD=JSON", dest="sets",
                   help="set a top-level field, e.g. step_interval=5")
    c.add_argument("--framework", default=None, help="the fr argument of TrainerMonitorV2 (overrides 'framework')")
    c.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return p


# ----------------------------------------------------------------------- the engine
def choose_engine(args: argparse.Namespace) -> AnalysisEngine:
    """The one place the engine is chosen: the columnar engine (Polars), unless the
    reference one is asked for; a missing Polars is an input error naming what to install."""
    if getattr(args, "engine", "columnar") == "reference":
        return ReferenceEngine()
    from .engine import ColumnarEngine

    return ColumnarEngine()


def _selection(args: argparse.Namespace) -> Tuple[Optional[List[int]], Optional[List[str]], Optional[StepRange]]:
    """--ranks, --monitors and --steps."""
    return parse_int_list(args.ranks, "--ranks"), parse_monitor_list(args.monitors), parse_steps(args.steps)


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


def _analyse(args: argparse.Namespace, engine: AnalysisEngine, layout: Layout, problems: Problems, err: TextIO,
             visitors: Sequence[RowVisitor] = ()) -> Report:
    spikes, rank_check = _settings(args)
    report = engine.analyse(layout, problems, spikes, rank_check, steps=parse_steps(args.steps),
                            limit=None if args.limit == 0 else args.limit,
                            progress=True if args.progress else None, visitors=visitors, progress_stream=err)
    from .moe import MoeSettings, expert_spread, moe_findings

    report.moe_settings = MoeSettings(dead_steps=args.moe_steps, maxvio=args.moe_maxvio, cv=args.moe_cv,
                                      entropy_fraction=args.moe_entropy, logit_growth=args.moe_logit_growth,
                                      cosine=args.moe_cosine)
    report.moe = moe_findings(layout, problems, report.moe_settings, parse_steps(args.steps))
    report.experts = expert_spread(layout, problems, parse_steps(args.steps))
    return report


def _run_analysis(args: argparse.Namespace, err: TextIO) -> Report:
    problems = Problems(strict=args.strict, stream=err)
    ranks, monitors, steps = _selection(args)
    engine = choose_engine(args)
    layout = engine.open_layout(args.out_dir, ranks=ranks, monitors=monitors, steps=steps)
    return _analyse(args, engine, layout, problems, err)


# ----------------------------------------------------------------------- commands
def cmd_summary(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    report = _run_analysis(args, err)
    if args.json:
        dump_json(summary_json(report, args.limit), out)
    else:
        print(summary_text(report), file=out)
    return EXIT_OK


def cmd_anomalies(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    report = _run_analysis(args, err)
    code = EXIT_FOUND if report.anomalies_found else EXIT_OK
    if args.json:
        dump_json(anomalies_json(report, args.limit, code), out)
    else:
        print(anomalies_text(report, args.limit, code), file=out)
    return code


def cmd_plot(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .plot import PlotCollector, PlotSettings, import_matplotlib, render, write_html

    import_matplotlib()  # fail early, before reading anything, when matplotlib is missing
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
    ranks, monitors, steps = _selection(args)
    engine = choose_engine(args)
    layout = engine.open_layout(args.out_dir, ranks=ranks, monitors=monitors, steps=steps)
    rank = args.rank if args.rank is not None else layout.ranks[0]
    if rank not in layout.files:
        raise InputError(f"--rank {rank}: no such rank in {args.out_dir} (ranks: {ranks_text(layout.ranks)})")
    collector = PlotCollector(settings, rank)
    report = _analyse(args, engine, layout, problems, err, visitors=[collector])
    out_dir = args.out or os.path.join(layout.root, "analysis_report")
    figures = render(collector, report, out_dir)
    from .plot import draw_moe_heat_maps

    figures += draw_moe_heat_maps(layout, rank, problems, steps, out_dir, len(figures) + 1)
    html_path = None
    if settings.html:
        html_path = os.path.join(out_dir, "report.html")
        write_html(html_path, report, collector, figures, settings.embed, anomaly_tables(report, args.limit))
    if args.json:
        dump_json(plot_json(report, args.limit, out_dir, [n for _, _, n in figures], html_path,
                            collector.omitted_lines), out)
    else:
        print(plot_text(report, args.stat, rank, out_dir, len(figures), html_path, collector.omitted_lines,
                        args.max_plots), file=out)
    return EXIT_OK


def cmd_diff(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .diff import DiffSettings, diff_runs

    problems = Problems(strict=args.strict, stream=err)
    ranks, monitors, steps = _selection(args)
    engine = choose_engine(args)
    la = engine.open_layout(args.out_a, ranks=ranks, monitors=monitors, steps=steps)
    lb = engine.open_layout(args.out_b, ranks=ranks, monitors=monitors, steps=steps)
    settings = DiffSettings(rtol=args.rtol, atol=args.atol, stats=args.stats,
                            top=10 ** 9 if args.limit == 0 else args.limit)
    rep = diff_runs(la, lb, problems, settings, steps=steps, progress=True if args.progress else None,
                    progress_stream=err)
    code = EXIT_FOUND if rep.differs else EXIT_OK
    if args.json:
        dump_json(diff_json(rep, problems, code), out)
    else:
        print(diff_text(rep, problems, code), file=out)
    return code


def cmd_compare(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .compare import CompareSettings, dtype_name, read_map, write_csv
    from .compare_run import compare_runs
    from .compare_render import report_json, report_text, write_html

    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise InputError(f"--out {args.out!r}: exists and is not a directory")
    settings = CompareSettings(stats=tuple(args.stats), dtype=dtype_name(args.dtype) if args.dtype else None,
                               tolerance=args.tolerance, floor=args.floor, collapse_dp=args.collapse_dp,
                               step_offset=args.step_offset, rename=read_map(args.map) if args.map else [],
                               fail_on=args.fail_on, top=10 ** 9 if args.limit == 0 else args.limit,
                               out_dir=args.out)
    problems = Problems(strict=args.strict, stream=err)
    report = compare_runs(args.ref, args.cand, settings, problems, baseline_root=args.baseline,
                          steps=parse_steps(args.steps), loss_logs=tuple(args.loss_log) if args.loss_log else None,
                          engine=args.compare_engine)
    levels = ("pass", "warning", "error")
    code = EXIT_FOUND if levels.index(report.verdict) >= levels.index(args.fail_on) else EXIT_OK
    os.makedirs(args.out, exist_ok=True)
    report.files = {k: os.path.join(args.out, f"compare.{k}") for k in ("csv", "json", "html")}
    if report.frame is not None:
        from .compare_columnar import write_csv as write_frame_csv

        write_frame_csv(report, report.files["csv"])
    else:
        write_csv(report, report.files["csv"])
    doc = report_json(report, code)
    with open(report.files["json"], "w", encoding="utf-8") as fh:
        dump_json(doc, fh)
    write_html(report, report.files["html"], code, args.limit)
    if args.json:
        dump_json(doc, out)
    else:
        print(report_text(report, code, args.limit), file=out)
    return code


def cmd_export(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .text import Progress

    if args.dest is None and args.tensorboard is None:
        raise InputError("give DEST (a Parquet dataset to write) or --tensorboard TB_DIR, or both")
    for flag, target in (("DEST", args.dest), ("--tensorboard", args.tensorboard)):
        if target is not None and os.path.abspath(target) == os.path.abspath(args.out_dir):
            raise InputError(f"{flag} {target!r}: must differ from OUT_DIR")
    if args.tensorboard is not None:
        from .tensorboard import tensorboard_writer_class

        tensorboard_writer_class()  # a missing TensorBoard is said before anything is read
    problems = Problems(strict=args.strict, stream=err)
    parquet = tensorboard = None
    if args.dest is not None:
        from .columnar import export, polars

        polars()
        ranks, monitors, steps = _selection(args)
        layout = choose_engine(args).open_layout(args.out_dir, ranks=ranks, monitors=monitors, steps=steps)
        prog = Progress(layout.n_files, "exporting", enabled=True if args.progress else None, stream=err)

        def advance(what: str, files: int) -> None:
            for _ in range(files):
                prog.advance(what)

        res = export(args.out_dir, args.dest, ranks=parse_int_list(args.ranks, "--ranks"),
                     monitors=parse_monitor_list(args.monitors), steps=parse_steps(args.steps), problems=problems,
                     progress=advance)
        prog.close()
        parquet = (args.dest, res, layout.n_files)
    if args.tensorboard is not None:
        tensorboard = (args.tensorboard, _export_tensorboard(args, problems, err))
    if args.json:
        dump_json(export_json(args.out_dir, parquet, tensorboard, problems), out)
    else:
        print(export_text(args.out_dir, parquet, tensorboard, problems), file=out)
    return EXIT_OK


def _export_tensorboard(args: argparse.Namespace, problems: Problems, err: TextIO) -> Dict[str, Any]:
    from .tensorboard import export_tensorboard
    from .text import Progress

    steps = parse_steps(args.steps)
    ranks, monitors = parse_int_list(args.ranks, "--ranks"), parse_monitor_list(args.monitors)
    # the input's format, not the engine, decides how it is opened: CSV needs no Polars here
    if os.path.isdir(args.out_dir) and _is_parquet(args.out_dir):
        from .columnar import open_layout

        layout = open_layout(args.out_dir, ranks=ranks, monitors=monitors, steps=steps)
    else:
        layout = scan(args.out_dir, ranks=ranks, monitors=monitors, steps=steps)
    refuse_merged(layout, "export --tensorboard")
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
    return res


def _is_parquet(path: str) -> bool:
    from .columnar import is_parquet_dataset

    return is_parquet_dataset(path)


def cmd_merge(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .merge import count_files, merge_run
    from .text import Progress

    problems = Problems(strict=args.strict, stream=err)
    prog = Progress(count_files(args.out_dir), "merging", enabled=True if args.progress else None, stream=err)
    rep = merge_run(args.out_dir, args.dest, args.rtol, problems=problems, progress=prog.advance,
                    engine=args.merge_engine)
    prog.close()
    code = EXIT_FOUND if rep.disagreements else EXIT_OK
    if args.json:
        dump_json(merge_json(rep, args.limit, code), out)
    else:
        print(merge_text(rep, args.out_dir, args.dest, args.limit, code), file=out)
    return code


def cmd_validate(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .validate import validate

    res = validate(args.config, fr=args.framework, create_output_dir=args.create_output_dir)
    code = EXIT_OK if res.ok else EXIT_INPUT
    if args.json:
        dump_json(validate_json(res, code), out)
        return code
    warnings, verdict = validate_text(res, args.config)
    for line in warnings:
        print(line, file=err)
    print(verdict, file=out if res.ok else err)
    return code


def cmd_struct(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .struct import run_struct

    return run_struct(args.out_dir, args.rank, args.targets, args.json, out)


def cmd_control(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .control import run_control

    return run_control(args.config, args.enable, args.disable, args.targets, args.ops, args.steps, args.sets,
                       args.framework, out)


COMMANDS = {"summary": cmd_summary, "anomalies": cmd_anomalies, "plot": cmd_plot, "diff": cmd_diff,
            "compare": cmd_compare,
            "export": cmd_export, "merge": cmd_merge, "validate": cmd_validate, "struct": cmd_struct,
            "control": cmd_control}


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
