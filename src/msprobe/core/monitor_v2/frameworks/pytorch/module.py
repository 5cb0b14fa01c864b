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
"""

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ...monitor import Monitor, remove_all, select_modules
from ...stats import Record
from ...structure import flatten_tensors
from .stats import StatPlan

logger = logging.getLogger("msprobe.monitor_v2")

_get_sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", None)


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

    __slots__ = ("inputs", "boundary")

    def __init__(self, inputs: List[Any], boundary: int) -> None:
        self.inputs = inputs
        self.boundary = boundary


class _GradInputSum:
    """Collects the contributions of several graph edges to one input's gradient."""

    __slots__ = ("expected", "parts")

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.parts: List[torch.Tensor] = []


class ModuleMonitor(Monitor):
    name = "module"

    def attach(self) -> None:
        self.plan = StatPlan.from_ops(self.settings.ops)
        targets: Sequence[str] = self.settings.get("targets")
        self._handles: List[Any] = []
        self._calls: Dict[int, List[_Call]] = {}
        self._pending: Dict[int, Tuple[_GradInputSum, Tuple[int, str]]] = {}
        self._warned: set = set()
        self.attached = True
        named = [(vpp, name, m) for vpp, root in enumerate(self.session.roots) for name, m in root.named_modules()]
        for vpp, tag, module in select_modules(named, targets, self.session.qualify):
            self._hook(module, vpp, tag)

    def _hook(self, module: torch.nn.Module, vpp: int, tag: str) -> None:
        def pre_hook(mod: torch.nn.Module, args: Tuple, kwargs: Dict) -> None:
            if self.active:
                self._before_forward(mod, vpp, tag, args, kwargs)

        # always_call: the post-hook also runs when forward raises (non-reentrant
        # checkpointing stops its recomputation that way), so the call state is dropped.
        def post_hook(mod: torch.nn.Module, args: Tuple, kwargs: Dict, output: Any) -> None:
            if self.active:
                self._after_forward(mod, vpp, tag, output)

        self._handles.append(
            module.register_forward_pre_hook(self.errors.wrap(f"module forward pre-hook of {tag}", pre_hook),
                                             with_kwargs=True)
        )
        self._handles.append(
            module.register_forward_hook(self.errors.wrap(f"module forward hook of {tag}", post_hook),
                                         with_kwargs=True, always_call=True)
        )

    # ------------------------------------------------------------------ forward
    def _before_forward(self, module: torch.nn.Module, vpp: int, tag: str, args: Tuple, kwargs: Dict) -> None:
        inputs = flatten_tensors((args, kwargs), _is_tensor)
        recompute = _in_backward()
        if not recompute:
            engine = self.session.engine
            for i, t in enumerate(inputs):
                self._records.append(engine.record(t, self.plan, vpp, f"{tag}.input.{i}", "forward", cache=True))
        # Nodes created from here on belong to this call; grad_input needs the inputs'
        # producers as they are now, before any in-place op inside the module.
        boundary = _get_sequence_nr() if _get_sequence_nr is not None else -1
        producers = [_grad_edges(t) if t.grad_fn is not None else t for t in inputs]
        self._calls.setdefault(id(module), []).append(_Call(producers, boundary))

    def _after_forward(self, module: torch.nn.Module, vpp: int, tag: str, output: Any) -> None:
        stack = self._calls.get(id(module))
        call = stack.pop() if stack else None
        outputs = flatten_tensors(output, _is_tensor)
        if not _in_backward():
            engine = self.session.engine
            for i, t in enumerate(outputs):
                self._records.append(engine.record(t, self.plan, vpp, f"{tag}.output.{i}", "forward", cache=True))
        if torch.is_grad_enabled() and any(t.requires_grad for t in outputs):
            self._hook_grad_outputs(vpp, tag, outputs, call)
            if call is not None:
                self._hook_grad_inputs(vpp, tag, call, outputs)

    # ----------------------------------------------------------------- backward
    def _hook_grad_outputs(self, vpp: int, tag: str, outputs: List[torch.Tensor], call: Optional[_Call]) -> None:
        by_node: Dict[Any, List[Tuple[int, int]]] = {}
        for j, t in enumerate(outputs):
            if not t.requires_grad:
                continue
            if t.grad_fn is None:
                # A Parameter passed through as an output (Megatron's linear layers return
                # their bias with skip_bias_add): its gradient is the parameter's own,
                # reported by weight_grad, so there is nothing to say about it here.
                if not isinstance(t, torch.nn.Parameter):
                    self._warn_once(f"{tag}.leaf", f"output {j} of {tag} is a leaf tensor; its gradient is not observed")
                continue
            node, nr = _grad_edges(t)[-1]
            if call is not None and node is not t.grad_fn and node._sequence_nr() < call.boundary:
                node, nr = t.grad_fn, t.output_nr  # the base is not this module's own result
            by_node.setdefault(node, []).append((nr, j))
        for node, slots in by_node.items():
            def prehook(grad_outputs: Tuple, slots=slots) -> None:
                if not (self.active and self.attached):
                    return
                for nr, j in slots:
                    g = grad_outputs[nr]
                    if g is not None:
                        self._records.append(self.session.engine.record(
                            g, self.plan, vpp, f"{tag}.grad_output.{j}", "backward", cache=True))
            node.register_prehook(self.errors.wrap(f"module grad_output hook of {tag}", prehook))

    def _hook_grad_inputs(self, vpp: int, tag: str, call: _Call, outputs: List[torch.Tensor]) -> None:
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
        hooks: Dict[Any, List[Tuple[int, int]]] = {}  # node -> [(edge index, input index)]
        counts: Dict[int, int] = {}
        visited = set()
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
                is_leaf = _is_accumulate_grad(child)
                if i is None and is_leaf:
                    i = leaf_targets.get(id(child.variable))
                if i is not None:
                    hooks.setdefault(node, []).append((e, i))
                    counts[i] = counts.get(i, 0) + 1
                elif not is_leaf and child._sequence_nr() >= boundary and child not in visited:
                    stack.append(child)
        # An input reached by several edges gets one accumulator shared by their hooks.
        sums = {i: _GradInputSum(c) for i, c in counts.items() if c > 1}
        for node, edges in hooks.items():

            def posthook(grad_inputs: Tuple, grad_outputs: Tuple, edges=edges) -> None:
                if not (self.active and self.attached):
                    return
                for e, i in edges:
                    g = grad_inputs[e]
                    if g is None:
                        continue
                    name = f"{tag}.grad_input.{i}"
                    acc = sums.get(i)
                    if acc is None:
                        self._records.append(self.session.engine.record(g, self.plan, vpp, name, "backward", cache=True))
                        continue
                    acc.parts.append(g)
                    self._pending[id(acc)] = (acc, (vpp, name))
                    if len(acc.parts) == acc.expected:
                        self._flush(acc, vpp, name)

            node.register_hook(self.errors.wrap(f"module grad_input hook of {tag}", posthook))

    def _flush(self, acc: _GradInputSum, vpp: int, name: str) -> None:
        self._pending.pop(id(acc), None)
        parts, acc.parts = acc.parts, []
        if parts:
            # Parts through a view's node and through its base's node differ only in shape.
            total = parts[0] if len(parts) == 1 else sum((p.reshape(parts[0].shape) for p in parts[1:]), parts[0])
            self._records.append(self.session.engine.record(total, self.plan, vpp, name, "backward"))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("monitor_v2 module: %s (logged once)", message)

    # -------------------------------------------------------------- lifecycle
    def begin_step(self, step: int, active: bool) -> None:
        super().begin_step(step, active)
        self._calls.clear()

    def collect(self) -> List[Record]:
        for acc, (vpp, name) in list(self._pending.values()):
            self._flush(acc, vpp, name)
        return super().collect()

    def detach(self) -> None:
        self.attached = False
        remove_all(self._handles)
        self._calls.clear()
        self._pending.clear()
