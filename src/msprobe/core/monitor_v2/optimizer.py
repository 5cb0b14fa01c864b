"""``optimizer``: the optimizer's per-parameter state right after its update.
Framework-independent: each session lists the state tensors (``optimizer_states``),
named as PyTorch names them (see the framework's ``optimizer_state.py``)."""

from . import rows
from .checks import Fields, check_bool
from .monitor import Monitor
from .stats import StatPlan

CONFIG_FIELDS: Fields = {"mv_distribution": (check_bool, True)}


class OptimizerStateMonitor(Monitor):
    name = rows.OPTIMIZER
    needs_optimizer = True

    def attach(self) -> None:
        self.plan = StatPlan.from_ops(self.settings.ops)
        self.enabled = self.settings.get("mv_distribution")

    def after_optimizer_step(self) -> None:
        if not (self.active and self.enabled):
            return
        tensors, keys = [], []
        for info, state_name, value in self.session.optimizer_states():
            t, k = self.session.expand([(info, value)], state_name, suffix=rows.state_suffix(state_name))
            tensors += t
            keys += k
        self._records = self.session.engine.record_many(tensors, self.plan, keys)
