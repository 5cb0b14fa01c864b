"""What the PyTorch monitors share during one ``start()``/``stop()``: the model chunks,
parameter names, the optimizer, the statistics engine, and the optimizer-step hooks."""

import logging
from typing import Any, Callable, Dict, Iterator, List, Mapping, Sequence, Tuple

import torch

from ...errors import ConfigError
from .. import rank_from_environment
from .copies import set_without_copy
from .fsdp import FlatParamLayout, clean_name, fsdp1_layouts, fsdp2_modules, fsdp2_sharded_params
from .stats import TorchStatsEngine

logger = logging.getLogger("msprobe.monitor_v2")

NAME_SEP = ":"


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


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The user's own module below the wrappers that add nothing to it: DDP and
    ``torch.compile``'s ``OptimizedModule`` (its ``_orig_mod`` runs the compiled code, so
    hooks on it and its submodules see every call), in any nesting."""
    compiled = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    optimized = getattr(compiled, "OptimizedModule", ())
    while True:
        if isinstance(chunk, torch.nn.parallel.DistributedDataParallel):
            chunk = chunk.module
        elif optimized and isinstance(chunk, optimized):
            chunk = chunk._orig_mod
        else:
            return chunk


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
        # Names are read below DDP's and torch.compile's wrappers, so they match the
        # user's model (no "module.", no "_orig_mod.").
        self.roots = [unwrap(c) for c in self.chunks]
        self.optimizer = optimizer
        self.context = dict(context)
        self.engine = TorchStatsEngine()
        self.params: List[ParamInfo] = []
        self._by_id: Dict[int, ParamInfo] = {}
        for vpp, chunk in enumerate(self.roots):
            for name, p in chunk.named_parameters():
                if id(p) not in self._by_id:
                    self._add(vpp, self.qualify(vpp, clean_name(name)), p)
        self.n_model_params = len(self.params)
        self._find_fsdp()
        if optimizer is not None:
            for g, group in enumerate(optimizer.param_groups):
                for i, p in enumerate(group["params"]):
                    if id(p) not in self._by_id:  # not part of the model given to start()
                        self._add(0, f"param_groups.{g}.params.{i}", p)

    def _find_fsdp(self) -> None:
        """FSDP1 flat parameters (by id) and the FSDP2 modules of the model chunks; the
        ids of parameters whose ``unreduced`` gradient is not read on the parameter."""
        self.flat_layouts: Dict[int, Tuple[int, FlatParamLayout]] = {}
        self.fsdp2_modules: List[Tuple[int, torch.nn.Module]] = []
        self.fsdp_managed: set = set()
        for vpp, chunk in enumerate(self.roots):
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

    def _add(self, vpp: int, name: str, p: torch.nn.Parameter) -> None:
        info = ParamInfo(len(self.params), vpp, name, p)
        self.params.append(info)
        self._by_id[id(p)] = info

    def qualify(self, vpp_stage: int, name: str) -> str:
        """Name as written in the CSV: chunk prefix for a list of chunks."""
        return f"{vpp_stage}{NAME_SEP}{name}" if self.is_chunk_list else name

    def info(self, p: torch.Tensor) -> ParamInfo:
        return self._by_id[id(p)]

    def model_params(self) -> List[ParamInfo]:
        """Parameters of the model chunks that train (``requires_grad``)."""
        return [i for i in self.params[: self.n_model_params] if i.param.requires_grad]

    def optimizer_params(self) -> List[ParamInfo]:
        if self.optimizer is None:
            return []
        seen, out = set(), []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(self._by_id[id(p)])
        return out

    def optimizer_states(self) -> Iterator[Tuple[ParamInfo, str, torch.Tensor]]:
        """Every per-parameter tensor the optimizer keeps, under its own name: Adam/AdamW
        ``exp_avg``/``exp_avg_sq`` (and ``max_exp_avg_sq``), SGD ``momentum_buffer``,
        Adagrad ``sum``, RMSprop ``square_avg``... The scalar ``step`` is not state of the
        parameter's values."""
        state = self.optimizer.state
        for info in self.optimizer_params():
            for key, value in state.get(info.param, {}).items():
                if key != "step" and isinstance(value, torch.Tensor) and value.dim() > 0:
                    yield info, key, value

    def install_step_hooks(self, before: Callable[[], None], after: Callable[[], None]) -> Callable[[], None]:
        """Call ``before``/``after`` around every ``optimizer.step()``; returns the undo.

        A ``torch.optim.Optimizer`` gets removable step hooks (no attribute is patched);
        another object with a ``step`` method gets an instance-level wrapper that the undo
        removes again."""
        opt = self.optimizer
        if opt is None:
            return lambda: None
        if isinstance(opt, torch.optim.Optimizer):
            pre = opt.register_step_pre_hook(lambda *_: before())
            post = opt.register_step_post_hook(lambda *_: after())

            def undo() -> None:
                pre.remove()
                post.remove()

            return undo
        if not callable(getattr(opt, "step", None)):
            raise ConfigError(
                f"start(): optimizer must have a step() method, got {type(opt).__name__}", field="optimizer"
            )
        had_instance_attr = "step" in vars(opt)
        previous = vars(opt).get("step")
        step = _PatchedStep(opt.step, before, after)
        # Copies and pickles of the optimizer get its step() as it was before.
        copy_state = set_without_copy(opt, "step", step)

        def undo_wrapper() -> None:
            if copy_state is not None:
                copy_state.uninstall()
            if vars(opt).get("step") is not step:
                logger.warning("monitor_v2: %s.step was replaced after start(); leaving it as it is",
                               type(opt).__name__)
                return
            if had_instance_attr:
                opt.step = previous
            else:
                del opt.step

        return undo_wrapper


class _PatchedStep:
    """The instance-level ``step`` of an optimizer that is not a ``torch.optim.Optimizer``:
    ``before()``, the original ``step``, ``after()``."""

    __slots__ = ("original", "before", "after")

    def __init__(self, original: Callable[..., Any], before: Callable[[], None], after: Callable[[], None]) -> None:
        self.original = original
        self.before = before
        self.after = after

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.before()
        result = self.original(*args, **kwargs)
        self.after()
        return result
