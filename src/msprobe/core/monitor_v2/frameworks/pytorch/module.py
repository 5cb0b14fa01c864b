"""``module``: forward inputs/outputs and backward gradients of modules.

Forward: a forward pre-hook records the inputs (before the module can modify them in
place) and a forward hook records the outputs.

Backward, without ``register_full_backward_hook``: that API wraps outputs in a custom
autograd function, and any in-place op on them afterwards (``ReLU(inplace=True)``,
``x += y``) is then a hard error. Instead, hooks go on the autograd graph the forward
pass built, which leaves the graph as it is:

- ``grad_output``: a pre-hook on each output's ``grad_fn`` node receives the gradient
  with respect to that output (even if the output is modified in place later).
- ``grad_input``: the gradient the module sends to each input. The forward hook walks
  the graph from the outputs back to the inputs' producers, stopping at nodes created
  before the module ran, and hooks the nodes whose edges lead into an input. When an
  input is used several times inside the module, the contributions are summed (a
  temporary of the gradient's size, freed at once) before statistics are taken.

Recomputation (activation checkpointing) runs forward hooks again during the
backward pass; those calls record no forward statistics, so nothing is counted twice.

Evaluation passes: a call of a model chunk given to ``start()`` made with gradients off
(``torch.no_grad()``, ``torch.inference_mode()``) or in evaluation mode (``.eval()``)
is an evaluation pass, as the Hugging Face Trainer runs between steps. Its forward rows
go under their own scope ``eval_forward``, never into the training step's ``forward``
rows. The chunk's call decides for every module inside it: reentrant activation
checkpointing runs the training forward of a block under ``no_grad``, and a frozen
submodule may be kept in ``eval()`` mode while the model trains. A module called outside
a chunk's call (Lightning's ``training_step``/``validation_step`` call submodules) is in
an evaluation pass when its chunk is in ``eval()`` mode or inference mode is on.

Threads: passes are tracked per thread. A second thread calling the model while the
main thread trains (an evaluation under ``no_grad`` on a background thread) is in its
own pass, decided by its own outermost call: under ``no_grad`` or ``eval()`` its rows go
under ``eval_forward``, never into the training ``forward`` rows.

Copies and ``torch.compile``: the forward hooks are left out of ``torch.save``,
``copy.deepcopy`` and EMA/SWA copies of the modules (see ``copies.py``), and Dynamo does
not trace them (``compile.py``): a compiled model breaks its graph at each
monitored module, and the hooks run eagerly on the real tensors there.
"""

import logging
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ... import rows
from ...logonce import LogOnce
from ...monitor import ContainedHook, Monitor, select_modules
from ...stats import Record
from ...structure import flatten_tensors, named_outputs
from .compile import eager_hook, warn_if_already_compiled
from .copies import ModuleHooks
from .passes import internal_pass
from .stats import StatPlan

logger = logging.getLogger("msprobe.monitor_v2")

_get_sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", None)
def _is_evaluation(module: torch.nn.Module) -> bool:
    return not torch.is_grad_enabled() or not module.training


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


_ACCUMULATE_GRAD: Dict[type, bool] = {}


def _is_accumulate_grad(node: Any) -> bool:
    """Whether a graph node accumulates into a leaf (has ``variable``). Decided once per
    node type: ``hasattr`` on the other C++ node types raises inside, on every edge."""
    kind = type(node)
    known = _ACCUMULATE_GRAD.get(kind)
    if known is None:
        known = _ACCUMULATE_GRAD[kind] = hasattr(node, "variable")
    return known


def _in_backward() -> bool:
    return torch._C._current_autograd_node() is not None


def _grad_edges(t: torch.Tensor) -> List[Tuple[Any, int]]:
    """The graph edges through which a gradient with respect to ``t`` can flow.

    An in-place op on a view (``x += y`` after a ``Linear`` on a 3-D input, whose output
    is a view of a 2-D matmul) takes the view's own node out of the graph: the gradient
    then flows into the node of the view's base. A view with as many elements as its
    base is a reshape, so the gradient of the base has the same statistics."""
    edges = [(t.grad_fn, t.output_nr)]
    if t._is_view():
        base = t._base
        if base is not None and base.grad_fn is not None and base.numel() == t.numel():
            edges.append((base.grad_fn, base.output_nr))
    return edges


class _Call:
    """State of one module call between its pre-hook and its forward hook: for each
    input, its producer edges (or the leaf tensor itself), and the sequence number from
    which autograd nodes belong to this call."""

    __slots__ = ("inputs", "boundary", "scope")

    def __init__(self, inputs: List[Any], boundary: int, scope: str) -> None:
        self.inputs = inputs
        self.boundary = boundary
        self.scope = scope


class _Pass(threading.local):
    """One thread's pass: nesting of model chunk calls in progress, whether the
    outermost one is an evaluation pass, and nesting of framework-internal chunk calls
    (passes.py)."""

    depth = 0
    evaluation = False
    internal = 0


class _Names:
    """One module's row names and error sites, formatted once at attach time (or at a
    name's first use) instead of on every call: the hooks run for every module on
    every written step."""

    __slots__ = ("tag", "input_prefix", "output_prefix", "output_0", "grad_output_prefix",
                 "_inputs", "_grad_outputs", "_grad_inputs", "grad_output_site", "grad_input_site")

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.input_prefix = rows.module_prefix(tag, rows.INPUT)
        self.output_prefix = rows.module_prefix(tag, rows.OUTPUT)
        self.output_0 = rows.module_row(tag, rows.OUTPUT, 0)
        self.grad_output_prefix = rows.module_prefix(tag, rows.GRAD_OUTPUT)
        self._inputs: List[str] = []
        self._grad_outputs: Dict[str, str] = {}
        self._grad_inputs: List[str] = []
        self.grad_output_site = f"module grad_output hook of {tag}"
        self.grad_input_site = f"module grad_input hook of {tag}"

    def input(self, i: int) -> str:
        names = self._inputs
        while len(names) <= i:
            names.append(rows.module_row(self.tag, rows.INPUT, len(names)))
        return names[i]

    def grad_input(self, i: int) -> str:
        names = self._grad_inputs
        while len(names) <= i:
            names.append(rows.module_row(self.tag, rows.GRAD_INPUT, len(names)))
        return names[i]

    def grad_output(self, suffix: str) -> str:
        name = self._grad_outputs.get(suffix)
        if name is None:
            name = self._grad_outputs[suffix] = rows.module_row(self.tag, rows.GRAD_OUTPUT, suffix)
        return name


class _GradInputSum:
    """Collects the contributions of several graph edges to one input's gradient."""

    __slots__ = ("expected", "parts")

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.parts: List[torch.Tensor] = []


class _GradOutputHook(ContainedHook):
    """The ``grad_output`` pre-hook of one graph node: the gradients of the outputs in
    ``slots`` (``(output number, row name)``). A ``ContainedHook``: these are built for
    every monitored module on every written step and live until the backward pass, long
    enough for the garbage collector to move them to its oldest generation, whose full
    collections they then bring forward (a closure in a wrapper was seven objects)."""

    __slots__ = ("vpp", "slots")

    def __init__(self, monitor: "ModuleMonitor", vpp: int, slots: List[Tuple[int, str]], site: str) -> None:
        super().__init__(monitor, site)
        self.vpp = vpp
        self.slots = slots

    def run(self, grad_outputs: Tuple) -> None:
        monitor = self.monitor
        if not monitor.attached:
            return
        engine, plan, records, vpp = monitor.session.engine, monitor.plan, monitor._records, self.vpp
        for nr, name in self.slots:
            g = grad_outputs[nr]
            if g is not None:
                records.append(engine.record(g, plan, vpp, name, rows.BACKWARD, cache=True))


class _GradInputHook(ContainedHook):
    """The ``grad_input`` post-hook of one graph node (``_GradOutputHook``'s reasons):
    ``edges`` are ``(edge index, input index, row name)``, ``sums`` the accumulators of
    inputs reached by several edges."""

    __slots__ = ("vpp", "edges", "sums")

    def __init__(self, monitor: "ModuleMonitor", vpp: int, edges: List[Tuple[int, int, str]],
                 sums: Dict[int, _GradInputSum], site: str) -> None:
        super().__init__(monitor, site)
        self.vpp = vpp
        self.edges = edges
        self.sums = sums

    def run(self, grad_inputs: Tuple, grad_outputs: Tuple) -> None:
        monitor = self.monitor
        if monitor.attached:
            monitor._grad_inputs(self.vpp, self.edges, self.sums, grad_inputs)


class ModuleMonitor(Monitor):
    name = rows.MODULE

    def attach(self) -> None:
        self.plan = StatPlan.from_ops(self.settings.ops)
        targets: Sequence[str] = self.settings.get("targets")
        self._hooks = ModuleHooks()
        self._calls: Dict[Tuple[int, int], List[_Call]] = {}  # (thread, module) -> calls in progress
        self._pending: Dict[int, Tuple[_GradInputSum, Tuple[int, str]]] = {}
        self._once = LogOnce()
        self._pass = _Pass()  # per thread: a background evaluation never joins the training pass
        self.attached = True
        for vpp, tag, module in select_modules(self.session.named_modules(), targets, self.session.table.qualify):
            self._hook(module, vpp, tag)
        roots = {id(r): r for r in self.session.roots}
        for root in roots.values():
            self._track_passes(root)
        warn_if_already_compiled()

    def _track_passes(self, root: torch.nn.Module) -> None:
        """Hooks around each call of a model chunk: the first to run before the call and
        the last after it, so that the chunk's own rows are classified too. A call the
        framework makes for itself (pipelining's shape inference, a pass on meta tensors:
        see passes.py) records nothing, forward or backward: no rows, and no graph hooks on
        what it builds. It is looked for on written steps only: elsewhere nothing is
        recorded anyway, and the check reads every input's type."""

        def enter(mod: torch.nn.Module, args: Tuple, kwargs: Dict) -> None:
            state = self._pass
            if state.depth == 0:
                state.evaluation = _is_evaluation(mod)
            state.depth += 1
            if state.internal:
                state.internal += 1
            elif self.active:
                what = internal_pass(args, kwargs)
                if what is not None:
                    state.internal = 1
                    self._once.info(("internal", what), "monitor_v2 module: %s is a framework-internal pass, not "
                                    "training: no module rows for it (logged once)", what)

        def leave(mod: torch.nn.Module, args: Tuple, output: Any) -> None:
            state = self._pass
            if state.depth:
                state.depth -= 1
            if state.internal:
                state.internal -= 1

        self._hooks.forward_pre(root, eager_hook(self.errors.wrap("module pass tracking", enter)), prepend=True,
                                with_kwargs=True)
        self._hooks.forward(root, eager_hook(self.errors.wrap("module pass tracking", leave)), always_call=True)

    def _forward_scope(self, vpp: int) -> str:
        state = self._pass
        if state.depth:
            evaluation = state.evaluation
        else:
            # A submodule called outside the model's own call (a LightningModule's
            # training_step calls its submodules): the model's mode decides, or inference
            # mode. Plain no_grad does not: reentrant checkpointing trains under it.
            evaluation = not self.session.roots[vpp].training or torch.is_inference_mode_enabled()
        return rows.EVAL_FORWARD if evaluation else rows.FORWARD

    def _hook(self, module: torch.nn.Module, vpp: int, tag: str) -> None:
        names = _Names(tag)

        def pre_hook(mod: torch.nn.Module, args: Tuple, kwargs: Dict) -> None:
            if self.active and not self._pass.internal:
                self._before_forward(mod, vpp, names, args, kwargs)

        # always_call: the post-hook also runs when forward raises (non-reentrant
        # checkpointing stops its recomputation that way), so the call state is dropped.
        def post_hook(mod: torch.nn.Module, args: Tuple, kwargs: Dict, output: Any) -> None:
            if self.active and not self._pass.internal:
                self._after_forward(mod, vpp, names, output)

        # owner=self: on steps that are not written the hooks return before any other call
        self._hooks.forward_pre(module, eager_hook(self.errors.wrap(f"module forward pre-hook of {tag}", pre_hook),
                                                   self), with_kwargs=True)
        self._hooks.forward(module, eager_hook(self.errors.wrap(f"module forward hook of {tag}", post_hook), self),
                            with_kwargs=True, always_call=True)

    # ------------------------------------------------------------------ forward
    def _before_forward(self, module: torch.nn.Module, vpp: int, names: _Names, args: Tuple, kwargs: Dict) -> None:
        if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):
            inputs: List[Any] = [args[0]]  # the common call, without the general walk
        else:
            inputs = flatten_tensors((args, kwargs), _is_tensor, names.input_prefix)
        scope = self._forward_scope(vpp)
        if not _in_backward():
            engine = self.session.engine
            plan = self.plan
            records = self._records
            for i, t in enumerate(inputs):
                records.append(engine.record(t, plan, vpp, names.input(i), scope, cache=True))
        # Nodes created from here on belong to this call; grad_input needs the inputs'
        # producers as they are now, before any in-place op inside the module.
        boundary = _get_sequence_nr() if _get_sequence_nr is not None else -1
        producers = [_grad_edges(t) if t.grad_fn is not None else t for t in inputs]
        key = (threading.get_ident(), id(module))
        stack = self._calls.get(key)  # not setdefault: its default list would be built on every call
        if stack is None:
            stack = self._calls[key] = []
        stack.append(_Call(producers, boundary, scope))

    def _after_forward(self, module: torch.nn.Module, vpp: int, names: _Names, output: Any) -> None:
        stack = self._calls.get((threading.get_ident(), id(module)))
        call = stack.pop() if stack else None
        if isinstance(output, torch.Tensor):  # the common output, without the general walk
            named: List[Tuple[str, Any]] = [(names.output_0, output)]
            outputs = [output]
        else:
            named = named_outputs(output, _is_tensor, names.output_prefix)  # a dict output by key: structure.py
            outputs = [t for _, t in named]
        if not _in_backward():
            engine = self.session.engine
            plan = self.plan
            records = self._records
            scope = call.scope if call is not None else self._forward_scope(vpp)
            for name, t in named:
                records.append(engine.record(t, plan, vpp, name, scope, cache=True))
        if torch.is_grad_enabled() and (outputs[0].requires_grad if len(outputs) == 1
                                        else any(t.requires_grad for t in outputs)):
            cut = len(names.output_prefix) + 1  # after "<prefix>."
            grad_names = [names.grad_output(name[cut:]) for name, _ in named]
            self._hook_grad_outputs(vpp, names, outputs, call, grad_names)
            if call is not None:
                self._hook_grad_inputs(vpp, names, call, outputs)

    # ----------------------------------------------------------------- backward
    def _hook_grad_outputs(self, vpp: int, names: _Names, outputs: List[torch.Tensor], call: Optional[_Call],
                           grad_names: Sequence[str]) -> None:
        by_node: Dict[Any, List[Tuple[int, str]]] = {}
        for j, t in enumerate(outputs):
            if not t.requires_grad:
                continue
            if t.grad_fn is None:
                # A Parameter passed through as an output (Megatron's linear layers return
                # their bias with skip_bias_add): its gradient is the parameter's own,
                # reported by weight_grad, so there is nothing to say about it here.
                if not isinstance(t, torch.nn.Parameter):
                    tag = names.tag
                    suffix = grad_names[j][len(names.grad_output_prefix) + 1:]
                    self._warn_once(f"{tag}.leaf", f"output {suffix} of {tag} is a leaf tensor; its gradient "
                                    f"is not observed")
                continue
            node, nr = _grad_edges(t)[-1]
            if call is not None and node is not t.grad_fn and node._sequence_nr() < call.boundary:
                node, nr = t.grad_fn, t.output_nr  # the base is not this module's own result
            by_node.setdefault(node, []).append((nr, grad_names[j]))
        site = names.grad_output_site
        for node, slots in by_node.items():
            node.register_prehook(_GradOutputHook(self, vpp, slots, site))

    def _hook_grad_inputs(self, vpp: int, names: _Names, call: _Call, outputs: List[torch.Tensor]) -> None:
        edge_targets: Dict[Tuple[Any, int], int] = {}
        leaf_targets: Dict[int, int] = {}
        boundary = call.boundary
        for i, producer in enumerate(call.inputs):
            if isinstance(producer, list):
                for edge in producer:
                    edge_targets[edge] = i
                    if _get_sequence_nr is None:
                        boundary = max(boundary, edge[0]._sequence_nr())
            elif producer.requires_grad:
                leaf_targets[id(producer)] = i
        if not edge_targets and not leaf_targets:
            return
        hooks: Dict[Any, List[Tuple[int, int, str]]] = {}  # node -> [(edge index, input index, row name)]
        counts: Dict[int, int] = {}
        visited = set()
        accumulate = _ACCUMULATE_GRAD
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node in visited:
                continue
            visited.add(node)
            for e, (child, nr) in enumerate(node.next_functions):
                if child is None:
                    continue
                i = edge_targets.get((child, nr))
                is_leaf = accumulate.get(type(child))
                if is_leaf is None:
                    is_leaf = _is_accumulate_grad(child)
                if i is None and is_leaf and leaf_targets:  # ``variable`` builds a Python object
                    i = leaf_targets.get(id(child.variable))
                if i is not None:
                    hooks.setdefault(node, []).append((e, i, names.grad_input(i)))
                    counts[i] = counts.get(i, 0) + 1
                elif not is_leaf and child._sequence_nr() >= boundary and child not in visited:
                    stack.append(child)
        # An input reached by several edges gets one accumulator shared by their hooks.
        sums = {i: _GradInputSum(c) for i, c in counts.items() if c > 1}
        site = names.grad_input_site
        for node, edges in hooks.items():
            node.register_hook(_GradInputHook(self, vpp, edges, sums, site))

    def _grad_inputs(self, vpp: int, edges: List[Tuple[int, int, str]], sums: Dict[int, _GradInputSum],
                     grad_inputs: Tuple) -> None:
        """The body of a ``grad_input`` hook: each edge's gradient, or its part of a sum."""
        for e, i, name in edges:
            g = grad_inputs[e]
            if g is None:
                continue
            acc = sums.get(i)
            if acc is None:
                self._records.append(self.session.engine.record(g, self.plan, vpp, name, rows.BACKWARD, cache=True))
                continue
            acc.parts.append(g)
            self._pending[id(acc)] = (acc, (vpp, name))
            if len(acc.parts) == acc.expected:
                self._flush(acc, vpp, name)

    def _flush(self, acc: _GradInputSum, vpp: int, name: str) -> None:
        self._pending.pop(id(acc), None)
        parts, acc.parts = acc.parts, []
        if parts:
            # Parts through a view's node and through its base's node differ only in shape.
            total = parts[0] if len(parts) == 1 else sum((p.reshape(parts[0].shape) for p in parts[1:]), parts[0])
            self._records.append(self.session.engine.record(total, self.plan, vpp, name, rows.BACKWARD))

    def _warn_once(self, key: str, message: str) -> None:
        self._once.warning(key, "monitor_v2 module: %s (logged once)", message)

    # -------------------------------------------------------------- lifecycle
    def begin_step(self, step: int, active: bool) -> None:
        super().begin_step(step, active)
        self._calls.clear()
        self._pass.depth = 0  # no model call of this thread spans a step boundary; never let a count drift
        self._pass.internal = 0

    def collect(self) -> List[Record]:
        for acc, (vpp, name) in list(self._pending.values()):
            self._flush(acc, vpp, name)
        return super().collect()

    def detach(self) -> None:
        self.attached = False
        self._hooks.remove_all()
        self._calls.clear()
        self._pending.clear()
