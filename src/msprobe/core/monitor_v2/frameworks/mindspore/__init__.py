"""MindSpore (PyNative) implementation of the monitors."""

from ...optimizer import OptimizerStateMonitor
from ...param import ParamMonitor
from .cc import MsCommMonitor
from .evidence import GradientGuard
from .module import MsModuleMonitor
from .session import MsSession as Session
from .session import global_rank
from .weight_grad import MsWeightGradMonitor

MONITORS = {
    m.name: m for m in (MsModuleMonitor, MsWeightGradMonitor, OptimizerStateMonitor, ParamMonitor, MsCommMonitor)
}

__all__ = ["MONITORS", "GradientGuard", "Session", "global_rank"]
