"""Worker for tests/analysis, run by torchrun with 2 gloo ranks (CPU):

    train_runs.py OUT_ROOT NAN_STEP LR_STEP SPIKE_STEP DESYNC_STEP

Trains a small MLP under DDP for STEPS steps with gradient accumulation (ACC = 2
micro-batches, no_sync on the first), each rank on its own data, with the module,
weight_grad (per micro-batch), optimizer and param monitors on, every step written.
Several runs in one launch, each in its own output directory under OUT_ROOT:

- ``clean``:  the reference run;
- ``nan``:    on rank 1 only, a forward hook multiplies ``fc2``'s output by NaN in
              micro-batch 2 of step NAN_STEP;
- ``lr``:     as ``clean`` (same seed, same data), but the learning rate is 10x larger
              from step LR_STEP on;
- ``spike``:  the inputs of step SPIKE_STEP are multiplied by 1000 on every rank;
- ``desync``: after the optimizer step of step DESYNC_STEP, rank 1 alone adds 1e-3 to
              ``fc1.weight`` (the ranks' replicas silently diverge).
"""

import sys

import torch
import torch.distributed as dist

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

STEPS, ACC = 14, 2


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.act = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(8, 4)
        self.fc3 = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc3(self.fc2(self.act(self.fc1(x))))


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def train(out_dir, rank, nan_step=None, lr_step=None, spike_step=None, desync_step=None):
    torch.manual_seed(0)
    net = Net()
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = {"inject": False}

    def poison(module, inputs, output):
        return output * float("nan") if state["inject"] else output

    net.fc2.register_forward_hook(poison)
    mon = TrainerMonitorV2({
        "output_dir": out_dir,
        "monitors": {
            "module": {"enabled": True},
            "weight_grad": {"enabled": True, "monitor_mbs_grad": True},
            "optimizer": {"enabled": True},
            "param": {"enabled": True},
        },
    })
    mon.start(model=model, optimizer=opt, grad_acc_steps=ACC)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        if step == lr_step:
            for group in opt.param_groups:
                group["lr"] = 0.1
        for micro in range(1, ACC + 1):
            x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
            if step == spike_step:
                x = x * 1000.0
            state["inject"] = rank == 1 and step == nan_step and micro == 2
            ctx = _nullcontext() if micro == ACC else model.no_sync()
            with ctx:
                loss = torch.nn.functional.mse_loss(model(x), y) / ACC
                loss.backward()
            state["inject"] = False
        opt.step()  # patched by the monitor: also ends its step
        opt.zero_grad()
        if step == desync_step and rank == 1:
            with torch.no_grad():
                net.fc1.weight.add_(1e-3)
    mon.stop()


def main() -> None:
    root, nan_step, lr_step, spike_step, desync_step = sys.argv[1], *map(int, sys.argv[2:6])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    train(f"{root}/clean", rank)
    train(f"{root}/nan", rank, nan_step=nan_step)
    train(f"{root}/lr", rank, lr_step=lr_step)
    train(f"{root}/spike", rank, spike_step=spike_step)
    train(f"{root}/desync", rank, desync_step=desync_step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from support import finish

    finish()
