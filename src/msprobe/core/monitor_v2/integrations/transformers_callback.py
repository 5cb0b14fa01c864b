"""Hugging Face ``transformers.Trainer``: ``MonitorTrainerCallback``.

>>> trainer = Trainer(model=model, args=args, ..., callbacks=[MonitorTrainerCallback("monitor_v2_config.json")])
"""

import logging
import sys
from typing import Any, Optional

from ..patching import Patch, replace_attribute
from ._common import ConfigSource, FrameworkStepMonitor, deepspeed_engine, require, torch_ddp

logger = logging.getLogger("msprobe.monitor_v2")

_transformers = require("transformers", "transformers", "MonitorTrainerCallback")


# The Trainer's log entries written as scalars rows (its training logs; evaluation ones are
# named eval_*, the end-of-training summary train_*).
SCALARS_LOGGED = ("loss", "grad_norm")


class MonitorTrainerCallback(_transformers.TrainerCallback):
    """Monitors a ``transformers.Trainer`` run.

    - ``on_train_begin``: the model and the optimizer exist, wrapped by the Trainer
      (Accelerate's ``AcceleratedOptimizer``; the monitor hooks the optimizer it wraps):
      the monitor starts at the Trainer's global step with its
      ``gradient_accumulation_steps``. Under DeepSpeed it starts on the engine
      (``trainer.deepspeed``), whose module is the Trainer's model; under FSDP the
      Trainer's model is already the wrapped one.
    - ``on_step_end``: the monitor's step follows ``state.global_step``.
    - ``on_log``: the Trainer's ``loss`` and ``grad_norm`` (``SCALARS_LOGGED``) become
      ``scalars`` rows of the step that just ended (``state.global_step - 1`` in the
      monitor's numbering: the Trainer's log entry of ``"step": N`` is the monitor's step
      ``N - 1``), as the Trainer logs them: ``loss`` is the mean over the
      ``logging_steps`` steps since the last log; written when that step is written.
    - ``on_train_end`` stops the monitor; an exception out of ``trainer.train()`` stops it
      too when the callback was given to the Trainer's constructor (the Trainer has no
      callback event for exceptions, so its ``train`` is wrapped at instance level, from
      the end of the Trainer's ``__init__`` until the callback stops the monitor: the
      instance is then exactly as before; a later ``train()`` is not wrapped again).
    - Evaluation runs (``model.eval()`` under ``no_grad``) are not merged into the
      training steps' ``module`` rows.
    """

    def __init__(self, config: ConfigSource, fr: Optional[str] = None) -> None:
        super().__init__()
        self.driver = FrameworkStepMonitor(config, fr, integration="MonitorTrainerCallback")
        self._guarded: Any = None
        self._train_patch = Patch()

    @property
    def monitor(self) -> Any:
        """The running ``TrainerMonitorV2`` (None outside ``trainer.train()``)."""
        return self.driver.monitor

    # The Trainer calls on_init_end at the end of its __init__: find it on the stack.
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _calling_trainer()
        if trainer is not None and self._guarded is not trainer:
            self._train_patch.remove()
            self._train_patch = replace_attribute(
                trainer, "train", _StopOnException(trainer.train, self.driver, self._unguard),
                keep_out_of_copies=True, if_replaced=_train_replaced)
            self._guarded = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if model is None or optimizer is None:
            logger.warning("monitor_v2 MonitorTrainerCallback: the Trainer gave no model/optimizer at "
                           "on_train_begin; nothing is monitored")
            return
        if self._guarded is not None and not self._train_patch.installed:
            logger.info("monitor_v2 MonitorTrainerCallback: trainer.train() called again after the monitor stopped; "
                        "the monitor stops at the end of training but not on an exception")
        elif self._guarded is None:
            logger.info("monitor_v2 MonitorTrainerCallback: added after the Trainer was built; the monitor "
                        "stops at the end of training but not on an exception (pass it in Trainer(callbacks=[...]))")
        # Under DeepSpeed the callback gets the bare model and Accelerate's wrapper of the
        # ZeRO optimizer; the engine (trainer.deepspeed) is what the monitor reads through.
        trainer = _calling_trainer() or self._guarded
        engine = deepspeed_engine(getattr(trainer, "deepspeed", None), getattr(trainer, "model_wrapped", None))
        if engine is not None and getattr(engine, "module", None) is model:
            model = engine
        # several processes: model_wrapped is torch's DDP around model
        self.driver.start(model, optimizer, global_step=state.global_step,
                          grad_acc_steps=args.gradient_accumulation_steps,
                          **torch_ddp(getattr(trainer, "model_wrapped", None)))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.driver.sync(state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and self.driver.running and state.global_step > 0:
            self.driver.log_scalars(state.global_step - 1, {k: logs[k] for k in SCALARS_LOGGED if k in logs})

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.driver.sync(state.global_step)
        self.driver.stop()
        self._unguard()

    def _unguard(self) -> None:
        """Put ``trainer.train`` back as it was before the callback wrapped it."""
        self._train_patch.remove()


class _StopOnException:
    """``trainer.train`` that stops the monitor when an exception leaves it (and then
    takes itself off the trainer with ``unguard``)."""

    __slots__ = ("original", "driver", "unguard")

    def __init__(self, original: Any, driver: FrameworkStepMonitor, unguard: Any) -> None:
        self.original = original
        self.driver = driver
        self.unguard = unguard

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.original(*args, **kwargs)
        except BaseException:
            try:
                self.driver.stop()
            except Exception as exc:  # noqa: BLE001 - the training error is the one to raise
                logger.error("monitor_v2 MonitorTrainerCallback: stopping after an exception failed: %r", exc)
            self.unguard()
            raise


def _train_replaced() -> None:
    logger.warning("monitor_v2 MonitorTrainerCallback: trainer.train was replaced after the callback wrapped it; "
                   "left as it is")


def _calling_trainer() -> Any:
    """The ``transformers.Trainer`` whose method is on the call stack (the callback's own
    frames and the callback handler's are a few levels down)."""
    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, _transformers.Trainer):
            return candidate
        frame = frame.f_back
    return None
