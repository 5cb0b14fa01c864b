"""What the PyTorch monitors share during one ``start()``/``stop()``: the model chunks,
parameter names, the optimizer, the statistics engine, and the optimizer-step hooks."""

import logging
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from ... import rows
from ...errors import ConfigError
from ...model_structure import ParamEntry, Structure, module_entries
from ...monitor import module_tags
from ...patching import Patch
from .. import rank_from_environment
from .stacks.fsdp import FlatParamLayout, fsdp1_layouts, fsdp2_modules, fsdp2_sharded_params
from . import naming
from .naming import class_name, named_parameters, unwrap
from .stacks import TrainingStack, UnreducedCapture, detect_stack
from .stats import TorchStatsEngine

logger = logging.getLogger("msprobe.monitor_v2")


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


class ParamInfo:
    __slots__ = ("index", "vpp_stage", "name", "param")

    def __init__(self, index: int, vpp_stage: int, name: str, param: torch.nn.Parameter) -> None:
        self.index = index
        self.vpp_stage = vpp_stage
        self.name = name
        self.param = param


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
        self.params: List[ParamInfo] = []
        self._by_id: Dict[int, ParamInfo] = {}
        for vpp, chunk in enumerate(self.roots):
            for name, p in named_parameters(chunk):
                if id(p) not in self._by_id:
                    self._add(vpp, self.qualify(vpp, name), p)
        self.n_model_params = len(self.params)
        self._find_fsdp()
        self._optimizer_params: List[ParamInfo] = []
        if optimizer is not None:
            model_params = self.stack.optimizer_model_params()
            if model_params is not None:
                self._optimizer_params = _unique([self._by_id[id(p)] for p in model_params if id(p) in self._by_id])
            else:
                for g, group in enumerate(optimizer.param_groups):
                    for i, p in enumerate(group["params"]):
                        if id(p) not in self._by_id:  # not part of the model given to start()
                            self._add(0, rows.unlisted_param_name(g, i), p)
                        self._optimizer_params.append(self._by_id[id(p)])
                self._optimizer_params = _unique(self._optimizer_params)

    def _find_fsdp(self) -> None:
        """FSDP1 flat parameters (by id) and the FSDP2 modules of the model chunks; the
        ids of parameters whose ``unreduced`` gradient is not read on the parameter."""
        self.flat_layouts: Dict[int, Tuple[int, FlatParamLayout]] = {}
        self.fsdp2_modules: List[Tuple[int, torch.nn.Module]] = []
        self.fsdp_managed: set = set()
        # The chunks as given: an FSDP1 root is a pure wrapper above its root (``self.roots``)
        # and holds that unit's flat parameter.
        for vpp, chunk in enumerate(self.chunks):
            for layout in fsdp1_layouts(chunk):
                for seg in layout.unsharded + layout.shard:
                    seg.name = self.qualify(vpp, seg.name)
                self.flat_layouts[id(layout.flat_param)] = (vpp, layout)
                self.fsdp_managed.add(id(layout.flat_param))
                self.fsdp_managed.update(id(p) for p in getattr(layout.flat_param, "_params", None) or ())
            self.fsdp2_modules.extend((vpp, m) for m in fsdp2_modules(chunk))
            self.fsdp_managed.update(id(p) for p in fsdp2_sharded_params(chunk))

    def expand(self, items: Sequence[Tuple[ParamInfo, torch.Tensor]], scope: str, suffix: str = "") -> Tuple[
            List[torch.Tensor], List[Tuple[int, str, str, None]]]:
        """Tensors and row keys for ``(param, tensor)`` pairs read at the optimizer step.

        An FSDP1 flat shard is cut into one view per original parameter; local shards
        without elements (a rank that holds nothing of a parameter) are left out. A
        parameter without elements (``numel() == 0``) keeps its rows, as in every monitor:
        ``nan`` min/max/mean, 0 norm and NaNs."""
        tensors, keys = [], []
        for info, t in items:
            flat = self.flat_layouts.get(id(info.param))
            if flat is not None:
                for seg in flat[1].shard:
                    tensors.append(seg.view(t))
                    keys.append((info.vpp_stage, seg.name + suffix, scope, None))
                continue
            local = t.to_local() if hasattr(t, "to_local") else t
            if local.numel() == 0 and t.numel() != 0:
                continue
            tensors.append(t)
            keys.append((info.vpp_stage, info.name + suffix, scope, None))
        return tensors, keys

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
        modules = module_entries(module_tags(self.named_modules(), self.qualify), self.roots, containers)
        params = []
        for info in self.params:
            p = info.param
            dtype = str(p.dtype).replace("torch.", "")
            flat = self.flat_layouts.get(id(p))
            if flat is not None:  # an FSDP1 flat parameter: rows carry the original parameters' names
                params.extend(ParamEntry(seg.name, dtype, (seg.numel,), p.requires_grad) for seg in flat[1].unsharded)
                continue
            params.append(ParamEntry(info.name, dtype, tuple(p.shape), p.requires_grad))
        return Structure(framework="pytorch", rank=global_rank(), modules=modules, params=params)

    def _add(self, vpp: int, name: str, p: torch.nn.Parameter) -> None:
        info = ParamInfo(len(self.params), vpp, name, p)
        self.params.append(info)
        self._by_id[id(p)] = info

    def qualify(self, vpp_stage: int, name: str) -> str:
        """Name as written in the CSV: chunk prefix for a list of chunks."""
        return rows.chunk_name(vpp_stage, name) if self.is_chunk_list else name

    def info(self, p: torch.Tensor) -> ParamInfo:
        return self._by_id[id(p)]

    def model_params(self) -> List[ParamInfo]:
        """Parameters of the model chunks that train (``requires_grad``)."""
        return [i for i in self.params[: self.n_model_params] if i.param.requires_grad]

    def optimizer_params(self) -> List[ParamInfo]:
        """The model parameters the optimizer updates (for flat or master tensors: the
        parameters they stand for), each once, in the optimizer's order."""
        return list(self._optimizer_params)

    def reduced_grads(self) -> List[Tuple[ParamInfo, torch.Tensor]]:
        """Gradients as they stand at the optimizer step (local shards allowed)."""
        return self.stack.reduced_grads(self)

    def param_values(self) -> List[Tuple[ParamInfo, torch.Tensor]]:
        """The values the optimizer updates, per parameter (fp32 masters where the stack
        keeps them; local shards allowed)."""
        return self.stack.param_values(self)

    def optimizer_states(self) -> Iterator[Tuple[ParamInfo, str, torch.Tensor]]:
        """Every per-parameter tensor the optimizer keeps, under its own name (see
        ``TrainingStack.optimizer_states``)."""
        return self.stack.optimizer_states(self)

    def unreduced_capture(self, per_micro_batch: bool, micro_batches: int) -> Optional[UnreducedCapture]:
        return self.stack.unreduced_capture(self, per_micro_batch, micro_batches)

    def install_step_hooks(self, before: Callable[[], None], after: Callable[[], None]) -> Patch:
        """Call ``before``/``after`` around every real optimizer step; returns the patch."""
        return self.stack.install_step_hooks(before, after)


def _unique(infos: List[ParamInfo]) -> List[ParamInfo]:
    seen, out = set(), []
    for info in infos:
        if info.index not in seen:
            seen.add(info.index)
            out.append(info)
    return out
