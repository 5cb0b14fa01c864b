"""MindSpore (PyNative) implementation of the monitors."""

from .cc import MsCommMonitor
from .module import MsModuleMonitor
from ...param import ParamMonitor
from .optimizer import MsOptimizerStateMonitor
from .session import MsSession as Session
from .session import global_rank
from .weight_grad import MsWeightGradMonitor

MONITORS = {
    m.name: m for m in (MsModuleMonitor, MsWeightGradMonitor, MsOptimizerStateMonitor, ParamMonitor, MsCommMonitor)
}

__all__ = ["MONITORS", "Session", "global_rank"]
