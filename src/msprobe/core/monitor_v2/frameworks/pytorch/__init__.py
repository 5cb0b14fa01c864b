"""PyTorch implementation of the monitors."""

from .module import ModuleMonitor
from .optimizer import OptimizerStateMonitor
from .param import ParamMonitor
from .session import TorchSession as Session
from .session import global_rank
from .weight_grad import WeightGradMonitor

MONITORS = {
    m.name: m for m in (ModuleMonitor, WeightGradMonitor, OptimizerStateMonitor, ParamMonitor)
}

__all__ = ["MONITORS", "Session", "global_rank"]
