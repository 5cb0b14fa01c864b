"""Worker for tests/distributed/test_cc_unseen.py, run by torchrun with 2 gloo ranks (CPU).

    cc_unseen.py MODE OUT_DIR

MODE:
- ``unseen``: a small model whose forward sends its hidden activations through an
  expert-parallel all-to-all (``_functional_collectives.all_to_all_single_autograd``: one
  all-to-all forward, one backward) on a group of its own (``experts``), the loss summed
  over ranks for logging with ``_functional_collectives.all_reduce`` on that group, a
  DTensor redistributed from ``Shard(0)`` to ``Replicate()`` on a 1-D mesh over the world
  (one all-gather), and the gradients averaged with ``dist.all_reduce`` (seen by ``cc``).
  Per step: 3 collectives the monitor cannot see on ``experts``, 1 on the world.
- ``seen``: the same training with plain ``torch.distributed`` calls only (all_reduce,
  all_to_all_single, broadcast on ``experts``, barrier, monitored_barrier, send/recv,
  an async all_reduce, all_gather_object): every collective goes through the wrappers;
  the monitor runs with ``"dynamic": true`` (its own all-reduce between steps).
- ``ddp``: the model wrapped in ``DistributedDataParallel`` without a comm hook (its C++
  reducer all-reduces the gradients).

Each mode trains STEPS steps without the monitor, then again, from the same weights and
data, with the ``cc`` monitor; it saves both runs' losses and parameters, the monitor's
WARNING messages, and clones of the gradients after each ``dist.all_reduce`` (the
tag's call site: the line marked with the comment ``cc-unseen-grad-all-reduce``) to ``<OUT_DIR>/<mode>_rank<r>.pt``.
"""

import datetime
import json
import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

STEPS = 3


class Warnings(logging.Handler):
    """The monitor's WARNING messages, as logged."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class ExpertMix(torch.nn.Module):
    """Linear, ReLU, [tokens to the experts' ranks and back], Linear."""

    def __init__(self, experts) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 4)
        self.experts = experts  # None: no all-to-all

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        if self.experts is not None:
            h = funcol.all_to_all_single_autograd(h, None, None, self.experts)
        return self.down(h)


def batches(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(STEPS)]


def train(mode: str, experts, mesh, out_dir, monitored: bool):
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = ExpertMix(experts if mode == "unseen" else None)
    net = torch.nn.parallel.DistributedDataParallel(model) if mode == "ddp" else model
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    caught = Warnings()
    mon = None
    if monitored:
        logging.getLogger("msprobe.monitor_v2").addHandler(caught)
        config = {"output_dir": os.path.join(out_dir, mode), "patch_optimizer_step": False,
                  "monitors": {"module": {"enabled": False}, "cc": {"enabled": True}}}
        if mode == "seen":
            # "dynamic": the ranks agree on config edits with an all-reduce between steps,
            # the monitor's own: neither a cc row nor counted as unseen
            config["dynamic"] = True
            path = os.path.join(out_dir, f"config_rank{rank}.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump(config, f)
            config = path
        mon = TrainerMonitorV2(config)
        mon.start(model=net, optimizer=opt)
    losses, reduced, logged = [], [], []
    for step, (x, y) in enumerate(batches(rank)):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        if mode != "ddp":
            grads = []
            for p in model.parameters():
                dist.all_reduce(p.grad)  # cc-unseen-grad-all-reduce
                grads.append(p.grad.reshape(-1).clone())  # the all-reduce's result
                p.grad.div_(dist.get_world_size())
            reduced.append({"step": step, "post": torch.cat(grads).clone()})
        if mode == "unseen":
            # the loss summed over the experts' group, for logging (a functional collective)
            logged.append(funcol.wait_tensor(funcol.all_reduce(loss.detach(), "sum", experts)).clone())
            # a tensor-parallel style redistribution: Shard(0) -> Replicate() (one all-gather)
            piece = DTensor.from_local(model.down.weight.detach()[:2].clone(), mesh, [Shard(0)])
            logged.append(piece.redistribute(mesh, [Replicate()]).to_local().sum())
        elif mode == "seen":
            t = torch.full((4,), float(rank + step))
            out = torch.empty(4)
            dist.all_to_all_single(out, t, group=experts)
            dist.broadcast(t, src=0, group=experts)
            dist.barrier()
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
            if rank == 0:
                dist.send(t, 1)
            else:
                dist.recv(t, 0)
            dist.all_reduce(t, async_op=True).wait()
            names = [None] * dist.get_world_size()
            dist.all_gather_object(names, f"rank{rank}")
            logged.append(out.clone())
        opt.step()
        losses.append(loss.detach().clone())
        if mon is not None:
            mon.step()  # cc-unseen-step
    if mon is not None:
        mon.stop()
        logging.getLogger("msprobe.monitor_v2").removeHandler(caught)
    return {"losses": torch.stack(losses), "params": [p.detach().clone() for p in model.parameters()],
            "reduced": reduced, "logged": logged, "warnings": caught.messages}


def main() -> None:
    mode, out_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    experts = dist.new_group([0, 1], group_desc="experts")
    # a group on the fake backend, as TorchTitan gives each mesh dimension of degree 1: it
    # communicates nothing, and is neither counted nor said
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers "fake"

    dist.new_group([0, 1], backend="fake", group_desc="unused")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plain = train(mode, experts, mesh, out_dir, monitored=False)
    mon = train(mode, experts, mesh, out_dir, monitored=True)
    mon["bit_identical"] = torch.equal(plain["losses"], mon["losses"]) and all(
        torch.equal(a, b) for a, b in zip(plain["params"], mon["params"])) and all(
        torch.equal(a, b) for a, b in zip(plain["logged"], mon["logged"]))
    torch.save(mon, os.path.join(out_dir, f"{mode}_rank{dist.get_rank()}.pt"))


if __name__ == "__main__":
    main()
    from support import finish

    finish()
