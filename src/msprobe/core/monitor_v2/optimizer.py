"""``optimizer``: the optimizer's per-parameter state right after its update.
Framework-independent: each session lists the state tensors (``optimizer_states``),
named as PyTorch names them (see the framework's ``optimizer_state.py``)."""

from typing import Any, Dict, List, Tuple

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
        tensors, keys = self._state_tensors()
        self._records = self.session.engine.record_many(tensors, self.plan, keys)

    def _state_tensors(self) -> Tuple[List[Any], List[Any]]:
        """The state tensors and their row keys, each parameter's states together in the
        optimizer's order: one ``expand`` per state name (whose row keys it caches), not one
        per tensor, unless the stack expands a state into several tensors or none."""
        states = list(self.session.optimizer_states())
        by_state: Dict[str, List[int]] = {}
        for n, (_, state_name, _) in enumerate(states):
            by_state.setdefault(state_name, []).append(n)
        tensors: List[Any] = [None] * len(states)
        keys: List[Any] = [None] * len(states)
        for state_name, places in by_state.items():
            t, k = self.session.expand([states[n][::2] for n in places], state_name,
                                       suffix=rows.state_suffix(state_name))
            if len(t) != len(places):
                return self._state_tensors_one_by_one(states)
            for n, tensor, key in zip(places, t, k):
                tensors[n] = tensor
                keys[n] = key
        return tensors, keys

    def _state_tensors_one_by_one(self, states: List[Tuple[Any, str, Any]]) -> Tuple[List[Any], List[Any]]:
        tensors: List[Any] = []
        keys: List[Any] = []
        for info, state_name, value in states:
            t, k = self.session.expand([(info, value)], state_name, suffix=rows.state_suffix(state_name))
            tensors += t
            keys += k
        return tensors, keys
