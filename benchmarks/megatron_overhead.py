"""Overhead of ``weight_grad`` on a Megatron-Core GPTModel (TP=PP=1, DP=2, gloo, CPU),
measured as ratios in one process per rank, like benchmarks/overhead.py.

    torchrun --nproc_per_node=2 benchmarks/megatron_overhead.py [--rounds 7] [--steps-per-window 3]
        [--layers 4 --hidden 256 --seq 128 --batch 4 --acc 2] [--bf16] [--distopt]
    torchrun --nproc_per_node=2 benchmarks/megatron_overhead.py --smoke   # tiny, one round (CI)

Megatron-Core hard-codes a few CUDA calls; on a CPU-only torch build the shim
(benchmarks/megatron_cpu_shim.py, shared with the tests) points them at the CPU. Its TorchFunctionMode sees
every torch call, so it is only entered for model/optimizer construction and around
``optimizer.step()`` (the same for both sides), not for forward and backward.

For every round the same model and optimizer train one window of steps without and one
with the monitor (the order flips every round); the ratio is time(with) / time(without).
Rank 0 prints the median ratio, its spread, and the share of the monitor's own code
(``busy_seconds``) in the plain step time.
"""

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")  # Megatron: "Transformer Engine and Apex are not installed"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megatron_cpu_shim  # noqa: E402
from alternating import alternate, settle  # noqa: E402
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402


def build(args):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    cfg = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                            use_cpu_initialization=True, bf16=args.bf16, params_dtype=dtype, pipeline_dtype=dtype,
                            hidden_dropout=0.0, attention_dropout=0.0)
    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab,
                   max_sequence_length=args.seq)
    model = Float16Module(cfg, gpt) if args.bf16 else gpt
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=args.distopt), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, bf16=args.bf16,
                                                 use_distributed_optimizer=args.distopt, clip_grad=1.0), [ddp])
    return gpt, ddp, opt


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        with megatron_cpu_shim.CudaToCpuMode():
            self.gpt, self.ddp, self.opt = build(args)
        self.n_params = sum(p.numel() for p in self.gpt.parameters())
        g = torch.Generator().manual_seed(dist.get_rank())
        self.tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        self.labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        self.pos = torch.arange(args.seq).unsqueeze(0).expand(args.batch, args.seq)
        self.mask = torch.ones(args.batch, 1, args.seq, args.seq, dtype=torch.bool).tril().logical_not()
        self.busy = 0.0

    def train_steps(self, n: int) -> None:
        for _ in range(n):
            self.ddp.zero_grad_buffer()
            self.opt.zero_grad()
            for _ in range(self.args.acc):
                loss = self.ddp(self.tokens, self.pos, self.mask, labels=self.labels).float().mean() / self.args.acc
                loss.backward()
            self.ddp.finish_grad_sync()
            with megatron_cpu_shim.CudaToCpuMode():
                self.opt.step()

    def window(self, cfg) -> float:
        mon = None
        if cfg is not None:
            out = os.path.join(tempfile.gettempdir(), f"msprobe_megatron_bench_{os.getpid()}")
            shutil.rmtree(out, ignore_errors=True)
            mon = TrainerMonitorV2({**cfg, "output_dir": out})
            mon.start(model=self.ddp, optimizer=self.opt, grad_acc_steps=self.args.acc)
        settle()
        dist.barrier()
        t0 = time.perf_counter()
        self.train_steps(self.args.steps_per_window)
        elapsed = time.perf_counter() - t0
        if mon is not None:
            self.busy = mon.busy_seconds
            mon.stop()
            shutil.rmtree(out, ignore_errors=True)
        return elapsed

    def run(self, name: str, cfg: dict) -> None:
        timed = alternate(lambda monitored: self.window(cfg if monitored else None), lambda: self.busy,
                          self.args.rounds, self.args.steps_per_window)
        if dist.get_rank() == 0:
            print(f"{name:<34} median {timed.median:.3f}  (min {timed.min:.3f}, max {timed.max:.3f})"
                  f"  monitor's own code {100 * timed.busy_median:.1f}% of a plain window"
                  f"  (plain step {1e3 * timed.plain_median:.0f} ms)", flush=True)


def main() -> int:
    # The monitor prints its end-of-run line on stderr only where logging is not set up;
    # a benchmark starts and stops it many times, so its INFO lines go through logging.
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps-per-window", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--acc", type=int, default=2, help="micro-batches per step")
    p.add_argument("--bf16", action="store_true", help="Float16Module + Float16OptimizerWithFloat16Params")
    p.add_argument("--distopt", action="store_true", help="the distributed optimizer")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round: checks that the benchmark runs")
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.steps_per_window, args.warmup = 1, 1, 1
        args.layers, args.hidden, args.heads, args.vocab, args.seq, args.batch = 1, 32, 4, 64, 16, 2
    dist.init_process_group("gloo")
    megatron_cpu_shim.install(mode=False)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    bench = Bench(args)
    bench.train_steps(args.warmup)
    if dist.get_rank() == 0:
        print(f"Megatron-Core GPTModel {bench.n_params / 1e6:.2f}M params, {args.layers} layers, hidden {args.hidden}, "
              f"seq {args.seq}, batch {args.batch} x {args.acc} micro-batches, DP=2 (gloo, CPU), "
              f"{'bf16' if args.bf16 else 'fp32'}{', distributed optimizer' if args.distopt else ''}; "
              f"{args.rounds} rounds x {args.steps_per_window} steps per window; torch {torch.__version__}",
              flush=True)
    bench.run("weight_grad (accumulated)", {"monitors": {"weight_grad": {"enabled": True}}})
    bench.run("weight_grad (monitor_mbs_grad)",
              {"monitors": {"weight_grad": {"enabled": True, "monitor_mbs_grad": True}}})
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from torchrun_exit import leave

    leave(main())
