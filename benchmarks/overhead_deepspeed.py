"""Overhead of ``weight_grad`` on a DeepSpeed engine, measured as ratios (CPU, gloo).

    torchrun --nproc_per_node=2 benchmarks/overhead_deepspeed.py                # ZeRO-1 fp32, gas 2
    torchrun --nproc_per_node=2 benchmarks/overhead_deepspeed.py --stage 2 --dtype bf16 --mbs
    torchrun --nproc_per_node=2 benchmarks/overhead_deepspeed.py --smoke        # tiny, one round (CI)

As in ``overhead.py``: the same engine alternates timed windows of optimizer steps
without and with the monitor (``mon.start(model=engine, optimizer=optimizer)`` ...
``mon.stop()``), the order flipping every round; a round's ratio is time(with) /
time(without), and the table gives the median ratio and its spread. Every rank runs the
same windows in lockstep (the collectives keep them together); rank 0 prints its own
ratios and the monitor's own time (code inside its hooks) per step. ``DS_ACCELERATOR``
defaults to ``cpu``.
"""

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
from typing import List, Optional

os.environ.setdefault("DS_ACCELERATOR", "cpu")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "src"))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from alternating import alternate, settle  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batches  # noqa: E402
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--stage", type=int, default=1, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--gas", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--mbs", action="store_true", help="monitor_mbs_grad=true (one unreduced row per micro-batch)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="micro-batch size per rank")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps-per-window", type=int, default=3, help="optimizer steps per window")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round: checks that the benchmark runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.d_model, args.heads, args.vocab, args.context, args.batch = 2, 32, 2, 128, 16, 2
        args.rounds, args.steps_per_window, args.warmup = 1, 1, 1
    return args


def ds_config(args: argparse.Namespace) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": args.gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
        if args.stage == 1:
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}  # DeepSpeed's BF16_Optimizer
    return cfg


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        torch.manual_seed(0)
        cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=args.heads,
                        vocab_size=args.vocab, block_size=args.context)
        model = GPT(cfg)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config(args))
        self.data = synthetic_batches(cfg, args.batch, seed=dist.get_rank())
        self.out = tempfile.mkdtemp(prefix="msprobe_bench_ds_")
        self.busy = 0.0

    def train_steps(self, n: int) -> None:
        for _ in range(n * self.args.gas):  # engine.step() per micro-batch; an optimizer step every gas
            x, y = next(self.data)
            _, loss = self.engine(x, y)
            self.engine.backward(loss)
            self.engine.step()

    def window(self, monitored: bool) -> float:
        mon = None
        if monitored:
            out = os.path.join(self.out, "run")
            shutil.rmtree(out, ignore_errors=True)
            mon = TrainerMonitorV2({"output_dir": out, "monitors": {
                "weight_grad": {"enabled": True, "monitor_mbs_grad": self.args.mbs}}})
            mon.start(model=self.engine, optimizer=self.optimizer)
        settle()
        dist.barrier()
        t0 = time.perf_counter()
        self.train_steps(self.args.steps_per_window)
        elapsed = time.perf_counter() - t0
        if mon is not None:
            self.busy = mon.busy_seconds
            mon.stop()
        return elapsed


def main(argv: Optional[List[str]] = None) -> int:
    # The monitor prints its end-of-run line on stderr only where logging is not set up;
    # a benchmark starts and stops it many times, so its INFO lines go through logging.
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    deepspeed.init_distributed(dist_backend="gloo")
    bench = Bench(args)
    rank = dist.get_rank()
    bench.train_steps(args.warmup)
    timed = alternate(bench.window, lambda: bench.busy, args.rounds, args.steps_per_window)
    if rank == 0:
        name = (f"ZeRO-{args.stage} {args.dtype}, gas {args.gas}, weight_grad "
                f"monitor_mbs_grad={'true' if args.mbs else 'false'}")
        print(f"model: GPT {args.layers} layers, d_model {args.d_model}, vocab {args.vocab}, context "
              f"{args.context}, micro-batch {args.batch}; {bench.n_params / 1e6:.1f}M parameters; DeepSpeed "
              f"{deepspeed.__version__} ({type(bench.engine.optimizer).__name__}), {dist.get_world_size()} "
              f"rank(s), {args.threads} thread(s) each; {args.rounds} rounds x {args.steps_per_window} "
              f"optimizer steps per window")
        print()
        print("| config | median ratio (with / without) | spread (min..max) | monitor code per step | "
              "step without monitor |")
        print("|---|---|---|---|---|")
        print(f"| {name} | {timed.median:.3f} | {timed.min:.3f}..{timed.max:.3f} | "
              f"{timed.busy_ms:.1f} ms "
              f"({100 * timed.busy_median:.1f} %) | {timed.plain_median * 1e3:.0f} ms |", flush=True)
    shutil.rmtree(bench.out, ignore_errors=True)
    dist.barrier()
    return 0


if __name__ == "__main__":
    from torchrun_exit import leave

    leave(main())
