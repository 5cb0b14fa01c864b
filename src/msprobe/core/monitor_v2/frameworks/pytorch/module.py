"""``module``: forward inputs/outputs and backward gradients of modules.

Forward: a forward pre-hook records the inputs (before the module can modify them in
place) and a forward hook records the outputs. On a written step with the kernel's
extension, a module without hooks that is not a model chunk given to ``start()`` has its
``forward`` wrapped instead (the extension's ``CallWrapper``, set in the module's instance
dictionary, calling the same two hooks around its class's forward): a module with any
forward hook takes PyTorch's slow call path, about 3.5 us a call in Python, and a module
whose only observer is the wrapper keeps the fast one; with no other hook, both see the
same tensors. A module with hooks, or with a ``forward`` of its own in its instance
dictionary (a library's wrapper), or of a class a kernel library swaps forwards of
(``_rekernelized``), keeps the hooks; a wrapped module that gains a hook gets the monitor's
hooks first at its next call (``_hooked_instead``); a wrapper someone removes or replaces
is found before each model chunk's call on written steps (``_follow_replaced``) and set
again, or gives way to the hooks, before the module's next call; one replaced while a
chunk's call is in progress, or in a module called outside any chunk, is found at the
step's end, said once and hooked from then on (``_check_wrapped``).
``MSPROBE_MONITOR_WRAP=0``: hooks everywhere.

Backward, without ``register_full_backward_hook``: that API wraps outputs in a custom
autograd function, and any in-place op on them afterwards (``ReLU(inplace=True)``,
``x += y``) is then a hard error. Instead, hooks go on the autograd graph the forward
pass built, which leaves the graph as it is:

- ``grad_output``: each output's ``grad_fn`` node receives the gradient with respect to
  that output (even if the output is modified in place later), in a pre-hook or as a
  post-hook's second argument.
- ``grad_input``: the gradient the module sends to each input. The forward hook walks
  the graph from the outputs back to the inputs' producers, stopping at nodes created
  before the module ran, and hooks the nodes whose edges lead into an input. When an
  input is used several times inside the module, the contributions are summed (a
  temporary of the gradient's size, freed at once) before statistics are taken.

A node serves several modules (a Linear's output node gives its ``grad_output``, its
``grad_input`` and its block's ``grad_input``): the monitor puts one hook object on it
for all of them (``_NodeHook``).

Steps that are not written: where the next written step is at least four steps away,
the modules' hooks and wrappers come off and go back on for the written step, each hook
where it ran among the module's other hooks; once Dynamo compiles anything the hooks stay
on, and no forward is wrapped (``_set_call_hooks``, ``_compile_started``).

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

Generation: a model call made inside ``generate`` (transformers' ``GenerationMixin.generate``,
as ``model.generate(...)`` and TRL's GRPO/PPO trainers call it inside their training step,
under ``no_grad`` with the model in train mode) is a generation pass: its forward rows
(prefill and every decoding step) go under their own scope ``generate``, apart from the
training step's ``forward`` rows and from evaluation's ``eval_forward``. The monitor wraps
``generate`` where transformers defines it (and each override in the classes of the
monitored modules) while it runs: the wrapper counts this thread's generations in
progress and nothing else; ``stop()`` puts the functions back.

Threads: passes are tracked per thread. A second thread calling the model while the
main thread trains (an evaluation under ``no_grad`` on a background thread) is in its
own pass, decided by its own outermost call: under ``no_grad`` or ``eval()`` its rows go
under ``eval_forward``, never into the training ``forward`` rows.

Copies and ``torch.compile``: the forward hooks are left out of ``torch.save``,
``copy.deepcopy`` and EMA/SWA copies of the modules (see ``copies.py``), and Dynamo does
not trace them (``compile.py``): a compiled model breaks its graph at each
monitored module, and the hooks run eagerly on the real tensors there.
"""

import functools
import inspect
import itertools
import logging
import os
import sys
import threading
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ... import native, rows
from ...layout import dtype_name
from ...logonce import LogOnce
from ...model_structure import target_hits
from ...monitor import ContainedHook, Monitor, module_tags, select_modules
from ...param_table import Added
from ...patching import Patch, replace_attribute
from ...stats import Record
from ...structure import flatten_tensors, named_outputs
from .compile import _skipped as skip_in_dynamo
from .compile import compiled_anything, eager_hook, on_next_compile, warn_if_already_compiled
from . import graph_hooks
from .copies import ModuleHooks, hook_order, restore_order
from .passes import internal_pass
from .stats import StatPlan

logger = logging.getLogger("msprobe.monitor_v2")

_get_sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", None)
_current_autograd_node = torch._C._current_autograd_node
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_NO_ARGUMENT = object()
_NODE_HOOK_SITE = "module graph hook"
_IDLE_STEPS_TO_UNHOOK = 4  # see ModuleMonitor.begin_step
_NO_SEQUENCE_NR = 2 ** 64 - 1  # UINT64_MAX: the number of nodes outside the sequence


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


def _grad_edges(t: torch.Tensor, fn: Any) -> Tuple[Tuple[Any, int], ...]:
    """The graph edges through which a gradient with respect to ``t`` can flow (``fn``:
    ``t.grad_fn``, read once by the caller).

    An in-place op on a view (``x += y`` after a ``Linear`` on a 3-D input, whose output
    is a view of a 2-D matmul) takes the view's own node out of the graph: the gradient
    then flows into the node of the view's base. A view with as many elements as its
    base is a reshape, so the gradient of the base has the same statistics."""
    own = (fn, t.output_nr)
    if t._is_view():
        base = t._base
        if base is not None and base.grad_fn is not None and base.numel() == t.numel():
            return own, (base.grad_fn, base.output_nr)
    return (own,)


def _producer(t: torch.Tensor) -> Any:
    """What made a call's input: its graph edges, or the tensor itself where it has no
    ``grad_fn`` (a leaf, or a tensor that needs no gradient)."""
    fn = t.grad_fn
    if fn is None:
        return t
    return _grad_edges(t, fn) if t._is_view() else ((fn, t.output_nr),)


def _output_edge(t: torch.Tensor, own: Any, call: Optional["_Call"]) -> Tuple[Any, int]:
    """The node and output number that receive the gradient with respect to the output
    ``t`` (``own``: its ``grad_fn``): its base's where an in-place op on the view moved it
    there (``_grad_edges``), unless the base was made before the call."""
    if not t._is_view():
        return own, t.output_nr
    edges = _grad_edges(t, own)
    node, nr = edges[-1]
    if call is not None and node is not own and node._sequence_nr() < call.boundary:
        node, nr = edges[0]  # the base is not this module's own result
    return node, nr


def _one_edge(call: "_Call") -> Optional[Tuple[Any, int]]:
    """The one graph edge that made a call's one input, where that is what it has (the
    common call: its ``grad_input`` needs no input tables); None otherwise."""
    inputs = call.inputs
    if len(inputs) == 1 and type(inputs[0]) is tuple and len(inputs[0]) == 1 and _get_sequence_nr is not None:
        return inputs[0][0]
    return None


class _Call:
    """State of one module call between its pre-hook and its forward hook: for each
    input, its producer edges (or the leaf tensor itself), the sequence number from
    which autograd nodes belong to this call, and the call of the same module and
    thread it is nested in (a stack without a list per module)."""

    __slots__ = ("inputs", "boundary", "scope", "outer")

    def __init__(self, inputs: List[Any], boundary: int, scope: str, outer: Optional["_Call"]) -> None:
        self.inputs = inputs
        self.boundary = boundary
        self.scope = scope
        self.outer = outer


class _Pass(threading.local):
    """One thread's pass: nesting of model chunk calls in progress, whether the
    outermost one is an evaluation pass or a generation pass (made inside ``generate``),
    nesting of framework-internal chunk calls (passes.py), and the graph hooks put on
    nodes of this thread's pass (``_NodeHook``). ``scope``: the forward scope of a module
    call inside a chunk's call that is not internal, None otherwise (``settled``): the one
    attribute the extension's ``CallHook`` reads to know that it decides the call."""

    depth = 0
    evaluation = False
    generation = False
    internal = 0
    nodes: Optional[Dict[int, "_NodeHook"]] = None
    scope: Optional[str] = None

    def settled(self) -> None:
        """``scope`` after a change of ``depth``, ``internal``, ``evaluation`` or ``generation``."""
        self.scope = None if self.internal or not self.depth else (
            rows.GENERATE if self.generation else rows.EVAL_FORWARD if self.evaluation else rows.FORWARD)


class _Generating(threading.local):
    """This thread's calls of a generation function (``generate``) in progress."""

    depth = 0


_GENERATING = _Generating()
# Where transformers defines generation: GenerationMixin.generate, which model.generate(...)
# reaches (an override in a model's class calls it through super(), or is wrapped too).
_GENERATION_MODULE = "transformers.generation.utils"
_GENERATION_BASE = "GenerationMixin"
_GENERATION_FUNCTION = "generate"
# (class, name) -> [the patch that put the wrapper there, the monitors using it]: one wrapper
# a function for the process, whatever the number of monitors, removed with the last of them
_GENERATION_WRAPPERS: Dict[Tuple[type, str], List[Any]] = {}
_GENERATION_LOCK = threading.Lock()


def _counting_generation(generate: Callable[..., Any]) -> Callable[..., Any]:
    """``generate`` that counts itself in progress in this thread (``_GENERATING``): the
    module monitor reads the count at a model call to tell a generation pass."""
    @functools.wraps(generate)  # the signature stays readable (inspect follows __wrapped__)
    def generating(*args: Any, **kwargs: Any) -> Any:
        state = _GENERATING
        state.depth += 1
        try:
            return generate(*args, **kwargs)
        finally:
            state.depth -= 1

    return generating


def _generation_owners(modules: Sequence[torch.nn.Module]) -> List[type]:
    """The classes whose ``generate`` a generation of ``modules`` runs: transformers'
    ``GenerationMixin`` (where transformers is imported) and, in the classes of the
    modules, each one subclassing it that defines ``generate`` itself (an override that
    does not call ``super().generate``, as some speech and multimodal models have)."""
    module = sys.modules.get(_GENERATION_MODULE)
    base = getattr(module, _GENERATION_BASE, None) if module is not None else None
    if not isinstance(base, type):
        return []
    owners: List[type] = [base]
    seen = {base}
    for kind in {type(m) for m in modules}:
        if not issubclass(kind, base):
            continue
        for cls in kind.__mro__:
            if cls not in seen and issubclass(cls, base) and callable(vars(cls).get(_GENERATION_FUNCTION)):
                seen.add(cls)
                owners.append(cls)
    return owners


def _release_generation_wrapper(key: Tuple[type, str]) -> None:
    with _GENERATION_LOCK:
        entry = _GENERATION_WRAPPERS.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _GENERATION_WRAPPERS[key]
            entry[0].remove()


class _GenerationPatch(Patch):
    """One monitor's use of the ``generate`` wrapper of ``key`` (``_watch_generation``)."""

    __slots__ = ("key",)

    def __init__(self, key: Tuple[type, str]) -> None:
        super().__init__(functools.partial(_release_generation_wrapper, key))
        self.key = key


def _watch_generation(modules: Sequence[torch.nn.Module], watched: List[Patch]) -> None:
    """Count generations in progress (``_counting_generation``) around each ``generate`` of
    ``_generation_owners(modules)`` not yet in ``watched``; each patch added to ``watched``
    releases its wrapper, which goes when no monitor uses it."""
    have = {p.key for p in watched if isinstance(p, _GenerationPatch)}
    for owner in _generation_owners(modules):
        key = (owner, _GENERATION_FUNCTION)
        if key in have:
            continue
        with _GENERATION_LOCK:
            entry = _GENERATION_WRAPPERS.get(key)
            if entry is None:
                function = vars(owner)[_GENERATION_FUNCTION]
                patch = replace_attribute(owner, _GENERATION_FUNCTION, _counting_generation(function))
                entry = _GENERATION_WRAPPERS[key] = [patch, 0]
            entry[1] += 1
        watched.append(_GenerationPatch(key))


class _Names:
    """One module's row names and error sites, formatted once at attach time (or at a
    name's first use) instead of on every call: the hooks run for every module on
    every written step."""

    __slots__ = ("tag", "input_prefix", "output_prefix", "output_0", "grad_output_prefix", "grad_output_0",
                 "_inputs", "_grad_outputs", "_grad_inputs", "grad_output_site", "grad_input_site", "vpp",
                 "out_slot_0", "_in_slots", "outs_0", "_in_ones")

    def __init__(self, tag: str, vpp: int) -> None:
        self.tag = tag
        self.vpp = vpp
        self.input_prefix = rows.module_prefix(tag, rows.INPUT)
        self.output_prefix = rows.module_prefix(tag, rows.OUTPUT)
        self.output_0 = rows.module_row(tag, rows.OUTPUT, 0)
        self.grad_output_prefix = rows.module_prefix(tag, rows.GRAD_OUTPUT)
        self._inputs: List[str] = []
        self._grad_outputs: Dict[str, str] = {}
        self._grad_inputs: List[str] = []
        # the name of a single tensor output's gradient (output_0's suffix)
        self.grad_output_0 = self.grad_output(self.output_0[len(self.output_prefix) + 1:])
        self.grad_output_site = f"module grad_output hook of {tag}"
        self.grad_input_site = f"module grad_input hook of {tag}"
        # The graph hooks' slots of the common call, made once: every written step puts
        # them on the nodes again, and a tuple made per step lives until its backward.
        self.out_slot_0 = (vpp, 0, self.grad_output_0, self.grad_output_site)
        self._in_slots: Dict[int, Tuple[int, int, str, int, int, str]] = {}
        # A node's first slot is most often its only one: the one-slot tuples are made once
        # too (about 1,750 tuples a step fewer on a model of 250 blocks, each an object the
        # collector counts).
        self.outs_0 = (self.out_slot_0,)
        self._in_ones: Dict[int, Tuple[Tuple[int, int, str, int, int, str]]] = {}

    def out_slot(self, vpp: int, nr: int, name: str) -> Tuple[int, int, str, str]:
        """The ``grad_output`` slot of output ``nr`` named ``name``: the one made at attach
        time for the common call's."""
        if nr == 0 and name is self.grad_output_0 and vpp == self.vpp:
            return self.out_slot_0
        return (vpp, nr, name, self.grad_output_site)

    def add_out(self, outs: Tuple, vpp: int, nr: int, name: str) -> Tuple:
        """``outs`` (a node hook's ``grad_output`` slots) with ``out_slot(vpp, nr, name)`` added."""
        if not outs and nr == 0 and name is self.grad_output_0 and vpp == self.vpp:
            return self.outs_0
        return outs + (self.out_slot(vpp, nr, name),)

    def add_in(self, ins: Tuple, e: int) -> Tuple:
        """``ins`` (a node hook's ``grad_input`` slots) with ``in_slot(e)`` added."""
        if ins:
            return ins + (self.in_slot(e),)
        one = self._in_ones.get(e)
        if one is None:
            one = self._in_ones[e] = (self.in_slot(e),)
        return one

    def in_slot(self, e: int) -> Tuple[int, int, str, int, int, str]:
        """The ``grad_input`` slot of input 0 reached by the one edge ``e`` of its node."""
        slot = self._in_slots.get(e)
        if slot is None:
            slot = self._in_slots[e] = (self.vpp, e, self.grad_input(0), -1, 1, self.grad_input_site)
        return slot

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


# A running sum (``ModuleMonitor._sums``): the gradient one input receives through several
# graph edges, the parts added in the order they arrive (``((p0 + p1) + p2)``, the order
# ``sum`` adds in), one temporary of the gradient's size, recorded and dropped when the last
# part is in (or at ``collect`` when some part never came). Made when the first part
# arrives: the graph hooks' slots name it by a number, so that no object lives from the
# forward pass to the backward pass for it. A list ``[expected, count, total, vpp, name]``,
# which the extension's NodeHook reads and writes too.
_EXPECTED, _COUNT, _TOTAL, _SUM_VPP, _SUM_NAME = range(5)


class _NodeHook(ContainedHook):
    """All of the monitor's hooks on one autograd node, as one object: ``outs`` the
    ``grad_output`` slots ``(vpp, output number, row name, site)`` and ``ins`` the
    ``grad_input`` edges ``(vpp, edge index, row name, sum number, parts, site)`` of every module
    whose rows come from this node, in the order the modules' forward hooks put them.

    One object per node rather than a pre-hook and a post-hook per module: a Linear's
    output node is where its ``grad_output`` and its ``grad_input`` come from, and the
    same node serves the enclosing block's ``grad_input`` (and a wrapper's ``grad_output``):
    each registration costs torch a hook dictionary and a handle. Where the node gets a
    ``grad_input`` edge the object is a post-hook only, and reads the ``grad_output``
    slots from the post-hook's second argument (the node's incoming gradients, the ones a
    pre-hook would be given); a node with ``grad_output`` slots only gets a pre-hook (a
    post-hook makes the engine keep the incoming gradients while the node runs). The
    rows come in the order separate hooks gave: every ``grad_output`` of the node, then
    every ``grad_input``.

    A ``monitor.ContainedHook``: it returns at once while its monitor is not active, an
    error in one slot is logged once per site (the module's grad_output or grad_input
    hook; an error outside the slots under ``module graph hook``) and never reaches
    training, and the time is counted in ``busy``. The slots are tuples of strings and
    ints, which the garbage collector stops tracking: they live from the forward pass to
    the backward pass of every written step (an input reached by several edges has a sum
    number, -1 for one edge, and the number of parts its sum waits for)."""

    __slots__ = ("kind", "outs", "ins", "pre", "post")

    def __init__(self, monitor: "ModuleMonitor", kind: type) -> None:
        super().__init__(monitor, _NODE_HOOK_SITE)
        self.kind = kind
        self.outs: Tuple[Tuple[int, int, str, str], ...] = ()
        self.ins: Tuple[Tuple[int, int, str, int, int, str], ...] = ()
        self.pre = False  # registered as a pre-hook: the ``outs`` are recorded there
        self.post = False

    def run(self, grads: Tuple, grad_outputs: Any = _NO_ARGUMENT) -> None:
        monitor = self.monitor
        if not monitor.attached:
            return
        if grad_outputs is _NO_ARGUMENT:  # the pre-hook: ``grads`` are the node's incoming gradients
            self._outputs(monitor, grads)
            return
        if not self.pre:
            self._outputs(monitor, grad_outputs)
        self._inputs(monitor, grads)

    def _outputs(self, monitor: "ModuleMonitor", grad_outputs: Tuple) -> None:
        read, records = monitor._read, monitor._records
        for vpp, nr, name, site in self.outs:
            try:
                g = grad_outputs[nr]
                if g is not None:
                    records.append(read(g, vpp, name, rows.BACKWARD))
            except Exception as exc:  # noqa: BLE001 - containment is the point
                monitor.errors.report(site, exc)

    def _inputs(self, monitor: "ModuleMonitor", grad_inputs: Tuple) -> None:
        read, records = monitor._read, monitor._records
        for vpp, e, name, number, parts, site in self.ins:
            try:
                g = grad_inputs[e]
                if g is None:
                    continue
                if number < 0:
                    records.append(read(g, vpp, name, rows.BACKWARD))
                else:
                    monitor._add_part(number, parts, vpp, name, g)
            except Exception as exc:  # noqa: BLE001 - containment is the point
                monitor.errors.report(site, exc)


def _edges_into(target: Tuple[Any, int], roots: List[Any], boundary: int) -> List[Tuple[Any, int]]:
    """``(node, edge index)`` of each edge equal to ``target`` met walking the graph from
    the outputs' nodes ``roots``, through nodes numbered from ``boundary`` on: the general
    walk of ``ModuleMonitor._grad_input_edges`` for one input made by one edge, in the same
    order. With the kernel's extension the same walk runs in C (``edges_into``)."""
    found: List[Tuple[Any, int]] = []
    visited = set()
    accumulate = _ACCUMULATE_GRAD
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in visited:
            continue
        visited.add(node)
        for e, edge in enumerate(node.next_functions):
            if edge == target:
                found.append((node, e))
                continue
            child = edge[0]
            if child is None:
                continue
            is_leaf = accumulate.get(type(child))
            if is_leaf is None:
                is_leaf = _is_accumulate_grad(child)
            if not is_leaf and child._sequence_nr() >= boundary and child not in visited:
                stack.append(child)
    return found


def _node_hook(monitor: "ModuleMonitor", nodes: Dict[int, _NodeHook], node: Any) -> _NodeHook:
    """The monitor's hook object of ``node`` in this thread's pass, new if it has none.
    Looked up by the node's sequence number, not its Python object: in some torch
    versions that object is freed and made again between two module calls (its address
    then differs, or is another node's); the number stays (unique within the thread that
    made the node; the type is checked too)."""
    seq = node._sequence_nr()
    if seq == _NO_SEQUENCE_NR:  # a node type that shares this number (AccumulateGrad's): no lookup
        return monitor._new_node_hook(type(node))
    hook = nodes.get(seq)
    if hook is None or hook.kind is not type(node):
        hook = nodes[seq] = monitor._new_node_hook(type(node))
    return hook


def _native_call_hooks(ext: Any) -> bool:
    """Whether the extension's ``CallHook`` can run the modules' common calls here: this torch
    has the sequence numbers the graph hooks need and ``torch.compiler``'s tracing flag (which
    ``CallHook`` reads, as ``torch.compiler.is_compiling`` does, to leave a trace to the Python
    hook). Hands the extension, once, the functions ``CallHook`` calls."""
    global _FORWARD_API_SET
    compiler = getattr(torch, "compiler", None)
    flags = getattr(compiler, "__dict__", {})
    if _get_sequence_nr is None or not isinstance(flags.get("_is_compiling_flag"), bool):
        return False
    if not _FORWARD_API_SET:
        ext.forward_api(_current_autograd_node, _get_sequence_nr, torch.is_grad_enabled, _Tensor, flags,
                        _ACCUMULATE_GRAD, _is_accumulate_grad, _producer, _output_edge, _register, rows.FORWARD,
                        rows.EVAL_FORWARD, _NODE_HOOK_SITE, rows.BACKWARD)
        _FORWARD_API_SET = True
    return True


_FORWARD_API_SET = False


def _register(hook: _NodeHook, node: Any) -> None:
    """Put ``hook`` on ``node``, once: a post-hook where it has ``grad_input`` slots (it then
    reads the ``grad_output`` slots from the post-hook's second argument), a pre-hook
    otherwise. Slots added after it is on are read all the same. Through the C++ graph
    hooks where they are in use and the node is one of torch's C++ nodes (the extension's
    ``CallHook`` does the same), else through torch's Python API."""
    put = _graph.register
    if hook.ins:
        if not hook.post:
            hook.post = True
            if put is None or not put(node, hook, True):
                node.register_hook(hook)
    elif not hook.pre and not hook.post:
        hook.pre = True
        if put is None or not put(node, hook, False):
            node.register_prehook(hook)


# how this process puts node hooks on (graph_hooks.GraphHooks): the C++ library's, or None
_graph = graph_hooks.state


_PLAIN_FORWARD: Dict[type, bool] = {}
# MSPROBE_MONITOR_WRAP=0: every module keeps a pair of forward hooks (its rows are the same
# where no other hook of the module changes its inputs or outputs)
WRAP_SWITCH = "MSPROBE_MONITOR_WRAP"


def _wrapping_allowed() -> bool:
    return os.environ.get(WRAP_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


_module_hooks = torch.nn.modules.module
# torch's global module hooks: any entry puts every module's call on the slow path
_GLOBAL_HOOKS = tuple(d for d in (getattr(_module_hooks, name, None) for name in (
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks", "_global_backward_hooks"))
    if isinstance(d, dict))
_MODULE_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _wrappable(module: torch.nn.Module) -> bool:
    """Whether the monitor's ``CallWrapper`` can be ``module.forward`` for a written step
    instead of a pair of forward hooks: a call of the module is on torch's fast path (no hook
    of its own, no global one: where there is one, the slow path is taken anyway, and the
    monitor's hooks keep their place among the others), its class has a plain function as
    its forward (not a TorchScript module's method), and nothing set a forward of its own on
    the module (a library's wrapper, which would lose it: such a module keeps the hooks), and
    its class is not one a kernel library swaps forwards of (``_rekernelized``)."""
    entries = vars(module)
    kind = type(module)
    if ("forward" in entries or "_replicate_for_data_parallel" in entries or any(_GLOBAL_HOOKS)
            or any(entries.get(name) for name in _MODULE_HOOK_DICTS) or _rekernelized(kind)):
        return False
    plain = _PLAIN_FORWARD.get(kind)
    if plain is None:
        plain = _PLAIN_FORWARD[kind] = (isinstance(inspect.getattr_static(kind, "forward", None), types.FunctionType)
                                         and not issubclass(kind, torch.jit.ScriptModule))
    return plain


def _rekernelized(kind: type) -> bool:
    """Whether ``kernels`` (the hub kernels of transformers 5) may swap the forward of modules
    of class ``kind`` at any time: its ``use_kernel_forward_from_hub`` and
    ``replace_kernel_forward_from_hub`` mark a class with ``kernel_layer_name``, and its
    ``kernelize`` (which transformers 5 runs again on every ``train()``/``eval()`` that changes
    a loaded model's mode) pops such a module's instance ``forward`` or sets a kernel's there,
    wherever the module is called from. Such a module keeps the hooks: they live in its hook
    dictionaries, which ``kernelize`` leaves alone. Looked up at each use, not cached: a class
    can be marked after ``start()``."""
    return getattr(kind, "kernel_layer_name", None) is not None


def _describe(forward: Any) -> str:
    """A short description of someone's ``forward`` for a log line (its type and name only)."""
    if forward is None:
        return "its class's"
    name = getattr(forward, "__qualname__", None)
    return f"{type(forward).__name__} {name}" if isinstance(name, str) else type(forward).__name__


_dynamo_compiling: Callable[[], bool] = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


def _dtype_probe(read: Callable[..., Record], dtypes: Dict[str, str]) -> Callable[..., Record]:
    """A module row's read (``ModuleMonitor._read``) that notes the dtype of the row's
    tensor the first time the row is read (``ModuleMonitor.row_dtypes``); a function, which
    Dynamo traces like the hooks that call it."""

    def probe(t: torch.Tensor, vpp_stage: int, name: str, *rest: Any) -> Record:
        # not while Dynamo traces a hook (fullgraph: the read is what it was without the probe)
        if name not in dtypes and not _dynamo_compiling():
            dtypes[name] = dtype_name(t.dtype)
        return read(t, vpp_stage, name, *rest)

    probe.dtype_probe = True  # type: ignore[attr-defined]
    # a frame Dynamo never compiles (the hooks that call it run eagerly or take their
    # compiling branch; under fullgraph a frame of its own would fail the compile)
    return skip_in_dynamo(probe)


class _CallSpec:
    """What observes one module's calls, made at attach time: its Python pre-hook and forward
    hook, the extension's ``CallHook`` of each (None without the extension), its
    ``CallWrapper`` (None where its forward is never wrapped: a model chunk, no extension,
    ``MSPROBE_MONITOR_WRAP=0``) and its tag, for what is said of it."""

    __slots__ = ("module", "tag", "pre", "post", "native_pre", "native_post", "wrapper")

    def __init__(self, module: torch.nn.Module, tag: str, pre: Any, post: Any, native_pre: Any, native_post: Any,
                 wrapper: Any) -> None:
        self.module, self.tag = module, tag
        self.pre, self.post = pre, post
        self.native_pre, self.native_post = native_pre, native_post
        self.wrapper = wrapper


class _ForwardPreHook(ContainedHook):
    """A module's forward pre-hook (``ContainedHook``: contained, timed, gated on the
    monitor being active): one object per module, built at attach time."""

    __slots__ = ("vpp", "names", "key")

    def __init__(self, monitor: "ModuleMonitor", vpp: int, names: _Names, module: torch.nn.Module) -> None:
        super().__init__(monitor, f"module forward pre-hook of {names.tag}")
        self.vpp = vpp
        self.names = names
        self.key = id(module)

    def run(self, module: torch.nn.Module, args: Tuple, kwargs: Dict) -> None:
        monitor = self.monitor
        if not monitor._pass.internal:
            monitor._before_forward(self.key, self.vpp, self.names, args, kwargs)


class _ForwardHook(ContainedHook):
    """A module's forward hook (``_ForwardPreHook``'s reasons)."""

    __slots__ = ("vpp", "names", "key")

    def __init__(self, monitor: "ModuleMonitor", vpp: int, names: _Names, module: torch.nn.Module) -> None:
        super().__init__(monitor, f"module forward hook of {names.tag}")
        self.vpp = vpp
        self.names = names
        self.key = id(module)

    def run(self, module: torch.nn.Module, args: Tuple, kwargs: Dict, output: Any) -> None:
        monitor = self.monitor
        if not monitor._pass.internal:
            monitor._after_forward(self.key, self.vpp, self.names, output)


class ModuleMonitor(Monitor):
    name = rows.MODULE

    def attach(self) -> None:
        self.plan = StatPlan.from_ops(self.settings.ops)
        # engine.record(t, plan, vpp, name, scope, cache=True) as one call (stats.py, recorder)
        self._read = self.session.engine.recorder(self.plan)
        # a running sum's total is a temporary: read without the same-tensor cache
        self._read_sum = self.session.engine.recorder(self.plan, cache=False)
        # a running sum's next part added (outside the training's dispatch modes, as every
        # tensor op of the engine); the extension's NodeHook calls it too
        self._sum_parts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self.session.engine.sum_parts
        ext = native.extension()
        self._edges_into_api: Callable[[Tuple[Any, int], List[Any], int], List[Tuple[Any, int]]] = (
            _edges_into if ext is None else functools.partial(ext.edges_into, _ACCUMULATE_GRAD, _is_accumulate_grad))
        if ext is not None and self.errors.clock is None:
            self.errors.clock = ext.BusyClock()  # the extension's hooks count their time here
        # a node's hooks: _NodeHook, or the extension's NodeHook (the same in C, and not an
        # object the garbage collector tracks: about 750 fewer a written step per 1,000
        # tensors; it holds the monitor by a weak reference, so it sits in no cycle)
        self._new_node_hook: Callable[[type], Any] = (
            functools.partial(_NodeHook, self) if ext is None
            else functools.partial(ext.NodeHook, self, _NODE_HOOK_SITE, rows.BACKWARD, clock=self.errors.clock))
        targets: Sequence[str] = self.settings.get("targets")
        # each module's pair of hooks, put on for written steps only (see _set_call_hooks)
        self._call_hooks = ModuleHooks()
        # id(module) -> what observes its calls, in the order the modules were selected
        self._specs: Dict[int, _CallSpec] = {}
        self._pass_hook_specs: List[Tuple[torch.nn.Module, Any, Any]] = []  # the chunks' (_track_passes)
        self._call_hooks_on = False
        self._keep_call_hooks = False  # set once Dynamo compiles (see _set_call_hooks)
        self._cancel_on_compile: Optional[Any] = None
        self._native_calls = ext is not None and _native_call_hooks(ext)
        if self._native_calls:
            # Dynamo must find the Python hooks, not CallHook: they go in its place before it
            # traces anything (_compile_started), so the call hooks in C are used only where
            # that moment can be seen
            if compiled_anything():
                self._native_calls = False
            else:
                self._cancel_on_compile = on_next_compile(
                    self.errors.wrap("module hooks at a compile start", self._compile_started))
                self._native_calls = self._cancel_on_compile is not None
        # the call state: the extension's CallState where CallHook runs (it reads its fields directly)
        self._new_call: Callable[[List[Any], int, str, Optional[Any]], Any] = (
            ext.CallState if self._native_calls else _Call)
        self._removed: Optional[Tuple[Dict[int, List[int]], List[Tuple[torch.nn.Module, Any]]]] = None
        self._calls: Dict[Tuple[int, int], _Call] = {}  # (thread, module) -> innermost call in progress
        self._sums: Dict[int, List[Any]] = {}  # sum number -> the parts summed so far (_EXPECTED...)
        self._sum_numbers = itertools.count()
        self._once = LogOnce()
        self._pass = _Pass()  # per thread: a background evaluation never joins the training pass
        # generate wrapped where transformers defines it (generation passes: scope generate);
        # looked for again at written steps while it is not (transformers imported after start())
        self._generation: List[Patch] = []
        self._watch_generation()
        self.attached = True
        self._root_ids = {id(r) for r in self.session.roots}
        self._wrap = _wrapping_allowed()
        for vpp, tag, module in select_modules(self.session.named_modules(), targets, self.session.table.qualify):
            self._hook(module, vpp, tag)
        roots = {id(r): r for r in self.session.roots}
        for root in roots.values():
            self._track_passes(root)
        # on at start(), where they always were: a step that is not written takes them off
        # and puts them back in this place among the modules' hooks
        self._set_call_hooks(True)
        warn_if_already_compiled()
        # layout.json's "dtypes" of this monitor's rows: each row's tensor dtype, recorded
        # on the first written step that reads any (the reads go through a probe then)
        self.row_dtypes: Dict[str, str] = {}
        self._unprobed: Optional[Tuple[Any, Any]] = None

    def _edges_into(self, target: Tuple[Any, int], roots: List[Any], boundary: int) -> List[Tuple[Any, int]]:
        """``_edges_into``'s walk: on torch's C++ nodes in C++ where the graph hooks are built,
        else through the Python API (in C with the kernel's extension)."""
        walk = _graph.edges_into
        found = walk(target, roots, boundary) if walk is not None else None
        return found if found is not None else self._edges_into_api(target, roots, boundary)

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
                state.generation = _GENERATING.depth > 0
                if self.active:  # a forward swapped since the last call: followed before any is missed
                    self._follow_replaced()
            state.depth += 1
            if state.internal:
                state.internal += 1
            elif self.active:
                what = internal_pass(args, kwargs)
                if what is not None:
                    state.internal = 1
                    self._once.info(("internal", what), "monitor_v2 module: %s is a framework-internal pass, not "
                                    "training: no module rows for it (logged once)", what)
            state.settled()

        def leave(mod: torch.nn.Module, args: Tuple, output: Any) -> None:
            state = self._pass
            if state.depth:
                state.depth -= 1
                if not state.depth:
                    # the chunk's graph hooks are all in place: none is looked up again
                    state.nodes = None
            if state.internal:
                state.internal -= 1
            state.settled()

        self._pass_hook_specs.append((root, eager_hook(self.errors.wrap("module pass tracking", enter)),
                                      eager_hook(self.errors.wrap("module pass tracking", leave))))

    def _forward_scope(self, vpp: int) -> str:
        state = self._pass
        if state.depth:
            if state.generation:
                return rows.GENERATE
            evaluation = state.evaluation
        else:
            # A submodule called outside the model's own call (a LightningModule's
            # training_step calls its submodules; a wrapper's inner model generates):
            # inside generate it is generation; else the model's mode decides, or inference
            # mode. Plain no_grad does not: reentrant checkpointing trains under it.
            if _GENERATING.depth:
                return rows.GENERATE
            evaluation = not self.session.roots[vpp].training or torch.is_inference_mode_enabled()
        return rows.EVAL_FORWARD if evaluation else rows.FORWARD

    def _watch_generation(self) -> None:
        """``generate`` counted in progress where transformers defines it (and where the
        monitored modules' classes override it); nothing before transformers is imported."""
        if _GENERATION_MODULE not in sys.modules:
            return
        try:
            _watch_generation([m for _, _, m in self.session.named_modules()], self._generation)
        except Exception as exc:  # noqa: BLE001 - generation rows then go under eval_forward
            self.errors.report("module generation passes", exc)

    def _hook(self, module: torch.nn.Module, vpp: int, tag: str) -> None:
        names = _Names(tag, vpp)
        # owner=self: on steps that are not written the hooks return before any other call.
        # always_call: the post-hook also runs when forward raises (non-reentrant
        # checkpointing stops its recomputation that way), so the call state is dropped.
        before, after = _ForwardPreHook(self, vpp, names, module), _ForwardHook(self, vpp, names, module)
        pre, post = eager_hook(before, self), eager_hook(after, self)
        native_pre = native_post = wrapper = None
        if self._native_calls:
            # the common call in C (the extension's CallHook); every other call goes to pre/post
            ext = native.extension()
            native_pre = ext.CallHook(self, pre, before.site, vpp, names, id(module), names.input(0), False)
            native_post = ext.CallHook(self, post, after.site, vpp, names, id(module), names.output_0, True)
            if self._wrap and id(module) not in self._root_ids:  # a chunk has its pass tracking's hooks anyway
                wrapper = ext.CallWrapper(module, native_pre, native_post, self._hooked_instead, _GLOBAL_HOOKS)
        self._specs[id(module)] = _CallSpec(module, tag, pre, post, native_pre, native_post, wrapper)

    def _compile_started(self) -> None:
        """Dynamo starts to compile: the hooks go on before it traces and stay on, and no
        forward is wrapped from then on (Dynamo cannot trace a C object): a wrapped module
        gets the Python hooks instead, after its other hooks."""
        self._cancel_on_compile = None
        self._keep_call_hooks = True
        if self.attached:
            if self._native_calls and self._call_hooks_on:
                # each CallHook's Python hook in its place, in the same place among the module's hooks
                call_hook = native.extension().CallHook
                self._call_hooks.replace(lambda hook: hook.fallback if type(hook) is call_hook else None)
                # and a wrapped forward's module gets the Python hooks, after its other hooks
                for module, _ in self._call_hooks.wrapped():
                    self._hooks_instead(self._specs[id(module)], in_c=False)
            self._set_call_hooks(True)

    def _set_call_hooks(self, on: bool) -> None:
        """Put the modules' hooks (and the chunks' pass tracking) on for a written step,
        take them off for one that is not.

        A module with any forward hook takes PyTorch's slow call path: about 5 us more per
        call than without, even for a hook that returns at once (a model with a thousand
        modules paid 12 % on every step outside the window). They stay on once Dynamo
        compiles anything: compiled code does not see hooks added or removed after it was
        compiled (``skip_nnmodule_hook_guards``), so they are put back before Dynamo traces
        its first frame (its compile-start callback) and kept. Where that callback does not
        exist, or code was compiled before, they are never taken off. Put on again, each
        runs where it ran among the module's other hooks (``copies.restore_order``): the
        pre-hook still sees the inputs before a hook registered after ``start()`` changes
        them."""
        if on == self._call_hooks_on or (not on and self._keep_call_hooks):
            return
        if not on:
            if self._cancel_on_compile is None and not compiled_anything():
                # contained: it runs inside Dynamo's compilation of the user's code
                self._cancel_on_compile = on_next_compile(
                    self.errors.wrap("module hooks at a compile start", self._compile_started))
            if self._cancel_on_compile is None:  # compiled code exists, or its start cannot be seen
                self._keep_call_hooks = True
                return
            self._call_hooks_on = False
            # where they ran among the modules' other hooks, to put them back there
            self._removed = (self._call_hooks.handle_ids(),
                             [(m, hook_order(m)) for m in self._call_hooks.modules()])
            self._disarm(self._call_hooks.remove_all())
            return
        self._call_hooks_on = True
        hooks = self._call_hooks
        self._add_call_hooks(hooks)
        if self._removed is not None:
            old_ids, orders = self._removed
            self._removed = None
            new_ids = hooks.handle_ids()
            renamed = {}  # a module's hooks are added in the same order as before
            for key, ids in old_ids.items():
                renamed.update(zip(ids, new_ids.get(key, ())))
            for module, order in orders:
                restore_order(module, order, renamed)

    def _add_call_hooks(self, hooks: ModuleHooks) -> None:
        in_c = self._native_calls and not self._keep_call_hooks  # see _compile_started
        for spec in self._specs.values():
            self._observe(spec, in_c)
        # after the modules': a chunk's pass is entered before and left after its own hooks
        for root, enter, leave in self._pass_hook_specs:
            hooks.forward_pre(root, enter, prepend=True, with_kwargs=True)
            hooks.forward(root, leave, always_call=True)

    def _observe(self, spec: _CallSpec, in_c: bool) -> None:
        """``spec``'s module wrapped for the written step, or given its pair of hooks."""
        # a wrapper disarmed once (someone replaced it) is not put back
        wrapper = spec.wrapper
        if in_c and wrapper is not None and wrapper.armed and _wrappable(spec.module):
            self._call_hooks.wrap_forward(spec.module, wrapper)
        else:
            self._put_hooks(spec, in_c)

    def on_added(self, added: Added) -> None:
        """Modules added to the model chunks after ``start()`` (the session's ``find_added``,
        at the beginning of a written step): those ``targets`` select are observed from this
        step on, as the modules selected at ``attach()`` are (wrapped or hooked for written
        steps; ``stop()`` takes them off with the others). Named as ``targets`` match them."""
        if not added.modules or not self.attached:
            return
        targets: Sequence[str] = self.settings.get("targets")
        in_c = self._native_calls and not self._keep_call_hooks
        for vpp, tag, module in module_tags(added.modules, self.session.table.qualify):
            if id(module) in self._specs or (targets and not target_hits(tag, targets)):
                continue
            self._hook(module, vpp, tag)
            if self._call_hooks_on:  # else put on with the others when the step begins
                self._observe(self._specs[id(module)], in_c)

    def _check_wrapped(self) -> None:
        """At a step's end: a wrapped forward that someone replaced or removed in the module
        since (a library's own forward wrapper, a patched method, a kernel swapped in). On a
        written step that module's calls may have gone unrecorded (it was called outside a
        chunk's call, or inside one after the chunk's check): said once, and the module gets
        forward hooks instead from now on. On a step that is not written nothing was missed:
        followed as before a chunk's call (``_follow_replaced``)."""
        if self.active:
            for module, _ in self._call_hooks.replaced():
                self._hooks_instead(self._specs[id(module)], in_c=True)
        else:
            self._follow_replaced()

    def _follow_replaced(self) -> None:
        """Before a model chunk's call on a written step (its pass tracking's pre-hook, which
        runs first) and at the end of a step that is not written: a wrapped forward that
        someone replaced or removed since, before any call of the module it would have
        missed. A library that swaps forwards after ``start()`` does it between calls of the
        model (accelerate's ``add_hook_to_module``/``remove_hook_from_module``, a kernel
        library's ``kernelize`` on ``train()``). A forward removed, so that the module's class's
        runs again, gets the wrapper back where the module can still have one; any other
        (someone's forward, or a hook gained meanwhile) gets the monitor's hooks, first among
        the module's hooks as the wrapper was, and the wrapper is disarmed, for a chain that
        calls it. One pass in C over the modules' dictionaries where nothing changed.
        Contained here: the chunk's pass is entered whatever happens."""
        try:
            self._follow_each(self._call_hooks.replaced())
        except Exception as exc:  # noqa: BLE001 - containment is the point
            self.errors.report("module forwards replaced since start()", exc)

    def _follow_each(self, replaced: List[Tuple[torch.nn.Module, Any]]) -> None:
        for module, wrapper in replaced:
            spec = self._specs[id(module)]
            entries = vars(module)
            removed = "forward" not in entries
            self._call_hooks.unwrap(module, wrapper)  # the wrapper's entries and records; someone's forward stays
            if removed and _wrappable(module):
                self._call_hooks.wrap_forward(module, wrapper)
                self._once.info(("removed", id(module)), "monitor_v2 module: the forward of %s was taken out of "
                                "it after the monitor set its own; set again before its next call (logged once)",
                                spec.tag)
                continue
            wrapper.armed = 0
            self._put_hooks(spec, in_c=self._native_calls and not self._keep_call_hooks, prepend=True)
            self._once.info(("forward", id(module)), "monitor_v2 module: the forward of %s was replaced after "
                            "the monitor set its own (now %s); its rows come from forward hooks from now on, "
                            "starting before its next call (logged once)", spec.tag,
                            "its class's" if removed else _describe(entries.get("forward")))

    def _put_hooks(self, spec: _CallSpec, in_c: bool, prepend: bool = False) -> None:
        """``spec``'s pre-hook and forward hook on its module (the extension's ``CallHook``s
        where ``in_c``), after its other hooks, or before them (``prepend``)."""
        hooks, module = self._call_hooks, spec.module
        hooks.forward_pre(module, spec.native_pre if in_c else spec.pre, prepend=prepend, with_kwargs=True)
        hooks.forward(module, spec.native_post if in_c else spec.post, prepend=prepend, with_kwargs=True,
                      always_call=True)

    def _hooks_instead(self, spec: _CallSpec, in_c: bool, prepend: bool = False) -> None:
        """``spec``'s wrapper out of its module's forward (``_unwrap``) and its hooks on instead."""
        self._unwrap(spec.module, spec.wrapper)
        self._put_hooks(spec, in_c, prepend)

    def _hooked_instead(self, module: torch.nn.Module) -> bool:
        """A wrapped module that has gained a hook (a call of it takes torch's slow path now):
        its forward unwrapped and the monitor's hooks put on it first, where they would be had
        they been put on with the wrapper; the wrapper calls the pre-hook's part of the call
        in progress itself (it has the arguments its forward got) and the forward hook, now
        on the module, runs after it. True where the hooks are on."""
        try:
            spec = self._specs.get(id(module))
            if spec is None or spec.wrapper is None or vars(module).get("forward") is not spec.wrapper:
                return False  # called through someone's chain: _check_wrapped says it
            self._hooks_instead(spec, in_c=True, prepend=True)
            return True
        except Exception as exc:  # noqa: BLE001 - containment is the point
            self.errors.report("module hooks instead of a forward wrapper", exc)
            return False

    def _unwrap(self, module: torch.nn.Module, wrapper: Any) -> None:
        """``wrapper`` out of ``module.forward``, or disarmed where it cannot be (``_disarm``)."""
        if not self._call_hooks.unwrap(module, wrapper):
            self._disarm([(module, wrapper)])

    def _disarm(self, left: List[Tuple[torch.nn.Module, Any]], at_stop: bool = False) -> None:
        """Wrappers that someone replaced in their module's forward (perhaps calling them from
        theirs): from now on each calls its forward and nothing else, and its module is
        hooked instead. Said once a module."""
        for module, wrapper in left:
            wrapper.armed = 0
            tag = self._specs[id(module)].tag
            now = vars(module).get("forward")
            if at_stop:
                self._once.info(("forward", id(module)), "monitor_v2 module: the forward of %s was replaced after "
                                "the monitor set its own (now %s); left as it is, the monitor's part of it does "
                                "nothing more (logged once)", tag, _describe(now))
            else:
                self._warn_once(f"{tag}.forward", f"the forward of {tag} was replaced while the monitor's call "
                                f"wrapper was in it (now {_describe(now)}); its calls since may have no rows, and "
                                f"from the next written step its rows come from forward hooks")

    # ------------------------------------------------------------------ forward
    def _before_forward(self, key: int, vpp: int, names: _Names, args: Tuple, kwargs: Dict) -> None:
        scope = self._forward_scope(vpp)
        # Nodes created after the boundary belong to this call; grad_input needs the inputs'
        # producers as they are now, before any in-place op inside the module.
        if not kwargs and len(args) == 1 and isinstance(args[0], _Tensor):
            # the common call, one tensor input: no list to walk
            t = args[0]
            if _current_autograd_node() is None:
                self._records.append(self._read(t, vpp, names.input(0), scope))
            boundary = _get_sequence_nr() if _get_sequence_nr is not None else -1
            producers: List[Any] = [_producer(t)]
        else:
            inputs = flatten_tensors((args, kwargs), _is_tensor, names.input_prefix)
            if _current_autograd_node() is None:
                read, records = self._read, self._records
                for i, t in enumerate(inputs):
                    records.append(read(t, vpp, names.input(i), scope))
            boundary = _get_sequence_nr() if _get_sequence_nr is not None else -1
            producers = [_producer(t) for t in inputs]
        calls = self._calls
        call_key = (threading.get_ident(), key)
        calls[call_key] = self._new_call(producers, boundary, scope, calls.get(call_key))

    def _after_forward(self, key: int, vpp: int, names: _Names, output: Any) -> None:
        calls = self._calls
        call_key = (threading.get_ident(), key)
        call = calls.get(call_key)
        if call is not None:
            if call.outer is None:
                del calls[call_key]
            else:
                calls[call_key] = call.outer
        if isinstance(output, _Tensor):  # the common output, without the general walk
            if _current_autograd_node() is None:
                scope = call.scope if call is not None else self._forward_scope(vpp)
                self._records.append(self._read(output, vpp, names.output_0, scope))
            if output.requires_grad and torch.is_grad_enabled():
                edge = _one_edge(call) if call is not None else None
                own = output.grad_fn
                if edge is not None and own is not None:
                    self._hook_graph_one(vpp, names, output, own, edge, call)
                else:
                    self._hook_graph(vpp, names, (output,), (names.grad_output_0,), call)
            return
        named = named_outputs(output, _is_tensor, names.output_prefix)  # a dict output by key: structure.py
        if _current_autograd_node() is None:
            read, records = self._read, self._records
            scope = call.scope if call is not None else self._forward_scope(vpp)
            for name, t in named:
                records.append(read(t, vpp, name, scope))
        if torch.is_grad_enabled() and any(t.requires_grad for _, t in named):
            cut = len(names.output_prefix) + 1  # after "<prefix>."
            self._hook_graph(vpp, names, [t for _, t in named], [names.grad_output(name[cut:]) for name, _ in named],
                             call)

    # ----------------------------------------------------------------- backward
    def _hook_graph(self, vpp: int, names: _Names, outputs: Sequence[torch.Tensor], grad_names: Sequence[str],
                    call: Optional[_Call]) -> None:
        """The graph hooks of one module call: its ``grad_output`` slots on its outputs'
        nodes, and its ``grad_input`` edges (when the call's inputs are known) on the nodes
        found by ``_grad_input_edges``, added to the ``_NodeHook`` of each node."""
        state = self._pass
        nodes = state.nodes
        if nodes is None:
            nodes = state.nodes = {}
        touched: List[_NodeHook] = []
        for j, t in enumerate(outputs):
            if not t.requires_grad:
                continue
            own = t.grad_fn
            if own is None:
                # A Parameter passed through as an output (Megatron's linear layers return
                # their bias with skip_bias_add): its gradient is the parameter's own,
                # reported by weight_grad, so there is nothing to say about it here.
                if not isinstance(t, _Parameter):
                    tag = names.tag
                    suffix = grad_names[j][len(names.grad_output_prefix) + 1:]
                    self._warn_once(f"{tag}.leaf", f"output {suffix} of {tag} is a leaf tensor; its gradient "
                                    f"is not observed")
                continue
            node, nr = _output_edge(t, own, call)
            hook = _node_hook(self, nodes, node)
            hook.outs = names.add_out(hook.outs, vpp, nr, grad_names[j])
            touched.append(hook)
            touched.append(node)
        if call is not None:
            self._grad_input_edges(vpp, names, call, outputs, nodes, touched)
        for k in range(0, len(touched), 2):
            _register(touched[k], touched[k + 1])

    def _hook_graph_one(self, vpp: int, names: _Names, output: torch.Tensor, own: Any, edge: Tuple[Any, int],
                        call: _Call) -> None:
        """``_hook_graph`` of the common call, without its lists: one output made by the graph
        node ``own``, one input made by the one edge ``edge`` (a Linear, a norm, a block of a
        deep stack). The same slots on the same nodes, registered the same way."""
        state = self._pass
        nodes = state.nodes
        if nodes is None:
            nodes = state.nodes = {}
        node, nr = _output_edge(output, own, call)
        out_hook = _node_hook(self, nodes, node)
        out_hook.outs = names.add_out(out_hook.outs, vpp, nr, names.grad_output_0)
        found = self._edges_into(edge, [own], call.boundary)
        in_hooks = self._one_input_slots(vpp, names, found, nodes) if found else ()
        # registered as _hook_graph does: the output's node first, then each input edge's
        _register(out_hook, node)
        for hook, in_node in in_hooks:
            _register(hook, in_node)

    def _one_input_slots(self, vpp: int, names: _Names, found: List[Tuple[Any, int]],
                         nodes: Dict[int, _NodeHook]) -> List[Tuple[_NodeHook, Any]]:
        """The ``grad_input`` slots of a call's one input, reached by the edges ``found``
        (``(node, edge index)``), added to their nodes' hooks; ``(hook, node)`` of each. Several
        edges share one running sum."""
        name = names.grad_input(0)
        parts = len(found)
        number = next(self._sum_numbers) if parts > 1 else -1
        site = names.grad_input_site
        hooks = []
        for node, e in found:
            hook = _node_hook(self, nodes, node)
            if number >= 0 or vpp != names.vpp:
                hook.ins += ((vpp, e, name, number, parts, site),)
            else:
                hook.ins = names.add_in(hook.ins, e)
            hooks.append((hook, node))
        return hooks

    def _grad_input_edges(self, vpp: int, names: _Names, call: _Call, outputs: Sequence[torch.Tensor],
                          nodes: Dict[int, _NodeHook], touched: List[Any]) -> None:
        """Walk the graph from the outputs back to the inputs' producers, stopping at
        nodes created before the call, and add the edges that lead into an input to their
        node's hook (``touched`` gets each hook and its node)."""
        edge = _one_edge(call)
        if edge is not None:
            # The common call: one input, made by one edge. The same walk without the
            # input tables, the counts and the accumulators' table.
            found_one = self._edges_into(edge, [t.grad_fn for t in outputs if t.grad_fn is not None],
                                         call.boundary)
            if found_one:
                for hook, node in self._one_input_slots(vpp, names, found_one, nodes):
                    touched.append(hook)
                    touched.append(node)
            return
        edge_targets: Dict[Tuple[Any, int], int] = {}
        leaf_targets: Dict[int, int] = {}
        boundary = call.boundary
        for i, producer in enumerate(call.inputs):
            if type(producer) is tuple:
                for edge in producer:
                    edge_targets[edge] = i
                    if _get_sequence_nr is None:
                        boundary = max(boundary, edge[0]._sequence_nr())
            elif producer.requires_grad:
                leaf_targets[id(producer)] = i
        if not edge_targets and not leaf_targets:
            return
        found: List[Tuple[Any, int, int]] = []  # (node, edge index, input index)
        counts: Dict[int, int] = {}
        visited = set()
        accumulate = _ACCUMULATE_GRAD
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node in visited:
                continue
            visited.add(node)
            for e, edge in enumerate(node.next_functions):
                child = edge[0]
                if child is None:
                    continue
                i = edge_targets.get(edge)
                is_leaf = accumulate.get(type(child))
                if is_leaf is None:
                    is_leaf = _is_accumulate_grad(child)
                if i is None and is_leaf and leaf_targets:  # ``variable`` builds a Python object
                    i = leaf_targets.get(id(child.variable))
                if i is not None:
                    found.append((node, e, i))
                    counts[i] = counts.get(i, 0) + 1
                elif not is_leaf and child._sequence_nr() >= boundary and child not in visited:
                    stack.append(child)
        # An input reached by several edges gets one accumulator shared by their hooks.
        numbers = {i: next(self._sum_numbers) for i, c in counts.items() if c > 1}
        site = names.grad_input_site
        for node, e, i in found:
            hook = _node_hook(self, nodes, node)
            hook.ins += ((vpp, e, names.grad_input(i), numbers.get(i, -1), counts[i], site),)
            touched.append(hook)
            touched.append(node)

    def _add_part(self, number: int, parts: int, vpp: int, name: str, g: torch.Tensor) -> None:
        """One part of the ``grad_input`` that sum ``number`` adds up (``parts`` in all)."""
        sums = self._sums
        acc = sums.get(number)
        if acc is None:
            acc = sums[number] = [parts, 1, g, vpp, name]
        else:
            acc[_TOTAL] = self._sum_parts(acc[_TOTAL], g)  # a part through a view's node reshaped
            acc[_COUNT] += 1
        if acc[_COUNT] == acc[_EXPECTED]:
            self._flush(number)

    def _flush(self, number: int) -> None:
        acc = self._sums.pop(number)
        self._records.append(self._read_sum(acc[_TOTAL], acc[_SUM_VPP], acc[_SUM_NAME], rows.BACKWARD))

    def _warn_once(self, key: str, message: str) -> None:
        self._once.warning(key, "monitor_v2 module: %s (logged once)", message)

    # -------------------------------------------------------------- lifecycle
    def begin_step(self, step: int, active: bool) -> None:
        super().begin_step(step, active)
        if active and not self._generation and self.attached:
            self._watch_generation()  # transformers imported after start()
        # taking the hooks off and on costs about as much as 3 steps with them (~13 us a
        # module against ~5 us a module call): worth it for a longer gap only
        if active or self.idle_ahead >= _IDLE_STEPS_TO_UNHOOK:
            try:
                self._set_call_hooks(active)
            except Exception as exc:  # noqa: BLE001 - never let the hooks' bookkeeping stop a step
                self.errors.report("module hooks on or off between steps", exc)
        if active and not self.row_dtypes and self._unprobed is None:
            self._probe_dtypes()
        self._calls.clear()
        self._pass.depth = 0  # no model call of this thread spans a step boundary; never let a count drift
        self._pass.internal = 0
        self._pass.nodes = None
        self._pass.scope = None

    def collect(self) -> List[Record]:
        for number in list(self._sums):
            self._flush(number)
        self._end_dtype_probe()
        self._check_wrapped()
        return super().collect()

    def _probe_dtypes(self) -> None:
        """For one written step, every read of a row's tensor (``_read``, ``_read_sum``: the
        Python hooks and the extension's look them up on each call) notes the tensor's dtype
        under the row's name first: metadata, no value is read. The hooks stay as they are."""
        read, read_sum = self._read, self._read_sum
        self._unprobed = (read, read_sum)
        self._read, self._read_sum = _dtype_probe(read, self.row_dtypes), _dtype_probe(read_sum, self.row_dtypes)

    def _end_dtype_probe(self) -> None:
        """The reads as they were (each only where it is still the probe)."""
        if self._unprobed is not None:
            read, read_sum = self._unprobed
            self._unprobed = None
            if getattr(self._read, "dtype_probe", False):
                self._read = read
            if getattr(self._read_sum, "dtype_probe", False):
                self._read_sum = read_sum

    def detach(self) -> None:
        self.attached = False
        generation = vars(self).get("_generation", [])  # none where attach() failed before
        while generation:
            generation.pop().remove()
        self._disarm(self._call_hooks.remove_all(), at_stop=True)
        for spec in self._specs.values():  # one kept by the user's code (``f = m.forward``) does nothing more
            if spec.wrapper is not None:
                spec.wrapper.armed = 0
                entries = vars(spec.module)
                if entries.get("forward") is spec.wrapper:
                    # a library put back the forward it had found, a wrapper disarmed since
                    # (accelerate's remove_hook_from_module): the module's class's runs again
                    del entries["forward"]
        self._call_hooks_on = False
        if self._cancel_on_compile is not None:
            self._cancel_on_compile()
            self._cancel_on_compile = None
        self._calls.clear()
        self._sums.clear()
        self._pass.nodes = None
