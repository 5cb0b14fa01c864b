"""``optimizer``: the optimizer's per-parameter state right after its update.
Framework-independent: each session lists the state tensors (``optimizer_states``),
named as PyTorch names them (see the framework's ``optimizer_state.py``)."""

from operator import is_, itemgetter
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

from . import rows
from .checks import Fields, check_bool
from .experts import CONFIG_FIELDS as EXPERT_FIELDS
from .experts import ExpertReads
from .monitor import Monitor
from .param_table import Added
from .stats import StatPlan

CONFIG_FIELDS: Fields = {"mv_distribution": (check_bool, True), **EXPERT_FIELDS}

_INFO, _NAME, _TENSOR = itemgetter(0), itemgetter(1), itemgetter(2)  # of an (info, state name, tensor)


def _group_by_name(names: List[str]) -> Tuple[List[Tuple[str, List[int]]], Optional[List[int]]]:
    """The places of each state name in ``names``, and where each place lands in the
    groups one after the other (None when there is one group: the places themselves)."""
    by_name: Dict[str, List[int]] = {}
    for n, name in enumerate(names):
        by_name.setdefault(name, []).append(n)
    groups = list(by_name.items())
    if len(groups) <= 1:
        return groups, None
    order = [0] * len(names)
    for landed, n in enumerate(n for _, places in groups for n in places):
        order[n] = landed
    return groups, order


class _KeptKeys:
    """The row keys of the last step's state tensors, where ``expand`` gave the tensors
    back unchanged: the same at the next step if the same parameters come with the same
    state names, in the same order, and tensors of the same types. Holds no tensor."""

    def __init__(self, infos: List[Any], names: List[str], types: set, keys: List[Any]) -> None:
        self.infos, self.names, self.types, self.keys = infos, names, types, keys

    @classmethod
    def of(cls, states: List[Tuple[Any, str, Any]], tensors_in: List[Any], tensors: List[Any],
           keys: List[Any]) -> Optional["_KeptKeys"]:
        if len(tensors) != len(tensors_in) or not all(map(is_, tensors, tensors_in)):
            return None
        return cls(list(map(_INFO, states)), list(map(_NAME, states)), set(map(type, tensors_in)), keys)

    def fits(self, states: List[Tuple[Any, str, Any]], tensors_in: List[Any]) -> bool:
        return (len(states) == len(self.infos) and all(map(is_, map(_INFO, states), self.infos))
                and list(map(_NAME, states)) == self.names and set(map(type, tensors_in)) <= self.types)


class OptimizerStateMonitor(Monitor):
    name = rows.OPTIMIZER
    needs_optimizer = True

    def attach(self) -> None:
        self._kept: Optional[_KeptKeys] = None
        self.plan = StatPlan.from_ops(self.settings.ops)
        self.enabled = self.settings.get("mv_distribution")
        self.experts = ExpertReads(self.session, self.settings, self.name)
        self._expert_states: Dict[FrozenSet[str], Dict[str, int]] = {}

    def on_added(self, added: Added) -> None:
        if added.params:
            self.experts.refresh()
            self._expert_states.clear()

    def after_optimizer_step(self) -> None:
        if not (self.active and self.enabled):
            return
        tensors, keys = self._state_tensors()
        if not self.experts.params:
            self._records = self.session.engine.record_many(tensors, self.plan, keys)
            return
        self._records = self.experts.record_many(self.session.engine, tensors, self.plan, keys,
                                                 self._expert_state_names(keys))

    def _expert_state_names(self, keys: List[Any]) -> Dict[str, int]:
        """The row names of the grouped experts' state tensors (``<param>.<state>``) among
        ``keys``, by the step's state names (the scopes), kept while those stay the same."""
        scopes = frozenset(key[2] for key in keys)
        names = self._expert_states.get(scopes)
        if names is None:
            names = self._expert_states[scopes] = {
                name + rows.state_suffix(scope): nd for name, nd in self.experts.params.items() for scope in scopes}
        return names

    def _state_tensors(self) -> Tuple[List[Any], List[Any]]:
        """The state tensors and their row keys, each parameter's states together in the
        optimizer's order: one ``expand`` per state name (whose row keys it caches), not one
        per tensor, unless the stack expands a state into several tensors or none.

        Thousands of state tensors are usual. Where the session's ``expand`` gave the
        tensors back as they were (no flat parameter cut into views, no empty shard left
        out), the row keys are kept and used again while the same parameters come with
        the same state names and tensors of the same types (``_KeptKeys``); the passes
        over the tensors run in C (``map``)."""
        states = list(self.session.optimizer_states())
        tensors_in = list(map(_TENSOR, states))
        kept = self._kept
        if kept is not None and kept.fits(states, tensors_in):
            return tensors_in, kept.keys
        tensors, keys = self._expanded(states)
        self._kept = _KeptKeys.of(states, tensors_in, tensors, keys)
        return tensors, keys

    def _expanded(self, states: List[Tuple[Any, str, Any]]) -> Tuple[List[Any], List[Any]]:
        groups, order = _group_by_name(list(map(_NAME, states)))
        tensors: List[Any] = []
        keys: List[Any] = []
        for state_name, places in groups:
            chosen = states if order is None else list(map(states.__getitem__, places))
            t, k = self.session.expand(list(zip(map(_INFO, chosen), map(_TENSOR, chosen))), state_name,
                                       suffix=rows.state_suffix(state_name))
            if len(t) != len(places):
                return self._state_tensors_one_by_one(states)
            tensors += t
            keys += k
        if order is not None:  # back to each parameter's states together
            tensors = list(map(tensors.__getitem__, order))
            keys = list(map(keys.__getitem__, order))
        return tensors, keys

    def _state_tensors_one_by_one(self, states: List[Tuple[Any, str, Any]]) -> Tuple[List[Any], List[Any]]:
        tensors: List[Any] = []
        keys: List[Any] = []
        for info, state_name, value in states:
            t, k = self.session.expand([(info, value)], state_name, suffix=rows.state_suffix(state_name))
            tensors += t
            keys += k
        return tensors, keys
