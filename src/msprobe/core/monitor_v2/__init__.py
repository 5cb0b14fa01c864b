"""Monitor V2: a lightweight training-state monitor.

Public entry point: ``msprobe.core.monitor_v2.trainer.TrainerMonitorV2``.
"""

from .errors import ConfigError, MonitorError, MonitorStateError, ScalarError

__all__ = ["ConfigError", "MonitorError", "MonitorStateError", "ScalarError", "TrainerMonitorV2"]


def __getattr__(name):
    # Imported lazily so that ``import msprobe.core.monitor_v2`` stays cheap.
    if name == "TrainerMonitorV2":
        from .trainer import TrainerMonitorV2

        return TrainerMonitorV2
    raise AttributeError(name)
