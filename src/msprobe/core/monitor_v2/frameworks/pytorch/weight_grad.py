"""``weight_grad``: parameter gradients, ``unreduced`` during backward and ``reduced``
right before the optimizer's update.

``unreduced`` with ``monitor_mbs_grad=false``: a post-accumulate-grad hook reads
``param.grad`` after the announced last micro-batch (and after every later one, if a
step runs more backward passes than announced), so the row holds the whole local
gradient of the step while the statistics are computed once per step, not once per
micro-batch. A parameter that got fewer gradients than announced is read right before
the optimizer step instead (logged once).

``unreduced`` with ``monitor_mbs_grad=true``: a tensor hook on the parameter sees the
gradient of one backward pass before it is accumulated into ``.grad``, i.e. that
micro-batch's own gradient (all uses of a shared parameter already summed).
"""

import functools
import logging
from typing import Dict, List, Tuple

import torch

from ...config import resolve_micro_batches
from ...monitor import Monitor, remove_all
from ...stats import Record
from .session import ParamInfo
from .stats import StatPlan

logger = logging.getLogger("msprobe.monitor_v2")


class WeightGradMonitor(Monitor):
    name = "weight_grad"
    with_micro_step = True
    needs_optimizer = True

    def attach(self) -> None:
        self.plan = StatPlan.from_ops(self.settings.ops)
        self.micro_batches = resolve_micro_batches(self.settings, self.context)
        self.per_micro_batch = self.settings.get("monitor_mbs_grad")
        self.params = self.session.model_params() or [
            i for i in self.session.optimizer_params() if i.param.requires_grad
        ]
        self._handles: List = []
        self._warned_short = False
        self._reset()
        for info in self.params:
            if self.per_micro_batch:
                hook = functools.partial(self._on_micro_batch_grad, info)
                self._handles.append(info.param.register_hook(self.errors.wrap("weight_grad unreduced hook", hook)))
            else:
                hook = functools.partial(self._on_accumulated_grad, info)
                self._handles.append(
                    info.param.register_post_accumulate_grad_hook(
                        self.errors.wrap("weight_grad unreduced hook", hook)
                    )
                )

    def _reset(self) -> None:
        self._passes: Dict[int, int] = {}  # param index -> backward passes that reached it
        self._unreduced: Dict[Tuple[int, int], Record] = {}  # (param index, micro step)
        self._reduced: List[Record] = []

    def begin_step(self, step: int, active: bool) -> None:
        super().begin_step(step, active)
        self._reset()

    def _count_pass(self, info: ParamInfo) -> int:
        n = self._passes.get(info.index, 0) + 1
        self._passes[info.index] = n
        return n

    def _on_micro_batch_grad(self, info: ParamInfo, grad: torch.Tensor) -> None:
        if not self.active:
            return
        n = self._count_pass(info)
        self._unreduced[(info.index, n)] = self.session.engine.record(
            grad, self.plan, info.vpp_stage, info.name, "unreduced", n
        )

    def _on_accumulated_grad(self, info: ParamInfo, param: torch.Tensor) -> None:
        if not self.active:
            return
        n = self._count_pass(info)
        if n >= self.micro_batches and param.grad is not None:
            self._unreduced[(info.index, 0)] = self.session.engine.record(
                param.grad, self.plan, info.vpp_stage, info.name, "unreduced"
            )

    def before_optimizer_step(self) -> None:
        if not self.active:
            return
        if not self.per_micro_batch:
            self._read_short_params()
        infos = [i for i in self.session.optimizer_params() if i.param.grad is not None]
        keys = [(i.vpp_stage, i.name, "reduced", None) for i in infos]
        self._reduced = self.session.engine.record_many([i.param.grad for i in infos], self.plan, keys)

    def _read_short_params(self) -> None:
        short = [
            i for i in self.params
            if 0 < self._passes.get(i.index, 0) < self.micro_batches
            and (i.index, 0) not in self._unreduced and i.param.grad is not None
        ]
        if not short:
            return
        if not self._warned_short:
            self._warned_short = True
            logger.warning(
                "monitor_v2 weight_grad: at step %d, %d parameter(s) (e.g. %s) got gradients in fewer "
                "backward passes than the %d announced by grad_acc_steps/micro_batch_number; their "
                "'unreduced' rows are read right before optimizer.step() (after any data-parallel "
                "reduction). Logged once.", self.step, len(short), short[0].name, self.micro_batches,
            )
        for i in short:
            self._unreduced[(i.index, 0)] = self.session.engine.record(
                i.param.grad, self.plan, i.vpp_stage, i.name, "unreduced"
            )

    def collect(self) -> List[Record]:
        micro = max(self._passes.values(), default=0) or self.micro_batches
        records = []
        for (_, mb), rec in sorted(self._unreduced.items(), key=lambda kv: kv[0]):
            if mb == 0:
                rec.micro_step = micro
            records.append(rec)
        for rec in self._reduced:
            rec.micro_step = micro
            records.append(rec)
        self._reset()
        return records

    def detach(self) -> None:
        remove_all(self._handles)
