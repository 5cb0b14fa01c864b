"""Ready-made glue for training frameworks that own the training loop.

- ``MonitorTrainerCallback``: a ``transformers.TrainerCallback`` (Hugging Face Trainer).
- ``MonitorLightningCallback``: a Lightning ``Callback`` (``lightning`` or ``pytorch_lightning``).
- ``AccelerateMonitor``: starts the monitor on what ``accelerator.prepare`` returned
  and ends its steps with Accelerate's real optimizer steps.

Each is built from the same config as ``TrainerMonitorV2`` (a dict or a path). None of
these libraries is a dependency of msprobe: an integration imports its library when it
is first used, and a missing one raises ``MissingDependencyError`` naming the package.
"""

from importlib import import_module
from typing import Any

__all__ = ["AccelerateMonitor", "MonitorLightningCallback", "MonitorTrainerCallback"]

# Public name -> module of this package that defines it (imported on first use).
_LAZY = {
    "MonitorTrainerCallback": "transformers_callback",
    "MonitorLightningCallback": "lightning_callback",
    "AccelerateMonitor": "accelerate_monitor",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)
