"""``param``: parameters right before (``param_origin``) and right after
(``param_updated``) the optimizer's update. Framework-independent: it reads the
session's ``param_values()`` (the values the optimizer updates: the parameters, or
the fp32 masters a training stack keeps for them) and the shared engine interface."""

from . import rows
from .checks import Fields, check_bool
from .experts import CONFIG_FIELDS as EXPERT_FIELDS
from .experts import ExpertReads
from .monitor import Monitor
from .param_table import Added
from .stats import StatPlan

CONFIG_FIELDS: Fields = {"param_distribution": (check_bool, True), **EXPERT_FIELDS}


class ParamMonitor(Monitor):
    name = rows.PARAM
    needs_optimizer = True

    def attach(self) -> None:
        self.plan = StatPlan.from_ops(self.settings.ops)
        self.enabled = self.settings.get("param_distribution")
        self.experts = ExpertReads(self.session, self.settings, self.name)

    def on_added(self, added: Added) -> None:
        if added.params:
            self.experts.refresh()

    def _read(self, scope: str) -> None:
        tensors, keys = self.session.expand(self.session.param_values(), scope)
        self._records += self.experts.record_many(self.session.engine, tensors, self.plan, keys)

    def before_optimizer_step(self) -> None:
        if self.active and self.enabled:
            self._read(rows.PARAM_ORIGIN)

    def after_optimizer_step(self) -> None:
        if self.active and self.enabled:
            self._read(rows.PARAM_UPDATED)
