"""Evaluation passes between training steps (issue 12, item 6).

Lightning and the Hugging Face Trainer run validation loops between optimizer steps,
with ``model.eval()`` and ``torch.no_grad()`` / ``torch.inference_mode()``. Their
forward rows go under scope ``eval_forward`` of the step the monitor is in, never into
the training step's ``forward``/``backward`` rows, and the spike alert does not flag
them, even when the evaluation data are on another scale. Every value is checked
against NumPy statistics of copies of the tensors the model saw.
"""

import contextlib
import copy
import logging

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from support import TinyMLP, assert_row_matches, find_row, loss_fn, make_batches, numpy_stats, rows_of
from support.extras import needs
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

LOGGER = "msprobe.monitor_v2"
STEPS = 6
EVAL_BATCHES = 3


class CheckpointedMLP(TinyMLP):
    """``fc2`` under reentrant activation checkpointing when training (as Hugging Face
    models do): its training forward runs under ``no_grad`` inside the training pass, and
    must still count as training."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        if self.training and torch.is_grad_enabled():
            return checkpoint(self.fc2, h, use_reentrant=True)
        return self.fc2(h)


def evaluation(kind: str):
    if kind == "eval+no_grad":
        return torch.no_grad()
    if kind == "eval+inference_mode":
        return torch.inference_mode()
    if kind == "train+no_grad":
        return torch.no_grad()
    return contextlib.nullcontext()  # "eval, gradients on": a loop that forgot no_grad


def alerts(caplog):
    return [r.getMessage() for r in caplog.records if "monitor_v2 alert:" in r.getMessage()]


@pytest.mark.parametrize("kind", ["eval+no_grad", "eval+inference_mode", "train+no_grad", "eval+grad"])
def test_evaluation_loops_between_steps_are_kept_apart(write_config, caplog, kind):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    model = CheckpointedMLP()
    twin = copy.deepcopy(model)  # never monitored: the training must not change
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.01)
    cfg = {"alert": {"spike_factor": 5, "spike_warmup": 3},
           "monitors": {"module": {"enabled": True}, "weight_grad": {"enabled": True}}}
    mon = TrainerMonitorV2(write_config(cfg))
    mon.start(model=model, optimizer=opt)
    train = make_batches(STEPS, seed=3)
    val = [(x * 1000.0, y) for x, y in make_batches(EVAL_BATCHES, seed=4)]  # another scale: would spike
    eval_outputs = {}  # step the monitor is in -> outputs of its evaluation loop
    for s, (x, y) in enumerate(train):
        for m in (model, twin):
            m.train()
            m.fc1.eval()  # a frozen submodule kept in eval mode: still training
        loss = loss_fn(model, x, y)
        loss.backward()
        twin_loss = loss_fn(twin, x, y)
        twin_loss.backward()
        assert torch.equal(loss, twin_loss)
        opt.step()  # ends step s
        opt.zero_grad()
        twin_opt.step()
        twin_opt.zero_grad()
        if s < STEPS - 1:  # an evaluation after the last step would belong to a step never written
            model.train(kind.startswith("train"))
            outs = []
            with evaluation(kind):
                for vx, _ in val:
                    outs.append(model(vx).detach().clone())
            eval_outputs[s + 1] = outs
    mon.stop()
    assert mon.errors.count == 0
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)

    rows = rows_of(mon.config.output_dir, "module")
    for s, (x, _) in enumerate(train):
        step_rows = [r for r in rows if r["step"] == str(s)]
        # training rows: the training batch alone (an evaluation merged in would change them)
        assert_row_matches(find_row(step_rows, module_name="fc1.input.0", scope="forward"), numpy_stats(x))
        assert_row_matches(find_row(step_rows, module_name="CheckpointedMLP.input.0", scope="forward"), numpy_stats(x))
        assert {r["scope"] for r in step_rows} == ({"forward", "backward", "eval_forward"} if s in eval_outputs
                                                   else {"forward", "backward"})
        forward_tags = {r["module_name"] for r in step_rows if r["scope"] == "forward"}
        assert {"fc1.output.0", "act.input.0", "fc2.output.0", "CheckpointedMLP.output.0"} <= forward_tags
        if s not in eval_outputs:
            continue
        # evaluation rows: every batch of the loop, together
        inputs = torch.cat([vx for vx, _ in val])
        outputs = torch.cat(eval_outputs[s])
        for tag, want in (("CheckpointedMLP.input.0", inputs), ("fc1.input.0", inputs),
                          ("fc2.output.0", outputs), ("CheckpointedMLP.output.0", outputs)):
            assert_row_matches(find_row(step_rows, module_name=tag, scope="eval_forward"), numpy_stats(want),
                               rtol=1e-5, atol=1e-4)
    spikes = [m for m in alerts(caplog) if "spike" in m]
    assert not spikes, spikes


class LightningStyle(TinyMLP):
    """As a LightningModule: the loop calls ``training_step``/``validation_step``, which
    call the submodules; the model itself is never called."""

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        out = checkpoint(self.fc2, h, use_reentrant=True)  # trains under no_grad inside
        return torch.nn.functional.mse_loss(out, y)

    def validation_step(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("grad_off", [torch.inference_mode, torch.no_grad])
def test_lightning_style_steps_that_call_submodules(write_config, grad_off):
    model = LightningStyle()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True}}}))
    mon.start(model=model, optimizer=opt)
    train = make_batches(3, seed=5)
    val = [x * 100.0 for x, _ in make_batches(2, seed=6)]
    for s, (x, y) in enumerate(train):
        model.train()  # what Lightning does around the loops
        model.fc1.eval()
        model.training_step(x, y).backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        with grad_off():
            for vx in val:
                model.validation_step(vx)
    mon.stop()
    assert mon.errors.count == 0
    rows = rows_of(mon.config.output_dir, "module")
    assert not [r for r in rows if r["module_name"].startswith("LightningStyle")]  # never called
    for s, (x, _) in enumerate(train):
        step_rows = [r for r in rows if r["step"] == str(s)]
        assert_row_matches(find_row(step_rows, module_name="fc1.input.0", scope="forward"), numpy_stats(x))
        assert {r["module_name"] for r in step_rows if r["scope"] == "forward"} == {
            "fc1.input.0", "fc1.output.0", "act.input.0", "act.output.0", "fc2.input.0", "fc2.output.0"}
        assert any(r["scope"] == "backward" for r in step_rows)
        if s:
            assert_row_matches(find_row(step_rows, module_name="fc1.input.0", scope="eval_forward"),
                               numpy_stats(torch.cat(val)))
        else:
            assert not [r for r in step_rows if r["scope"] == "eval_forward"]


def test_nonfinite_values_in_an_evaluation_pass_are_still_alerted(write_config, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    model = TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMonitorV2(write_config({"alert": True, "monitors": {"module": {"enabled": True, "targets": ["fc2"]}}}))
    mon.start(model=model, optimizer=opt)
    x, y = make_batches(1)[0]
    loss_fn(model, x, y).backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        model(x * float("nan"))
    model.train()
    loss_fn(model, x, y).backward()
    opt.step()
    mon.stop()
    messages = alerts(caplog)
    assert messages and "step 1" in messages[0] and "fc2.input.0 (scope eval_forward" in messages[0], messages


class FailsOnEmpty(TinyMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if x.shape[0] == 0:
            raise ValueError("empty batch")
        return out


def test_an_evaluation_pass_that_raises_does_not_mark_the_next_training_pass(write_config):
    model = FailsOnEmpty()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True}}, "patch_optimizer_step": False}))
    mon.start(model=model, optimizer=opt)
    x, y = make_batches(1)[0]
    model.eval()
    with torch.no_grad(), pytest.raises(ValueError):
        model(x[:0])
    model.train()
    loss_fn(model, x, y).backward()  # same step: its rows must be training rows
    opt.step()
    mon.step()
    mon.stop()
    rows = rows_of(mon.config.output_dir, "module")
    assert_row_matches(find_row(rows, step=0, module_name="FailsOnEmpty.input.0", scope="forward"), numpy_stats(x))
    assert_row_matches(find_row(rows, step=0, module_name="fc1.input.0", scope="eval_forward"), numpy_stats(x[:0]))


@needs("lightning", "this test runs a real lightning.Trainer with validation loops")
def test_real_lightning_trainer_validation_loops(write_config, caplog):
    """A real ``lightning.Trainer``: validation every 2 training steps (under ``eval()``
    and ``inference_mode``, data on another scale), the monitor started and stopped by a
    callback as a user would."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    caplog.set_level(logging.WARNING, logger=LOGGER)
    train_x, train_y = (torch.cat(t) for t in zip(*make_batches(4, seed=21)))
    val_x, val_y = (torch.cat(t) for t in zip(*make_batches(2, seed=22)))
    val_x = val_x * 1000.0
    mon = TrainerMonitorV2(write_config({"alert": {"spike_factor": 5, "spike_warmup": 1},
                                         "monitors": {"module": {"enabled": True}}}))
    seen = {"train": {}, "val": {}}  # monitor step -> inputs the model saw

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyMLP()

        def training_step(self, batch, batch_idx):
            x, y = batch
            seen["train"][mon.current_step] = x.clone()
            return torch.nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            x, _ = batch
            seen["val"].setdefault(mon.current_step, []).append(x.clone())
            self.net(x)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class StartStop(L.Callback):
        def on_train_start(self, trainer, pl_module):
            mon.start(model=pl_module, optimizer=trainer.optimizers[0])

        def on_train_end(self, trainer, pl_module):
            mon.stop()

    trainer = L.Trainer(max_steps=4, val_check_interval=2, limit_val_batches=2, num_sanity_val_steps=0,
                        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[StartStop()])
    trainer.fit(Lit(), DataLoader(TensorDataset(train_x, train_y), batch_size=4),
                DataLoader(TensorDataset(val_x, val_y), batch_size=4))
    assert mon.errors.count == 0
    rows = rows_of(mon.config.output_dir, "module")
    assert sorted(seen["train"]) == [0, 1, 2, 3] and sorted(seen["val"]) == [2, 4]
    for s, x in seen["train"].items():
        assert_row_matches(find_row(rows, step=s, module_name="net.fc1.input.0", scope="forward"), numpy_stats(x))
    # step 4 never ends (training stops after step 3): its evaluation is not written
    assert_row_matches(find_row(rows, step=2, module_name="net.fc1.input.0", scope="eval_forward"),
                       numpy_stats(torch.cat(seen["val"][2])), atol=1e-4)
    assert {r["step"] for r in rows if r["scope"] == "eval_forward"} == {"2"}
    spikes = [m for m in alerts(caplog) if "spike" in m]
    assert not spikes, spikes


@needs("transformers", "this test runs a real transformers.Trainer evaluating a tiny GPT-2 built from a config")
def test_real_huggingface_trainer_evaluation(write_config):
    """A real ``transformers.Trainer`` (tiny GPT-2 from a config) evaluating every 2
    steps (``model.eval()`` + ``torch.no_grad()``); the monitor driven by a callback."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    g = torch.Generator().manual_seed(1)
    train = [{"input_ids": torch.randint(0, 50, (8,), generator=g)} for _ in range(8)]
    val = [{"input_ids": torch.randint(0, 50, (8,), generator=g)} for _ in range(4)]
    for example in train + val:
        example["labels"] = example["input_ids"]
    mon = TrainerMonitorV2(write_config({"patch_optimizer_step": False,
                                         "monitors": {"module": {"enabled": True, "targets": ["wte"]}}}))
    seen = {}  # (monitor step, training?) -> token ids the embedding received
    model.transformer.wte.register_forward_pre_hook(
        lambda m, args: seen.setdefault((mon.current_step, torch.is_grad_enabled()), []).append(args[0].clone()))

    class Drive(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            mon.start(model=model)

        def on_step_end(self, args, state, control, **kwargs):
            mon.step()

        def on_train_end(self, args, state, control, **kwargs):
            mon.stop()

    args = TrainingArguments(output_dir=str(mon.config.output_dir) + "/hf", max_steps=4, per_device_train_batch_size=2,
                             per_device_eval_batch_size=2, eval_strategy="steps", eval_steps=2, save_strategy="no",
                             report_to=[], use_cpu=True, logging_strategy="no", disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=train, eval_dataset=val, callbacks=[Drive()]).train()
    assert mon.errors.count == 0
    rows = rows_of(mon.config.output_dir, "module")
    assert sorted(k for k in seen) == [(0, True), (1, True), (2, False), (2, True), (3, True), (4, False)]
    for (step, training), ids in seen.items():
        if step == 4:  # after the last step: never written
            continue
        scope = "forward" if training else "eval_forward"
        assert_row_matches(find_row(rows, step=step, module_name="transformer.wte.input.0", scope=scope),
                           numpy_stats(torch.cat(ids)))
    assert {r["step"] for r in rows if r["scope"] == "eval_forward"} == {"2"}
