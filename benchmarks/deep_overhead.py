"""Per-tensor cost of the monitor: a deep stack of small blocks with many parameter tensors.

    .venv/bin/python benchmarks/deep_overhead.py                       # 1,000 and 4,000 tensors
    .venv/bin/python benchmarks/deep_overhead.py --tensors 10000 --only weight_grad
    .venv/bin/python benchmarks/deep_overhead.py --smoke               # tiny and quick (CI)
    .venv/bin/python benchmarks/deep_overhead.py --json deep.json      # also the rows as JSON
    .venv/bin/python benchmarks/deep_overhead.py --ddp --only weight_grad  # the model under torch DDP

The default benchmark (benchmarks/overhead.py) has ~100 parameter tensors of ~100k
elements each, where the monitor's cost follows the bytes it reads. This one isolates
the other axis: the model is a stack of ``Linear(d, d) + LayerNorm(d)`` blocks (four
parameter tensors per block) of width ``d`` = 32, so the data is small and what the
monitor costs is mostly its fixed cost per tensor (hooks, Python, one kernel call per
statistic).

As in overhead.py, the same model and optimizer alternate timed windows of training
steps without and with the monitor in one process, the order flipped every round
(benchmarks/alternating.py). For each tensor count and config the table gives the
median ratio (with / without) and its spread over rounds, the same ratio for the steps
after each window's first (the first written step after ``start()`` makes the run's files
and caches; the later ones are what a long run pays a written step), the median ratio of
the process's CPU time (steadier on a shared machine), the plain step time, the
monitor's own time per written step (timed inside it) and that time divided by the
number of parameter tensors, the same per tensor for the steps after each window's
first (which makes the window's files and caches: the steady state of a long run), the
garbage collector's time per step in the windows without and with the monitor (a cost of
the monitor that its own clock does not see), and the machine's load average at the end
of the row (the numbers are only comparable at the same load).

``--ddp`` trains the model under torch's ``DistributedDataParallel`` in a one-process gloo
(NCCL on CUDA) group (``--ddp-bucket-view`` with ``gradient_as_bucket_view=True``): the reducer's hooks,
bucket copies and all-reduce run as on a cluster, and the monitor reads gradients as it
does under DDP.
"""

import argparse
import gc
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Dict, Iterator, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from alternating import alternate, settle  # noqa: E402
from msprobe.core.monitor_v2 import native  # noqa: E402
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

TENSORS_PER_BLOCK = 4  # Linear weight and bias, LayerNorm weight and bias

_ALL_MONITORS = {
    "module": {"enabled": True, "targets": []},
    "weight_grad": {"enabled": True, "monitor_mbs_grad": False},
    "optimizer": {"enabled": True},
    "param": {"enabled": True},
}
CONFIGS: Dict[str, dict] = {
    "weight_grad": {"monitors": {"weight_grad": {"enabled": True}}},
    "all": {"monitors": _ALL_MONITORS},
    "all, step outside window": {"start_step": 10 ** 9, "monitors": _ALL_MONITORS},
}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.linear(x))


class DeepStack(nn.Module):
    """``blocks`` residual blocks: ``4 * blocks`` parameter tensors."""

    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def graph_hooks_in_use() -> str:
    """The module monitor's graph hooks this run uses, the C++ library built first: a build
    in the background (10 to 30 s of a core, once per torch version) must not run during the
    timed windows, nor leave the first windows on torch's Python API and the later on C++."""
    from msprobe.core.monitor_v2.frameworks.pytorch import graph_hooks

    if graph_hooks.wait() is not None:
        return "C++ (graph_hooks.cpp)"
    return "torch's Python API (MSPROBE_MONITOR_GRAPH=0, or the C++ library could not be built)"


def load_average() -> float:
    """The 1-minute load average (NaN where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return float("nan")


class GcClock:
    """The seconds Python's garbage collector runs while the block runs (``gc.callbacks``).

    The monitor's Python objects (and the graph nodes' Python objects that its hooks make
    torch create) trigger young collections during training; they are neither in the
    monitor's own clock nor in an instruction count with the collector off, so they are
    shown apart. Each window starts after a full collection (``alternating.settle``): the
    rare full collection of a long run is under-counted here."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def __enter__(self) -> "GcClock":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


class DeepBench:
    def __init__(self, tensors: int, args: argparse.Namespace) -> None:
        if tensors % TENSORS_PER_BLOCK:
            raise SystemExit(f"--tensors {tensors}: must be a multiple of {TENSORS_PER_BLOCK}")
        self.args = args
        self.tensors = tensors
        torch.manual_seed(0)
        self.device = torch.device(args.device)
        self.model = DeepStack(tensors // TENSORS_PER_BLOCK, args.width).to(self.device)
        self.out = tempfile.mkdtemp(prefix="msprobe_deep_bench_")
        self.group = False
        ddp = getattr(args, "ddp", False) or getattr(args, "ddp_bucket_view", False)
        if ddp:
            import torch.distributed as dist

            if not dist.is_initialized():
                store = dist.FileStore(os.path.join(self.out, "store"), 1)
                backend = "nccl" if self.device.type == "cuda" else "gloo"
                dist.init_process_group(backend, store=store, rank=0, world_size=1)
                self.group = True
            self.model = nn.parallel.DistributedDataParallel(
                self.model, gradient_as_bucket_view=bool(getattr(args, "ddp_bucket_view", False)))
        # foreach: the optimizer's own per-tensor cost is one fused pass, as on a GPU by default
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=True)
        g = torch.Generator().manual_seed(0)
        self.batch = torch.randn(args.batch, args.width, generator=g).to(self.device)
        self.busy = 0.0  # seconds the last monitored window spent in the monitor's code
        # the monitor's seconds per step after each monitored window's first step (the first
        # makes the window's files and caches): the steady state of a long run
        self.later_steps: List[float] = []
        # seconds per step the garbage collector ran inside the windows, without and with
        # the monitor (its time is the part of the monitor's cost that no instruction count
        # and no clock inside the monitor sees: see GcClock)
        self.gc_per_step: Dict[bool, List[float]] = {False: [], True: []}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def train_steps(self, n: int) -> None:
        for _ in range(n):
            loss = self.model(self.batch).pow(2).mean()
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def window(self, cfg: Optional[dict]) -> Tuple[float, ...]:
        """(wall seconds, this process's CPU seconds) of ``steps_per_window`` steps: on a
        shared machine the CPU time is the steadier of the two (a core taken by another
        process stretches the wall time, not this process's CPU time); with more than one
        step a window, then the wall seconds of the steps after the first (the first
        written step after ``start()`` makes the run's files and the row keys' caches:
        the steps after it are what a long run pays for each written step)."""
        mon = None
        if cfg is not None:
            out = os.path.join(self.out, "run")
            shutil.rmtree(out, ignore_errors=True)
            mon = TrainerMonitorV2({**cfg, "output_dir": out})
            mon.start(model=self.model, optimizer=self.opt)
        self.sync()
        settle()
        t0, c0 = time.perf_counter(), time.process_time()
        steps = self.args.steps_per_window
        with GcClock() as collector:
            self.train_steps(1)
            self.sync()
            t1 = time.perf_counter()
            after_first = mon.busy_seconds if mon is not None else 0.0  # an attribute read: nothing to time
            self.train_steps(steps - 1)
            self.sync()
            end = time.perf_counter()
        self.gc_per_step[mon is not None].append(collector.seconds / steps)
        elapsed, cpu = end - t0, time.process_time() - c0
        if mon is not None:
            self.busy = mon.busy_seconds
            if steps > 1:
                self.later_steps.append((self.busy - after_first) / (steps - 1))
            mon.stop()
        return (elapsed, cpu, end - t1) if steps > 1 else (elapsed, cpu)

    def run_config(self, name: str, cfg: dict) -> dict:
        self.later_steps = []
        self.gc_per_step = {False: [], True: []}
        timed = alternate(lambda monitored: self.window(cfg if monitored else None), lambda: self.busy,
                          self.args.rounds, self.args.steps_per_window)
        own_ms = timed.busy_ms  # per step (the window's steps are all written, or none)
        return {
            "tensors": self.tensors,
            "config": name,
            "median": timed.median,
            "min": timed.min,
            "max": timed.max,
            "cpu_median": statistics.median(timed.more_ratios[0]),
            # the wall-time ratio of the steps after each window's first (NaN with one step a window)
            "later_median": (statistics.median(timed.more_ratios[1]) if len(timed.more_ratios) > 1
                             else float("nan")),
            "plain_ms": timed.plain_median * 1e3,
            "own_ms": own_ms,
            "own_us_per_tensor": own_ms * 1e3 / self.tensors,
            # NaN with one step per window
            "later_us_per_tensor": (statistics.median(self.later_steps) * 1e6 / self.tensors
                                    if self.later_steps else float("nan")),
            "gc_plain_ms": statistics.median(self.gc_per_step[False]) * 1e3,
            "gc_monitored_ms": statistics.median(self.gc_per_step[True]) * 1e3,
            "load": load_average(),
        }

    def close(self) -> None:
        if self.group:
            import torch.distributed as dist

            dist.destroy_process_group()
        shutil.rmtree(self.out, ignore_errors=True)


def add_model_arguments(p: argparse.ArgumentParser, default_tensors: str) -> None:
    """The model's options (also deep_instructions.py's)."""
    p.add_argument("--tensors", type=int, action="append",
                   help=f"parameter tensors of the model (a multiple of 4; repeatable); default {default_tensors}")
    p.add_argument("--width", type=int, default=32, help="features of every block")
    p.add_argument("--batch", type=int, default=8)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_arguments(p, "1000 and 4000")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=7, help="alternating with/without rounds per config")
    p.add_argument("--steps-per-window", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the first config of a model")
    p.add_argument("--only", action="append", help="run only configs whose name is this (repeatable)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round: checks that the benchmark runs")
    p.add_argument("--ddp", action="store_true",
                   help="the model under torch DistributedDataParallel (one-process gloo group; NCCL on CUDA)")
    p.add_argument("--ddp-bucket-view", action="store_true",
                   help="as --ddp, with gradient_as_bucket_view=True")
    p.add_argument("--no-native", action="store_true",
                   help="ATen reductions only, without the one-pass C kernel (as on a machine without a C compiler)")
    args = p.parse_args(argv)
    if args.smoke:
        args.tensors = args.tensors or [40]
        # two steps a window: the columns of the steps after a window's first are exercised too
        args.rounds, args.steps_per_window, args.warmup = 1, 2, 1
    args.tensors = args.tensors or [1000, 4000]
    return args


def selected(args: argparse.Namespace) -> Iterator[Tuple[str, dict]]:
    for name, cfg in CONFIGS.items():
        if not args.only or name in args.only:
            yield name, cfg


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    args = parse_args(argv)
    if args.no_native:
        os.environ[native.ENV_SWITCH] = "0"
    torch.set_num_threads(args.threads)
    kernel = "ATen reductions only (--no-native)" if native.load() is None else "one-pass C kernel"
    print(f"model: {TENSORS_PER_BLOCK} tensors per block (Linear({args.width}, {args.width}) + "
          f"LayerNorm({args.width})), batch {args.batch}; AdamW (foreach); "
          f"{'under DDP (gradient_as_bucket_view), ' if args.ddp_bucket_view else 'under DDP, ' if args.ddp else ''}"
          f"device {args.device}, "
          f"{args.threads} thread(s)")
    graph = graph_hooks_in_use()
    print(f"{args.rounds} rounds x {args.steps_per_window} steps per window; torch {torch.__version__}; "
          f"CPU statistics: {kernel}; module graph hooks: {graph}; load at start {load_average():.2f}")
    rows = []
    for tensors in args.tensors:
        bench = DeepBench(tensors, args)
        try:
            bench.train_steps(args.warmup)
            for name, cfg in selected(args):
                row = bench.run_config(name, cfg)
                rows.append(row)
                print(f"  {tensors} tensors, {name:<26} ratio {row['median']:.3f} "
                      f"({row['min']:.3f}..{row['max']:.3f}), {row['later_median']:.3f} after a window's first "
                      f"step; {row['own_us_per_tensor']:.1f} us per tensor "
                      f"({row['later_us_per_tensor']:.1f} after a window's first step); garbage collector "
                      f"{row['gc_plain_ms']:.2f} -> {row['gc_monitored_ms']:.2f} ms a step; load {row['load']:.2f}",
                      flush=True)
        finally:
            bench.close()
    print()
    print("| tensors | config | median ratio (with / without) | spread (min..max) | ratio after a window's first step "
          "| CPU-time ratio | plain step | monitor per step | monitor per tensor | per tensor after a window's first "
          "step | garbage collector per step (without -> with) | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        later, later_ratio = row["later_us_per_tensor"], row["later_median"]
        print(f"| {row['tensors']} | {row['config']} | {row['median']:.3f} | {row['min']:.3f}..{row['max']:.3f} | "
              f"{'-' if later_ratio != later_ratio else f'{later_ratio:.3f}'} | "
              f"{row['cpu_median']:.3f} | {row['plain_ms']:.1f} ms | {row['own_ms']:.2f} ms | {row['own_us_per_tensor']:.1f} us | "
              f"{'-' if later != later else f'{later:.1f} us'} | "
              f"{row['gc_plain_ms']:.2f} -> {row['gc_monitored_ms']:.2f} ms | {row['load']:.2f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            ddp = "gradient_as_bucket_view" if args.ddp_bucket_view else "default" if args.ddp else None
            json.dump({"torch": torch.__version__, "kernel": kernel, "ddp": ddp, "rounds": args.rounds,
                       "steps_per_window": args.steps_per_window, "width": args.width, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
