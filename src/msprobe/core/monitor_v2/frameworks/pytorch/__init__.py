"""PyTorch implementation of the monitors."""

from ...optimizer import OptimizerStateMonitor
from ...param import ParamMonitor
from .cc import CommMonitor, enable_ddp_comm_visibility
from .evidence import GradientGuard
from .module import ModuleMonitor
from .moe import MoeMonitor
from .session import TorchSession as Session
from .session import global_rank
from .weight_grad import WeightGradMonitor

MONITORS = {
    m.name: m for m in (ModuleMonitor, WeightGradMonitor, OptimizerStateMonitor, ParamMonitor, CommMonitor, MoeMonitor)
}

__all__ = ["MONITORS", "GradientGuard", "Session", "enable_ddp_comm_visibility", "global_rank"]
