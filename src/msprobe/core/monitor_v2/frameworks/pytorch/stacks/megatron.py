"""Megatron-Core adapter (written against Megatron-Core 0.16; nothing here imports
Megatron): ``mon.start(model=ddp_model_or_list_of_chunks, optimizer=get_megatron_optimizer(...))``.

What Megatron does differently from plain torch (user documentation: docs/frameworks.md):

- Its ``DistributedDataParallel`` hooks each parameter's gradient accumulator node:
  the hook adds ``param.grad`` into ``param.main_grad`` (a view into a flat fp32 or
  model-dtype buffer) and sets ``param.grad`` to None. ``main_grad`` holds the local
  gradient accumulated over the micro-batches until ``finish_grad_sync()`` reduces it:
  all-reduce, or reduce-scatter with the distributed optimizer (then only this rank's
  slice of each parameter is reduced; the rest of ``main_grad`` is stale).
- Its optimizers (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``,
  ``DistributedOptimizer``, all inside the ``ChainedOptimizer`` that
  ``get_megatron_optimizer`` returns) give the torch optimizer fp32 master copies, or
  this rank's shards of them, so the torch optimizer's tensors are not the model's
  parameters. ``ChainedOptimizer.state`` is a ``ProxyDict`` without ``get``: state is
  read from each inner torch optimizer instead.

Rows:
- ``unreduced`` (accumulated): a post-hook on the same gradient accumulator node,
  registered after Megatron's, reads ``main_grad`` once Megatron has added the pass's
  gradient; after the last announced micro-batch it is the whole local gradient, and
  the reduction has not started (``overlap_grad_reduce=False``). With
  ``overlap_grad_reduce=True`` the reduction starts inside backward: not observable.
- ``unreduced`` (per micro-batch): a tensor hook on the parameter sees the pass's own
  gradient before Megatron adds it to ``main_grad``.
- ``reduced``: ``main_grad`` when ``optimizer.step()`` is called (before the step copies,
  unscales and clips it), this rank's slice under the distributed optimizer.
- ``param`` / ``optimizer``: the fp32 masters (or master shards; the parameter itself for
  an fp32 model without the distributed optimizer) and their Adam moments, per name.

Private attributes are read defensively: a layout this module does not recognise is
logged once, naming what is not observable, and never raises into training.
"""

import functools
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from ....param_table import ParamInfo, ParamTable
from .base import GradCallback, TrainingStack, UnreducedCapture, tensor_states

# Megatron's wrappers whose ``.module`` is the user's model (how the stack is detected;
# naming.py strips them from names with every other pure wrapper).
_WRAPPERS = ("DistributedDataParallel", "Float16Module")


def is_megatron(obj: Any) -> bool:
    return type(obj).__module__.startswith("megatron.")


def is_megatron_ddp(chunk: Any) -> bool:
    return is_megatron(chunk) and hasattr(chunk, "ddp_config") and callable(getattr(chunk, "finish_grad_sync", None))


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
        return state[self.value] if state is not None and self.value in state else {}

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
    return [(p, v) for mg, vg in zip(getattr(opt, model_attr), getattr(opt, value_attr)) for p, v in zip(mg, vg)]


class MegatronStack(TrainingStack):
    name = "megatron"

    def __init__(self, chunks: List[torch.nn.Module], optimizer: Any) -> None:
        super().__init__(chunks, optimizer)
        # A Megatron optimizer holds masters and shards (self.entries); otherwise (None, or
        # a torch optimizer beside Megatron's DDP) the plain readers of TrainingStack apply.
        self.megatron_optimizer = is_megatron(optimizer)
        self.ddp_chunks = [c for c in chunks if is_megatron_ddp(c)]
        # Megatron FSDP shards parameters and gradients its own way: not read here.
        self.fsdp = any(getattr(c.ddp_config, "use_megatron_fsdp", False) for c in self.ddp_chunks)
        if self.fsdp:
            self.log_once("fsdp", "Megatron FSDP (use_megatron_fsdp) is not supported in this version: no "
                          "weight_grad, optimizer or param rows are written. Logged once.")
            self.ddp_chunks = []
        self.entries: List[MasterEntry] = (
            self._optimizer_entries() if optimizer is not None and not self.fsdp else [])

    @classmethod
    def detect(cls, chunks: List[torch.nn.Module], optimizer: Any) -> Optional["MegatronStack"]:
        wrapped = any(is_megatron(c) and type(c).__name__ in _WRAPPERS for c in chunks)
        if wrapped or (optimizer is not None and is_megatron(optimizer)):
            return cls(chunks, optimizer)
        return None

    # ----------------------------------------------------------------- names
    def optimizer_model_params(self) -> Optional[List[torch.Tensor]]:
        if not self.megatron_optimizer:
            return None
        return [e.model_param for e in self.entries]

    def context_defaults(self) -> dict:
        """Megatron-LM sets up the number of micro-batches; read it when it exists."""
        try:
            from megatron.core.num_microbatches_calculator import get_num_microbatches

            return {"grad_acc_steps": int(get_num_microbatches())}
        except Exception:  # noqa: BLE001 - not set up (Megatron-Core used directly): nothing known
            return {}

    # ------------------------------------------------------ optimizer layouts
    def _optimizer_entries(self) -> List[MasterEntry]:
        """Every parameter of a Megatron optimizer (``ChainedOptimizer`` or one of the
        optimizers it chains), mapped to the model parameter it belongs to."""
        if not self.megatron_optimizer:
            return []
        entries: List[MasterEntry] = []
        for opt in leaf_optimizers(self.optimizer):
            kind = type(opt).__name__
            try:
                if hasattr(opt, "shard_fp32_from_float16_groups"):
                    entries += self._distributed_entries(opt)
                elif hasattr(opt, "fp32_from_float16_groups"):
                    pairs = _pairs(opt, "float16_groups", "fp32_from_float16_groups")
                    pairs += [(p, p) for group in opt.fp32_from_fp32_groups for p in group]
                    entries += [MasterEntry(p, master, opt.optimizer) for p, master in pairs]
                elif isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer):
                    entries += [MasterEntry(p, p, opt.optimizer)
                                for group in opt.optimizer.param_groups for p in group["params"]]
                else:
                    self.log_once(f"layout-{kind}", "%s keeps no torch optimizer this version knows: its "
                                  "optimizer, param and reduced weight_grad rows are not written. Logged once.",
                                  kind)
            except (AttributeError, KeyError, TypeError) as exc:
                self.log_once(f"layout-{kind}", "could not map the tensors of %s to the model's parameters "
                              "(%r; a Megatron-Core version this monitor does not know?): its optimizer, param "
                              "and reduced weight_grad rows are not written. Logged once.", kind, exc)
        return entries

    def _distributed_entries(self, opt: Any) -> List[MasterEntry]:
        pairs = _pairs(opt, "model_float16_groups", "shard_fp32_from_float16_groups")
        pairs += _pairs(opt, "model_fp32_groups", "shard_fp32_groups")
        entries = []
        for p, shard in pairs:
            if shard is None:
                self.log_once("no-master", "%s keeps no fp32 master shards here (precision-aware optimizer: "
                              "they live inside the fused optimizer): their optimizer and param rows are not "
                              "written. Logged once.", type(opt).__name__)
                continue
            rng = opt._get_model_param_range_map(p)["param"]
            entries.append(MasterEntry(p, shard, opt.optimizer, (rng.start, rng.end)))
        return entries

    def _pairs_for(self, table: ParamTable) -> Iterator[Tuple[ParamInfo, MasterEntry]]:
        for e in self.entries:
            try:
                info = table.info(e.model_param)
            except KeyError:  # a parameter of a model chunk not given to start()
                continue
            yield info, e

    # ------------------------------------------------------------- gradients
    def reduced_grads(self, table: ParamTable) -> List[Tuple[ParamInfo, torch.Tensor]]:
        if not self.megatron_optimizer:
            return super().reduced_grads(table)
        out = []
        for info, e in self._pairs_for(table):
            grad = e.reduced_grad()
            if grad is not None:
                out.append((info, grad))
        return out

    def unreduced_capture(self, table: ParamTable, per_micro_batch: bool,
                          micro_batches: int) -> Optional[UnreducedCapture]:
        if self.fsdp:
            return UnreducedCapture(not_observable="Megatron FSDP (use_megatron_fsdp) is not supported")
        if not self.ddp_chunks:
            return None  # no Megatron DDP: gradients are in .grad, the default hooks read them
        overlapped = [c for c in self.ddp_chunks if getattr(c.ddp_config, "overlap_grad_reduce", False)]
        if overlapped and not per_micro_batch:
            return UnreducedCapture(not_observable=(
                "Megatron-Core's DistributedDataParallel with overlap_grad_reduce=True starts reducing "
                "main_grad inside the last backward pass, so the accumulated local gradient is never whole "
                "and unreduced at one point (monitor_mbs_grad=true gives each micro-batch's own gradient)"))
        return UnreducedCapture(install=functools.partial(self._install_unreduced, per_micro_batch, table))

    def _install_unreduced(self, per_micro_batch: bool, table: ParamTable, on_micro_batch: GradCallback,
                           on_accumulated: GradCallback) -> List[Any]:
        handles: List[Any] = []
        for chunk in self.ddp_chunks:
            for p in chunk.module.parameters():
                if not (p.requires_grad and hasattr(p, "main_grad")):
                    continue
                info = table.info(p)
                if per_micro_batch:
                    handles.append(p.register_hook(functools.partial(self._micro_batch_grad, on_micro_batch, info, p)))
                    continue
                node = _grad_accumulator(p)
                if node is None:
                    self.log_once("no-grad-acc", "no gradient accumulator node found for %s: no accumulated "
                                  "'unreduced' rows for it. Logged once.", info.name)
                    continue
                # Runs after Megatron's hook on the same node (hooks run in the order they
                # were registered), when main_grad includes this pass's gradient.
                handles.append(node.register_hook(functools.partial(self._accumulated, on_accumulated, info, p)))
        return handles

    def _micro_batch_grad(self, callback: GradCallback, info: ParamInfo, p: torch.Tensor,
                          grad: torch.Tensor) -> None:
        if getattr(p, "grad_added_to_main_grad", False):
            # Fused weight-gradient accumulation (Transformer Engine / APEX) already wrote the
            # gradient into main_grad; what reaches autograd is a placeholder.
            self.log_once("fused-wgrad", "gradient_accumulation_fusion adds weight gradients straight into "
                          "main_grad: per-micro-batch 'unreduced' rows of those parameters (e.g. %s) are not "
                          "written. Logged once.", info.name)
            return
        callback(info, grad)

    @staticmethod
    def _accumulated(callback: GradCallback, info: ParamInfo, p: torch.Tensor, *_: Any) -> None:
        # main_grad is read inside the contained callback (and only for a recorded pass):
        # a Megatron that dropped the attribute gets a logged error, not one in autograd.
        callback(info, functools.partial(getattr, p, "main_grad"))

    # ------------------------------------------------------ optimizer, params
    def param_values(self, table: ParamTable) -> List[Tuple[ParamInfo, torch.Tensor]]:
        if not self.megatron_optimizer:
            return super().param_values(table)
        return [(info, e.value) for info, e in self._pairs_for(table)]

    def optimizer_states(self, table: ParamTable) -> Iterator[Tuple[ParamInfo, str, torch.Tensor]]:
        if not self.megatron_optimizer:
            yield from super().optimizer_states(table)
            return
        for info, e in self._pairs_for(table):
            yield from tensor_states(info, e.state())


def _grad_accumulator(p: torch.Tensor) -> Optional[Any]:
    """The gradient accumulator node of a leaf parameter: the same node Megatron's DDP
    hooked (it keeps a reference to it, so autograd hands out that node again)."""
    with torch.enable_grad():
        grad_fn = p.expand_as(p).grad_fn
    if grad_fn is None or not grad_fn.next_functions:
        return None
    return grad_fn.next_functions[0][0]


STACK = MegatronStack
