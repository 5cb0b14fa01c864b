"""Training-stack adapters: where a framework that wraps the model and the optimizer
(DeepSpeed, Megatron-Core) keeps what the monitors read.

``detect_stack(chunks, optimizer)`` looks at the objects passed to ``start()`` and returns
one adapter. ``TrainingStack`` itself is the adapter of plain torch, DDP and FSDP (what
the monitors did before adapters existed); a framework adapter subclasses it, overrides
``detect`` and only the hook points that differ, and is listed in ``_ADAPTERS``. The
hook points (``backend.TrainingStack``, the protocol) take the session's ``ParamTable``
(``table``) for parameter names, never the session itself:

- ``optimizer_model_params()``: the *model* parameters the optimizer updates, in order
  (None: the tensors in ``optimizer.param_groups``). Flat or fp32-master tensors in the
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

Adapters import their framework lazily (only once it is already imported by the user)
and read its private attributes defensively: what a version does not expose is logged
once, naming what is not observed, and never raises into the training loop.
"""

import importlib
import logging
import sys
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from ....backend import GradCallback, UnreducedCapture
from ....errors import ConfigError
from ....logonce import LogOnce
from ....param_table import ParamInfo, ParamTable
from ....patching import Patch, hooks, wrap_method
from .state_listing import StateListing, is_state_tensor

logger = logging.getLogger("msprobe.monitor_v2")

__all__ = ["GradCallback", "TrainingStack", "UnreducedCapture", "detect_stack", "hookable_optimizer",
           "optimizer_step_hooks", "tensor_states"]

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
        over every parameter's state, while the optimizer keeps the same tensors."""
        state = self.optimizer.state
        infos = table.optimizer_params()
        if self._state_listing is not None:
            found = self._state_listing.again(state, infos)
            if found is not None:
                return iter(found)
        found, self._state_listing = StateListing.of(state, infos)
        return iter(found)


def tensor_states(info: ParamInfo, state: Any) -> Iterator[Tuple[ParamInfo, str, torch.Tensor]]:
    """The non-scalar tensors of one parameter's optimizer state, by state name."""
    for key, value in state.items():
        if is_state_tensor(key, value):
            yield info, key, value


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
