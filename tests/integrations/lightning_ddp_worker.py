"""Worker for test_lightning.py, run by torchrun with 2 gloo ranks: trains with and
without the monitor under Lightning's DDP strategy and checks each rank's rows against
its references; the local gradient before the all-reduce is cloned by a communication
hook that then reduces as DDP does (average)."""

import os
import sys

import torch
import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from lightning_app import CONFIG_MONITORS, check_run, fit  # noqa: E402
from support.ddp import clone_then_average  # noqa: E402


class CloneLocalGrads(pl.Callback):
    """A DDP communication hook (registered once the strategy has wrapped the model; the
    strategy registers hooks only on CUDA) that stores ``local[step][name]`` = the local
    accumulated gradient as it enters the all-reduce, then averages as DDP does."""

    def __init__(self, local):
        self.local = local

    def on_fit_start(self, trainer, pl_module):
        names = {id(p): n for n, p in pl_module.named_parameters()}
        trainer.strategy.model.register_comm_hook(
            None, clone_then_average(self.local, names, lambda: trainer.global_step))


class BatchedProbe(pl.Callback):
    """Whether weight_grad reads the local gradients in one batch a backward pass (the
    callback names DDPStrategy's DDP to the monitor), at each training batch's end."""

    def __init__(self, monitored):
        self.monitored, self.seen = monitored, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        wg = next(m for m in self.monitored.monitor.monitors if m.name == "weight_grad")
        self.seen.append(wg._batched)


def strategy():
    return DDPStrategy(process_group_backend="gloo")


def main(out_dir: str) -> None:
    local_on, local_off = {}, {}
    batched = BatchedProbe(None)
    module, monitored, probe = fit({"output_dir": out_dir, "monitors": CONFIG_MONITORS}, strategy(), 2,
                                   [CloneLocalGrads(local_on), batched], bind=batched)
    plain, _, _ = fit(None, strategy(), 2, [CloneLocalGrads(local_off)])
    rank = dist.get_rank()
    assert torch.equal(torch.stack(module.losses), torch.stack(plain.losses))
    for (n, p), (_, q) in zip(module.named_parameters(), plain.named_parameters()):
        assert torch.equal(p, q), n
    check_run(out_dir, module, monitored, probe, rank=rank, unreduced=local_on)
    # The ranks' local gradients differ (different data) and average to the reduced one.
    other = [None, None]
    dist.all_gather_object(other, {s: {n: g for n, g in grads.items()} for s, grads in local_on.items()})
    for step in range(len(module.before_clip)):
        for name, reduced in module.before_clip[step].items():
            mean = (other[0][step][name] + other[1][step][name]) / 2
            assert torch.allclose(mean, reduced, rtol=1e-5, atol=1e-7), (step, name)
            assert not torch.equal(other[0][step][name], other[1][step][name]), (step, name)
    torch.save({"ok": True, "rank": rank, "batched": batched.seen}, os.path.join(out_dir, f"ref_rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
    from support import finish

    finish()
