"""Worker for tests/distributed/test_incident_ranks.py, run by torchrun with 2 gloo ranks:

    incident.py edit OUT     a DDP model; rank 0 alone edits the shared config (with
                             ``control``) late in step 3, after rank 1 has already looked
                             at the file; OUT/seen_rank<r>.json: what each rank's own
                             check saw at each step boundary
    incident.py anomaly OUT  one model per rank (no gradient all-reduce: rank 0 stays
                             clean); a NaN written into rank 1's fc2.weight before step 4
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from support import finish, loss_fn, make_batches
from support.models import TinyMLP

from msprobe.core.monitor_v2.analysis.control import ControlEdit, control
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

STEPS = 10


def edit(out: str) -> None:
    rank = dist.get_rank()
    cfg = os.path.join(out, "monitor_config.json")
    if rank == 0:
        with open(cfg, "w") as f:
            json.dump({"output_dir": out, "dynamic": True, "monitors": {"weight_grad": {"enabled": True}}}, f)
    dist.barrier()
    model = torch.nn.parallel.DistributedDataParallel(TinyMLP())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = TrainerMonitorV2(cfg)
    mon.start(model, opt)
    seen = []
    watch = mon._watch
    original = watch.changed

    def recorded() -> bool:
        result = original()
        seen.append([mon.current_step, result])
        return result

    watch.changed = recorded
    for step, (x, y) in enumerate(make_batches(STEPS, seed=10 + rank)):
        loss_fn(model, x, y).backward()
        if step == 3 and rank == 0:
            time.sleep(1.5)  # rank 1 ends step 3 (and checks the file) first
            control(cfg, ControlEdit(enable="module", targets=["fc1"], steps=3))
        opt.step()
        opt.zero_grad()
    mon.stop()
    with open(os.path.join(out, f"seen_rank{rank}.json"), "w") as f:
        json.dump(seen, f)


def anomaly(out: str) -> None:
    rank = dist.get_rank()
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = TrainerMonitorV2({"output_dir": out, "monitors": {"param": {"enabled": True}},
                            "alert": {"on_anomaly": {"steps": 3, "monitors": {"module": {"targets": "auto"}}}}})
    mon.start(model, opt)
    for step, (x, y) in enumerate(make_batches(STEPS, seed=10 + rank)):
        if step == 4 and rank == 1:
            with torch.no_grad():
                model.fc2.weight[1, 2] = float("nan")
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()


def main() -> None:
    dist.init_process_group("gloo")
    {"edit": edit, "anomaly": anomaly}[sys.argv[1]](sys.argv[2])
    finish()


if __name__ == "__main__":
    main()
