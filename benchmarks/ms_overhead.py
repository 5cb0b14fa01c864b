"""Overhead of the monitor on MindSpore (PyNative), measured as ratios in one process.

    .venv/bin/python benchmarks/ms_overhead.py                 # default model, all configs
    .venv/bin/python benchmarks/ms_overhead.py --smoke         # tiny and quick (CI)
    .venv/bin/python benchmarks/ms_overhead.py --only weight_grad --rounds 11

The MindSpore counterpart of ``overhead.py``: the same configs and the same table. The
model is a small transformer-like Cell: an embedding, ``--layers`` blocks of
LayerNorm + Dense(d, 4d) + GELU + Dense(4d, d) with a residual, a LayerNorm and a head
(defaults: d 256, vocab 2048, batch 4 x 64 tokens), trained with ``nn.AdamWeightDecay``
and ``ms.value_and_grad`` in PyNative mode.

For every config, the same model and optimizer alternate timed windows of training steps
without and with the monitor (the order flips every round, to cancel drift); a round's
ratio is time(with) / time(without); the CPU time of the process (all its threads) gives
a second ratio, steadier on a machine shared with other work. Every window ends by waiting for the operators
PyNative still has queued (``ms.runtime.synchronize`` refuses the CPU), so they are
counted. The table gives the median ratio, its spread (min..max over rounds), the
plain step time, the monitor's own code per step (timed inside it), the change of peak
memory (allocated heap bytes, sampled) during a window with the monitor against one
without, and the number of ``Tensor.asnumpy`` calls per step made by the monitor (on the
CPU a zero-copy view of the tensor's memory; elsewhere a device-to-host transfer).
"""

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))

import numpy as np  # noqa: E402
import mindspore as ms  # noqa: E402
from mindspore import nn  # noqa: E402
from mindspore.common.api import _pynative_executor  # noqa: E402

from alternating import alternate, settle  # noqa: E402
from config_matrix import configs  # noqa: E402
from heap_memory import PeakMemory  # noqa: E402
from msprobe.core.monitor_v2 import native  # noqa: E402
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402



def sync() -> None:
    """Wait until every operator PyNative has queued has run."""
    _pynative_executor.sync()


class Block(nn.Cell):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm((d,))
        self.fc1 = nn.Dense(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Dense(4 * d, d)

    def construct(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class TinyLM(nn.Cell):
    def __init__(self, vocab: int, d: int, n_layer: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.CellList([Block(d) for _ in range(n_layer)])
        self.norm = nn.LayerNorm((d,))
        self.head = nn.Dense(d, vocab)

    def construct(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@contextmanager
def count_asnumpy(counts: Dict[str, int]) -> Iterator[None]:
    original = ms.Tensor.asnumpy

    def counting(self, *args, **kwargs):
        counts["asnumpy"] = counts.get("asnumpy", 0) + 1
        return original(self, *args, **kwargs)

    ms.Tensor.asnumpy = counting
    try:
        yield
    finally:
        ms.Tensor.asnumpy = original


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        ms.set_seed(0)
        self.model = TinyLM(args.vocab, args.d_model, args.layers)
        self.opt = nn.AdamWeightDecay(self.model.trainable_params(), learning_rate=1e-4)
        self.param_bytes = sum(p.size * p.itemsize for p in self.model.trainable_params())
        rng = np.random.default_rng(0)
        self.data = [(ms.Tensor(rng.integers(0, args.vocab, (args.batch, args.context)), ms.int32),
                      ms.Tensor(rng.integers(0, args.vocab, (args.batch * args.context,)), ms.int32))
                     for _ in range(4)]
        self._next = 0
        loss_fn = nn.CrossEntropyLoss()
        vocab = args.vocab

        def forward(x, y):
            return loss_fn(self.model(x).reshape(-1, vocab), y)

        self.grad_fn = ms.value_and_grad(forward, None, self.opt.parameters)
        self.out = tempfile.mkdtemp(prefix="msprobe_ms_bench_")
        self.busy = 0.0

    def train_steps(self, n: int) -> None:
        for _ in range(n):
            x, y = self.data[self._next % len(self.data)]
            self._next += 1
            _, grads = self.grad_fn(x, y)
            self.opt(grads)
        sync()

    def _start(self, cfg: dict, sub: str) -> TrainerMonitorV2:
        out = os.path.join(self.out, sub)
        shutil.rmtree(out, ignore_errors=True)
        mon = TrainerMonitorV2({**cfg, "output_dir": out}, fr="mindspore")
        mon.start(model=self.model, optimizer=self.opt)
        return mon

    def window(self, cfg: Optional[dict], measure_memory: bool = False) -> Tuple[float, float]:
        """``(wall seconds, CPU seconds of the process)`` for ``steps_per_window`` steps,
        or (``measure_memory``) their peak heap bytes, measured in separate windows (the
        sampling thread competes for the GIL)."""
        mon = self._start(cfg, "run") if cfg is not None else None
        sync()
        settle()
        if measure_memory:
            with PeakMemory() as mem:
                self.train_steps(self.args.steps_per_window)
            result = (float(mem.peak), 0.0)
        else:
            t0, c0 = time.perf_counter(), time.process_time()
            self.train_steps(self.args.steps_per_window)
            result = (time.perf_counter() - t0, time.process_time() - c0)
        if mon is not None:
            self.busy = mon.busy_seconds
            mon.stop()
        return result

    def asnumpy_per_step(self, cfg: dict) -> float:
        steps = max(2, self.args.steps_per_window)
        per_step = []
        for which in (None, cfg):
            mon = self._start(which, "count") if which is not None else None
            counts: Dict[str, int] = {}
            with count_asnumpy(counts):
                self.train_steps(steps)
            if mon is not None:
                mon.stop()
            per_step.append(counts.get("asnumpy", 0) / steps)
        return per_step[1] - per_step[0]

    def run_config(self, name: str, cfg: dict) -> dict:
        timed = alternate(lambda monitored: self.window(cfg if monitored else None), lambda: self.busy,
                          self.args.rounds, self.args.steps_per_window)
        mem = []
        for _ in range(self.args.memory_rounds):
            off = self.window(None, measure_memory=True)[0]
            mem.append(self.window(cfg, measure_memory=True)[0] - off)
        return {
            "name": name,
            "ratios": timed.ratios,
            "median": timed.median,
            "min": timed.min,
            "max": timed.max,
            "cpu_ratios": timed.more_ratios[0],
            "cpu_median": statistics.median(timed.more_ratios[0]),
            "step_s": timed.plain_median,
            "busy": timed.busy_median,
            "busy_ms": timed.busy_ms,
            "mem": statistics.median(mem),
            "asnumpy": self.asnumpy_per_step(cfg),
        }


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="MindSpore runtime threads (runtime_num_threads)")
    p.add_argument("--rounds", type=int, default=7, help="alternating with/without rounds per config")
    p.add_argument("--steps-per-window", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the first config")
    p.add_argument("--memory-rounds", type=int, default=2, help="pairs of windows that sample peak memory per config")
    p.add_argument("--only", action="append", help="run only configs whose name contains this (repeatable)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round: checks that the benchmark runs")
    p.add_argument("--no-native", action="store_true",
                   help="MindSpore reductions only, without the one-pass C kernel (as on a machine without a C compiler)")
    p.add_argument("--device-reductions", action="store_true",
                   help="reduce with MindSpore primitives even on the CPU (the path taken on GPU and Ascend, "
                        "where tensors cannot be read in place)")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.d_model, args.vocab, args.context, args.batch = 2, 32, 128, 16, 2
        args.rounds, args.steps_per_window, args.warmup, args.memory_rounds = 1, 1, 1, 1
    return args


def main(argv: Optional[List[str]] = None) -> int:
    # The monitor prints its end-of-run line on stderr only where logging is not set up;
    # a benchmark starts and stops it many times, so its INFO lines go through logging.
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    args = parse_args(argv)
    if args.no_native:
        os.environ[native.ENV_SWITCH] = "0"
    if args.device_reductions:
        from msprobe.core.monitor_v2.frameworks.mindspore import stats as ms_stats

        ms_stats._host_memory_readable = lambda: False
    ms.set_context(mode=ms.PYNATIVE_MODE, runtime_num_threads=args.threads)
    ms.set_device("CPU")
    bench = Bench(args)
    n_params = sum(p.size for p in bench.model.trainable_params())
    print(f"model: {args.layers} blocks of LayerNorm + Dense({args.d_model}, {4 * args.d_model}) + GELU + "
          f"Dense({4 * args.d_model}, {args.d_model}), vocab {args.vocab}, batch {args.batch} x {args.context}; "
          f"{n_params / 1e6:.1f}M parameters ({bench.param_bytes / 2**20:.1f} MiB); nn.AdamWeightDecay; "
          f"PyNative, CPU, {args.threads} thread(s)")
    if args.device_reductions:
        kernel = "MindSpore primitives (--device-reductions)"
    elif native.load() is None:
        kernel = "NumPy on the tensor's memory (--no-native)"
    else:
        kernel = "one-pass C kernel on the tensor's memory"
    print(f"{args.rounds} rounds x {args.steps_per_window} steps per window; mindspore {ms.__version__}; "
          f"CPU statistics: {kernel}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    bench.train_steps(args.warmup)
    rows = []
    for name, cfg in configs(args.layers).items():
        if args.only and not any(o in name for o in args.only):
            continue
        row = bench.run_config(name, cfg)
        rows.append(row)
        print(f"  {name:<28} ratio {row['median']:.3f}  ({row['min']:.3f}..{row['max']:.3f}); "
              f"rounds {' '.join(f'{r:.3f}' for r in row['ratios'])}; CPU-time ratio {row['cpu_median']:.3f} "
              f"({' '.join(f'{r:.3f}' for r in row['cpu_ratios'])}); step without {row['step_s']:.3f} s; "
              f"monitor code {100 * row['busy']:.1f} %", flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    print()
    print("| config | median ratio (with / without) | spread (min..max) | CPU-time ratio | step without | "
          "monitor code per step | peak memory delta | .asnumpy() per step |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        mem_pct = 100.0 * row["mem"] / bench.param_bytes
        print(f"| {row['name']} | {row['median']:.3f} | {row['min']:.3f}..{row['max']:.3f} | {row['cpu_median']:.3f} | "
              f"{row['step_s']:.3f} s | "
              f"{row['busy_ms']:.1f} ms ({100 * row['busy']:.1f} %) | "
              f"{row['mem'] / 2**20:+.1f} MiB ({mem_pct:+.1f} % of params) | {row['asnumpy']:.1f} |")
    shutil.rmtree(bench.out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
