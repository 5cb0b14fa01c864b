"""Worker for tests/analysis/test_compare.py, run by torchrun with 2 gloo ranks (CPU):

    compare_ddp.py OUT_ROOT PERTURB_STEP

Trains a small MLP under DDP for STEPS steps (each rank its own data) twice, into
OUT_ROOT/ref and OUT_ROOT/cand, with the weight_grad (unreduced and reduced), optimizer
and param monitors on. In ``cand`` a DDP communication hook multiplies ``fc2.weight``'s
slice of the all-reduced bucket by 1.01 from step PERTURB_STEP on: the gradient is changed
only after the all-reduce, so its local (unreduced) rows agree with ``ref`` and its
reduced rows do not. Both runs use the same all-reduce (the hook's own) so that they are
bit-identical elsewhere.
"""

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


def main() -> None:
    root, perturb_step = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    train(f"{root}/ref", rank, perturb_step, perturb=False)
    train(f"{root}/cand", rank, perturb_step, perturb=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from support import finish

    finish()
