"""Worker for test_trainer_deepspeed.py, run by torchrun with 2 gloo ranks on the CPU
(``DS_ACCELERATOR=cpu``):

    trainer_deepspeed_worker.py OUT_DIR STAGE [STAGE ...]

For each ZeRO stage the same model is trained three times by ``transformers.Trainer`` with
``TrainingArguments(deepspeed=...)`` (gradient accumulation 2, clipping): with
``MonitorTrainerCallback`` (wired as docs/integrations.md shows) and, in the same run, a
plain ``TrainerMonitorV2`` started on what a callback receives (the bare model and
Accelerate's ``DeepSpeedOptimizerWrapper``), then once without any monitor. Each rank saves
``OUT_DIR/z<STAGE>/ref_rank<r>.pt`` with the independent references:

- ``mb``: each micro-batch's local gradient, from ``torch.autograd.grad`` on a plain torch
  replica loaded with the model's full weights at the step's start and fed the
  micro-batch the model saw (loss / gas, as the Trainer scales it under DeepSpeed);
  ``mean``: the rank average of their sums, in fp64 (all-gathered);
- ``ds``: fp32 masters and Adam moments after each step through DeepSpeed's public
  ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``;
- ``logged``: ``(step, grad_norm)`` of the Trainer's own ``log_history``;
- ``foreign_warnings``: what a monitor started on another model with this optimizer logged;
- ``identical``: losses and final weights equal the unmonitored run's bit for bit;
  ``warnings``: what the monitors logged at WARNING; ``restored``: nothing left on the engine.

Then Accelerate's DeepSpeed plugin (ZeRO-2) in a hand-written loop with
``AccelerateMonitor``, trained with and without it: ``OUT_DIR/accelerate/ref_rank<r>.pt``
holds the same kind of replica references (``mb``, ``mean``) and ``seen``, the monitor's
step after each synchronised step.
"""

import logging
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from accelerate.state import AcceleratorState, GradientState, PartialState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

from msprobe.core.monitor_v2.integrations import AccelerateMonitor, MonitorTrainerCallback  # noqa: E402
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

STEPS, GAS, BATCH, CLIP, LR = 3, 2, 2, 0.05, 1e-2


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 10)
        self.fc2 = torch.nn.Linear(10, 3)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))), labels)}


def data():
    g = torch.Generator().manual_seed(1)
    n = STEPS * GAS * BATCH * 2
    return [{"x": torch.randn(6, generator=g), "labels": torch.randn(3, generator=g)} for _ in range(n)]


def ds_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
            "zero_optimization": {"stage": stage}, "fp16": {"enabled": False}, "bf16": {"enabled": False},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}}, "steps_per_print": 10 ** 9}


def full_weights(engine, stage: int):
    params = list(engine.module.named_parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {n: p.detach().clone() for n, p in params}
    return {n: p.detach().clone() for n, p in params}


class Reference(transformers.TrainerCallback):
    """Full weights at each step's start; DeepSpeed's own view of masters and moments at
    each step's end (collectives: every rank runs them at the same point)."""

    def __init__(self, stage: int) -> None:
        self.stage, self.weights, self.ds, self.trainer = stage, [], [], None
        self.optimizer = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.weights.append(full_weights(self.trainer.deepspeed, self.stage))

    def on_step_end(self, args, state, control, **kwargs):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        out = {}
        for n, p in self.trainer.deepspeed.module.named_parameters():
            out[n] = safe_get_full_fp32_param(p).detach().float().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{n}.{key}"] = safe_get_full_optimizer_state(p, key).detach().float().clone()
        self.ds.append(out)


class PlainStart(transformers.TrainerCallback):
    """``TrainerMonitorV2`` started on what the Trainer hands a callback: the bare model and
    the optimizer wrapper, not the engine (the monitor has to find it). Its own step hook
    ends its steps; stopped after the last step, before the callback's monitor stops."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.mon = out_dir, None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.mon = TrainerMonitorV2({"output_dir": self.out_dir, "monitors": {
            "weight_grad": {"enabled": True, "monitor_mbs_grad": True}, "param": {"enabled": True},
            "optimizer": {"enabled": True}}})
        self.mon.start(model, optimizer)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == STEPS:
            self.mon.stop()


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def train(stage: int, out_dir: str, monitored: bool):
    # one Accelerator per Trainer: the previous run's state (and DeepSpeed plugin) goes
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    torch.manual_seed(0)
    model = Net()
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out_dir, "hf"), max_steps=STEPS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=GAS, max_grad_norm=CLIP, learning_rate=LR, logging_steps=1, save_strategy="no",
        report_to=[], seed=0, data_seed=0, disable_tqdm=True, deepspeed=ds_config(stage), ddp_backend="gloo",
        dataloader_num_workers=0, accelerator_config={"use_configured_state": True})
    ref = Reference(stage)
    callbacks = [ref]
    if monitored:
        callbacks += [MonitorTrainerCallback({"output_dir": os.path.join(out_dir, "callback"), "monitors": {
            "weight_grad": {"enabled": True, "monitor_mbs_grad": True}, "param": {"enabled": True},
            "optimizer": {"enabled": True}, "module": {"enabled": True, "targets": ["fc1"]}}}),
            PlainStart(os.path.join(out_dir, "plain"))]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data(), callbacks=callbacks)
    ref.trainer = trainer
    inputs, losses = {}, []
    model.register_forward_pre_hook(
        lambda m, a, kw: inputs.setdefault(trainer.state.global_step, []).append(
            (kw["x"].clone(), kw["labels"].clone())), with_kwargs=True)
    model.register_forward_hook(lambda m, a, kw, out: losses.append(out["loss"].detach().clone()), with_kwargs=True)
    trainer.train()
    engine = trainer.deepspeed
    restored = not {"_take_model_step", "step", "__getstate__"} & set(vars(engine))
    final = {"losses": losses, "weights": full_weights(engine, stage)}
    logged = [(h["step"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]
    ref.optimizer = trainer.optimizer
    return ref, inputs, final, logged, restored, type(engine.optimizer).__name__


def start_on_a_foreign_model(optimizer, out_dir: str):
    """A monitor on a model the engine does not train, with the engine's optimizer
    wrapper: what it logs at WARNING."""
    capture = Capture()
    logging.getLogger("msprobe.monitor_v2").addHandler(capture)
    foreign = TrainerMonitorV2({"output_dir": os.path.join(out_dir, "foreign"), "monitors": {
        "weight_grad": {"enabled": True}, "param": {"enabled": True}, "optimizer": {"enabled": True}}})
    foreign.start(Net(), optimizer)
    foreign.step()
    foreign.stop()
    logging.getLogger("msprobe.monitor_v2").removeHandler(capture)
    return capture.messages


def references(ref: Reference, inputs, names):
    replica = Net()
    mb_all, acc_all = [], []
    for step in range(STEPS):
        replica.load_state_dict(ref.weights[step])
        mbs = []
        for x, y in inputs[step]:
            loss = replica(x, y)["loss"] / GAS
            mbs.append({n: g.detach().clone() for n, g in zip(names, torch.autograd.grad(loss,
                                                                                        list(replica.parameters())))})
        mb_all.append(mbs)
        acc_all.append({n: sum(m[n] for m in mbs) for n in names})
    gathered = [None, None]
    dist.all_gather_object(gathered, [{n: t.double() for n, t in a.items()} for a in acc_all])
    mean = [{n: (gathered[0][s][n] + gathered[1][s][n]) / 2 for n in names} for s in range(STEPS)]
    return mb_all, mean


def accelerate_run(out_dir, monitored: bool):
    """Accelerate's DeepSpeed plugin (ZeRO-2) in a hand-written loop with
    ``AccelerateMonitor``, given ``accelerator.unwrap_model(model)`` (the bare model): the
    helper monitors through ``accelerator.deepspeed_engine_wrapped.engine``."""
    import accelerate
    from accelerate.utils import DeepSpeedPlugin

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    config = dict(ds_config(2), train_micro_batch_size_per_gpu=BATCH)
    config.pop("optimizer")
    accelerator = accelerate.Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config),
                                         gradient_accumulation_steps=GAS)
    torch.manual_seed(0)
    model = Net()
    engine, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    batches = [[(torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)) for _ in range(GAS)]
               for _ in range(STEPS)]
    weights, losses, seen, helper = [], [], [], None
    if monitored:
        helper = AccelerateMonitor({"output_dir": out_dir, "monitors": {
            "weight_grad": {"enabled": True, "monitor_mbs_grad": True}, "param": {"enabled": True},
            "optimizer": {"enabled": True}}}, accelerator, accelerator.unwrap_model(engine), optimizer)
    try:
        for step in range(STEPS):
            weights.append({n: p.detach().clone() for n, p in engine.module.named_parameters()})
            for x, y in batches[step]:
                with accelerator.accumulate(engine):
                    loss = engine(x, y)["loss"]
                    losses.append(loss.detach().clone())
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
            if helper is not None:
                seen.append(helper.monitor.current_step)
    finally:
        if helper is not None:
            helper.stop()
    final = {"losses": losses, "weights": {n: p.detach().clone() for n, p in engine.module.named_parameters()}}
    return batches, weights, final, seen, type(engine).__name__


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


def main() -> None:
    out_root, stages = sys.argv[1], [int(s) for s in sys.argv[2:]]
    deepspeed.init_distributed(dist_backend="gloo")
    # accelerate 1.15 sees one process without a GPU: a pre-configured DeepSpeed state lets
    # the Trainer run both ranks (TrainingArguments' use_configured_state).
    PartialState(backend="gloo").distributed_type = DistributedType.DEEPSPEED
    rank = dist.get_rank()
    for stage in stages:
        out_dir = os.path.join(out_root, f"z{stage}")
        os.makedirs(out_dir, exist_ok=True)
        capture = Capture()
        logging.getLogger("msprobe.monitor_v2").addHandler(capture)
        ref, inputs, final, logged, restored, kind = train(stage, out_dir, monitored=True)
        logging.getLogger("msprobe.monitor_v2").removeHandler(capture)
        foreign_warnings = start_on_a_foreign_model(ref.optimizer, out_dir)
        _, _, plain, _, _, _ = train(stage, out_dir, monitored=False)
        names = list(ref.weights[0])
        mb, mean = references(ref, inputs, names)
        torch.save({"names": names, "kind": kind, "mb": mb, "mean": mean, "ds": ref.ds, "logged": logged,
                    "identical": same(final, plain), "restored": restored, "warnings": capture.messages,
                    "foreign_warnings": foreign_warnings,
                    "micro_batches": [len(inputs[s]) for s in range(STEPS)]},
                   os.path.join(out_dir, f"ref_rank{rank}.pt"))
    out_dir = os.path.join(out_root, "accelerate")
    os.makedirs(out_dir, exist_ok=True)
    capture = Capture()
    logging.getLogger("msprobe.monitor_v2").addHandler(capture)
    batches, weights, final, seen, model_kind = accelerate_run(out_dir, monitored=True)
    logging.getLogger("msprobe.monitor_v2").removeHandler(capture)
    _, _, plain, _, _ = accelerate_run(None, monitored=False)
    replica = Net()
    names = list(weights[0])
    mb, acc = [], []
    for step in range(STEPS):
        replica.load_state_dict(weights[step])
        grads = [dict(zip(names, torch.autograd.grad(replica(x, y)["loss"] / GAS, list(replica.parameters()))))
                 for x, y in batches[step]]
        mb.append(grads)
        acc.append({n: sum(g[n] for g in grads) for n in names})
    gathered = [None, None]
    dist.all_gather_object(gathered, [{n: t.double() for n, t in a.items()} for a in acc])
    mean = [{n: (gathered[0][s][n] + gathered[1][s][n]) / 2 for n in names} for s in range(STEPS)]
    torch.save({"names": names, "mb": mb, "mean": mean, "seen": seen, "model_kind": model_kind,
                "identical": same(final, plain), "warnings": capture.messages},
               os.path.join(out_dir, f"ref_rank{rank}.pt"))
    dist.barrier()


if __name__ == "__main__":
    main()
    from support import finish

    finish()
