"""``param``: parameters right before (``param_origin``) and right after
(``param_updated``) the optimizer's update. Framework-independent: it reads the
session's optimizer parameters and the shared engine interface."""

from .monitor import Monitor
from .stats import StatPlan


class ParamMonitor(Monitor):
    name = "param"
    needs_optimizer = True

    def attach(self) -> None:
        self.plan = StatPlan.from_ops(self.settings.ops)
        self.enabled = self.settings.get("param_distribution")

    def _read(self, scope: str) -> None:
        items = [(i, i.param) for i in self.session.optimizer_params()]
        tensors, keys = self.session.expand(items, scope)
        self._records += self.session.engine.record_many(tensors, self.plan, keys)

    def before_optimizer_step(self) -> None:
        if self.active and self.enabled:
            self._read("param_origin")

    def after_optimizer_step(self) -> None:
        if self.active and self.enabled:
            self._read("param_updated")
