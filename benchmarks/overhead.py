"""Overhead of the monitor on a GPT-style model, measured as ratios in one process.

    .venv/bin/python benchmarks/overhead.py                 # default model, all configs
    .venv/bin/python benchmarks/overhead.py --smoke         # tiny and quick (CI)
    .venv/bin/python benchmarks/overhead.py --only weight_grad --rounds 11
    .venv/bin/python benchmarks/overhead.py --sinks --only all   # the dashboards against the CSV writer

For every config, the same model and optimizer alternate timed windows of training steps
without and with the monitor (the order flips every round, to cancel drift); a round's
ratio is time(with) / time(without). The table gives the median ratio, its spread
(min..max over rounds), the change of peak memory (allocated heap bytes, sampled; on a
GPU the allocator's exact peak) during a window with the monitor against one without, and the number of device-to-host transfers per step (``Tensor.cpu`` calls
made by the monitor) and of scalar reads inside hooks (``Tensor.item``; on the CPU these
read host memory and are no synchronisation).

A second table times the statistics engine alone on GPT-2-small-shaped tensors (148
tensors, 124M fp32 elements) against one ``torch._foreach_norm`` pass over the same
tensors, which reads the data once: the floor for any statistic.
"""

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "src"))

import torch  # noqa: E402

from gpt import GPT, GPTConfig, synthetic_batches  # noqa: E402
from alternating import alternate, settle  # noqa: E402
from config_matrix import configs  # noqa: E402
from deep_overhead import graph_hooks_in_use  # noqa: E402
from heap_memory import PeakMemory  # noqa: E402
from msprobe.core.monitor_v2 import native  # noqa: E402
from msprobe.core.monitor_v2.frameworks.pytorch.stats import StatPlan, TorchStatsEngine  # noqa: E402
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

ALL_OPS = ["min", "max", "mean", "norm", "nans"]



@contextmanager
def count_calls(counts: Dict[str, int]) -> Iterator[None]:
    """Count Tensor.cpu and Tensor.item calls (the monitor's transfers and scalar reads)."""
    originals = {name: getattr(torch.Tensor, name) for name in ("cpu", "item")}

    def counting(name: str, fn: Callable) -> Callable:
        def wrapper(self, *args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(self, *args, **kwargs)
        return wrapper

    for name, fn in originals.items():
        setattr(torch.Tensor, name, counting(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        torch.manual_seed(0)
        self.cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=args.heads,
                             vocab_size=args.vocab, block_size=args.context)
        self.device = torch.device(args.device)
        self.model = GPT(self.cfg).to(self.device, dtype=getattr(torch, args.dtype))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.data = synthetic_batches(self.cfg, args.batch, seed=0, device=self.device)
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.out = tempfile.mkdtemp(prefix="msprobe_bench_")
        self.busy = 0.0  # seconds the last monitored window spent in the monitor's code

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def train_steps(self, n: int) -> None:
        for _ in range(n):
            x, y = next(self.data)
            _, loss = self.model(x, y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def window(self, cfg: Optional[dict], measure_memory: bool = False) -> float:
        """Seconds for ``steps_per_window`` steps, or (``measure_memory``) their peak
        memory. Memory is sampled in separate windows: the sampling thread competes for
        the GIL and would slow the Python-heavy side of the comparison."""
        mon = None
        if cfg is not None:
            out = os.path.join(self.out, "run")
            shutil.rmtree(out, ignore_errors=True)
            mon = self.monitor(cfg, out)
            mon.start(model=self.model, optimizer=self.opt)
            _wait_for_sinks(mon)
        self.sync()
        settle()
        if measure_memory:
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            with PeakMemory() as mem:
                self.train_steps(self.args.steps_per_window)
                self.sync()
            result = torch.cuda.max_memory_allocated() if self.device.type == "cuda" else mem.peak
        else:
            t0 = time.perf_counter()
            self.train_steps(self.args.steps_per_window)
            self.sync()
            result = time.perf_counter() - t0
        if mon is not None:
            self.busy = mon.busy_seconds
            mon.stop()
        return result

    def monitor(self, cfg: dict, out: str) -> TrainerMonitorV2:
        """``"dynamic": true`` watches a config file: such a config is written to one."""
        cfg = {**cfg, "output_dir": out}
        if not cfg.get("dynamic"):
            return TrainerMonitorV2(cfg)
        path = os.path.join(self.out, "dynamic_config.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(cfg, fh)
        return TrainerMonitorV2(path)

    def transfers(self, cfg: dict) -> Tuple[float, float]:
        """Calls per step made by the monitor: counted with it, minus those without it
        (AdamW itself reads its step counter with .item())."""
        steps = max(2, self.args.steps_per_window)
        per_step = []
        for which in (None, cfg):
            mon = None
            if which is not None:
                out = os.path.join(self.out, "count")
                shutil.rmtree(out, ignore_errors=True)
                mon = self.monitor(which, out)
                mon.start(model=self.model, optimizer=self.opt)
            counts: Dict[str, int] = {}
            with count_calls(counts):
                self.train_steps(steps)
            if mon is not None:
                mon.stop()
            per_step.append({k: v / steps for k, v in counts.items()})
        base, on = per_step
        return on.get("cpu", 0) - base.get("cpu", 0), on.get("item", 0) - base.get("item", 0)

    def run_config(self, name: str, cfg: dict) -> dict:
        timed = alternate(lambda monitored: self.window(cfg if monitored else None), lambda: self.busy,
                          self.args.rounds, self.args.steps_per_window)
        mem = []
        for _ in range(2):
            off = self.window(None, measure_memory=True)
            mem.append(self.window(cfg, measure_memory=True) - off)
        cpu_per_step, items_per_step = self.transfers(cfg)
        return {
            "name": name,
            "median": timed.median,
            "min": timed.min,
            "max": timed.max,
            # The monitor's own code, timed inside it: the direct part of the overhead,
            # without the machine's run-to-run noise (it misses indirect costs such as
            # caches the statistics evict).
            "busy": timed.busy_median,
            "busy_ms": timed.busy_ms,
            "mem": statistics.median(mem),
            "cpu": cpu_per_step,
            "item": items_per_step,
        }


def _wait_for_sinks(mon: TrainerMonitorV2, timeout_s: float = 120.0) -> None:
    """Wait until the live sinks are open: a run opens them once (a W&B run takes seconds
    on the sink thread), and that start-up is not the cost of a step."""
    writer = getattr(mon, "_writer", None)
    writer = getattr(writer, "_writer", writer)  # the async writer wraps the CSV writer
    hub = getattr(writer, "sinks", None)
    if hub is not None:
        hub.opened.wait(timeout_s)


def engine_bench(args: argparse.Namespace) -> Tuple[float, float, int, int]:
    """Median ms of the engine (five ops, then one transfer) and of one foreach-norm pass."""
    d, layers, vocab, ctx = (768, 12, 50257, 1024) if not args.smoke else (64, 2, 1000, 64)
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    shapes += [(d,), (d,)]
    g = torch.Generator().manual_seed(0)
    device = torch.device(args.device)
    tensors = [torch.randn(s, generator=g).to(device) for s in shapes]
    numel = sum(t.numel() for t in tensors)
    engine = TorchStatsEngine()
    plan = StatPlan.from_ops(ALL_OPS)
    keys = [(0, f"t{i}", "param_origin", None) for i in range(len(tensors))]

    def stats() -> None:
        engine.to_host(engine.record_many(tensors, plan, keys))

    def floor() -> None:
        torch.stack(torch._foreach_norm(tensors)).cpu().tolist()

    def timed(fn: Callable[[], None]) -> float:
        fn()
        samples = []
        for _ in range(args.engine_repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples) * 1e3

    t_floor, t_stats = [], []
    for _ in range(2):  # interleave to cancel drift
        t_floor.append(timed(floor))
        t_stats.append(timed(stats))
    return min(t_stats), min(t_floor), len(tensors), numel


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the model's parameters (and so its gradients and AdamW's moments)")
    p.add_argument("--rounds", type=int, default=7, help="alternating with/without rounds per config")
    p.add_argument("--steps-per-window", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the first config")
    p.add_argument("--engine-repeats", type=int, default=7)
    p.add_argument("--only", action="append", help="run only configs whose name contains this (repeatable)")
    p.add_argument("--skip-engine", action="store_true", help="skip the statistics-engine micro-benchmark")
    p.add_argument("--incident", action="store_true",
                   help="also weight_grad with each incident-mode field (dynamic, alert.on_anomaly, alert, alert.dump)")
    p.add_argument("--sinks", action="store_true",
                   help="also the live-sink configs (tensorboard, wandb, mlflow; offline, in a temporary directory)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round: checks that the benchmark runs")
    p.add_argument("--no-native", action="store_true",
                   help="ATen reductions only, without the one-pass C kernel (as on a machine without a C compiler)")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.d_model, args.heads, args.vocab, args.context, args.batch = 2, 32, 2, 128, 16, 2
        args.rounds, args.steps_per_window, args.warmup, args.engine_repeats = 1, 1, 1, 1
    return args


def main(argv: Optional[List[str]] = None) -> int:
    # The monitor prints its end-of-run line on stderr only where logging is not set up;
    # a benchmark starts and stops it many times, so its INFO lines go through logging.
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    args = parse_args(argv)
    if args.no_native:
        os.environ[native.ENV_SWITCH] = "0"
    torch.set_num_threads(args.threads)
    bench = Bench(args)
    n_params = sum(p.numel() for p in bench.model.parameters())
    print(f"model: GPT {args.layers} layers, d_model {args.d_model}, {args.heads} heads, vocab {args.vocab}, "
          f"context {args.context}, batch {args.batch}; {n_params / 1e6:.1f}M parameters "
          f"({bench.param_bytes / 2**20:.1f} MiB, {args.dtype}); AdamW; device {args.device}, {args.threads} thread(s)")
    kernel = "ATen reductions only (--no-native)" if native.load() is None else "one-pass C kernel"
    print(f"{args.rounds} rounds x {args.steps_per_window} steps per window; torch {torch.__version__}; "
          f"CPU statistics: {kernel}; module graph hooks: {graph_hooks_in_use()}")
    bench.train_steps(args.warmup)
    rows = []
    if args.sinks:
        # the dashboards offline, in the benchmark's temporary directory: nothing reaches the network
        os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DISABLE_GIT="true",
                          MLFLOW_ALLOW_FILE_STORE="true", MLFLOW_TRACKING_URI=f"file:{bench.out}/mlruns")
    for name, cfg in configs(args.layers, sinks=args.sinks, incident=args.incident).items():
        if args.only and not any(o in name for o in args.only):
            continue
        row = bench.run_config(name, cfg)
        rows.append(row)
        print(f"  {name:<28} ratio {row['median']:.3f}  ({row['min']:.3f}..{row['max']:.3f}); "
              f"monitor code {100 * row['busy']:.1f} %", flush=True)
    print()
    print("| config | median ratio (with / without) | spread (min..max) | monitor code per step | peak memory delta | "
          ".cpu() per step | .item() per step |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        mem_pct = 100.0 * row["mem"] / bench.param_bytes
        print(f"| {row['name']} | {row['median']:.3f} | {row['min']:.3f}..{row['max']:.3f} | "
              f"{row['busy_ms']:.1f} ms ({100 * row['busy']:.1f} %) | "
              f"{row['mem'] / 2**20:+.1f} MiB ({mem_pct:+.1f} % of params) | {row['cpu']:.1f} | {row['item']:.1f} |")
    if not args.skip_engine:
        t_stats, t_floor, n, numel = engine_bench(args)
        print()
        print(f"statistics engine, {n} tensors, {numel / 1e6:.1f}M fp32 elements, five ops + one transfer: "
              f"{t_stats:.1f} ms; one _foreach_norm pass: {t_floor:.1f} ms; ratio {t_stats / t_floor:.2f}")
    shutil.rmtree(bench.out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
