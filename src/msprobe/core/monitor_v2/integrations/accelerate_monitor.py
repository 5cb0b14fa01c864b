"""Accelerate: ``AccelerateMonitor``.

>>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
>>> with AccelerateMonitor("monitor_v2_config.json", accelerator, model, optimizer):
...     train(...)  # the usual loop: accelerator.accumulate / backward / optimizer.step()
"""

import logging
from typing import Any, Optional

from ..errors import ConfigError
from ..patching import wrap_method
from ._common import ConfigSource, FrameworkStepMonitor, deepspeed_engine, require

logger = logging.getLogger("msprobe.monitor_v2")

_accelerate = require("accelerate", "accelerate", "AccelerateMonitor")


class AccelerateMonitor:
    """Monitors a loop written with Accelerate, from ``accelerator.prepare``'s objects.

    ``AcceleratedOptimizer.step()`` runs on every micro-batch and steps the optimizer it
    wraps only when gradients are synchronised (``accelerator.sync_gradients``); each such
    call ends one monitor step, whether or not a gradient scaler skipped the update, so
    that the monitor counts the steps a loop counts with ``if accelerator.sync_gradients``.
    The gradient-accumulation setting is taken from the accelerator.

    Starts when built; ``stop()`` (or leaving the ``with`` block, on an exception too)
    removes everything it installed."""

    def __init__(self, config: ConfigSource, accelerator: Any, model: Any, optimizer: Any,
                 fr: Optional[str] = None, global_step: int = 0) -> None:
        if not isinstance(optimizer, _accelerate.optimizer.AcceleratedOptimizer):
            raise ConfigError(
                f"AccelerateMonitor: optimizer must be the AcceleratedOptimizer returned by accelerator.prepare(), "
                f"got {type(optimizer).__name__}", field="optimizer")
        self.driver = FrameworkStepMonitor(config, fr, integration="AccelerateMonitor")
        # With the DeepSpeed plugin prepare() returns the engine; a model unwrapped from it
        # (accelerator.unwrap_model) is monitored through that engine.
        wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
        engine = deepspeed_engine(getattr(wrapped, "engine", None))
        if engine is not None and model is not engine and getattr(engine, "module", None) is model:
            model = engine
        self._steps = int(global_step)
        self.driver.start(model, optimizer, global_step=self._steps,
                          grad_acc_steps=accelerator.gradient_accumulation_steps)
        gradient_state = optimizer.gradient_state
        self._patch = wrap_method(optimizer, "step", _nothing, self._after_step,
                                  when=lambda: gradient_state.sync_gradients)

    @property
    def monitor(self) -> Any:
        """The running ``TrainerMonitorV2`` (None once stopped)."""
        return self.driver.monitor

    def _after_step(self) -> None:
        self._steps += 1
        try:
            self.driver.sync(self._steps)
        except Exception as exc:  # noqa: BLE001 - never into the training loop
            logger.error("monitor_v2 AccelerateMonitor: ending step %d failed: %r", self._steps - 1, exc)

    def stop(self) -> None:
        """Remove the step wrapper and stop the monitor; harmless twice."""
        self._patch.remove()
        self.driver.stop()

    def __enter__(self) -> "AccelerateMonitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _nothing() -> None:
    pass
