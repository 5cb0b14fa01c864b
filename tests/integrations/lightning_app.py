"""A small Lightning training shared by test_lightning.py (one process) and
lightning_ddp_worker.py (2 processes under torchrun, gloo): 6 optimizer steps of 2
micro-batches, gradient clipping, a validation pass after every step.

The references are clones the model takes itself: the gradient before and after
``clip_gradients`` (in ``configure_gradient_clipping``: the accumulated gradient, and the
gradient the update uses), the training inputs per step, the losses. Under DDP the local
gradient before the all-reduce is cloned by a communication hook."""

import lightning.pytorch as pl
import torch

from msprobe.core.monitor_v2.integrations import MonitorLightningCallback

STEPS, ACC, BATCH, D_IN = 6, 2, 4, 5
VAL_OFFSET = 10.0  # validation inputs are >= 10, training inputs < 1


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(D_IN, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.losses, self.inputs, self.before_clip, self.after_clip = [], {}, {}, {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.inputs.setdefault(self.trainer.global_step, []).append(x.clone())
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        self.log("train_loss", loss)  # the callback writes it as a scalars row
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        step = self.trainer.global_step
        self.before_clip[step] = {n: p.grad.detach().clone() for n, p in self.named_parameters()}
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                            gradient_clip_algorithm=gradient_clip_algorithm)
        self.after_clip[step] = {n: p.grad.detach().clone() for n, p in self.named_parameters()}

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


def loaders(world: int = 1):
    g = torch.Generator().manual_seed(1)
    n = STEPS * ACC * BATCH * world
    train = torch.utils.data.TensorDataset(torch.rand(n, D_IN, generator=g), torch.randn(n, 1, generator=g))
    val = torch.utils.data.TensorDataset(VAL_OFFSET + torch.rand(2 * BATCH * world, D_IN, generator=g),
                                         torch.randn(2 * BATCH * world, 1, generator=g))
    return (torch.utils.data.DataLoader(train, batch_size=BATCH, shuffle=False),
            torch.utils.data.DataLoader(val, batch_size=BATCH, shuffle=False))


class StepProbe(pl.Callback):
    """(trainer.global_step, monitor's current step) after each training batch."""

    def __init__(self, monitored) -> None:
        self.monitored, self.seen = monitored, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.monitored is not None and self.monitored.monitor is not None:
            self.seen.append((trainer.global_step, self.monitored.monitor.current_step))


def fit(config=None, strategy="auto", devices=1, extra_callbacks=(), bind=None):
    """Train once; returns (module, callback, probe). ``bind``: an extra callback given
    the monitor's callback as its ``monitored``."""
    pl.seed_everything(0, verbose=False)
    module = Regressor()
    monitored = MonitorLightningCallback(config) if config is not None else None
    if bind is not None:
        bind.monitored = monitored
    probe = StepProbe(monitored)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, accumulate_grad_batches=ACC,
        gradient_clip_val=0.05, val_check_interval=ACC, limit_val_batches=1, num_sanity_val_steps=1,
        callbacks=[c for c in (monitored, probe, *extra_callbacks) if c is not None], logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, deterministic=True,
    )
    train, val = loaders(devices)
    trainer.fit(module, train, val)
    assert trainer.global_step == STEPS
    return module, monitored, probe


def check_run(out_dir, module, monitored, probe, rank=0, unreduced=None):
    """The CSV rows of ``rank`` against the module's references (``unreduced``: the
    local gradients before the reduction by step, when they differ from before_clip)."""
    from support import assert_row_matches, find_row, numpy_stats, rows_of

    unreduced = unreduced if unreduced is not None else module.before_clip
    # After each training batch the monitor's step is Lightning's global step.
    assert probe.seen == [((b + 1) // ACC, (b + 1) // ACC) for b in range(STEPS * ACC)], probe.seen
    assert monitored.monitor is None
    rows = rows_of(out_dir, "weight_grad", rank)
    assert sorted({int(r["step"]) for r in rows}) == list(range(STEPS))
    clipped = 0
    for step in range(STEPS):
        for name, grad in unreduced[step].items():
            row = find_row(rows, step=step, module_name=name, scope="unreduced")
            assert row["micro_step"] == str(ACC)
            assert_row_matches(row, numpy_stats(grad), rtol=1e-4, atol=1e-6)
            used = module.after_clip[step][name]
            assert_row_matches(find_row(rows, step=step, module_name=name, scope="reduced"), numpy_stats(used),
                               rtol=1e-4, atol=1e-6)
            clipped += not torch.equal(module.before_clip[step][name], used)
    assert clipped, "gradient_clip_val must clip, or the test cannot tell where 'reduced' is read"
    module_rows = rows_of(out_dir, "module", rank)
    for step in range(STEPS):
        x = torch.cat(module.inputs[step])
        assert_row_matches(find_row(module_rows, step=step, module_name="net.0.input.0", scope="forward"),
                           numpy_stats(x))
    # The logged train_loss is a scalars row of each step: the value logged last in it (the
    # last micro-batch's), exactly (an fp32 tensor, nine significant digits).
    scalars = rows_of(out_dir, "scalars", rank)
    assert [(r["step"], r["module_name"], r["scope"]) for r in scalars] == [
        (str(s), "train_loss", "scalars") for s in range(STEPS)]
    for r in scalars:
        loss = module.losses[(int(r["step"]) + 1) * ACC - 1].item()
        as_fp32 = [torch.tensor(float(r[op]), dtype=torch.float32).item() for op in ("min", "max", "mean", "norm")]
        assert as_fp32 == [loss, loss, loss, abs(loss)], (r, loss)
        assert r["nans"] == "0"
    evaluated = [r for r in module_rows if r["module_name"] == "net.0.input.0" and r["scope"] == "eval_forward"]
    # Validation after steps 1..6 runs in monitor steps 1..6; step 6 never ends.
    assert [r["step"] for r in evaluated] == [str(s) for s in range(1, STEPS)], evaluated
    assert all(float(r["min"]) >= VAL_OFFSET for r in evaluated)


CONFIG_MONITORS = {"weight_grad": {"enabled": True}, "module": {"enabled": True, "targets": ["net.0"]},
                   "optimizer": {"enabled": True}, "param": {"enabled": True}}
