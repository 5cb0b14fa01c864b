"""Worker for tests/analysis/test_compare.py, run by torchrun with 2 gloo ranks (CPU):

    compare_ddp.py OUT_ROOT PERTURB_STEP

Trains a small MLP under DDP for STEPS steps (each rank its own data) twice, into
OUT_ROOT/ref and OUT_ROOT/cand, with the weight_grad (unreduced and reduced), optimizer
and param monitors on. In ``cand`` a DDP communication hook multiplies ``fc2.weight``'s
slice of the all-reduced bucket by 1.01 from step PERTURB_STEP on: the gradient is changed
only after the all-reduce, so its local (unreduced) rows agree with ``ref`` and its
reduced rows do not. Both runs use the same all-reduce (the hook's own) so that they are
bit-identical elsewhere. Rank 0 first trains OUT_ROOT/accum alone (world size 1, gradient
accumulation over the two ranks' batches: see ``train_accumulated``).
"""

import os
import sys

import torch
import torch.distributed as dist

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

STEPS = 5
PERTURBED = "fc2.weight"


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.act = torch.nn.Tanh()
        self.fc2 = torch.nn.Linear(16, 8)
        self.fc3 = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.fc3(self.act(self.fc2(self.act(self.fc1(x)))))


def train(out_dir: str, rank: int, perturb_step: int, perturb: bool) -> None:
    torch.manual_seed(0)
    net = Net()
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=100)
    state = {"step": 0}
    target = net.fc2.weight

    def hook(_state, bucket):
        buf = bucket.buffer()
        buf.div_(dist.get_world_size())
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def after(f):
            out = f.value()[0]
            if perturb and state["step"] >= perturb_step:
                offset = 0
                for p in bucket.parameters():
                    if p is target:
                        out[offset:offset + p.numel()].mul_(1.01)
                    offset += p.numel()
            return out

        return fut.then(after)

    model.register_comm_hook(None, hook)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = TrainerMonitorV2({
        "output_dir": out_dir,
        "monitors": {
            "weight_grad": {"enabled": True},
            "optimizer": {"enabled": True},
            "param": {"enabled": True},
        },
    })
    mon.start(model=model, optimizer=opt)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        state["step"] = step
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()


def train_accumulated(out_dir: str) -> None:
    """One process, no DDP: the two ranks' batches of each step as two micro-batches of
    gradient accumulation (each loss halved), so that its reduced gradients are the DDP
    run's (the mean of the two ranks'), up to rounding; its per-micro-batch rows are not
    comparable with the DDP run's."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    mon = TrainerMonitorV2({
        "output_dir": out_dir,
        "monitors": {
            "weight_grad": {"enabled": True, "monitor_mbs_grad": True},
            "optimizer": {"enabled": True},
            "param": {"enabled": True},
        },
    })
    mon.start(model=net, optimizer=opt, grad_acc_steps=2)
    gens = [torch.Generator().manual_seed(100 + r) for r in range(2)]
    for _step in range(STEPS):
        for g in gens:
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
            (torch.nn.functional.mse_loss(net(x), y) / 2).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()


def main() -> None:
    root, perturb_step = sys.argv[1], int(sys.argv[2])
    if os.environ.get("RANK") == "0":
        # before the process group exists: a run of its own, world size 1
        train_accumulated(f"{root}/accum")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    train(f"{root}/ref", rank, perturb_step, perturb=False)
    train(f"{root}/cand", rank, perturb_step, perturb=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from support import finish

    finish()
