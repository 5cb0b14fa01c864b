"""Worker for tests/distributed/test_sinks_ranks.py, run by torchrun with 2 gloo ranks:

    sinks_ranks.py OUT_ROOT

Trains a small MLP under DDP twice, each rank on its own data, with weight_grad on and the
TensorBoard sink: once with the default ``sinks.ranks`` (rank 0 only) into
OUT_ROOT/default, once with ``"ranks": "all"`` into OUT_ROOT/all.
"""

import os
import sys

import torch
import torch.distributed as dist
from support import finish

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2


def run(out: str, sinks: dict) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": out, "monitors": {"weight_grad": {"enabled": True}}, "sinks": sinks})
    mon.start(model=model, optimizer=opt)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()


def main() -> None:
    dist.init_process_group("gloo")
    root = sys.argv[1]
    run(os.path.join(root, "default"), {"tensorboard": True})
    run(os.path.join(root, "all"), {"tensorboard": True, "ranks": "all", "top_k": 0})
    finish()


if __name__ == "__main__":
    main()
