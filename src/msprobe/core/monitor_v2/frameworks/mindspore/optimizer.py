"""``optimizer`` for MindSpore.

Optimizer state lives in ``ParameterTuple`` attributes aligned with
``optimizer.parameters``: ``nn.Adam`` ``moment1``/``moment2``, ``nn.AdamWeightDecay``
``moments1``/``moments2``, ``mint.optim.AdamW`` ``exp_avg``/``exp_avg_sq``; these are
reported as ``exp_avg``/``exp_avg_sq`` like PyTorch's Adam. Momentum buffers
(``nn.Momentum`` ``moments``, ``nn.SGD`` ``accum``) are reported as PyTorch's
``momentum_buffer``; ``nn.SGD``'s ``stat`` (a first-step flag, not state of the
parameter's values) is left out. Any other per-parameter tuple is reported under its
own name.
"""

from typing import Any, List

from mindspore import ParameterTuple

from ...monitor import Monitor
from ...stats import StatPlan

_ALIASES = {"moment1": "exp_avg", "moments1": "exp_avg", "moment2": "exp_avg_sq", "moments2": "exp_avg_sq",
            "moments": "momentum_buffer", "accum": "momentum_buffer"}
_NOT_STATE = {"parameters", "_parameters", "params", "param_groups", "stat"}


def optimizer_states(optimizer: Any, n_params: int) -> List[tuple]:
    """``(report name, tuple of tensors)`` for each per-parameter state of ``optimizer``."""
    out = []
    for attr, value in vars(optimizer).items():
        if attr in _NOT_STATE or not isinstance(value, ParameterTuple) or len(value) != n_params:
            continue
        out.append((_ALIASES.get(attr, attr), value))
    order = {"exp_avg": 0, "exp_avg_sq": 1}
    return sorted(out, key=lambda kv: order.get(kv[0], 2))


class MsOptimizerStateMonitor(Monitor):
    name = "optimizer"
    needs_optimizer = True

    def attach(self) -> None:
        self.plan = StatPlan.from_ops(self.settings.ops)
        self.enabled = self.settings.get("mv_distribution")

    def after_optimizer_step(self) -> None:
        if not (self.active and self.enabled):
            return
        infos = self.session.optimizer_params()
        states = optimizer_states(self.session.optimizer, len(infos))
        tensors, keys = [], []
        for i, info in enumerate(infos):
            for state_name, values in states:
                tensors.append(values[i])
                keys.append((info.vpp_stage, f"{info.name}.{state_name}", state_name, None))
        self._records = self.session.engine.record_many(tensors, self.plan, keys)

