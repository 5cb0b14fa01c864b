"""Worker for tests/distributed/test_evidence_ranks.py, run by torchrun with 2 gloo ranks:

    evidence_ranks.py OUT_DIR

DDP over a small MLP with weight_grad, module (root) and ``alert.dump``; only rank 1
gets a NaN in its input at step 2. Each rank writes its own anomalies.jsonl and dump.
"""

import sys

import torch
import torch.distributed as dist
from support import finish

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

NAN_STEP = 2


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": sys.argv[1], "alert": {"spike_factor": None, "dump": True},
                            "monitors": {"weight_grad": {"enabled": True}}})
    mon.start(model=model, optimizer=opt)
    g = torch.Generator().manual_seed(100 + rank)
    for s in range(4):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        if s == NAN_STEP and rank == 1:
            x[0, 0] = float("nan")
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    finish()


if __name__ == "__main__":
    main()
