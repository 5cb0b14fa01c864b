"""Training-stack adapters: where a framework that wraps the model and the optimizer
(DeepSpeed, Megatron-Core) keeps what the monitors read.

``detect_stack(chunks, optimizer)`` looks at the objects passed to ``start()`` and returns
one adapter. ``TrainingStack`` itself is the adapter of plain torch, DDP and FSDP (what
the monitors did before adapters existed); a framework adapter subclasses it, overrides
``detect`` and only the hook points that differ, and is listed in ``_ADAPTERS``. The
hook points (``backend.TrainingStack``, the protocol) take the session's ``ParamTable``
(``table``) for parameter names, never the session itself:

- ``optimizer_model_params()``: the *model* parameters the optimizer updates, in order
  (None: the tensors in ``optimizer_param_groups()``). Flat or fp32-master tensors in the
  param groups are thus named after the parameters they belong to.
- ``install_step_hooks(before, after)``: hook the call that is the real optimizer step,
  once per step (not a wrapper's per-micro-batch ``step()``); returns a ``patching.Patch``.
- ``reduced_grads(table)``: ``(ParamInfo, tensor)`` of the gradients as they stand at
  the step, after the data-parallel reduction; local shards allowed (a tensor without
  elements is left out).
- ``unreduced_capture(table, per_micro_batch, micro_batches)``: None for the default hooks on
  the model parameters, or an ``UnreducedCapture``: the adapter's own hooks, which call
  back ``on_micro_batch(info, grad)`` / ``on_accumulated(info, grad)``, or a reason why
  the value cannot be captured exactly (logged once; no such rows are written).
- ``param_values(table)`` / ``optimizer_states(table)``: ``(ParamInfo, tensor)`` and
  ``(ParamInfo, state_name, tensor)`` of what the optimizer updates, flat partitions and
  fp32 masters mapped back to parameter names (local shards allowed).
- ``context_defaults()``: values the framework knows (e.g. ``grad_acc_steps``), used
  when the user passed none to ``start()``.
- ``layout(table, doc)``: fill the ``layout.json`` document (``layout.py`` defines it):
  this rank's parallel groups, the chunks' global layers, the renames, and per parameter
  its full shape and the piece each scope's rows describe. Unknown stays ``"unknown"``.

A container of optimizers (a list or tuple passed to ``start()``, TorchTitan's
``OptimizersContainer`` and most users' own in ``.optimizers``, Megatron-Core's
``ChainedOptimizer`` in ``.chained_optimizers``) is read through the optimizers it holds
(``inner_optimizers``): their param groups and states, never the container's own, which
may be empty (TorchTitan's ``.state``) or one merged group. Its step is its own ``step()``
where it has one (hooked once, not once per inner optimizer), else one ``step()`` of each
optimizer it holds (``optimizer_round_hooks``). What cannot be read is said once.

Adapters import their framework lazily (only once it is already imported by the user)
and read its private attributes defensively: what a version does not expose is logged
once, naming what is not observed, and never raises into the training loop.
"""

import functools
import importlib
import logging
import sys
from typing import Any, Callable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from ....backend import GradCallback, UnreducedCapture
from ....errors import ConfigError
from ....logonce import LogOnce
from ....param_table import ParamInfo, ParamTable
from ....patching import Patch, hooks, wrap_method
from .state_listing import StateListing, is_state_tensor

logger = logging.getLogger("msprobe.monitor_v2")

__all__ = ["GradCallback", "TrainingStack", "UnreducedCapture", "detect_stack", "hookable_optimizer",
           "inner_optimizers", "optimizer_round_hooks", "optimizer_step_hooks", "tensor_states",
           "torch_shaped_optimizer"]

# (module that must already be imported by the user, adapter module in this package).
# An adapter module defines ``STACK``, a TrainingStack subclass.
_ADAPTERS: Sequence[Tuple[str, str]] = (
    ("deepspeed", "deepspeed"),
    ("megatron.core", "megatron"),
)


class TrainingStack:
    """Plain torch, torch DDP and FSDP (FSDP's flat parameters are handled by the
    session's ``expand``)."""

    name = "torch"
    _state_listing: Optional[StateListing] = None  # optimizer_states' last listing
    _read: Optional[List[Any]] = None  # the optimizers whose param groups and states are read

    def __init__(self, chunks: List[torch.nn.Module], optimizer: Any) -> None:
        self.chunks = chunks
        self.optimizer = optimizer
        self._once = LogOnce()

    @classmethod
    def detect(cls, chunks: List[torch.nn.Module], optimizer: Any) -> Optional["TrainingStack"]:
        return cls(chunks, optimizer)

    def log_once(self, key: str, msg: str, *args: Any) -> None:
        """Warn once per adapter and key (what cannot be observed, and why)."""
        self._once.warning(key, "monitor_v2 (%s): " + msg, self.name, *args)

    # ----------------------------------------------------------------- names
    # Names need no hook point: every wrapper a stack puts around the model (DDP, FSDP1,
    # torch.compile, DeepSpeedEngine, Megatron's DDP and Float16Module...) is a pure
    # wrapper that the session removes with naming.unwrap, at the root and inside.
    def optimizer_model_params(self) -> Optional[List[torch.Tensor]]:
        return None

    def optimizer_param_groups(self) -> List[Mapping[str, Any]]:
        """The param groups of the optimizer, or of every optimizer a container holds, one
        after the other (where ``optimizer_model_params()`` is None, their tensors are the
        parameters the optimizer updates, in this order)."""
        return [group for opt in self._optimizers_read() for group in opt.param_groups]

    def _optimizers_read(self) -> List[Any]:
        """The optimizers whose ``param_groups`` and ``state`` are read: the one passed to
        ``start()``, or those a container holds. One that cannot be read is said once,
        naming its type and what it lacks, and left out."""
        if self._read is not None:
            return self._read
        opt = self.optimizer
        inner = inner_optimizers(opt)
        read: List[Any] = []
        if inner is None:
            shaped = torch_shaped_optimizer(opt)
            if shaped is None:
                self.log_once("unreadable", "the optimizer passed to start() (%s) has %s, and holds no list of "
                              "optimizers (a list or tuple, or one in .optimizers or .chained_optimizers): its "
                              "optimizer, param and reduced weight_grad rows are not written. Logged once.",
                              type(opt).__name__, " and ".join(_not_torch_shaped(opt)))
            else:
                read.append(shaped)
        elif not inner:
            self.log_once("unreadable", "the container of optimizers passed to start() (%s) holds no optimizer: "
                          "no optimizer, param or reduced weight_grad rows are written. Logged once.",
                          type(opt).__name__)
        for k, leaf in enumerate(inner or ()):
            shaped = torch_shaped_optimizer(leaf)
            if shaped is None:
                self.log_once(f"unreadable-{k}", "optimizer %d (%s) of the container passed to start() (%s) has "
                              "%s: the optimizer, param and reduced weight_grad rows of its parameters are not "
                              "written. Logged once.", k, type(leaf).__name__, type(opt).__name__,
                              " and ".join(_not_torch_shaped(leaf)))
            elif not any(shaped is r for r in read):
                read.append(shaped)
        self._read = read
        return read

    def context_defaults(self) -> dict:
        return {}

    # ---------------------------------------------------------------- layout
    def layout(self, table: ParamTable, doc: dict) -> None:
        """Plain torch, DDP, FSDP1 and DTensor parameters (FSDP2, tensor parallel on a
        ``DeviceMesh``): see ``native_layout.py``."""
        from .native_layout import fill

        fill(self.chunks, table, doc)

    # ------------------------------------------------------------------ step
    def install_step_hooks(self, before: Callable[[], None], after: Callable[[], None]) -> Patch:
        """Call ``before``/``after`` around every ``optimizer.step()``; returns the patch.

        A ``torch.optim.Optimizer`` gets removable step hooks (no attribute is patched);
        a wrapper of one (Accelerate, Lightning) is hooked through the optimizer it wraps;
        another object with a ``step`` method gets an instance-level wrapper that the
        patch's removal takes off again."""
        inner = inner_optimizers(self.optimizer)
        if inner is not None and not callable(getattr(self.optimizer, "step", None)):
            # a list of optimizers: its step is one step() of each
            return optimizer_round_hooks(inner, before, after, self.log_once)
        opt = hookable_optimizer(self.optimizer)
        if opt is None:
            return Patch()
        if isinstance(opt, torch.optim.Optimizer) and "_optimizer_step_pre_hooks" in vars(opt):
            return optimizer_step_hooks(opt, before, after)
        if not callable(getattr(opt, "step", None)):
            raise ConfigError(
                f"start(): optimizer must have a step() method, got {type(opt).__name__}", field="optimizer"
            )
        return wrap_method(opt, "step", before, after)

    # ------------------------------------------------------------- gradients
    def unreduced_capture(self, table: ParamTable, per_micro_batch: bool,
                          micro_batches: int) -> Optional[UnreducedCapture]:
        return None

    def reduced_grads(self, table: ParamTable) -> List[Tuple[ParamInfo, torch.Tensor]]:
        return [(i, g) for i in table.optimizer_params() if (g := i.param.grad) is not None]

    # ------------------------------------------------------ optimizer, params
    def param_values(self, table: ParamTable) -> List[Tuple[ParamInfo, torch.Tensor]]:
        return [(i, i.param) for i in table.optimizer_params()]

    def optimizer_states(self, table: ParamTable) -> Iterator[Tuple[ParamInfo, str, torch.Tensor]]:
        """Every per-parameter tensor the optimizer keeps, under its own name: Adam/AdamW
        ``exp_avg``/``exp_avg_sq`` (and ``max_exp_avg_sq``), SGD ``momentum_buffer``,
        Adagrad ``sum``, RMSprop ``square_avg``... The scalar ``step`` is not state of the
        parameter's values.

        The listing is kept (``state_listing.py``: the tensors' places and ids, no
        reference) and checked again at the next step in one pass in C instead of the walk
        over every parameter's state, while the optimizer keeps the same tensors.

        A container's optimizers' states are read as one (a dict of theirs, merged in
        C); a container's own ``state`` is not read. No state tensor for any parameter
        that has a gradient, after a step, is said once: that optimizer keeps none
        (SGD without momentum) or keeps it where this monitor does not look."""
        read = self._optimizers_read()
        if len(read) == 1:
            state = read[0].state
        else:
            state = {}
            for opt in read:
                state.update(opt.state)
        infos = table.optimizer_params()
        if self._state_listing is not None:
            found = self._state_listing.again(state, infos)
            if found is not None:
                return iter(found)
        found, listing = StateListing.of(state, infos)
        # an empty listing is not kept: the check below runs until a state appears
        self._state_listing = listing if found else None
        if not found and read and any(i.param.grad is not None for i in infos):
            self.log_once("no-state", "after optimizer.step(), the optimizer's state (%s) holds no tensor for any "
                          "of the %d parameters it updates (an optimizer without per-parameter state, such as SGD "
                          "without momentum, or one that keeps it outside .state): no optimizer rows are written "
                          "while that lasts. Logged once.", ", ".join(sorted({type(o).__name__ for o in read})),
                          len(infos))
        return iter(found)


def tensor_states(info: ParamInfo, state: Any) -> Iterator[Tuple[ParamInfo, str, torch.Tensor]]:
    """The non-scalar tensors of one parameter's optimizer state, by state name."""
    for key, value in state.items():
        if is_state_tensor(key, value):
            yield info, key, value


# Where a container of optimizers keeps them: Megatron-Core's ChainedOptimizer, then
# TorchTitan's OptimizersContainer and most containers of users' own.
_HELD_OPTIMIZERS = ("chained_optimizers", "optimizers")
_MAX_DEPTH = 8  # wrappers of wrappers and containers of containers, never a cycle


def _held_optimizers(obj: Any) -> Optional[List[Any]]:
    """The list a container of optimizers holds (a list or tuple itself, or one in
    ``_HELD_OPTIMIZERS``), None for anything else."""
    if isinstance(obj, (list, tuple)):
        return list(obj)
    for attr in _HELD_OPTIMIZERS:
        try:
            held = getattr(obj, attr, None)
        except Exception:  # noqa: BLE001 - a property that fails is no list
            continue
        if isinstance(held, (list, tuple)):
            return list(held)
    return None


def inner_optimizers(optimizer: Any) -> Optional[List[Any]]:
    """The optimizers a container holds, nested containers walked, each optimizer once,
    Megatron's stub optimizers (``is_stub_optimizer``, a rank with no parameters for one)
    left out; None where ``optimizer`` is not a container."""
    if _held_optimizers(optimizer) is None:
        return None
    found: List[Any] = []

    def walk(obj: Any, depth: int) -> None:
        held = _held_optimizers(obj) if depth < _MAX_DEPTH else None
        if held is None:
            if not getattr(obj, "is_stub_optimizer", False) and not any(obj is f for f in found):
                found.append(obj)
            return
        for inner in held:
            walk(inner, depth + 1)

    walk(optimizer, 0)
    return found


def _not_torch_shaped(opt: Any) -> List[str]:
    """What ``opt`` lacks of a ``torch.optim.Optimizer``'s shape (``param_groups`` a list
    of dicts with ``"params"``, ``state`` a mapping); empty where it has it."""
    try:
        groups, state = getattr(opt, "param_groups", None), getattr(opt, "state", None)
    except Exception as exc:  # noqa: BLE001 - a property that fails: not readable
        return [f"param_groups or state that cannot be read ({exc!r})"]
    missing = []
    if groups is None:
        missing.append("no param_groups")
    elif not isinstance(groups, (list, tuple)) or not all(isinstance(g, Mapping) and "params" in g for g in groups):
        missing.append(f"param_groups of type {type(groups).__name__} (not a list of dicts with 'params')")
    if state is None:
        missing.append("no state")
    elif not isinstance(state, Mapping):
        missing.append(f"a state of type {type(state).__name__} (not a mapping of parameter to its state)")
    return missing


def torch_shaped_optimizer(opt: Any) -> Optional[Any]:
    """``opt``, or the optimizer it wraps (``.optimizer``, ``._optimizer``: Accelerate,
    Lightning, Megatron's optimizers), whose ``param_groups`` and ``state`` have
    ``torch.optim.Optimizer``'s shape; None where there is none."""
    for _ in range(_MAX_DEPTH):
        if not _not_torch_shaped(opt):
            return opt
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            inner = getattr(opt, "_optimizer", None)
        if inner is None or inner is opt:
            return None
        opt = inner
    return None


def hookable_optimizer(opt: Any) -> Any:
    """The optimizer whose own ``step()`` is the real step, below the wrappers that
    subclass ``torch.optim.Optimizer`` without being one:

    - Accelerate's ``AcceleratedOptimizer`` never runs ``Optimizer.__init__`` (it has no
      hook dictionaries); its ``step()``/``zero_grad()`` run on every micro-batch and
      reach the wrapped optimizer (``.optimizer``) only when gradients are synchronised.
    - Lightning's ``LightningOptimizer`` (``._optimizer``) routes ``step()`` through the
      strategy and precision plugin to the wrapped optimizer.

    Anything else is returned as it is."""
    for _ in range(8):  # wrappers of wrappers, never a cycle
        if not isinstance(opt, torch.optim.Optimizer):
            return opt
        own = vars(opt)
        lightning = any(c.__name__ == "LightningOptimizer" for c in type(opt).__mro__)
        if "_optimizer_step_pre_hooks" in own and not lightning:
            return opt  # a fully initialised optimizer
        inner = own.get("optimizer")
        if not isinstance(inner, torch.optim.Optimizer):
            inner = own.get("_optimizer")
        if not isinstance(inner, torch.optim.Optimizer) or inner is opt:
            return opt
        opt = inner
    return opt


def optimizer_step_hooks(opt: torch.optim.Optimizer, before: Callable[[], None],
                         after: Callable[[], None]) -> Patch:
    """Step hooks on a ``torch.optim.Optimizer``, as one patch.

    ``before`` runs when the gradients are final and the update has not begun: right
    before ``step()`` runs, or, for ``step(closure)``, right after the closure's first
    call (Lightning runs the last micro-batch's forward/backward and the clipping inside
    the closure; LBFGS calls it again for line searches, which re-evaluate the same
    point). The closure is wrapped for that call only: nothing stays on the optimizer.
    If the closure is never called, ``before`` runs right before ``after``."""
    pending = [False]  # a closure was wrapped and has not run yet in this step

    def run_before_once() -> None:
        if pending[0]:
            pending[0] = False
            before()

    def pre_hook(optimizer: Any, args: Tuple[Any, ...], kwargs: dict) -> Optional[Tuple[Tuple[Any, ...], dict]]:
        # ``args`` are step()'s positional arguments, the optimizer itself first.
        first = 1 if args and args[0] is optimizer else 0
        in_kwargs = kwargs.get("closure") is not None
        closure = kwargs["closure"] if in_kwargs else (args[first] if len(args) > first else None)
        pending[0] = False
        if not callable(closure):
            before()
            return None
        pending[0] = True

        def closure_then_before() -> Any:
            result = closure()
            run_before_once()
            return result

        if in_kwargs:
            return args, dict(kwargs, closure=closure_then_before)
        return tuple(args[:first]) + (closure_then_before,) + tuple(args[first + 1:]), kwargs

    def post_hook(*_: Any) -> None:
        run_before_once()
        after()

    return hooks([opt.register_step_pre_hook(pre_hook), opt.register_step_post_hook(post_hook)])


def optimizer_round_hooks(optimizers: Sequence[Any], before: Callable[[], None], after: Callable[[], None],
                          warn: Callable[..., None]) -> Patch:
    """Step hooks on optimizers that step one by one (a list passed to ``start()``, which
    has no ``step()`` of its own): one step of the list is one ``step()`` of each, in any
    order. ``before`` runs when the first of them is about to update, ``after`` once the
    last has updated, each once a step. One that steps again before every other has
    stepped ends the step there (``after``, then ``before`` for the next), said once
    through ``warn(key, msg, *args)``."""
    members: List[Any] = []
    for opt in optimizers:
        hookable = hookable_optimizer(opt)
        if not any(hookable is m for m in members):
            members.append(hookable)
    stepped: set = set()  # the members that have stepped in the current step

    def member_before(k: int) -> None:
        if k in stepped:
            warn("round", "optimizer %d (%s) of the list passed to start() stepped again before each of the %d "
                 "optimizers had stepped once: the monitor's step ended there. A step of a list of optimizers "
                 "is one step() of each; otherwise set \"patch_optimizer_step\": false and call mon.step(). "
                 "Logged once.", k, type(members[k]).__name__, len(members))
            stepped.clear()
            after()
        if not stepped:
            before()

    def member_after(k: int) -> None:
        stepped.add(k)
        if len(stepped) == len(members):
            stepped.clear()
            after()

    patches: List[Patch] = []
    try:
        for k, opt in enumerate(members):
            on_before = functools.partial(member_before, k)
            on_after = functools.partial(member_after, k)
            if isinstance(opt, torch.optim.Optimizer) and "_optimizer_step_pre_hooks" in vars(opt):
                patches.append(optimizer_step_hooks(opt, on_before, on_after))
            elif callable(getattr(opt, "step", None)):
                patches.append(wrap_method(opt, "step", on_before, on_after))
            else:
                raise ConfigError(f"start(): optimizer {k} of the list must have a step() method, got "
                                  f"{type(opt).__name__}", field="optimizer")
    except BaseException:
        hooks(patches).remove()
        raise
    return hooks(patches)


def detect_stack(chunks: List[torch.nn.Module], optimizer: Any) -> TrainingStack:
    """The adapter for the objects given to ``start()``: the first framework adapter
    whose framework is imported and that recognises them, else plain torch."""
    for trigger, module_name in _ADAPTERS:
        if trigger not in sys.modules:
            continue  # the user never imported the framework: it cannot be in use
        try:
            module = importlib.import_module(f"{__package__}.{module_name}")
            stack = module.STACK.detect(chunks, optimizer)
        except Exception as exc:  # noqa: BLE001 - a framework we cannot read is not fatal
            logger.warning("monitor_v2: could not inspect the objects passed to start() as %s (%r); "
                           "monitoring them as plain torch", trigger, exc)
            continue
        if stack is not None:
            logger.info("monitor_v2: training stack %s detected", stack.name)
            return stack
    return TrainingStack(chunks, optimizer)
