"""Overhead of the ``moe`` monitor on a transformers 5.x MoE model (Mixtral from a config,
no download) on the CPU: alternating windows of training steps with the monitor off and
on (``alternating.alternate``), the monitor writing every step.

    python benchmarks/moe_overhead.py [--layers 4 --hidden 256 --experts 8 --top-k 2 ...]
    python benchmarks/moe_overhead.py --smoke   # tiny sizes, one round: checks it runs

Prints the median ratio time(on)/time(off) with its range, the monitor's own time per
step (timed inside it) and the plain step time; ``--json PATH`` writes them too.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from alternating import alternate, settle  # noqa: E402

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps-per-window", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--per-expert", action="store_true", help="also write the raw counts (moe_counts files)")
    p.add_argument("--json", default=None, help="write the numbers to this file")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round: checks that the benchmark runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.hidden, args.intermediate, args.vocab = 1, 32, 64, 128
        args.context, args.batch, args.rounds, args.steps_per_window, args.warmup = 16, 2, 1, 2, 1
    return args


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        from transformers import MixtralConfig, MixtralForCausalLM

        self.args = args
        torch.manual_seed(0)
        cfg = MixtralConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                            num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                            num_local_experts=args.experts, num_experts_per_tok=args.top_k,
                            max_position_embeddings=args.context)
        self.model = MixtralForCausalLM(cfg)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(0)
        self.data = [torch.randint(0, args.vocab, (args.batch, args.context), generator=g) for _ in range(8)]
        self.step = 0
        self.out = tempfile.mkdtemp(prefix="msprobe_moe_bench_")
        self.busy = 0.0

    def train_steps(self, n: int) -> None:
        for _ in range(n):
            x = self.data[self.step % len(self.data)]
            self.step += 1
            self.model(input_ids=x, labels=x).loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def window(self, monitored: bool) -> float:
        mon = None
        if monitored:
            out = os.path.join(self.out, "run")
            shutil.rmtree(out, ignore_errors=True)
            mon = TrainerMonitorV2({"output_dir": out, "monitors": {
                "module": {"enabled": False},
                "moe": {"enabled": True, "per_expert": self.args.per_expert}}})
            mon.start(model=self.model, optimizer=self.opt)
        settle()
        t0 = time.perf_counter()
        self.train_steps(self.args.steps_per_window)
        seconds = time.perf_counter() - t0
        if mon is not None:
            self.busy = mon.busy_seconds
            mon.stop()
        return seconds


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    bench = Bench(args)
    bench.train_steps(args.warmup)
    result = alternate(bench.window, lambda: bench.busy, rounds=args.rounds, steps_per_window=args.steps_per_window)
    shutil.rmtree(bench.out, ignore_errors=True)
    numbers = {"ratio_median": result.median, "ratio_min": result.min, "ratio_max": result.max,
               "monitor_ms_per_step": result.busy_ms, "plain_ms_per_step": result.plain_median * 1e3,
               "rounds": args.rounds, "layers": args.layers, "hidden": args.hidden, "experts": args.experts,
               "top_k": args.top_k, "tokens_per_step": args.batch * args.context, "threads": args.threads}
    print(f"| moe on/off | {result.median:.4f} | {result.min:.4f}-{result.max:.4f} | "
          f"{result.busy_ms:.2f} ms | {result.plain_median * 1e3:.1f} ms |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(numbers, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
