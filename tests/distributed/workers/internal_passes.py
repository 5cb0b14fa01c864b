"""Worker for tests/distributed/test_internal_passes.py, run by torchrun with 2 gloo ranks.

    internal_passes.py MODE OUT_DIR

MODE:
- ``gpipe`` / ``1f1b``: ``torch.distributed.pipelining`` with 2 stages (one per rank), 4
  micro-batches, the ``module`` and ``weight_grad`` monitors on the stage's module. Torch
  runs a shape-inference forward/backward at the first step (stage 1 on ``torch.empty``
  inputs); the monitor must write no row for it.
- ``ckpt_fsdp2``: FSDP2 (``fully_shard``) over ``checkpoint_wrapper``-ed blocks, every
  monitor but ``cc`` on.
- ``ckpt_fsdp1``: the same with FSDP1 units (``use_orig_params=False``: flat parameters)
  around the ``checkpoint_wrapper``-ed blocks and the model.

Each rank saves ``ref_rank<r>.pt``: per step, the tensors every module of an unmonitored
plain replica saw (inputs, outputs by forward hooks; ``grad_output``/``grad_input`` by
full backward hooks), the replica fed the same micro-batches by hand, and its names; and
whether training with the monitor was bit-identical to training without it.
"""

import os
import sys
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

STEPS, MICRO = 2, 4
LR = 0.05


class Front(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(self.fc1(x))


class Back(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc2 = nn.Linear(8, 5)
        self.fc3 = nn.Linear(5, 3)

    def forward(self, h):
        return self.fc3(torch.relu(self.fc2(h)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(self.lin(x)) + x


class Stacked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out, y)


def data(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(MICRO * 2, 6, generator=g), torch.randn(MICRO * 2, 3, generator=g)) for _ in range(STEPS)]


class Recorder:
    """Plain hooks on every module of an unmonitored replica: clones per tag."""

    def __init__(self, model: nn.Module, root: str) -> None:
        self.tensors = defaultdict(list)
        self.handles = []
        for name, mod in model.named_modules():
            tag = name or root
            self.handles.append(mod.register_forward_hook(self._forward(tag)))
            self.handles.append(mod.register_full_backward_hook(self._backward(tag)))

    def _forward(self, tag):
        def hook(mod, args, out):
            for i, t in enumerate(a for a in args if isinstance(a, torch.Tensor)):
                self.tensors[f"{tag}.input.{i}"].append(t.detach().clone())
            self.tensors[f"{tag}.output.0"].append(out.detach().clone())
        return hook

    def _backward(self, tag):
        def hook(mod, grad_input, grad_output):
            for i, g in enumerate(grad_input):
                if g is not None:
                    self.tensors[f"{tag}.grad_input.{i}"].append(g.detach().clone())
            for j, g in enumerate(grad_output):
                if g is not None:
                    self.tensors[f"{tag}.grad_output.{j}"].append(g.detach().clone())
        return hook

    def take(self):
        out, self.tensors = dict(self.tensors), defaultdict(list)
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


# ------------------------------------------------------------------- pipelining
def pipeline_train(mode: str, monitored: bool, out_dir: str):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    torch.manual_seed(0)
    front, back = Front(), Back()
    module = front if rank == 0 else back
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    cls = ScheduleGPipe if mode == "gpipe" else Schedule1F1B
    schedule = cls(stage, MICRO, loss_fn=loss_fn)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    mon = None
    if monitored:
        mon = TrainerMonitorV2({"output_dir": out_dir, "monitors": {
            "module": {"enabled": True}, "weight_grad": {"enabled": True, "monitor_mbs_grad": True}}})
        mon.start(model=module, optimizer=opt, grad_acc_steps=MICRO)
    losses = []
    for x, y in data(7):
        if rank == 0:
            schedule.step(x)
        else:
            step_losses = []
            schedule.step(target=y, losses=step_losses)
            losses.extend(l.detach().clone() for l in step_losses)
        opt.step()
        opt.zero_grad()
    errors = 0
    if mon is not None:
        mon.stop()
        errors = mon.errors.count
    return losses, [p.detach().clone() for p in module.parameters()], errors


def pipeline_reference():
    """The two stages trained by hand in plain torch on the same micro-batches: per step,
    what each module of this rank's stage saw."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    front, back = Front(), Back()
    mine = front if rank == 0 else back
    rec = Recorder(mine, type(mine).__name__)
    opt = torch.optim.SGD(list(front.parameters()) + list(back.parameters()), lr=LR)
    steps = []
    for x, y in data(7):
        for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):
            h = front(xm)
            received = h.detach().requires_grad_()  # what stage 1 receives
            loss = loss_fn(back(received), ym)
            loss.backward()
            h.backward(received.grad)
        for p in list(front.parameters()) + list(back.parameters()):
            p.grad /= MICRO  # the schedule's scale_grads
        opt.step()
        opt.zero_grad()
        steps.append(rec.take())
    rec.remove()
    return steps


def run_pipeline(mode: str, out_dir: str):
    plain = pipeline_train(mode, False, out_dir)
    watched = pipeline_train(mode, True, out_dir)
    same = all(torch.equal(a, b) for a, b in zip(plain[0], watched[0])) and len(plain[0]) == len(watched[0]) and all(
        torch.equal(a, b) for a, b in zip(plain[1], watched[1]))
    return {"steps": pipeline_reference(), "bit_identical": same, "errors": watched[2]}


# --------------------------------------------------- FSDP2 over checkpoint_wrapper
def ckpt_train(mode: str, monitored: bool, out_dir: str):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Stacked()
    plain_names = [n for n, _ in model.named_modules()]
    param_names = [n for n, _ in model.named_parameters()]
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer)
    if mode == "ckpt_fsdp2":
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        for i, layer in enumerate(model.layers):
            model.layers[i] = FSDP(layer, device_id=torch.device("cpu"), use_orig_params=False)
        model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = None
    if monitored:
        mon = TrainerMonitorV2({"output_dir": out_dir, "monitors": {
            "module": {"enabled": True}, "weight_grad": {"enabled": True}, "param": {"enabled": True},
            "optimizer": {"enabled": True}}})
        mon.start(model=model, optimizer=opt, grad_acc_steps=MICRO)
    losses = []
    for x, y in data(11 + dist.get_rank()):
        for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):
            loss = loss_fn(model(xm), ym) / MICRO
            loss.backward()
            losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad()
    errors = 0
    if mon is not None:
        mon.stop()
        errors = mon.errors.count
    if mode == "ckpt_fsdp2":
        full = [p.full_tensor().detach().clone() for p in model.parameters()]
    else:
        with FSDP.summon_full_params(model):
            full = [p.detach().clone() for p in model.parameters()]
    return losses, full, errors, plain_names, param_names


def ckpt_reference():
    """The plain model (no wrapper, no sharding), same seed, fed the same micro-batches;
    the reference is taken at the first step (the parameters all ranks start from)."""
    torch.manual_seed(0)
    model = Stacked()
    rec = Recorder(model, "Stacked")
    x, y = data(11 + dist.get_rank())[0]
    for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):
        (loss_fn(model(xm), ym) / MICRO).backward()
    rec.remove()
    return [rec.take()]


def run_ckpt(mode: str, out_dir: str):
    plain = ckpt_train(mode, False, out_dir)
    watched = ckpt_train(mode, True, out_dir)
    same = all(torch.equal(a, b) for a, b in zip(plain[0], watched[0])) and all(
        torch.equal(a, b) for a, b in zip(plain[1], watched[1]))
    return {"steps": ckpt_reference(), "bit_identical": same, "errors": watched[2],
            "module_names": plain[3], "param_names": plain[4]}


def main() -> None:
    mode, out_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    result = run_ckpt(mode, out_dir) if mode.startswith("ckpt_") else run_pipeline(mode, out_dir)
    torch.save(result, os.path.join(out_dir, f"ref_rank{dist.get_rank()}.pt"))


if __name__ == "__main__":
    main()
    from support import finish

    finish()
