"""Worker for tests/analysis/test_resumed_runs.py: a run that dies.

    dying_run.py CONFIG CKPT NAN_STEP DIE_STEP RESUME_STEP

Trains ``support.TinyMLP`` (plain SGD) with the monitor of CONFIG on
``make_batches(DIE_STEP + 1)``; before step RESUME_STEP it saves a checkpoint (the model
and optimizer state, as a trainer would) to CKPT/ckpt.pt; before step NAN_STEP a NaN is
written into ``fc2.weight[0, 0]`` (a corrupted weight), so that every later step's
gradients are non-finite; the parameters and gradients of step NAN_STEP before its update
are saved to CKPT/nan_step.pt, for the test to compare the dump with. After step
DIE_STEP, once the dump of step NAN_STEP is on disk, the process kills itself with
SIGKILL: no ``stop()``, no exit handler, as a node failure or the OOM killer leaves a run.
"""

import os
import signal
import sys
import time

import torch

from support import TinyMLP, make_batches
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2


def main(config: str, ckpt: str, nan_step: int, die_step: int, resume_step: int) -> None:
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = TrainerMonitorV2(config)
    mon.start(model=model, optimizer=opt)
    dump = os.path.join(mon.config.output_dir, "rank_0", f"dump_step{nan_step}", "manifest.json")
    for step, (x, y) in enumerate(make_batches(die_step + 1)):
        if step == resume_step:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, os.path.join(ckpt, "ckpt.pt"))
        if step == nan_step:
            with torch.no_grad():
                model.fc2.weight[0, 0] = float("nan")
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == nan_step:
            torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}},
                       os.path.join(ckpt, "nan_step.pt"))
        opt.step()  # patched: the monitor's step() runs after it
        opt.zero_grad()
    deadline = time.monotonic() + 60
    while not os.path.exists(dump) and time.monotonic() < deadline:  # the dump is written on its own thread
        time.sleep(0.05)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6]))
