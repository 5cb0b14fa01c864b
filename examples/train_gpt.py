"""Main-job demo: train a small GPT on synthetic data with Monitor V2 switched on.

It is also a complete, commented integration example: look for "Monitor V2, call 1/2/3"
in ``train()`` for the three calls a training script needs.

    .venv/bin/python examples/train_gpt.py               # defaults: < 60 s on 2 CPU cores
    .venv/bin/python examples/train_gpt.py --steps 100 --out /tmp/run1
    .venv/bin/python examples/train_gpt.py --config my_monitor_v2_config.json

Without ``--config`` the demo writes ``<out>/monitor_v2_config.json`` enabling the
``weight_grad`` (per micro-batch), ``optimizer`` and ``param`` monitors with all five
ops. The monitor needs three calls (constructor + ``start``, ``stop``); ``optimizer.step()``
is patched by ``start()`` (``patch_optimizer_step`` at its default) so it advances the
monitor's step counter itself. After training, the script reads the CSV files back with
the ``csv`` module only and prints a summary, then the ``msprobe-monitor`` commands that
read them.
"""

import argparse
import csv
import glob
import json
import logging
import math
import os
import re
import sys
import time
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

try:
    from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
    from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402
from msprobe.core.monitor_v2.errors import MonitorError  # noqa: E402

from gpt import GPT, GPTConfig, synthetic_batches  # noqa: E402

OPS = ["min", "max", "mean", "norm", "nans"]
MONITORS = ("module", "weight_grad", "optimizer", "param", "cc")
CONFIG_NAME = "monitor_v2_config.json"
CSV_NAME = re.compile(r"^(?P<monitor>[a-z_]+)_step(?P<a>\d+)-(?P<b>\d+)\.csv$")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:  # "(default: None)" says nothing; the help text does
            return action.help or ""
        return super()._get_help_string(action)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a small GPT on synthetic data with Monitor V2 on, then summarise its CSV output.",
        formatter_class=_HelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    m.add_argument("--d-model", type=int, default=128, help="embedding width")
    m.add_argument("--n-head", type=int, default=4, help="attention heads")
    m.add_argument("--vocab", type=int, default=512, help="vocabulary size")
    m.add_argument("--context", type=int, default=64, help="sequence length (block_size)")
    t = p.add_argument_group("training")
    t.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    t.add_argument("--steps", type=int, default=40, help="optimizer steps")
    t.add_argument("--grad-acc-steps", type=int, default=2, help="micro-batches per optimizer step")
    t.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    t.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    t.add_argument("--seed", type=int, default=0, help="seed of the weights and of the data")
    t.add_argument("--log-every", type=int, default=5, help="print the loss every N steps")
    o = p.add_argument_group("monitor")
    o.add_argument(
        "--out", default=None,
        help="output directory (default ./demo_out); it is emptied of earlier results at the start of each run",
    )
    o.add_argument(
        "--config", default=None,
        help=f"Monitor V2 config to use as is (its output_dir decides where the CSVs go); "
             f"default: write {CONFIG_NAME} into --out",
    )
    o.add_argument("--step-interval", type=int, default=5, help="generated config: write every N-th step")
    o.add_argument(
        "--steps-per-file", type=int, default=1,
        help="generated config: step_count_per_record (consecutive steps per CSV file)",
    )
    f = p.add_argument_group(
        "fault injection (to try `msprobe-monitor anomalies` on a known fault)")
    f.add_argument("--inject-nan-step", type=int, default=None,
                   help="at this step, multiply the output of --inject-nan-layer by NaN (a forward hook); the "
                        "generated config then also enables the module monitor. Pick a written step "
                        "(a multiple of --step-interval), or the NaN first shows at the next written one")
    f.add_argument("--inject-nan-layer", default=None,
                   help="module name as in model.named_modules(), e.g. blocks.1.mlp.fc")
    f.add_argument("--inject-nan-micro", type=int, default=None,
                   help="micro-batch (1-based) of that step to poison (default: the last)")
    args = p.parse_args(argv)
    if (args.inject_nan_step is None) != (args.inject_nan_layer is None):
        p.error("--inject-nan-step and --inject-nan-layer go together")
    if args.inject_nan_step is not None and not 0 <= args.inject_nan_step < args.steps:
        p.error(f"--inject-nan-step must be in 0..{args.steps - 1} (--steps {args.steps})")
    if args.inject_nan_micro is not None and not 1 <= args.inject_nan_micro <= args.grad_acc_steps:
        p.error(f"--inject-nan-micro must be in 1..{args.grad_acc_steps} (--grad-acc-steps)")
    if args.config is not None and args.out is not None:
        p.error("--out and --config exclude each other: the config's output_dir decides where the CSVs go")
    for name in ("n_layer", "d_model", "n_head", "vocab", "context", "batch", "steps",
                 "grad_acc_steps", "log_every", "step_interval", "steps_per_file"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.d_model % args.n_head:
        p.error(f"--d-model ({args.d_model}) must be divisible by --n-head ({args.n_head})")
    return args


# ----------------------------------------------------------------- output dir / config
def clear_previous_results(output_dir: str) -> int:
    """Remove what an earlier run of this demo left in ``output_dir``: the monitor's CSV
    files under ``rank_*/`` (then the rank directories if empty) and the generated
    config. Nothing else is touched, so a mistaken ``--out .`` cannot wipe a folder."""
    removed = 0
    for rank_dir in glob.glob(os.path.join(output_dir, "rank_*")):
        if not os.path.isdir(rank_dir):
            continue
        for path in glob.glob(os.path.join(rank_dir, "*.csv")):
            m = CSV_NAME.match(os.path.basename(path))
            if m and m.group("monitor") in MONITORS:
                os.remove(path)
                removed += 1
        try:
            os.rmdir(rank_dir)
        except OSError:
            pass  # not empty: holds files that are not ours
    generated = os.path.join(output_dir, CONFIG_NAME)
    if os.path.isfile(generated):
        os.remove(generated)
        removed += 1
    return removed


def write_default_config(output_dir: str, args: argparse.Namespace) -> str:
    config = {
        "framework": "pytorch",
        "output_dir": output_dir,
        "format": "csv",
        "start_step": 0,
        "step_interval": args.step_interval,
        "step_count_per_record": args.steps_per_file,
        "monitors": {
            "weight_grad": {"enabled": True, "ops": OPS, "monitor_mbs_grad": True},
            "optimizer": {"enabled": True, "ops": OPS, "mv_distribution": True},
            "param": {"enabled": True, "ops": OPS, "param_distribution": True},
        },
    }
    if args.inject_nan_step is not None:  # show where the NaN enters: activations too
        config["monitors"] = {"module": {"enabled": True, "ops": OPS}, **config["monitors"]}
    path = os.path.join(output_dir, CONFIG_NAME)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return path


def config_output_dir(config_path: str) -> Tuple[str, bool]:
    """``(output_dir, patch_is_off)`` of a user config (the library validates the rest)."""
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return os.path.abspath("./"), False  # TrainerMonitorV2 reports the problem precisely
    if not isinstance(raw, dict):
        return os.path.abspath("./"), False
    out = raw.get("output_dir") or "./"
    return os.path.abspath(out if isinstance(out, str) else "./"), raw.get("patch_optimizer_step") is False


# ------------------------------------------------------------------------ training
def train(args: argparse.Namespace, config_path: str, manual_step: bool) -> Tuple[TrainerMonitorV2, Dict[int, float]]:
    # Monitor V2, call 1 of 3: load and validate the config (a bad one fails here).
    mon = TrainerMonitorV2(config_path, fr="pytorch")

    torch.manual_seed(args.seed)
    cfg = GPTConfig(
        n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head,
        vocab_size=args.vocab, block_size=args.context,
    )
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    data = synthetic_batches(cfg, args.batch, seed=args.seed)
    print(
        f"model: GPT {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads, vocab {cfg.vocab_size}, "
        f"context {cfg.block_size}: {model.num_params():,} parameters ({len(list(model.parameters()))} tensors, "
        f"LM head tied to the token embedding)"
    )
    print(
        f"training: {args.steps} steps x {args.grad_acc_steps} micro-batches of {args.batch} sequences, "
        f"AdamW lr {args.lr:g}, seed {args.seed}, {torch.get_num_threads()} CPU threads"
    )

    poison = {"on": False}
    inject_at = None  # (step, micro-batch) of the fault
    if args.inject_nan_layer is not None:
        modules = dict(model.named_modules())
        if args.inject_nan_layer not in modules:
            names = [n for n in modules if n][:12]
            raise MonitorError(f"--inject-nan-layer {args.inject_nan_layer!r}: no such module; e.g. {', '.join(names)}")
        # fault injection: the module's output times NaN, only while poison["on"]
        modules[args.inject_nan_layer].register_forward_hook(
            lambda mod, inp, out: out * float("nan") if poison["on"] else out)
        inject_at = (args.inject_nan_step, args.inject_nan_micro or args.grad_acc_steps)
        print(f"fault injection: {args.inject_nan_layer} output x NaN at step {inject_at[0]}, "
              f"micro-batch {inject_at[1]}")

    # Monitor V2, call 2 of 3: hook the model and the optimizer.
    mon.start(model=model, optimizer=optimizer, grad_acc_steps=args.grad_acc_steps)

    losses: Dict[int, float] = {}
    try:
        for step in range(args.steps):
            step_loss = 0.0
            for micro in range(1, args.grad_acc_steps + 1):
                poison["on"] = (step, micro) == inject_at
                x, y = next(data)
                _, loss = model(x, y)
                (loss / args.grad_acc_steps).backward()
                step_loss += loss.item() / args.grad_acc_steps
            optimizer.step()  # patched by start(): also ends the monitor's step
            optimizer.zero_grad(set_to_none=True)
            if manual_step:  # only for a --config with "patch_optimizer_step": false
                mon.step()
            losses[step] = step_loss
            if step % args.log_every == 0 or step == args.steps - 1:
                print(f"  step {step:4d}  loss {step_loss:.4f}")
    finally:
        # Monitor V2, call 3 of 3: remove every hook, flush and close the CSV files.
        mon.stop()
    return mon, losses


# ------------------------------------------------------------------- reading the CSVs
def read_rank_dir(rank_dir: str) -> Dict[str, List[Tuple[str, List[Dict[str, str]], List[str]]]]:
    """monitor -> [(file name, rows, header)], files in step order."""
    found: Dict[str, List[Tuple[int, str, List[Dict[str, str]], List[str]]]] = defaultdict(list)
    for path in glob.glob(os.path.join(rank_dir, "*.csv")):
        name = os.path.basename(path)
        m = CSV_NAME.match(name)
        if not m:
            continue
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            header = list(reader.fieldnames or [])
        found[m.group("monitor")].append((int(m.group("a")), name, rows, header))
    return {
        mon: [(name, rows, header) for _, name, rows, header in sorted(files)]
        for mon, files in sorted(found.items(), key=lambda kv: MONITORS.index(kv[0]) if kv[0] in MONITORS else 99)
    }


def compact_steps(steps: List[int]) -> str:
    """0,5,10,15 -> '0, 5, 10, 15'; long arithmetic runs as '0, 5, ..., 95 (every 5th)'."""
    if len(steps) <= 8:
        return ", ".join(map(str, steps))
    diffs = {b - a for a, b in zip(steps, steps[1:])}
    if len(diffs) == 1:
        d = diffs.pop()
        return f"{steps[0]}, {steps[1]}, ..., {steps[-1]} (every {ordinal(d)} step, {len(steps)} steps)"
    return ", ".join(map(str, steps[:4])) + ", ..., " + ", ".join(map(str, steps[-2:])) + f" ({len(steps)} steps)"


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def num(row: Dict[str, str], op: str) -> Optional[float]:
    """A statistic of a CSV row, or None when the config did not ask for that op."""
    value = row.get(op)
    return None if value in (None, "") else float(value)


def fnum(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.4g}"


def summarise(rank_dir: str, losses: Dict[int, float]) -> bool:
    files = read_rank_dir(rank_dir)
    print()
    print(f"CSV files: {rank_dir}")
    if not files:
        print("  none were written (is this rank excluded by 'rank', or the monitors disabled?)")
        return False

    all_rows: Dict[str, List[Dict[str, str]]] = {}
    duplicates = 0
    for monitor, entries in files.items():
        rows = [r for _, rs, _ in entries for r in rs]
        # Rows appended by an earlier run (only possible with --config) repeat a key:
        # the summary keeps the last one, i.e. this run's.
        latest: Dict[Tuple[str, ...], Dict[str, str]] = {}
        for r in rows:
            latest[(r["vpp_stage"], r["step"], r["module_name"], r["scope"], r.get("micro_step", ""))] = r
        duplicates += len(rows) - len(latest)
        all_rows[monitor] = list(latest.values())
        steps = sorted({int(r["step"]) for r in rows})
        names = [name for name, _, _ in entries]
        shown = names if len(names) <= 3 else names[:2] + ["...", names[-1]]
        print(f"  {monitor:<12} {len(entries):3d} files, {len(rows):5d} rows; steps written: {compact_steps(steps)}")
        print(f"  {'':<12} header: {','.join(entries[0][2])}")
        print(f"  {'':<12} files:  {' '.join(shown)}")

    # Per written step: global grad norm, biggest grad, optimizer second moment, NaNs.
    per_step: Dict[int, Dict[str, object]] = defaultdict(dict)
    for r in all_rows.get("weight_grad", []):
        s = per_step[int(r["step"])]
        norm = num(r, "norm")
        if norm is None:
            continue
        if r["scope"] == "reduced":
            s["sumsq"] = s.get("sumsq", 0.0) + norm * norm
            top = s.get("top_norm", -1.0)
            if not math.isnan(top) and (math.isnan(norm) or norm > top):  # the first NaN wins
                s["top_norm"], s["top_name"] = norm, r["module_name"]
        elif r["scope"] == "unreduced":
            mb = s.setdefault("mb_sumsq", defaultdict(float))
            mb[int(r["micro_step"])] += norm * norm
    for r in all_rows.get("optimizer", []):
        if r["scope"] == "exp_avg_sq" and num(r, "max") is not None:
            s = per_step[int(r["step"])]
            s["v_max"] = nan_max(s.get("v_max"), num(r, "max"))
    for r in all_rows.get("param", []):
        if num(r, "norm") is None:
            continue
        s = per_step[int(r["step"])]
        key = "p_before" if r["scope"] == "param_origin" else "p_after"
        s[key] = s.get(key, 0.0) + num(r, "norm") ** 2
    # Rows, not NaN elements: one NaN gradient is also a NaN reduced gradient, NaN moments and
    # NaN parameters, so summing the elements of all files would count it several times.
    nan_rows: Dict[str, int] = defaultdict(int)  # "monitor scope" -> rows with a NaN/Inf
    total_rows = 0
    for monitor, rows in all_rows.items():
        for r in rows:
            total_rows += 1
            if not row_is_finite(r):
                nan_rows[f"{monitor} {r['scope']}"] += 1
                per_step[int(r["step"])]["bad_rows"] = per_step[int(r["step"])].get("bad_rows", 0) + 1

    print()
    if duplicates:
        print(f"note: {duplicates} row(s) repeat a (step, name, scope) of an earlier run appended to the "
              f"same files; the summary uses the last of each")
    print("Summary per written step (from the CSV files):")
    print("  grad norm      = sqrt(sum of norm^2) over the 'reduced' weight_grad rows (global gradient norm)")
    print("  micro-batches  = the same over the 'unreduced' rows of each micro_step (per micro-batch gradient)")
    print("  param norm     = global parameter norm after the update (param_updated)")
    print("  non-finite rows = CSV rows of that step (all monitors) holding a NaN or Inf")
    header = ["step", "loss", "grad norm", "micro-batches", "largest grad (norm)", "max exp_avg_sq",
              "param norm", "non-finite rows"]
    left = {"largest grad (norm)"}
    table = []
    for step in sorted(per_step):
        s = per_step[step]
        mb = s.get("mb_sumsq")
        table.append([
            str(step),
            f"{losses[step]:.4f}" if step in losses else "-",
            fnum(math.sqrt(s["sumsq"])) if "sumsq" in s else "-",
            " / ".join(fnum(math.sqrt(mb[k])) for k in sorted(mb)) if mb else "-",
            f"{s['top_name']} ({fnum(s['top_norm'])})" if "top_name" in s else "-",
            fnum(s["v_max"]) if "v_max" in s else "-",
            fnum(math.sqrt(s["p_after"])) if "p_after" in s else "-",
            str(s.get("bad_rows", 0)),
        ])
    widths = [max(len(row[i]) for row in [header] + table) for i in range(len(header))]

    def line(cells: List[str]) -> str:
        return "  " + "  ".join(c.ljust(w) if h in left else c.rjust(w)
                                for c, w, h in zip(cells, widths, header)).rstrip()

    print(line(header))
    print("  " + "  ".join("-" * w for w in widths))
    for row in table:
        print(line(row))
    bad = sum(nan_rows.values())
    if bad:
        parts = ", ".join(f"{k} {v}" for k, v in sorted(nan_rows.items(), key=lambda kv: -kv[1]))
        print(f"non-finite rows: {bad} of {total_rows} rows hold a NaN or Inf ({parts}); "
              f"where it started: msprobe-monitor anomalies (below)")
    else:
        print(f"non-finite rows: none of {total_rows} rows holds a NaN or Inf")
    return True


def nan_max(a: Optional[float], b: float) -> float:
    """max() that keeps a NaN (Python's max(0.0, nan) is 0.0, hiding it)."""
    if a is None:
        return b
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return max(a, b)


def row_is_finite(row: Dict[str, str]) -> bool:
    """No NaN count and no NaN/Inf statistic (an empty tensor, nan min/max/mean with norm 0, is finite)."""
    if row.get("nans") not in (None, "") and int(row["nans"]) > 0:
        return False
    norm = num(row, "norm")
    if norm is not None and not math.isfinite(norm):
        return False
    if norm == 0.0:
        return True
    return all(v is None or math.isfinite(v) for v in (num(row, op) for op in ("min", "max", "mean")))


def command_lines(out_root: str) -> List[str]:
    """The commands that read ``out_root``, as they run when pasted into the shell the demo
    was started from (``scripts/demo.sh`` passes that directory in MSPROBE_DEMO_CALLER_CWD)."""
    caller = os.environ.get("MSPROBE_DEMO_CALLER_CWD") or os.getcwd()

    def shown(path: str) -> str:
        rel = os.path.relpath(path, caller)
        return path if rel.startswith("..") else rel

    tool = os.path.join(os.path.dirname(sys.executable), "msprobe-monitor")
    if os.path.isfile(tool) and os.access(tool, os.X_OK):
        prog = shown(tool)
        prog = prog if os.sep in prog else os.path.join(".", prog)
    else:  # not installed: the same tool as a module (the checkout's src on the path)
        src = os.path.join(os.path.dirname(HERE), "src")
        prog = f"PYTHONPATH={shown(src)} {shown(sys.executable)} -m msprobe.core.monitor_v2.analysis"
    out = shown(out_root)
    return [f"  {prog} summary {out}     # what was collected, first NaN/Inf",
            f"  {prog} anomalies {out}   # NaN/Inf in execution order, spikes",
            f"  {prog} plot {out}        # PNG trends and report.html"]


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()

    if args.config is None:
        output_dir = os.path.abspath(args.out or "./demo_out")
        manual_step = False
        removed = clear_previous_results(output_dir)
        print(
            f"demo: clearing earlier results from {output_dir} ({removed} file(s) removed) so that "
            f"reruns do not append; a real job keeps them (the monitor appends to existing files, "
            f"e.g. on resume)"
        )
        os.makedirs(output_dir, mode=0o750, exist_ok=True)  # the monitor refuses a directory others can write
        config_path = write_default_config(output_dir, args)
        print(f"config: {config_path} ({'module, ' if args.inject_nan_step is not None else ''}"
              f"weight_grad per micro-batch, optimizer, param; ops {','.join(OPS)}; "
              f"every {ordinal(args.step_interval)} step)")
        if args.inject_nan_step is not None and args.inject_nan_step % args.step_interval:
            print(f"note: step {args.inject_nan_step} is not written (--step-interval {args.step_interval}); "
                  f"the NaN will first show at the next written step")
    else:
        config_path = args.config
        output_dir, manual_step = config_output_dir(config_path)
        print(f"config: {os.path.abspath(config_path)}")
        print(f"note: with --config nothing is deleted; CSV files already in {output_dir} are appended to "
              f"and counted in the summary")

    try:
        mon, losses = train(args, config_path, manual_step)
    except MonitorError as exc:  # a bad config fails at construction, before any training step
        print(f"error: {exc}", file=sys.stderr)
        return 2
    train_s = time.perf_counter() - t0
    first, last = losses[0], losses[args.steps - 1]
    print(f"loss {first:.4f} -> {last:.4f} in {train_s:.1f} s")
    if mon.errors.count:
        print(f"warning: the monitor contained {mon.errors.count} error(s) during training (see the log above)")

    ok = summarise(os.path.abspath(mon.rank_dir), losses)
    print(f"the monitor's own code: {mon.busy_seconds:.3f} s on the training path")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    out_root = os.path.dirname(os.path.abspath(mon.rank_dir))
    print("next: read the results (docs/cli.md explains each command):")
    print("\n".join(command_lines(out_root)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
