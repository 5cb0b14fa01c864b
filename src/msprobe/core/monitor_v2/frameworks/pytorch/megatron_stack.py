"""Megatron-Core: its model wrappers, gradient buffers and optimizers, as the PyTorch
monitors need them (written against Megatron-Core 0.16; nothing here imports Megatron).

What Megatron does differently from plain torch (see docs/frameworks.md):

- ``DistributedDataParallel`` (Megatron's own) hooks every parameter's gradient
  accumulator: it adds ``param.grad`` into ``param.main_grad`` (a view into a flat fp32
  or model-dtype buffer) and sets ``param.grad`` to None. ``main_grad`` holds the local
  accumulated gradient until ``finish_grad_sync()`` (or ``start_grad_sync()``) reduces
  it: all-reduce, or reduce-scatter with the distributed optimizer, where only this
  rank's slice of each parameter is reduced.
- The optimizers (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``,
  ``DistributedOptimizer``, all inside a ``ChainedOptimizer``) give the torch optimizer
  fp32 master copies (or local shards of them), so the torch optimizer's parameters and
  state are not the model's parameters.

Private attributes are read defensively: a layout this module does not recognise is
logged once, naming what is not observable, and never raises into training.
"""

import logging
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

logger = logging.getLogger("msprobe.monitor_v2")

# Wrappers whose ``.module`` is the user's model: their names never reach the CSV.
_WRAPPERS = ("DistributedDataParallel", "Float16Module")


def is_megatron(obj: Any) -> bool:
    return type(obj).__module__.startswith("megatron.")


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The user's model below Megatron's ``DistributedDataParallel`` and
    ``Float16Module`` (and torch's DDP), in any nesting."""
    while True:
        inner = getattr(module, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return module
        if isinstance(module, torch.nn.parallel.DistributedDataParallel) or (
                is_megatron(module) and type(module).__name__ in _WRAPPERS):
            module = inner
        else:
            return module


def grad_sync_chunks(chunks: Sequence[Any]) -> List[Any]:
    """The chunks that are Megatron ``DistributedDataParallel`` objects."""
    return [c for c in chunks if is_megatron(c) and callable(getattr(c, "finish_grad_sync", None))
            and hasattr(c, "ddp_config")]


def uses_megatron(model_chunks: Sequence[Any], optimizer: Any) -> bool:
    return bool(grad_sync_chunks(model_chunks)) or (optimizer is not None and is_megatron(optimizer))


class _Once:
    """Log a message once per key."""

    def __init__(self) -> None:
        self._said: set = set()

    def __call__(self, key: str, message: str, *args: Any) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.warning("monitor_v2 Megatron-Core: " + message + " Logged once.", *args)


say_once = _Once()


# ------------------------------------------------------------------- optimizers
class MasterEntry:
    """One model parameter as a Megatron optimizer holds it.

    ``value``: the tensor the torch optimizer updates for it (fp32 master, this rank's
    shard of the master, or the parameter itself); ``torch_optimizer``: whose ``state``
    holds its moments (keyed by ``value``); ``grad_range``: the slice of the flattened
    parameter this rank owns (distributed optimizer), None for the whole parameter."""

    __slots__ = ("model_param", "value", "torch_optimizer", "grad_range")

    def __init__(self, model_param: torch.Tensor, value: torch.Tensor, torch_optimizer: Any,
                 grad_range: Optional[Tuple[int, int]] = None) -> None:
        self.model_param = model_param
        self.value = value
        self.torch_optimizer = torch_optimizer
        self.grad_range = grad_range

    def state(self) -> Dict[str, Any]:
        state = getattr(self.torch_optimizer, "state", None)
        if state is None:
            return {}
        try:
            return state[self.value] if self.value in state else {}
        except (TypeError, KeyError):
            return {}

    def reduced_grad(self) -> Optional[torch.Tensor]:
        """The gradient the optimizer will use, as it stands now: ``main_grad`` (or
        ``.grad`` without Megatron's DDP), this rank's slice under the distributed
        optimizer."""
        grad = getattr(self.model_param, "main_grad", None)
        if grad is None:
            grad = self.model_param.grad
        if grad is None:
            return None
        if self.grad_range is not None:
            grad = grad.view(-1)[self.grad_range[0]:self.grad_range[1]]
        return grad


def leaf_optimizers(optimizer: Any) -> Iterator[Any]:
    """The optimizers inside (nested) ``ChainedOptimizer``s, stubs left out."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        for inner in chained:
            yield from leaf_optimizers(inner)
    elif not getattr(optimizer, "is_stub_optimizer", False):
        yield optimizer


def _pairs(opt: Any, model_attr: str, value_attr: str) -> List[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
    model_groups = getattr(opt, model_attr)
    value_groups = getattr(opt, value_attr)
    return [(p, v) for mg, vg in zip(model_groups, value_groups) for p, v in zip(mg, vg)]


def _distributed_entries(opt: Any) -> List[MasterEntry]:
    pairs = _pairs(opt, "model_float16_groups", "shard_fp32_from_float16_groups")
    pairs += _pairs(opt, "model_fp32_groups", "shard_fp32_groups")
    entries = []
    for p, shard in pairs:
        if shard is None:  # precision-aware optimizer: the master lives inside the fused optimizer
            say_once(f"no-master-{type(opt).__name__}",
                     "%s keeps no fp32 master shards (precision-aware optimizer): its optimizer and "
                     "param rows are not written.", type(opt).__name__)
            continue
        rng = opt._get_model_param_range_map(p)["param"]
        entries.append(MasterEntry(p, shard, opt.optimizer, (rng.start, rng.end)))
    return entries


def _float16_entries(opt: Any) -> List[MasterEntry]:
    pairs = _pairs(opt, "float16_groups", "fp32_from_float16_groups")
    pairs += [(p, p) for group in opt.fp32_from_fp32_groups for p in group]
    return [MasterEntry(p, master, opt.optimizer) for p, master in pairs]


def _plain_entries(opt: Any) -> List[MasterEntry]:
    inner = opt.optimizer
    return [MasterEntry(p, p, inner) for group in inner.param_groups for p in group["params"]]


def optimizer_entries(optimizer: Any) -> List[MasterEntry]:
    """Every parameter of a Megatron optimizer (``ChainedOptimizer`` or one of the
    optimizers it chains), mapped to the model parameter it belongs to."""
    entries: List[MasterEntry] = []
    for opt in leaf_optimizers(optimizer):
        kind = type(opt).__name__
        try:
            if hasattr(opt, "shard_fp32_from_float16_groups"):
                entries += _distributed_entries(opt)
            elif hasattr(opt, "fp32_from_float16_groups"):
                entries += _float16_entries(opt)
            elif isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer):
                entries += _plain_entries(opt)
            else:
                say_once(f"layout-{kind}", "%s has no layout this version knows (no inner torch "
                         "optimizer): its optimizer, param and reduced weight_grad rows are not written.", kind)
        except (AttributeError, KeyError, TypeError) as exc:
            say_once(f"layout-{kind}", "could not map the parameters of %s to the model (%r; a Megatron "
                     "version this monitor does not know?): its optimizer, param and reduced weight_grad "
                     "rows are not written.", kind, exc)
    return entries


# ----------------------------------------------------------- gradient reduction
class GradSyncTap:
    """Calls ``before_sync(chunk)`` right before a Megatron DDP chunk reduces its
    gradients (``start_grad_sync`` or ``finish_grad_sync``, whichever runs first), by
    wrapping the two methods on the instance; ``undo()`` removes the wrappers again.

    With ``overlap_grad_reduce`` the reduction starts inside backward, so there is no
    such point: those chunks are not wrapped and ``overlapped`` lists them."""

    _METHODS = ("start_grad_sync", "finish_grad_sync")

    def __init__(self, chunks: Sequence[Any], before_sync: Callable[[Any], None]) -> None:
        self._wrapped: List[Tuple[Any, str, Callable, bool, Any]] = []
        self.overlapped: List[Any] = []
        for chunk in chunks:
            if getattr(chunk.ddp_config, "overlap_grad_reduce", False):
                self.overlapped.append(chunk)
                continue
            for method in self._METHODS:
                if callable(getattr(chunk, method, None)):
                    self._wrap(chunk, method, before_sync)

    def _wrap(self, chunk: Any, method: str, before_sync: Callable[[Any], None]) -> None:
        original = getattr(chunk, method)
        had_instance_attr = method in vars(chunk)
        previous = vars(chunk).get(method)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            before_sync(chunk)
            return original(*args, **kwargs)

        setattr(chunk, method, wrapper)
        self._wrapped.append((chunk, method, wrapper, had_instance_attr, previous))

    def undo(self) -> None:
        while self._wrapped:
            chunk, method, wrapper, had_instance_attr, previous = self._wrapped.pop()
            if vars(chunk).get(method) is not wrapper:
                logger.warning("monitor_v2: %s.%s was replaced after start(); leaving it as it is",
                               type(chunk).__name__, method)
            elif had_instance_attr:
                setattr(chunk, method, previous)
            else:
                delattr(chunk, method)
