"""Worker for test_lightning_deepspeed.py, run by torchrun with 2 gloo ranks on the CPU
(``DS_ACCELERATOR=cpu``): Lightning ``DeepSpeedStrategy(stage=2)`` with
``MonitorLightningCallback`` wired as docs/integrations.md shows, gradient accumulation 2,
``gradient_clip_val``; trained with the monitor and without it. Each rank saves
``OUT_DIR/ref_rank<r>.pt`` with the independent references:

- ``mb``: each micro-batch's local gradient, from ``torch.autograd.grad`` on a plain torch
  replica loaded with the weights at the step's start and fed the micro-batch the module
  saw; the loss is divided by ``accumulate_grad_batches`` by Lightning and by
  ``gradient_accumulation_steps`` again by DeepSpeed; ``mean``: the rank average of their
  sums, in fp64;
- ``ds``: fp32 masters and Adam moments after each update through DeepSpeed's public
  ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``;
- ``logged``: the steps Lightning's logger received the training loss at; ``seen``:
  (``trainer.global_step``, monitor step) after each batch; ``identical``: losses and
  weights equal the unmonitored run's; ``warnings``: what the monitor logged at WARNING.

Lightning's ``DeepSpeedStrategy`` refuses a non-CUDA accelerator in
``setup_environment``; ``CpuDeepSpeed`` below skips that check and gives DeepSpeed a
device index (the engine compares it with 0), nothing else.
"""

import logging
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.strategies import DeepSpeedStrategy  # noqa: E402

from msprobe.core.monitor_v2.integrations import MonitorLightningCallback  # noqa: E402

STEPS, ACC, BATCH, CLIP = 3, 2, 4, 0.05
NAMES = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]


class CpuDeepSpeed(DeepSpeedStrategy):
    def setup_environment(self) -> None:
        self.accelerator.setup_device(self.root_device)
        self.setup_distributed()

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu", 0)

    def setup_distributed(self) -> None:
        self.set_world_ranks()
        self._init_deepspeed_distributed()


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.inputs, self.weights, self.ds, self.losses, self.seen = {}, [], [], [], []
        self.monitored = None

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx % ACC == 0:
            self.weights.append({n: p.detach().clone() for n, p in self.named_parameters()})

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.inputs.setdefault(self.trainer.global_step, []).append((x.clone(), y.clone()))
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        self.log("train_loss", loss, on_step=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.monitored is not None and self.monitored.monitor is not None:
            self.seen.append((self.trainer.global_step, self.monitored.monitor.current_step))
        if (batch_idx + 1) % ACC == 0:
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            out = {}
            for n, p in self.named_parameters():
                out[n] = safe_get_full_fp32_param(p).detach().float().clone()
                for key in ("exp_avg", "exp_avg_sq"):
                    out[f"{n}.{key}"] = safe_get_full_optimizer_state(p, key).detach().float().clone()
            self.ds.append(out)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


class StepLogger(pl.loggers.Logger):
    """The steps Lightning logs the training loss at."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = []

    name, version = "steps", 0

    @property
    def experiment(self):
        return None

    def log_metrics(self, metrics, step=None):
        if "train_loss" in metrics:
            self.steps.append(step)

    def log_hyperparams(self, *args, **kwargs):
        pass


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def fit(out_dir=None):
    pl.seed_everything(0, verbose=False)
    module = Regressor()
    callbacks = []
    if out_dir is not None:
        module.monitored = MonitorLightningCallback({"output_dir": out_dir, "monitors": {
            "weight_grad": {"enabled": True, "monitor_mbs_grad": True}, "param": {"enabled": True},
            "optimizer": {"enabled": True}, "module": {"enabled": True, "targets": ["net.0"]}}})
        callbacks.append(module.monitored)
    logger = StepLogger()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=CpuDeepSpeed(stage=2, process_group_backend="gloo"),
        max_steps=STEPS, accumulate_grad_batches=ACC, gradient_clip_val=CLIP, callbacks=callbacks, logger=logger,
        log_every_n_steps=1, num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, deterministic=True)
    g = torch.Generator().manual_seed(1)
    n = STEPS * ACC * BATCH * 2
    data = torch.utils.data.TensorDataset(torch.rand(n, 5, generator=g), torch.randn(n, 1, generator=g))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False))
    assert trainer.global_step == STEPS
    kind = type(trainer.strategy.model.optimizer).__name__
    return module, logger.steps, kind


def main(out_dir: str) -> None:
    capture = Capture()
    logging.getLogger("msprobe.monitor_v2").addHandler(capture)
    module, logged, kind = fit(out_dir)
    logging.getLogger("msprobe.monitor_v2").removeHandler(capture)
    plain, _, _ = fit()
    identical = torch.equal(torch.stack(module.losses), torch.stack(plain.losses)) and all(
        torch.equal(p, q) for p, q in zip(module.parameters(), plain.parameters()))
    replica = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    mb, acc = [], []
    for step in range(STEPS):
        replica.load_state_dict({n[len("net."):]: t for n, t in module.weights[step].items()})
        grads = []
        for x, y in module.inputs[step]:
            loss = torch.nn.functional.mse_loss(replica(x), y) / ACC / ACC
            grads.append({n: g.detach().clone() for n, g in zip(NAMES, torch.autograd.grad(
                loss, list(replica.parameters())))})
        mb.append(grads)
        acc.append({n: sum(g[n] for g in grads) for n in NAMES})
    gathered = [None, None]
    dist.all_gather_object(gathered, [{n: t.double() for n, t in a.items()} for a in acc])
    mean = [{n: (gathered[0][s][n] + gathered[1][s][n]) / 2 for n in NAMES} for s in range(STEPS)]
    rank = dist.get_rank()
    torch.save({"kind": kind, "mb": mb, "mean": mean, "ds": module.ds, "logged": logged, "seen": module.seen,
                "identical": identical, "warnings": capture.messages,
                "micro_batches": [len(module.inputs[s]) for s in range(STEPS)]},
               os.path.join(out_dir, f"ref_rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
    from support import finish

    finish()
