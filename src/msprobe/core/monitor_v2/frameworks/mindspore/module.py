"""``module`` for MindSpore: Cell forward pre-hooks (inputs), forward hooks (outputs)
and backward hooks (``grad_input``/``grad_output``), with the tags, root name and
aggregation of the PyTorch monitor.

The hooks are installed only for steps that are written. A MindSpore backward hook is
not free when it does nothing: the Cell then wraps its inputs and outputs in
``CellBackwardHook`` operators on every call, and any hook sends the call down
PyNative's slower path. The schedule is known before a step starts, so ``begin_step``
installs them when a written step begins and removes them when an unwritten one does.
Cells that contain the optimizer keep theirs for the whole run: the trainer advances
the step inside the optimizer's forward hook, while MindSpore iterates over those
Cells' hook dictionaries."""

import inspect
from typing import Any, Dict, List, Sequence, Tuple

import mindspore as ms
from mindspore import nn

from ...monitor import Monitor, remove_all, select_modules
from ...stats import StatPlan
from ...structure import flatten_tensors

import logging

logger = logging.getLogger("msprobe.monitor_v2")

# Keyword arguments reach forward hooks only with with_kwargs (MindSpore >= 2.5 or so).
_KWARGS = "with_kwargs" in inspect.signature(nn.Cell.register_forward_pre_hook).parameters


def _is_tensor(x: Any) -> bool:
    return isinstance(x, ms.Tensor)


class MsModuleMonitor(Monitor):
    name = "module"

    def attach(self) -> None:
        self.plan = StatPlan.from_ops(self.settings.ops)
        targets: Sequence[str] = self.settings.get("targets")
        self._handles: List[Any] = []  # hooks installed for written steps only
        self._kept: List[Any] = []  # hooks of Cells that contain the optimizer
        named = [(vpp, name, c) for vpp, root in enumerate(self.session.roots) for name, c in root.cells_and_names()]
        optimizer = self.session.optimizer
        self._toggled: List[Tuple[int, str, Any]] = []
        for vpp, tag, cell in select_modules(named, targets, self.session.qualify):
            if optimizer is not None and any(c is optimizer for _, c in cell.cells_and_names()):
                self._kept += self._hook(cell, vpp, tag)
            else:
                self._toggled.append((vpp, tag, cell))

    def begin_step(self, step: int, active: bool) -> None:
        super().begin_step(step, active)
        if active and not self._handles:
            for vpp, tag, cell in self._toggled:
                self._handles += self._hook(cell, vpp, tag)
        elif not active:
            remove_all(self._handles)

    def _emit(self, values: Any, vpp: int, tag: str, kind: str, scope: str) -> None:
        engine = self.session.engine
        for i, t in enumerate(flatten_tensors(values, _is_tensor)):
            self._records.append(engine.record(t, self.plan, vpp, f"{tag}.{kind}.{i}", scope))

    def _hook(self, cell: Any, vpp: int, tag: str) -> List[Any]:
        def pre(c: Any, inputs: Tuple, kwargs: Dict = None) -> None:
            if self.active:
                self._emit((inputs, kwargs or {}), vpp, tag, "input", "forward")

        def post(c: Any, inputs: Tuple, *rest: Any) -> None:
            if self.active:  # (kwargs, output) with with_kwargs, else (output,)
                self._emit(rest[-1], vpp, tag, "output", "forward")

        def backward(c: Any, grad_input: Tuple, grad_output: Tuple) -> None:
            if self.active:
                self._emit_indexed(grad_input, vpp, tag, "grad_input")
                self._emit_indexed(grad_output, vpp, tag, "grad_output")

        wrap = self.errors.wrap
        extra = {"with_kwargs": True} if _KWARGS else {}
        return [cell.register_forward_pre_hook(wrap(f"module forward pre-hook of {tag}", pre), **extra),
                cell.register_forward_hook(wrap(f"module forward hook of {tag}", post), **extra),
                cell.register_backward_hook(wrap(f"module backward hook of {tag}", backward))]

    def _emit_indexed(self, grads: Any, vpp: int, tag: str, kind: str) -> None:
        # A None gradient (an input that needs none) keeps its index, as in PyTorch.
        engine = self.session.engine
        items = grads if isinstance(grads, (tuple, list)) else (grads,)
        for i, g in enumerate(items):
            if _is_tensor(g):
                self._records.append(engine.record(g, self.plan, vpp, f"{tag}.{kind}.{i}", "backward"))

    def detach(self) -> None:
        remove_all(self._handles)
        remove_all(self._kept)
