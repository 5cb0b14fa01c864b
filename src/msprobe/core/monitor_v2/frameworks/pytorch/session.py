"""What the PyTorch monitors share during one ``start()``/``stop()``: the model chunks,
parameter names, the optimizer, the statistics engine, and the optimizer-step hooks
(``backend.Session``). Parameter names are a ``ParamTable``, which the training stack
reads at each hook point; the stack never sees the session."""

import logging
from itertools import repeat
from operator import attrgetter, is_, itemgetter
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from ... import layout, rows
from ...errors import ConfigError
from ...model_structure import ParamEntry, Structure, module_entries
from ...monitor import module_tags
from ...param_table import ParamInfo, ParamTable, unique
from ...patching import Patch
from .. import rank_from_environment
from .stacks.fsdp import FlatParamLayout, fsdp1_layouts, fsdp2_modules, fsdp2_sharded_params
from . import naming
from .naming import class_name, named_parameters, unwrap
from .stacks import TrainingStack, detect_stack
from .stats import _PLAIN_TYPES, TorchStatsEngine

logger = logging.getLogger("msprobe.monitor_v2")

_FIRST, _SECOND, _INDEX = itemgetter(0), itemgetter(1), attrgetter("index")
_PARAM, _GRAD = attrgetter("param"), attrgetter("grad")


def global_rank() -> int:
    """Rank for the output directory: the process group's when initialized, else the
    launcher's ``RANK`` variable, else 0."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    rank = rank_from_environment(("RANK",))
    return 0 if rank is None else rank


def _as_chunks(model: Any) -> Tuple[List[torch.nn.Module], bool]:
    if model is None:
        return [], False
    if isinstance(model, (list, tuple)):
        chunks = list(model)
        is_list = True
    else:
        chunks = [model]
        is_list = False
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, torch.nn.Module):
            where = f"model[{i}]" if is_list else "model"
            raise ConfigError(
                f"start(): {where} must be a torch.nn.Module (or a list of them), got {type(chunk).__name__}",
                field="model",
            )
    return chunks, is_list


class TorchSession:
    def __init__(self, model: Any, optimizer: Any, context: Mapping[str, Any], rank_dir: str) -> None:
        self.rank_dir = rank_dir
        self.chunks, self.is_chunk_list = _as_chunks(model)
        # What the training stack (plain torch, DeepSpeed, Megatron...) keeps where: see stacks/.
        self.stack: TrainingStack = detect_stack(self.chunks, optimizer)
        # Names are read below every pure wrapper (naming.py: DDP, FSDP1, torch.compile,
        # checkpoint/offload wrappers, DeepSpeed's engine, Megatron's), at the root and
        # inside, so they match the user's model (no "module.", no "_orig_mod.").
        self.roots = [unwrap(c) for c in self.chunks]
        self.optimizer = optimizer
        self.context = dict(context)
        if self.context.get("micro_batch_number") is None and self.context.get("grad_acc_steps") is None:
            self.context.update(self.stack.context_defaults())
        self.engine = TorchStatsEngine()
        self.table = ParamTable([named_parameters(chunk) for chunk in self.roots], self.is_chunk_list)
        self._find_fsdp()
        if optimizer is not None:
            table = self.table
            model_params = self.stack.optimizer_model_params()
            if model_params is not None:
                table.set_optimizer_params(unique(table.info(p) for p in model_params if p in table))
            else:
                # a tensor not part of the model given to start() is named by its place (the
                # groups of a container's optimizers one after the other)
                table.set_optimizer_params(unique(table.adopt(
                    (rows.unlisted_param_name(g, i), p)
                    for g, group in enumerate(self.stack.optimizer_param_groups())
                    for i, p in enumerate(group["params"]))))

    def _find_fsdp(self) -> None:
        """FSDP1 flat parameters (by id) and the FSDP2 modules of the model chunks; the
        ids of parameters whose ``unreduced`` gradient is not read on the parameter."""
        self.flat_layouts: Dict[int, Tuple[int, FlatParamLayout]] = {}
        self._row_keys: Dict[Tuple[str, str], Dict[int, Tuple[int, str, str, None]]] = {}  # see expand
        self._kept_keys: Dict[Tuple[str, str], Tuple[List[ParamInfo], List[Tuple[int, str, str, None]]]] = {}
        self.fsdp2_modules: List[Tuple[int, torch.nn.Module]] = []
        self.fsdp_managed: set = set()
        # The chunks as given: an FSDP1 root is a pure wrapper above its root (``self.roots``)
        # and holds that unit's flat parameter.
        for vpp, chunk in enumerate(self.chunks):
            for layout in fsdp1_layouts(chunk):
                for seg in layout.unsharded + layout.shard:
                    seg.name = self.table.qualify(vpp, seg.name)
                self.flat_layouts[id(layout.flat_param)] = (vpp, layout)
                self.fsdp_managed.add(id(layout.flat_param))
                self.fsdp_managed.update(id(p) for p in getattr(layout.flat_param, "_params", None) or ())
            self.fsdp2_modules.extend((vpp, m) for m in fsdp2_modules(chunk))
            self.fsdp_managed.update(id(p) for p in fsdp2_sharded_params(chunk))

    def expand(self, items: Sequence[Tuple[ParamInfo, torch.Tensor]], scope: str, suffix: str = "") -> Tuple[
            List[torch.Tensor], List[Tuple[int, str, str, None]]]:
        """Tensors and row keys for ``(param, tensor)`` pairs read at the optimizer step.

        An FSDP1 flat shard is cut into one view per original parameter; local shards
        without elements (a rank that holds nothing of a parameter: a DTensor's, or an
        FSDP1 original parameter's under ``use_orig_params=True``) are left out. A
        parameter without elements (``numel() == 0``) keeps its rows, as in every monitor:
        ``nan`` min/max/mean, 0 norm and NaNs. The lists returned are not to be changed
        (the list of keys is given again to the next call with the same parameters)."""
        flat_layouts = self.flat_layouts
        known = self._known_keys(scope, suffix)
        if not flat_layouts:
            # the common case in passes that run in C (thousands of parameters: a loop with a
            # type check and a lookup per item cost more than the statistics of a small
            # tensor); the same parameters as at the last call get the same list of keys
            tensors = list(map(_SECOND, items))
            if set(map(type, tensors)) <= _PLAIN_TYPES:
                return tensors, self._plain_keys(list(map(_FIRST, items)), scope, suffix)
        tensors, keys = [], []
        for info, t in items:
            if type(t) in _PLAIN_TYPES and not flat_layouts:  # plain tensors of a mixed list
                tensors.append(t)
                key = known.get(info.index)
                if key is None:
                    key = known[info.index] = (info.vpp_stage, info.name + suffix, scope, None)
                keys.append(key)
                continue
            flat = flat_layouts.get(id(info.param))
            if flat is not None:
                for seg in flat[1].shard:
                    tensors.append(seg.view(t))
                    keys.append((info.vpp_stage, seg.name + suffix, scope, None))
                continue
            local = t.to_local() if hasattr(t, "to_local") else t
            # A DTensor shard without elements, or an FSDP1 original parameter
            # (use_orig_params=True) of which this rank's flat shard holds nothing.
            if local.numel() == 0 and (t.numel() != 0 or id(info.param) in self.fsdp_managed):
                continue
            tensors.append(t)
            keys.append((info.vpp_stage, info.name + suffix, scope, None))
        return tensors, keys

    def _known_keys(self, scope: str, suffix: str) -> Dict[int, Tuple[int, str, str, None]]:
        """Parameter index -> its row key for ``scope`` and ``suffix``: the same at every
        step, built once."""
        known = self._row_keys.get((scope, suffix))
        if known is None:
            known = self._row_keys[(scope, suffix)] = {}
        return known

    def _plain_keys(self, infos: List[ParamInfo], scope: str, suffix: str) -> List[Tuple[int, str, str, None]]:
        """The row keys of whole parameters; the same list again for the same parameters."""
        kept = self._kept_keys.get((scope, suffix))
        if kept is not None and len(kept[0]) == len(infos) and all(map(is_, infos, kept[0])):
            return kept[1]
        known = self._known_keys(scope, suffix)
        keys = list(map(known.get, map(_INDEX, infos)))
        if None in keys:
            keys = [key if key is not None else known.setdefault(
                info.index, (info.vpp_stage, info.name + suffix, scope, None))
                for key, info in zip(keys, infos)]
        self._kept_keys[(scope, suffix)] = (infos, keys)
        return keys

    def reduced_grad_tensors(self, scope: str) -> Tuple[List[torch.Tensor], List[Tuple[int, str, str, None]]]:
        """``expand(reduced_grads(), scope)``. Where the stack reads ``param.grad`` (its
        ``reduced_grads`` is the base one) and every gradient is a plain tensor, the
        gradients are read in one C-level pass over the parameters, without a pair per
        parameter (thousands of parameters: the pairs and their unpacking cost about as
        much as the getters)."""
        if type(self.stack).reduced_grads is TrainingStack.reduced_grads and not self.flat_layouts:
            infos = self.table.optimizer_params()
            grads = list(map(_GRAD, map(_PARAM, infos)))
            if not any(map(is_, grads, repeat(None))) and set(map(type, grads)) <= _PLAIN_TYPES:
                return grads, self._plain_keys(infos, scope, "")
        return self.expand(self.reduced_grads(), scope)

    def named_modules(self) -> List[Tuple[int, str, torch.nn.Module]]:
        """``(vpp_stage, name, module)`` of every module of every chunk: what the module
        monitor selects from and the structure listing shows."""
        # wrappers left out and the root named by the user's class (naming.py)
        return [(vpp, name or class_name(m), m) for vpp, root in enumerate(self.roots)
                for name, m in naming.named_modules(root)]

    def structure(self) -> Structure:
        """Module names as ``targets`` matches them and parameter names as rows carry them.
        ``ModuleList``/``ModuleDict`` (and parameter containers) are never called: they
        are marked, having no rows of their own."""
        containers = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.ParameterList, torch.nn.ParameterDict)
        modules = module_entries(module_tags(self.named_modules(), self.table.qualify), self.roots, containers)
        params = []
        for info in self.table.params:
            p = info.param
            dtype = str(p.dtype).replace("torch.", "")
            flat = self.flat_layouts.get(id(p))
            if flat is not None:  # an FSDP1 flat parameter: rows carry the original parameters' names
                params.extend(ParamEntry(seg.name, dtype, (seg.numel,), p.requires_grad) for seg in flat[1].unsharded)
                continue
            params.append(ParamEntry(info.name, dtype, tuple(p.shape), p.requires_grad))
        return Structure(framework="pytorch", rank=global_rank(), modules=modules, params=params)

    def layout(self) -> Dict[str, Any]:
        """The ``layout.json`` document of this rank (``layout.py``), from the training stack."""
        doc = layout.new_document("pytorch", self.stack.name, global_rank(), world_size())
        self.stack.layout(self.table, doc)
        return doc

    def reduced_grads(self) -> List[Tuple[ParamInfo, torch.Tensor]]:
        """Gradients as they stand at the optimizer step (local shards allowed)."""
        return self.stack.reduced_grads(self.table)

    def param_values(self) -> List[Tuple[ParamInfo, torch.Tensor]]:
        """The values the optimizer updates, per parameter (fp32 masters where the stack
        keeps them; local shards allowed)."""
        return self.stack.param_values(self.table)

    def optimizer_states(self) -> Iterator[Tuple[ParamInfo, str, torch.Tensor]]:
        """Every per-parameter tensor the optimizer keeps, under its own name (see
        ``TrainingStack.optimizer_states``)."""
        return self.stack.optimizer_states(self.table)

    def install_step_hooks(self, before: Callable[[], None], after: Callable[[], None]) -> Patch:
        """Call ``before``/``after`` around every real optimizer step; returns the patch."""
        return self.stack.install_step_hooks(before, after)

    def agree_max(self, values: Sequence[int]) -> List[int]:
        """All-reduce MAX over the default group: a CPU tensor under gloo, one on the
        current CUDA device under nccl (which cannot reduce host tensors)."""
        group_size = world_size()
        if group_size <= 1:
            return [int(v) for v in values]
        dist = torch.distributed
        device = "cpu"
        if dist.get_backend() == "nccl":
            device = f"cuda:{torch.cuda.current_device()}"
        tensor = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return [int(v) for v in tensor.tolist()]

    def gather(self, value: Optional[str]) -> List[Optional[str]]:
        if world_size() <= 1:
            return [value]
        gathered: List[Optional[str]] = [None] * world_size()
        torch.distributed.all_gather_object(gathered, value)
        return gathered


def world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
