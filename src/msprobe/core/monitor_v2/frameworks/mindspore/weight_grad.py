"""``weight_grad`` for MindSpore.

``unreduced``: a hook on each parameter (``Parameter.register_hook``) receives the
gradient of one backward pass (``value_and_grad``), before any data-parallel
reduction, and statistics are taken right there (so later in-place edits of the
gradient do not leak into the row). With ``monitor_mbs_grad=true`` each pass is one
row. With ``monitor_mbs_grad=false`` the row must hold the step's accumulated
gradient, which in MindSpore lives in the user's own variables: with one announced
micro-batch the hook's gradient is that row; with ``N > 1`` announced, the monitor keeps
a running sum (one gradient-sized buffer per parameter, on written steps, until the
step ends) and reads it after the N-th pass and after any later one. If a step runs
more passes than announced with ``N == 1``, the row holds the last pass only (logged
once): announce ``grad_acc_steps``.

``reduced``: the gradients passed to the optimizer (``optimizer(grads)``), read by a
forward pre-hook on the optimizer, i.e. after ``DistributedGradReducer``.

The parameter hooks are installed only for written steps (``begin_step`` adds them when
a written step begins and removes them when an unwritten one does): a registered hook
puts every gradient through a Python call during the backward pass even when it does
nothing.
"""

import functools
from typing import Any, Dict, List, Tuple

import logging

from ... import rows
from ...config import resolve_micro_batches
from ...monitor import Monitor, weight_grad_rows
from ...logonce import LogOnce
from ...param_table import ParamInfo
from ...patching import remove_all
from ...stats import Record, StatPlan

logger = logging.getLogger("msprobe.monitor_v2")


class MsWeightGradMonitor(Monitor):
    name = rows.WEIGHT_GRAD
    needs_optimizer = True

    def attach(self) -> None:
        self.plan = StatPlan.from_ops(self.settings.ops)
        self.micro_batches = resolve_micro_batches(self.settings, self.context)
        self.per_micro_batch = self.settings.get("monitor_mbs_grad")
        table = self.session.table
        self.params = table.model_params() or [i for i in table.optimizer_params() if i.param.requires_grad]
        self._handles: List[Any] = []
        self._once = LogOnce()
        self._reset()

    def _install(self) -> None:
        for info in self.params:
            hook = self.errors.wrap("weight_grad unreduced hook", functools.partial(self._on_grad, info))
            self._handles.append(info.param.register_hook(hook))

    def _reset(self) -> None:
        self._passes: Dict[int, int] = {}
        self._sums: Dict[int, Any] = {}
        self._unreduced: Dict[Tuple[int, int], Record] = {}
        self._reduced: List[Record] = []

    def begin_step(self, step: int, active: bool) -> None:
        super().begin_step(step, active)
        self._reset()
        if active and not self._handles:
            self._install()
        elif not active:
            remove_all(self._handles)

    def _on_grad(self, info: ParamInfo, grad: Any) -> None:
        if not self.active:
            return
        n = self._passes.get(info.index, 0) + 1
        self._passes[info.index] = n
        engine = self.session.engine
        if self.per_micro_batch:
            self._unreduced[(info.index, n)] = engine.record(grad, self.plan, info.vpp_stage, info.name, rows.UNREDUCED, n)
            return
        if self.micro_batches == 1:
            if n > 1:
                self._once.warning(
                    "extra-passes",
                    "monitor_v2 weight_grad: step %d ran %d backward passes but grad_acc_steps / "
                    "micro_batch_number is 1; MindSpore's accumulated gradient cannot be rebuilt, so "
                    "'unreduced' holds the last pass. Announce the number of micro-batches. "
                    "Logged once.", self.step, n)
            total = grad
        else:
            prev = self._sums.get(info.index)
            total = self._sums[info.index] = grad.copy() if prev is None else prev + grad
        if n >= self.micro_batches:
            self._unreduced[(info.index, 0)] = engine.record(total, self.plan, info.vpp_stage, info.name, rows.UNREDUCED)

    def before_optimizer_step(self) -> None:
        if not self.active:
            return
        self._read_short_sums()
        tensors, keys = self.session.expand(self.session.reduced_grads(), rows.REDUCED)
        self._reduced = self.session.engine.record_many(tensors, self.plan, keys)

    def _read_short_sums(self) -> None:
        """Parameters that got fewer passes than announced: their sum so far."""
        short = [(index, total) for index, total in self._sums.items() if (index, 0) not in self._unreduced]
        if not short:
            return
        params = self.session.table.params
        keys = [(params[i].vpp_stage, params[i].name, rows.UNREDUCED, None) for i, _ in short]
        records = self.session.engine.record_many([total for _, total in short], self.plan, keys)
        for (index, _), rec in zip(short, records):
            self._unreduced[(index, 0)] = rec

    def collect(self) -> List[Record]:
        self._read_short_sums()
        records = weight_grad_rows(self._unreduced, self._reduced, self._passes, self.micro_batches)
        self._reset()
        return records

    def detach(self) -> None:
        remove_all(self._handles)
