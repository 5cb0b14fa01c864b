"""What the framework integrations share: a ``TrainerMonitorV2`` whose steps follow the
framework's own step counter, and the lazy import of the framework."""

import dataclasses
import importlib
import logging
import numbers
import os
from typing import Any, Dict, Mapping, Optional, Union

from ..analysis.command import pip_command
from ..backend import DATA_PARALLEL_WRAPPER
from ..errors import MissingDependencyError
from ..logonce import LogOnce
from ..trainer import TrainerMonitorV2

logger = logging.getLogger("msprobe.monitor_v2")

ConfigSource = Union[str, "os.PathLike[str]", Mapping[str, Any]]


def require(module: str, package: str, integration: str) -> Any:
    """Import ``module`` or raise ``MissingDependencyError`` naming what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"msprobe-monitor's {integration} needs the package '{package}', which is not installed "
            f"(import {module!r} failed: {exc}); install it with: {pip_command(package)}"
        ) from exc


def deepspeed_engine(*candidates: Any) -> Any:
    """The first of ``candidates`` that is a ``DeepSpeedEngine`` (None if none is). The
    frameworks keep the engine next to the bare model (``trainer.deepspeed``,
    ``trainer.strategy.model``); the monitor reads ZeRO's partitions, the names and the
    real step through it. Recognised by class name: DeepSpeed is not imported here."""
    for candidate in candidates:
        if any(c.__name__ == "DeepSpeedEngine" for c in type(candidate).__mro__):
            return candidate
    return None


def torch_ddp(*candidates: Any) -> Dict[str, Any]:
    """``{DATA_PARALLEL_WRAPPER: wrapper}`` for the first of ``candidates`` that is
    torch's ``DistributedDataParallel`` (empty if none is): the wrapper a framework made
    around the model it gives its callbacks, passed to ``start()`` so that ``weight_grad``
    knows what reduces the gradients (it reads them in one batch at the end of each
    backward pass where that DDP allows). Recognised by class, as torch defines it."""
    for candidate in candidates:
        if any(c.__name__ == "DistributedDataParallel" and c.__module__ == "torch.nn.parallel.distributed"
               for c in type(candidate).__mro__):
            return {DATA_PARALLEL_WRAPPER: candidate}
    return {}


def _is_scalar(value: Any) -> bool:
    """A real number, or a one-element tensor (what ``log_scalars`` takes)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Real):
        return True
    numel = getattr(value, "numel", None)
    return callable(numel) and hasattr(value, "dtype") and numel() == 1


class FrameworkStepMonitor:
    """A ``TrainerMonitorV2`` driven by a training framework.

    The framework says when its optimizer steps end (``sync(global_step)``); the monitor's
    step number is kept equal to the framework's global step, one monitor step per
    framework step, whether or not the optimizer's update ran (a gradient scaler skips
    it on overflow: said once in the log). The optimizer-step hooks still read
    ``reduced``, parameters and moments at the real update.

    The config is validated when this object is built; each ``start()`` makes a fresh
    ``TrainerMonitorV2`` from it (a second ``trainer.fit()``/``train()`` call starts again,
    at the framework's step)."""

    def __init__(self, config: ConfigSource, fr: Optional[str] = None, integration: str = "integration") -> None:
        self._source = config
        self._fr = fr
        self.integration = integration
        self.monitor: Optional[TrainerMonitorV2] = None
        self._check = self._new_monitor()  # a bad config fails here, not in the training loop
        self._real_steps_seen = 0
        self._once = LogOnce()

    def _new_monitor(self) -> TrainerMonitorV2:
        monitor = TrainerMonitorV2(self._source, fr=self._fr)
        if monitor.config.patch_optimizer_step:
            logger.info("monitor_v2 %s: 'patch_optimizer_step' is ignored: the framework's step counter "
                        "ends the monitor's steps", self.integration)
        # The framework ends the steps (sync); the optimizer hooks only read the values.
        monitor.config = dataclasses.replace(monitor.config, patch_optimizer_step=False)
        return monitor

    @property
    def running(self) -> bool:
        return self.monitor is not None

    def start(self, model: Any, optimizer: Any, global_step: int = 0, **context: Any) -> TrainerMonitorV2:
        """Start monitoring ``model``/``optimizer`` (the framework's wrapped objects) at the
        framework's ``global_step``; ``context`` as for ``TrainerMonitorV2.start``."""
        self.stop()
        monitor = self._check if self._check is not None else self._new_monitor()
        self._check = None
        context = {k: v for k, v in context.items() if v is not None}
        monitor.start(model, optimizer, first_step=int(global_step), **context)
        self.monitor = monitor
        self._real_steps_seen = monitor.optimizer_steps
        return monitor

    def sync(self, global_step: int) -> int:
        """The framework has ended its steps up to ``global_step`` (exclusive): end the
        monitor's steps until its current step is ``global_step``; how many ended."""
        monitor = self.monitor
        if monitor is None:
            return 0
        ended = int(global_step) - monitor.current_step
        if ended <= 0:
            return 0
        real = monitor.optimizer_steps - self._real_steps_seen
        self._real_steps_seen = monitor.optimizer_steps
        if real < ended:
            self._once.warning(
                "skipped",
                "monitor_v2 %s: step %d ended without an optimizer update (skipped, e.g. by the gradient "
                "scaler for an overflow); the monitor's step still follows the framework's global step, "
                "and that step has no 'reduced', 'param_updated' or moment rows. Logged once.",
                self.integration, monitor.current_step + ended - 1)
        elif real > ended:
            self._once.warning(
                "extra",
                "monitor_v2 %s: %d optimizer updates ran in %d framework step(s) (several optimizers or "
                "manual optimization?); the monitor's step follows the framework's global step. Logged once.",
                self.integration, real, ended)
        for _ in range(ended):
            monitor.step()
        return ended

    def log_scalars(self, step: int, values: Mapping[str, Any]) -> None:
        """The framework's own scalars of the monitor's step ``step`` (the loss, the global
        gradient norm, as its logs hold them) as ``scalars`` rows. Values that are neither
        real numbers nor one-element tensors are left out; an error is said once, never
        raised into the training."""
        monitor = self.monitor
        if monitor is None:
            return
        picked = {name: value for name, value in values.items() if _is_scalar(value)}
        if not picked:
            return
        try:
            monitor.log_scalars(step, picked)
        except Exception as exc:  # noqa: BLE001 - never into the training loop
            self._once.warning("scalars", "monitor_v2 %s: writing the framework's scalars (%s) failed: %r; "
                               "the other rows are unaffected. Logged once.", self.integration,
                               ", ".join(picked), exc)

    def stop(self) -> None:
        """Stop the running monitor (hooks removed, output flushed); harmless if none."""
        monitor, self.monitor = self.monitor, None
        if monitor is not None:
            monitor.stop()
