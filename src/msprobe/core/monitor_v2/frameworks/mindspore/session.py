"""What the MindSpore monitors share during one ``start()``/``stop()``: model chunks,
parameter names, the optimizer, the statistics engine and the optimizer-step hooks.

MindSpore optimizers are Cells called with the gradients (``optimizer(grads)``, also
inside ``nn.TrainOneStepCell``). A forward pre-hook on the optimizer sees those
gradients (after any ``DistributedGradReducer``) right before the update, and a forward
hook runs right after it: they play the role of PyTorch's optimizer step hooks; the
pre-hook keeps those gradients for the step, and ``reduced_grads()`` names them.
"""

import logging
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import mindspore as ms
from mindspore import nn

from ... import layout, rows
from ...errors import ConfigError, MonitorError
from ...model_structure import ParamEntry, Structure, module_entries
from ...monitor import module_tags
from ...param_table import ParamInfo, ParamTable
from ...patching import Patch, hooks
from .. import rank_from_environment
from .optimizer_state import optimizer_states
from .stats import MsStatsEngine

logger = logging.getLogger("msprobe.monitor_v2")


def global_rank() -> int:
    try:
        from mindspore.communication import GlobalComm, get_rank

        if GlobalComm.INITED:
            return get_rank()
    except Exception:  # noqa: BLE001
        pass
    rank = rank_from_environment(("RANK_ID", "RANK"))
    return 0 if rank is None else rank


def check_pynative() -> None:
    if ms.get_context("mode") != ms.PYNATIVE_MODE:
        raise MonitorError(
            "monitor_v2: MindSpore runs in GRAPH_MODE, where Python hooks never run, so nothing "
            "could be monitored. Use ms.set_context(mode=ms.PYNATIVE_MODE) for the monitored run "
            "(and no @ms.jit on the functions whose tensors you want to see)."
        )


class MsSession:
    def __init__(self, model: Any, optimizer: Any, context: Mapping[str, Any], rank_dir: str) -> None:
        check_pynative()
        self.rank_dir = rank_dir
        self.context = dict(context)
        self.optimizer = optimizer
        self.engine = MsStatsEngine()
        if model is None:
            chunks, self.is_chunk_list = [], False
        elif isinstance(model, (list, tuple)):
            chunks, self.is_chunk_list = list(model), True
        else:
            chunks, self.is_chunk_list = [model], False
        for i, c in enumerate(chunks):
            if not isinstance(c, nn.Cell):
                where = f"model[{i}]" if self.is_chunk_list else "model"
                raise ConfigError(f"start(): {where} must be a mindspore.nn.Cell (or a list of them), "
                                  f"got {type(c).__name__}", field="model")
        if optimizer is not None and not isinstance(optimizer, nn.Cell):
            raise ConfigError(f"start(): optimizer must be a MindSpore optimizer (an nn.Cell), got "
                              f"{type(optimizer).__name__}", field="optimizer")
        self.chunks = self.roots = chunks
        self.table = ParamTable([chunk.parameters_and_names() for chunk in chunks], self.is_chunk_list)
        # a tensor only the optimizer holds is named by MindSpore's own parameter name
        self.table.set_optimizer_params(self.table.adopt((p.name, p) for p in self.optimizer_parameters()))
        # the gradients the optimizer was called with, from its pre-hook until its update ends
        self._step_grads: Optional[Sequence[Any]] = None

    def named_modules(self) -> List[Tuple[int, str, Any]]:
        """``(vpp_stage, name, cell)`` of every Cell of every chunk: what the module monitor
        selects from and the structure listing shows."""
        return [(vpp, name, c) for vpp, root in enumerate(self.roots) for name, c in root.cells_and_names()]

    def structure(self) -> Structure:
        """Cell names as ``targets`` matches them and parameter names as rows carry them.
        ``CellList``/``CellDict`` are never called: they are marked, having no rows."""
        containers = tuple(c for c in (getattr(nn, "CellList", None), getattr(nn, "CellDict", None)) if c)
        modules = module_entries(module_tags(self.named_modules(), self.table.qualify), self.roots, containers)
        params = [ParamEntry(i.name, str(i.param.dtype), tuple(i.param.shape), bool(i.param.requires_grad))
                  for i in self.table.params]
        return Structure(framework="mindspore", rank=global_rank(), modules=modules, params=params)

    def optimizer_parameters(self) -> List[Any]:
        if self.optimizer is None:
            return []
        params = getattr(self.optimizer, "parameters", None)
        if params is None:
            params = [p for g in getattr(self.optimizer, "param_groups", []) for p in g["params"]]
        return list(params)

    def layout(self) -> Dict[str, Any]:
        """The ``layout.json`` document of this rank (``layout.py``): MindSpore's data
        parallelism holds every parameter whole on every rank; under another parallel
        mode the pieces are unknown (said in the document)."""
        doc = layout.new_document("mindspore", "mindspore", global_rank(), _world_size())
        for info in self.table.model_params():
            p = info.param
            whole = layout.piece(int(p.size))
            doc["params"][info.name] = {"shape": list(p.shape), "pieces": {c: whole for c in layout.SCOPE_CLASSES}}
        return doc

    def reduced_grads(self) -> List[Tuple[ParamInfo, Any]]:
        """The gradients the optimizer is applying (those it was called with, after any
        ``DistributedGradReducer``), per parameter; empty outside its step hooks."""
        grads = self._step_grads
        if grads is None:
            return []
        return [(i, g) for i, g in zip(self.table.optimizer_params(), grads) if g is not None]

    def param_values(self) -> List[Tuple[ParamInfo, Any]]:
        """The values the optimizer updates, per parameter: the parameters themselves."""
        return [(i, i.param) for i in self.table.optimizer_params()]

    def expand(self, items: Sequence[Tuple[ParamInfo, Any]], scope: str,
               suffix: str = "") -> Tuple[List[Any], List[Tuple[int, str, str, None]]]:
        """Tensors and row keys for ``(param, tensor)`` pairs (no flat parameters here)."""
        tensors = [t for _, t in items]
        keys = [(i.vpp_stage, i.name + suffix, scope, None) for i, _ in items]
        return tensors, keys

    def optimizer_states(self) -> Iterator[Tuple[ParamInfo, str, Any]]:
        """``(param info, state name, tensor)`` for each per-parameter state tensor."""
        infos = self.table.optimizer_params()
        states = optimizer_states(self.optimizer, len(infos))  # once: it walks the optimizer's attributes
        for i, info in enumerate(infos):
            for state_name, values in states:
                yield info, state_name, values[i]

    def install_step_hooks(self, before: Callable[[], None], after: Callable[[], None]) -> Patch:
        opt = self.optimizer
        if opt is None:
            return Patch()

        def pre(cell: Any, inputs: Tuple) -> None:
            grads = inputs[0] if inputs else None
            self._step_grads = grads if isinstance(grads, (tuple, list)) else None
            before()

        def post(cell: Any, inputs: Tuple, output: Any) -> None:
            after()
            self._step_grads = None

        return hooks([opt.register_forward_pre_hook(pre), opt.register_forward_hook(post)])

    def agree_max(self, values: Sequence[int]) -> List[int]:
        """The maximum over the world group of each of ``values`` when MindSpore's
        communication is initialized and has more than one rank; the values themselves
        otherwise. An all-gather, reduced here: MindSpore 2.10's CPU backend all-reduces
        with SUM only, and ``comm_func`` has no CPU kernels at all."""
        local = [int(v) for v in values]
        if _world_size() <= 1:
            return local
        try:
            import numpy as np

            gathered = _all_gather(np.asarray(local, np.int32))
            return [int(v) for v in gathered.max(axis=0).tolist()]
        except Exception as exc:  # noqa: BLE001 - the ranks then decide alone, said once
            _say_no_collective(exc)
            return local

    def gather(self, value: Optional[str]) -> List[Optional[str]]:
        """Every rank's ``value``: UTF-8 bytes padded to the longest, one all-gather."""
        if _world_size() <= 1:
            return [value]
        try:
            import numpy as np

            data = b"" if value is None else value.encode("utf-8", "backslashreplace")
            width = self.agree_max([len(data) + 1])[0]
            buf = np.zeros(width, np.int32)
            if value is not None:
                buf[0] = 1
                buf[1:len(data) + 1] = np.frombuffer(data, np.uint8)
            rows_ = _all_gather(buf)
            return [bytes(r[1:].astype(np.uint8)).rstrip(b"\0").decode("utf-8") if r[0] else None for r in rows_]
        except Exception as exc:  # noqa: BLE001
            _say_no_collective(exc)
            return [value]


def _all_gather(local: Any) -> Any:
    """Every rank's copy of the 1-D NumPy array ``local`` (same shape on every rank), as
    rows of one array, by ``mint.distributed.all_gather`` over the world group. The
    function as MindSpore defines it, not the cc monitor's wrapper: the monitor's own
    agreement is no collective of the training to record."""
    import numpy as np
    import mindspore.mint.distributed as md

    all_gather = md.all_gather
    while hasattr(all_gather, "__msprobe_original__"):
        all_gather = all_gather.__msprobe_original__
    received = [ms.Tensor(np.zeros_like(local)) for _ in range(_world_size())]
    all_gather(received, ms.Tensor(local))
    return np.stack([t.asnumpy() for t in received])


def _world_size() -> int:
    try:
        from mindspore.communication import GlobalComm, get_group_size

        return get_group_size() if GlobalComm.INITED else 1
    except Exception:  # noqa: BLE001
        return 1


_NO_COLLECTIVE_SAID: List[bool] = []


def _say_no_collective(exc: BaseException) -> None:
    if not _NO_COLLECTIVE_SAID:
        _NO_COLLECTIVE_SAID.append(True)
        logger.warning("monitor_v2: MindSpore could not run the small collective that makes every rank apply a "
                       "config edit or an escalation at the same step (%r); each rank decides alone, so ranks may "
                       "start at different steps. Logged once.", exc)
