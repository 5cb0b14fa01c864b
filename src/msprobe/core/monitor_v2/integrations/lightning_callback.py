"""Lightning: ``MonitorLightningCallback``.

>>> trainer = L.Trainer(..., callbacks=[MonitorLightningCallback("monitor_v2_config.json")])

Works with ``lightning`` (``lightning.pytorch``) or, if that is not installed, the older
``pytorch_lightning`` package.
"""

import importlib
import logging
from typing import Any, Optional

from ..analysis.command import pip_command
from ..errors import MissingDependencyError
from ._common import ConfigSource, FrameworkStepMonitor, deepspeed_engine, require, torch_ddp

logger = logging.getLogger("msprobe.monitor_v2")


def _lightning() -> Any:
    try:
        return importlib.import_module("lightning.pytorch")
    except ImportError:
        pass
    try:
        return require("pytorch_lightning", "lightning", "MonitorLightningCallback")
    except MissingDependencyError:
        raise MissingDependencyError(
            "msprobe-monitor's MonitorLightningCallback needs Lightning, which is not installed "
            f"(neither 'lightning.pytorch' nor 'pytorch_lightning' imports); install it with: {pip_command('lightning')}"
        ) from None


_pl = _lightning()


# The logged metrics written as scalars rows.
SCALARS_LOGGED = ("loss", "train_loss")


class MonitorLightningCallback(_pl.Callback):
    """Monitors a Lightning ``Trainer.fit`` run.

    - ``on_train_start``: the strategy has built the optimizer and wrapped the model
      (DDP...): the monitor starts on the ``LightningModule`` (names as in the user's
      module) and ``trainer.optimizers[0]`` at ``trainer.global_step``, with
      ``accumulate_grad_batches``; under ``DeepSpeedStrategy`` on the engine
      (``trainer.strategy.model``), names still the module's. The sanity-check validation before it is not monitored.
    - ``on_train_batch_end``: the monitor's step follows ``trainer.global_step``. When a
      step ends there, the metrics the module logged named ``loss`` or ``train_loss``
      (``SCALARS_LOGGED``, as ``trainer.callback_metrics`` holds them: the value logged
      last, with gradient accumulation the last micro-batch's) become ``scalars`` rows of
      that step (``trainer.global_step - 1``); tensors are not read until the step's
      other statistics are.
      With gradient accumulation Lightning runs the last micro-batch's
      forward/backward and the clipping inside ``optimizer.step(closure)``: ``reduced``
      is read after that closure, before the update.
    - ``on_train_end``, ``on_exception`` and ``teardown`` stop the monitor.
    - Validation (``model.eval()`` under ``inference_mode``) is not merged into the
      training steps' ``module`` rows.
    """

    def __init__(self, config: ConfigSource, fr: Optional[str] = None) -> None:
        super().__init__()
        self.driver = FrameworkStepMonitor(config, fr, integration="MonitorLightningCallback")

    @property
    def monitor(self) -> Any:
        """The running ``TrainerMonitorV2`` (None outside ``trainer.fit()``)."""
        return self.driver.monitor

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = list(trainer.optimizers)
        if not optimizers:
            logger.warning("monitor_v2 MonitorLightningCallback: the Trainer has no optimizer; nothing is monitored")
            return
        if len(optimizers) > 1:
            logger.warning("monitor_v2 MonitorLightningCallback: %d optimizers; only the first one is monitored",
                           len(optimizers))
        # DeepSpeedStrategy: the engine (strategy.model, whose module is pl_module) holds the
        # ZeRO partitions and the real step.
        model = deepspeed_engine(getattr(trainer.strategy, "model", None)) or pl_module
        # DDPStrategy: strategy.model is torch's DDP around (a wrapper of) pl_module
        self.driver.start(model, optimizers[0], global_step=trainer.global_step,
                          grad_acc_steps=trainer.accumulate_grad_batches,
                          **torch_ddp(getattr(trainer.strategy, "model", None)))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.driver.sync(trainer.global_step):
            metrics = trainer.callback_metrics
            self.driver.log_scalars(trainer.global_step - 1,
                                    {k: metrics[k] for k in SCALARS_LOGGED if k in metrics})

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.driver.sync(trainer.global_step)
        self.driver.stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.driver.stop()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.driver.stop()
