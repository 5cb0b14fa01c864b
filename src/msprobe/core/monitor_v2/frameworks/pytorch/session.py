"""What the PyTorch monitors share during one ``start()``/``stop()``: the model chunks,
parameter names, the optimizer, the statistics engine, and the optimizer-step hooks."""

import logging
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ...errors import ConfigError
from .stats import TorchStatsEngine

logger = logging.getLogger("msprobe.monitor_v2")

NAME_SEP = ":"


def global_rank() -> int:
    """Rank for the output directory: the process group's when initialized, else the
    launcher's ``RANK`` variable, else 0."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


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
        self.optimizer = optimizer
        self.context = dict(context)
        self.engine = TorchStatsEngine()
        self.params: List[ParamInfo] = []
        self._by_id: Dict[int, ParamInfo] = {}
        for vpp, chunk in enumerate(self.chunks):
            for name, p in chunk.named_parameters():
                if id(p) not in self._by_id:
                    self._add(vpp, self.qualify(vpp, name), p)
        self.n_model_params = len(self.params)
        if optimizer is not None:
            for g, group in enumerate(optimizer.param_groups):
                for i, p in enumerate(group["params"]):
                    if id(p) not in self._by_id:  # not part of the model given to start()
                        self._add(0, f"param_groups.{g}.params.{i}", p)

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
        original = opt.step

        def step(*args: Any, **kwargs: Any) -> Any:
            before()
            result = original(*args, **kwargs)
            after()
            return result

        opt.step = step

        def undo_wrapper() -> None:
            if vars(opt).get("step") is not step:
                logger.warning("monitor_v2: %s.step was replaced after start(); leaving it as it is",
                               type(opt).__name__)
                return
            if had_instance_attr:
                opt.step = previous
            else:
                del opt.step

        return undo_wrapper
