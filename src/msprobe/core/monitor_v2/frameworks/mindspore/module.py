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
Cells' hook dictionaries.

Evaluation passes: a call of a model chunk given to ``start()`` during which PyNative
records no gradient at all (a plain ``net(x)`` outside ``value_and_grad``/``grad``/
``TrainOneStepCell``) is an evaluation pass. Its forward rows go under their own scope
``eval_forward``, never into the training step's ``forward`` rows, as in PyTorch.
``set_train(False)`` alone does not decide: ``training`` is False by default in
MindSpore, and many training loops never call ``set_train()``. The whole call decides
for every Cell inside it, once it is known: a ``TrainOneStepCell`` given as the model
starts recording only in its inner network's call, and a ``recompute()`` block first runs
its forward without recording inside a training pass. The rows of a call wait for the
decision until the call returns or the step ends. A Cell called outside a chunk's call
decides for itself. Passes are tracked per thread: a second thread calling the model
while the main thread trains is its own pass, decided by its own calls, as in PyTorch.

Output names follow ``structure.named_outputs``: a dict output is named by key
(``output.logits``), everything else numbered over its tensors."""

import functools
import importlib
import inspect
import logging
import threading
from typing import Any, Callable, Dict, List, Sequence, Tuple

import mindspore as ms
from mindspore import nn

from ... import rows
from ...layout import dtype_name
from ...monitor import Monitor, select_modules
from ...patching import remove_all
from ...stats import StatPlan
from ...structure import flatten_tensors, named_outputs

logger = logging.getLogger("msprobe.monitor_v2")

# Keyword arguments reach forward hooks only with with_kwargs (MindSpore >= 2.5 or so).
_KWARGS = "with_kwargs" in inspect.signature(nn.Cell.register_forward_pre_hook).parameters


def _is_tensor(x: Any) -> bool:
    return isinstance(x, ms.Tensor)


def _pynative_executor() -> Any:
    """PyNative's executor, which knows whether the current forward is recorded for a
    gradient (private; ``mindspore.graph.api`` from 2.9, ``mindspore.common.api`` before)."""
    for name in ("mindspore.graph.api", "mindspore.common.api"):
        try:
            executor = getattr(importlib.import_module(name), "_pynative_executor", None)
        except ImportError:
            continue
        if callable(getattr(executor, "requires_grad", None)):
            return executor
    return None


class _Pass(threading.local):
    """One thread's pass: nesting of model chunk calls in progress, whether the outermost
    one recorded a gradient so far, and its forward records (scope not decided yet)."""

    def __init__(self) -> None:
        self.depth = 0
        self.trains = False
        self.records: List[Any] = []


class MsModuleMonitor(Monitor):
    name = rows.MODULE

    def attach(self) -> None:
        self.plan = StatPlan.from_ops(self.settings.ops)
        # layout.json's "dtypes" of this monitor's rows, noted until a written step has read any
        self.row_dtypes: Dict[str, str] = {}
        self._noting_dtypes = True
        targets: Sequence[str] = self.settings.get("targets")
        self._handles: List[Any] = []  # hooks installed for written steps only
        self._kept: List[Any] = []  # hooks of Cells that contain the optimizer
        named = self.session.named_modules()
        optimizer = self.session.optimizer
        self._toggled: List[Callable[[], List[Any]]] = []  # installed in this order
        self._pass = _Pass()  # per thread: another thread's calls never join the training pass
        self._executor = _pynative_executor()
        if self._executor is None:
            logger.info("monitor_v2 module: this MindSpore does not say whether a forward is recorded for a "
                        "gradient; evaluation passes are not told apart (all forward rows are 'forward')")
        roots = list({id(r): r for r in self.session.roots}.values())
        # On a chunk, the pass tracking's pre-hook runs before its row hooks and its forward
        # hook after them (hooks run in the order they were registered).
        installs = [(root, functools.partial(self._track_enter, root)) for root in roots]
        installs += [(cell, functools.partial(self._hook, cell, vpp, tag))
                     for vpp, tag, cell in select_modules(named, targets, self.session.table.qualify)]
        installs += [(root, functools.partial(self._track_leave, root)) for root in roots]
        for cell, install in installs:
            if optimizer is not None and any(c is optimizer for _, c in cell.cells_and_names()):
                self._kept += install()
            else:
                self._toggled.append(install)

    def begin_step(self, step: int, active: bool) -> None:
        super().begin_step(step, active)
        if active and not self._handles:
            for install in self._toggled:
                self._handles += install()
        elif not active:
            remove_all(self._handles)

    def before_optimizer_step(self) -> None:
        # The optimizer runs inside the model's call (TrainOneStepCell): a training pass,
        # even when its forward ran in an unwritten step, where no row hook saw it record.
        if self._pass.depth:
            self._pass.trains = True

    def collect(self) -> List[Any]:
        self._settle_pass()  # a step can end inside a chunk's call (TrainOneStepCell)
        if self.row_dtypes:
            self._noting_dtypes = False
        return super().collect()

    def _note_dtypes(self, keys: Sequence[Tuple[Any, ...]], tensors: Sequence[Any]) -> None:
        dtypes = self.row_dtypes
        for key, t in zip(keys, tensors):
            if key[1] not in dtypes:
                dtypes[key[1]] = dtype_name(t.dtype)

    def _track_enter(self, root: Any) -> List[Any]:
        def enter(c: Any, inputs: Tuple, kwargs: Dict = None) -> None:
            state = self._pass
            if state.depth == 0:
                state.trains = False
            state.depth += 1

        extra = {"with_kwargs": True} if _KWARGS else {}
        return [root.register_forward_pre_hook(self.errors.wrap("module pass tracking", enter), **extra)]

    def _track_leave(self, root: Any) -> List[Any]:
        def leave(c: Any, inputs: Tuple, *rest: Any) -> None:
            state = self._pass
            if state.depth:
                state.depth -= 1
                if state.depth == 0:
                    self._settle_pass()

        extra = {"with_kwargs": True} if _KWARGS else {}
        return [root.register_forward_hook(self.errors.wrap("module pass tracking", leave), **extra)]

    def _settle_pass(self) -> None:
        state = self._pass
        scope = rows.FORWARD if state.trains else rows.EVAL_FORWARD
        for rec in state.records:
            rec.scope = scope
        self._records += state.records
        state.records = []

    def _records_gradient(self) -> bool:
        return self._executor is None or bool(self._executor.requires_grad())

    def _emit_forward(self, values: Any, vpp: int, tag: str, kind: str) -> None:
        state = self._pass
        if state.depth == 0:  # outside a chunk's call: this call decides
            scope = rows.FORWARD if self._records_gradient() else rows.EVAL_FORWARD
            self._emit(values, vpp, tag, kind, scope, self._records)
        else:  # the scope is settled with the pass
            state.trains = state.trains or self._records_gradient()
            self._emit(values, vpp, tag, kind, rows.FORWARD, state.records)

    def _emit(self, values: Any, vpp: int, tag: str, kind: str, scope: str, into: List[Any]) -> None:
        engine = self.session.engine
        if kind == rows.OUTPUT:  # a dict output by key (structure.py)
            named = named_outputs(values, _is_tensor, rows.module_prefix(tag, rows.OUTPUT))
        else:
            named = [(rows.module_row(tag, kind, i), t)
                     for i, t in enumerate(flatten_tensors(values, _is_tensor, rows.module_prefix(tag, kind)))]
        tensors, keys = [t for _, t in named], [(vpp, name, scope, None) for name, _ in named]
        if self._noting_dtypes:
            self._note_dtypes(keys, tensors)
        # one call for all of the hook's tensors (the engine batches a cell's many outputs)
        into += engine.record_many(tensors, self.plan, keys)

    def _hook(self, cell: Any, vpp: int, tag: str) -> List[Any]:
        def pre(c: Any, inputs: Tuple, kwargs: Dict = None) -> None:
            if self.active:
                self._emit_forward((inputs, kwargs or {}), vpp, tag, rows.INPUT)

        def post(c: Any, inputs: Tuple, *rest: Any) -> None:
            if self.active:  # (kwargs, output) with with_kwargs, else (output,)
                self._emit_forward(rest[-1], vpp, tag, rows.OUTPUT)

        def backward(c: Any, grad_input: Tuple, grad_output: Tuple) -> None:
            if self.active:
                self._emit_indexed(grad_input, vpp, tag, rows.GRAD_INPUT)
                self._emit_indexed(grad_output, vpp, tag, rows.GRAD_OUTPUT)

        wrap = self.errors.wrap
        extra = {"with_kwargs": True} if _KWARGS else {}
        return [cell.register_forward_pre_hook(wrap(f"module forward pre-hook of {tag}", pre), **extra),
                cell.register_forward_hook(wrap(f"module forward hook of {tag}", post), **extra),
                cell.register_backward_hook(wrap(f"module backward hook of {tag}", backward))]

    def _emit_indexed(self, grads: Any, vpp: int, tag: str, kind: str) -> None:
        # A None gradient (an input that needs none) keeps its index, as in PyTorch.
        items = grads if isinstance(grads, (tuple, list)) else (grads,)
        indexed = [(i, g) for i, g in enumerate(items) if _is_tensor(g)]
        keys = [(vpp, rows.module_row(tag, kind, i), rows.BACKWARD, None) for i, _ in indexed]
        tensors = [g for _, g in indexed]
        if self._noting_dtypes:
            self._note_dtypes(keys, tensors)
        self._records += self.session.engine.record_many(tensors, self.plan, keys)

    def detach(self) -> None:
        remove_all(self._handles)
        remove_all(self._kept)
