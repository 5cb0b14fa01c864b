"""The parameter-name table both frameworks' sessions build at ``start()``: every
parameter of the model chunks, and of the optimizer where it updates tensors the
model does not hold, under the name its rows carry. PyTorch's session adds the
parameters it finds after ``start()`` (``Added``: a param group, a layer set on the model).

Framework-neutral (no torch, no MindSpore): a parameter is any object, found by
identity. The training-stack adapters read names from this table, never from the
session, so that neither needs the other."""

from typing import Any, Dict, Iterable, List, Sequence, Tuple

from . import rows

# Between the chunk number and the name, for a list of model chunks: "0:layers.0.weight".


class ParamInfo:
    """One parameter: its place in the table, its model chunk, its row name, the object."""

    __slots__ = ("index", "vpp_stage", "name", "param")

    def __init__(self, index: int, vpp_stage: int, name: str, param: Any) -> None:
        self.index = index
        self.vpp_stage = vpp_stage
        self.name = name
        self.param = param


class ParamTable:
    """Parameters by identity, in the order they were found: the model chunks' first
    (each parameter once, under its first name), then what only the optimizer holds.

    ``chunks``: per model chunk, its ``(name, parameter)`` pairs as the framework lists
    them. ``is_chunk_list``: the model was given as a list, so names carry the chunk."""

    def __init__(self, chunks: Sequence[Iterable[Tuple[str, Any]]], is_chunk_list: bool) -> None:
        self.is_chunk_list = is_chunk_list
        self.params: List[ParamInfo] = []
        self._by_id: Dict[int, ParamInfo] = {}
        # the model chunks' parameters, in the order found: at start(), then those found
        # later (added to the model after start()), which come after any tensor only the
        # optimizer holds in ``params``
        self._model: List[ParamInfo] = []
        for vpp, named in enumerate(chunks):
            self.add_model_params(vpp, named)
        self._optimizer_params: List[ParamInfo] = []

    def add(self, vpp_stage: int, name: str, p: Any) -> ParamInfo:
        """Add ``p`` under ``name`` (already qualified) and return its entry."""
        info = ParamInfo(len(self.params), vpp_stage, name, p)
        self.params.append(info)
        self._by_id[id(p)] = info
        return info

    def add_model_params(self, vpp_stage: int, named: Iterable[Tuple[str, Any]]) -> List[ParamInfo]:
        """The parameters of model chunk ``vpp_stage`` (``(name, parameter)`` pairs as the
        framework lists them) that the table does not hold yet, added under their
        qualified names; returns their entries."""
        added = []
        for name, p in named:
            if id(p) not in self._by_id:
                added.append(self.add(vpp_stage, self.qualify(vpp_stage, name), p))
        self._model.extend(added)
        return added

    def qualify(self, vpp_stage: int, name: str) -> str:
        """Name as written in the CSV: chunk prefix for a list of chunks."""
        return rows.chunk_name(vpp_stage, name) if self.is_chunk_list else name

    def __contains__(self, p: Any) -> bool:
        return id(p) in self._by_id

    def info(self, p: Any) -> ParamInfo:
        """The entry of ``p`` (by identity); ``KeyError`` for a tensor not in the table."""
        return self._by_id[id(p)]

    def model_params(self) -> List[ParamInfo]:
        """Parameters of the model chunks that train (``requires_grad``)."""
        return [i for i in self._model if i.param.requires_grad]

    def adopt(self, named: Iterable[Tuple[str, Any]]) -> List[ParamInfo]:
        """The entries of the ``(name, tensor)`` pairs, in order; a tensor the model
        chunks do not hold (a tensor only the optimizer has) is added first, under
        ``name`` in chunk 0."""
        infos = []
        for name, p in named:
            info = self._by_id.get(id(p))
            infos.append(self.add(0, name, p) if info is None else info)
        return infos

    def set_optimizer_params(self, infos: Iterable[ParamInfo]) -> None:
        """Record the parameters the optimizer updates, in its order (see ``optimizer_params``)."""
        self._optimizer_params = list(infos)

    def optimizer_params(self) -> List[ParamInfo]:
        """The model parameters the optimizer updates (for flat or master tensors: the
        parameters they stand for), in the optimizer's order."""
        return list(self._optimizer_params)


def unique(infos: Iterable[ParamInfo]) -> List[ParamInfo]:
    """``infos`` with each parameter once, at its first place."""
    seen, out = set(), []
    for info in infos:
        if info.index not in seen:
            seen.add(info.index)
            out.append(info)
    return out


class Added:
    """What a session found in the model and the optimizer that was not there at
    ``start()`` (or at its last look), at the beginning of a written step: what each
    monitor starts to observe from that step (``Monitor.on_added``).

    ``params``: entries of the table the monitors did not observe before (parameters new
    to the model or to the optimizer, and parameters the optimizer updates that were
    frozen and train now). ``modules``: ``(vpp_stage, name, module)`` of the modules new
    to the model chunks, in ``Session.named_modules()``'s form."""

    __slots__ = ("params", "modules")

    def __init__(self, params: Sequence[ParamInfo], modules: Sequence[Tuple[int, str, Any]]) -> None:
        self.params = list(params)
        self.modules = list(modules)

    def __bool__(self) -> bool:
        return bool(self.params or self.modules)
