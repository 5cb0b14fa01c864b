"""Worker for test_accelerate.py's FSDP2 case, run by torchrun with 2 gloo ranks on the
CPU: Accelerate with ``FullyShardedDataParallelPlugin(fsdp_version=2)``, gradient
accumulation 2, ``accelerator.clip_grad_norm_`` before ``optimizer.step()``, monitored by
``AccelerateMonitor`` as docs/integrations.md shows; trained with it and without it. Each
rank saves ``OUT_DIR/ref_rank<r>.pt`` with the independent references:

- ``acc``: the local accumulated gradient of each step, from ``torch.autograd.grad`` on a
  plain torch replica loaded with the full weights at the step's start and fed the same
  micro-batches (loss / gas, as ``accelerator.backward`` scales it); ``used``: the rank
  mean of ``acc`` (fp64, all-gathered) times the clipping coefficient of its global norm:
  the gradient the update uses;
- ``after``: full weights and Adam moments after each update (``DTensor.full_tensor()``);
- ``seen``: the monitor's step after each synchronised step; ``identical``: losses and
  weights equal the unmonitored run's bit for bit; ``warnings``: the monitor's WARNINGs;
- ``each_batch_warnings``: the WARNINGs of a third, monitored run with
  ``sync_each_batch=True`` (FSDP2 then reduce-scatters every micro-batch), written to
  ``OUT_DIR/each_batch``.

Accelerate 1.15 drops the FSDP plugin when it sees several CPU processes (MULTI_CPU); the
state is set to FSDP after the ``Accelerator`` is built (``prepare`` then applies
``fully_shard``) and again after ``prepare`` (which resets it), so that
``accelerator.accumulate`` turns FSDP2's gradient sync off on the first micro-batch.
"""

import logging
import os
import sys

import accelerate  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, GradientAccumulationPlugin  # noqa: E402

from msprobe.core.monitor_v2.integrations import AccelerateMonitor  # noqa: E402

STEPS, ACC, BATCH, CLIP = 3, 2, 4, 0.1
NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 10)
        self.fc2 = torch.nn.Linear(10, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def train(out_dir=None, sync_each_batch=False):
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = accelerate.Accelerator(cpu=True, fsdp_plugin=plugin, gradient_accumulation_plugin=(
        GradientAccumulationPlugin(num_steps=ACC, sync_each_batch=sync_each_batch)))
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    # prepare() sets MULTI_CPU again; without FSDP as the state, accumulate() would not
    # stop FSDP2's reduce-scatter on the first micro-batch
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2
    assert type(model).__name__.startswith("FSDP"), type(model)
    g = torch.Generator().manual_seed(4 + dist.get_rank())
    batches = [[(torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)) for _ in range(ACC)]
               for _ in range(STEPS)]
    weights, after, losses, seen = [], [], [], []
    helper = None
    if out_dir is not None:
        helper = AccelerateMonitor({"output_dir": out_dir, "monitors": {
            "weight_grad": {"enabled": True}, "param": {"enabled": True}, "optimizer": {"enabled": True},
            "module": {"enabled": True, "targets": ["fc1"]}}}, accelerator, model, optimizer)
    try:
        for step in range(STEPS):
            weights.append({n: full(p) for n, p in model.named_parameters()})
            for x, y in batches[step]:
                with accelerator.accumulate(model):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    losses.append(loss.detach().clone())
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), CLIP)
                    optimizer.step()
                    optimizer.zero_grad()
            if helper is not None:
                seen.append(helper.monitor.current_step)
            state = optimizer.optimizer.state
            out = {n: full(p) for n, p in model.named_parameters()}
            for n, p in model.named_parameters():
                for key in ("exp_avg", "exp_avg_sq"):
                    out[f"{n}.{key}"] = full(state[p][key])
            after.append(out)
    finally:
        if helper is not None:
            helper.stop()
    return batches, weights, after, losses, seen


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    capture = Capture()
    logging.getLogger("msprobe.monitor_v2").addHandler(capture)
    batches, weights, after, losses, seen = train(out_dir)
    logging.getLogger("msprobe.monitor_v2").removeHandler(capture)
    _, _, plain_after, plain_losses, _ = train()
    # sync_each_batch=True: FSDP2 reduce-scatters every micro-batch; no accumulated local gradient
    each_capture = Capture()
    logging.getLogger("msprobe.monitor_v2").addHandler(each_capture)
    train(os.path.join(out_dir, "each_batch"), sync_each_batch=True)
    logging.getLogger("msprobe.monitor_v2").removeHandler(each_capture)
    identical = torch.equal(torch.stack(losses), torch.stack(plain_losses)) and all(
        torch.equal(a[k], b[k]) for a, b in zip(after, plain_after) for k in a)
    replica = Net()
    acc = []
    for step in range(STEPS):
        replica.load_state_dict(weights[step])
        total = {n: 0 for n in NAMES}
        for x, y in batches[step]:
            loss = torch.nn.functional.mse_loss(replica(x), y) / ACC
            for n, grad in zip(NAMES, torch.autograd.grad(loss, list(replica.parameters()))):
                total[n] = total[n] + grad
        acc.append(total)
    gathered = [None, None]
    dist.all_gather_object(gathered, [{n: t.double() for n, t in a.items()} for a in acc])
    used = []
    for step in range(STEPS):
        mean = {n: (gathered[0][step][n] + gathered[1][step][n]) / 2 for n in NAMES}
        norm = sum(float(t.pow(2).sum()) for t in mean.values()) ** 0.5
        coef = min(1.0, CLIP / (norm + 1e-6))
        used.append({n: t * coef for n, t in mean.items()})
    rank = dist.get_rank()
    torch.save({"acc": acc, "used": used, "after": after, "seen": seen, "identical": identical,
                "warnings": capture.messages,
                "each_batch_warnings": each_capture.messages}, os.path.join(out_dir, f"ref_rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
    from support import finish

    finish()
