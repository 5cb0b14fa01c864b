"""Worker for tests/distributed/test_data_parallel.py, run by torchrun with 2 gloo ranks.

    data_parallel.py MODE OUT_DIR [--mbs]

MODE: ddp | ddp_bucket_view | ddp_static_graph | fsdp1 | fsdp1_orig | fsdp2. Each rank trains the same model on different
data with gradient accumulation (2 micro-batches; DDP's no_sync on the first), with the
weight_grad/optimizer/param monitors on, and saves the references the test needs:
- ``ref_rank<r>.pt``: for every step, each parameter's local gradient per micro-batch,
  computed with torch.autograd.grad on an unmonitored plain copy whose parameters are
  synced from the trained model at the start of each step;
  and whether weight_grad read the accumulated ``unreduced`` gradients in one batch at
  the end of the backward pass (``batched``) rather than in each parameter's hook;
- ``losses_rank<r>.pt``: the losses with the monitor, and (ddp) without it.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

STEPS, ACC = 3, 2


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.act = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(8, 4)
        self.fc3 = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc3(self.fc2(self.act(self.fc1(x))))


def batches(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)) for _ in range(STEPS * ACC)]


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def full_state(model, mode):
    """Unsharded parameters by original name (collectives: call outside the monitor)."""
    if mode.startswith("ddp"):
        return {n: p.detach().clone() for n, p in model.module.named_parameters()}
    if mode == "fsdp2":
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model):
        return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}


def wrap(model, mode):
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if mode == "ddp_bucket_view":  # .grad is the bucket: all-reduced in place during backward
        return torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    if mode == "ddp_static_graph":  # the first iteration's all-reduce is queued as backward starts
        return torch.nn.parallel.DistributedDataParallel(model, static_graph=True)
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.fc2)
        fully_shard(model)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    orig = mode == "fsdp1_orig"
    model.fc2 = FSDP(model.fc2, device_id=torch.device("cpu"), use_orig_params=orig)
    return FSDP(model, device_id=torch.device("cpu"), use_orig_params=orig)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def reference_grads(mode, out_dir, mbs):
    """Train once with the monitor, recording per step the local micro-batch gradients of
    an unmonitored plain copy synced from the model before the step."""
    torch.manual_seed(0)
    base = Net()
    ref = copy.deepcopy(base)
    model = wrap(base, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    cfg = {
        "output_dir": out_dir,
        "monitors": {
            "weight_grad": {"enabled": True, "monitor_mbs_grad": mbs},
            "optimizer": {"enabled": True},
            "param": {"enabled": True},
        },
    }
    rank = dist.get_rank()
    data = batches(rank)
    # Reading full parameters needs collectives (FSDP); the monitors used here make none.
    mon = TrainerMonitorV2(cfg)
    # static_graph fails inside torch's reducer under no_sync(): one micro-batch a step
    acc = 1 if mode == "ddp_static_graph" else ACC
    mon.start(model=model, optimizer=opt, grad_acc_steps=acc)
    names = [n for n, _ in ref.named_parameters()]
    refs, losses = [], []
    for s in range(STEPS):
        state = full_state(model, mode)
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(state[n])
        micro = data[s * ACC:s * ACC + acc]
        step_refs = []
        for x, y in micro:
            grads = torch.autograd.grad(loss_of(ref, x, y) / ACC, list(ref.parameters()))
            step_refs.append({n: g.clone() for n, g in zip(names, grads)})
        refs.append(step_refs)
        for i, (x, y) in enumerate(micro):
            last = i == acc - 1
            if mode == "fsdp2":
                model.set_requires_gradient_sync(last)
                ctx = _nullcontext()
            else:
                ctx = _nullcontext() if last else model.no_sync()
            with ctx:
                loss = loss_of(model, x, y) / ACC
                loss.backward()
            losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad()
    batched = next(m for m in mon.monitors if m.name == "weight_grad")._batched
    mon.stop()
    torch.save({"grads": refs, "losses": torch.stack(losses), "batched": batched},
               os.path.join(out_dir, f"ref_rank{rank}.pt"))


def bit_identical_ddp(out_dir):
    """Losses and parameters with and without the monitor, same process group: with a row
    per micro-batch (tensor hooks), and accumulated (the end-of-pass batch under DDP)."""
    results = {}
    for monitored in (None, "mbs", "accumulated"):
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(Net())
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        mon = None
        if monitored:
            mon = TrainerMonitorV2({
                "output_dir": os.path.join(out_dir, f"bitwise_{monitored}"),
                "monitors": {"weight_grad": {"enabled": True, "monitor_mbs_grad": monitored == "mbs"},
                             "optimizer": {"enabled": True}, "param": {"enabled": True},
                             "module": {"enabled": True}, "cc": {"enabled": True, "cc_pre_hook": True}},
            })
            mon.start(model=model, optimizer=opt, grad_acc_steps=ACC)
        losses = []
        data = batches(dist.get_rank())
        for s in range(STEPS):
            for i, (x, y) in enumerate(data[s * ACC:(s + 1) * ACC]):
                ctx = _nullcontext() if i == ACC - 1 else model.no_sync()
                with ctx:
                    loss = loss_of(model, x, y) / ACC
                    loss.backward()
                losses.append(loss.detach().clone())
            opt.step()
            opt.zero_grad()
        if mon is not None:
            if monitored == "accumulated":  # the end-of-pass batch was what ran
                batched = next(m for m in mon.monitors if m.name == "weight_grad")._batched
            mon.stop()
        results[monitored] = (torch.stack(losses), [p.detach().clone() for p in model.parameters()])
    same = all(torch.equal(results[None][0], results[m][0]) and all(
        torch.equal(a, b) for a, b in zip(results[None][1], results[m][1])) for m in ("mbs", "accumulated"))
    torch.save({"bit_identical": same, "batched": batched}, os.path.join(out_dir, f"bitwise_rank{dist.get_rank()}.pt"))


def main() -> None:
    mode, out_dir = sys.argv[1], sys.argv[2]
    mbs = "--mbs" in sys.argv
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    reference_grads(mode, out_dir, mbs)
    if mode == "ddp":
        bit_identical_ddp(out_dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from support import finish

    finish()
