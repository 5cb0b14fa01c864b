"""``optimizer``: the optimizer's per-parameter state right after its update."""

import torch

from ...monitor import Monitor
from ...stats import StatPlan

# Scalar bookkeeping entries of torch optimizers are not per-parameter state.
_SKIPPED_STATE = frozenset({"step"})


class OptimizerStateMonitor(Monitor):
    """Every per-parameter tensor the optimizer keeps: Adam/AdamW ``exp_avg`` and
    ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad), SGD ``momentum_buffer``,
    Adagrad ``sum``, RMSprop ``square_avg``... each under its own name."""

    name = "optimizer"
    needs_optimizer = True

    def attach(self) -> None:
        self.plan = StatPlan.from_ops(self.settings.ops)
        self.enabled = self.settings.get("mv_distribution")

    def after_optimizer_step(self) -> None:
        if not (self.active and self.enabled):
            return
        state = self.session.optimizer.state
        tensors, keys = [], []
        for info in self.session.optimizer_params():
            for key, value in state.get(info.param, {}).items():
                if key in _SKIPPED_STATE or not isinstance(value, torch.Tensor) or value.dim() == 0:
                    continue
                t, k = self.session.expand([(info, value)], key, suffix=f".{key}")
                tensors += t
                keys += k
        self._records = self.session.engine.record_many(tensors, self.plan, keys)

