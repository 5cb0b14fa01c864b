"""DeepSpeed: ``mon.start(model=engine, optimizer=optimizer)`` with what
``deepspeed.initialize`` returned (checked on DeepSpeed 0.19.8).

Where DeepSpeed keeps what the monitors read, by the optimizer the engine built:

=================  =============================  ==================================  ===============================
engine.optimizer   reduced gradient at the step   values the optimizer updates        unreduced, accumulated
=================  =============================  ==================================  ===============================
torch optimizer    ``param.grad`` (all-reduced)   the parameters                      ``param.grad`` (default hooks)
(ZeRO-0, fp32)
FP16_Unfused-      ``param.grad`` (bf16/fp16,     fp32 masters ``fp32_groups``        ``param.grad`` (default hooks)
Optimizer (ZeRO-0  all-reduced, before            aligned with ``fp16_groups``
bf16/fp16)         unscaling)
DeepSpeedZero-     this rank's partition,         this rank's fp32 master partition   ZeRO-1: ``param.grad`` (or
Optimizer          ``averaged_gradients``         (``_hp_mapping.hp_fragment``)       ``grad_accum``) + this pass's
(ZeRO-1/2)         through ``param._hp_mapping``                                      gradient; ZeRO-2: not held
BF16_Optimizer     this rank's partition of the   this rank's fp32 master partition   fp32 buffer
(ZeRO-1 bf16)      fp32 buffer (all-reduced)                                          ``fp32_groups_gradients`` +
                                                                                      this pass's gradient
DeepSpeedZero-     this rank's partition,         this rank's fp32 master partition   not held
Optimizer_Stage3   ``averaged_gradients``         ``fp32_partitioned_groups_flat``
=================  =============================  ==================================  ===============================

The monitor's step is ``engine._take_model_step`` (what ``engine.step()`` runs at the
gradient-accumulation boundary): ``reduced`` and ``param_origin`` are read right before
it (after the reduction; before clipping and unscaling), ``param_updated`` and the
moments right after it.

ZeRO-2/3 reduce-scatter each micro-batch's gradient during backward and never hold the
accumulated local gradient of a step: with ``gradient_accumulation_steps`` > 1 and
``monitor_mbs_grad=false`` no ``unreduced`` rows are written (logged once); one row per
micro-batch (``monitor_mbs_grad=true``) is exact. Computing the sum ourselves would keep
a full-size copy of every local gradient across micro-batches, which is what ZeRO exists
to avoid.

Frameworks hand their callbacks the bare model and a wrapper of the ZeRO optimizer (the
HF Trainer: ``trainer.model`` and Accelerate's ``DeepSpeedOptimizerWrapper``). Given those,
``detect`` finds the engine whose ``optimizer`` it is and monitors through it; without one
(``DeepSpeedWithoutEngine``) no flat partition is written under a made-up name and one
WARNING says what is not observed.

``layout.json`` (``layout()``) says what each row covers, by the same readers: the
``dp`` group is the engine's ``seq_data_parallel_group`` (what the ZeRO optimizers
partition and reduce over); ``tp``/``pp`` come from the engine's ``mpu`` where it has one.
The full shape is ``param.ds_shape`` under ZeRO-3 (the parameter itself is empty
outside forward), else ``param.shape``. ``unreduced`` rows are the whole local
gradient; ZeRO-1/2 and ``BF16_Optimizer`` rows are this rank's fragment
(``_hp_mapping``), ZeRO-3 rows its partition without the padding, both split
``[["dp", rank, size]]``; a rank holding none of a parameter writes no row. Under tensor
parallelism (``mpu`` with more than one tensor-parallel rank) the parameters are the
model's own TP shards, whose full shape DeepSpeed does not record: "unknown".

Everything below reads private attributes, defensively: one missing in another version
is logged once, naming what is not observed, and training goes on.
"""

import logging
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from .... import layout as lay
from ....param_table import ParamInfo, ParamTable
from ....patching import Patch, wrap_method
from .base import TrainingStack, UnreducedCapture

logger = logging.getLogger("msprobe.monitor_v2")

def _engine_class() -> Optional[type]:
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine

        return DeepSpeedEngine
    except Exception:  # noqa: BLE001 - an install we cannot read is not ours to fix
        return None


def _flat(groups: Any) -> List[torch.Tensor]:
    return [p for group in groups for p in group]


def _wrapper_chain(optimizer: Any) -> Iterator[Any]:
    """``optimizer`` and what it wraps, outermost first: Accelerate's
    ``AcceleratedOptimizer``/``DeepSpeedOptimizerWrapper`` (``.optimizer``), Lightning's
    ``LightningOptimizer`` (``._optimizer``)."""
    seen: set = set()
    while optimizer is not None and id(optimizer) not in seen and len(seen) < 8:
        seen.add(id(optimizer))
        yield optimizer
        own = getattr(optimizer, "__dict__", {})
        optimizer = own.get("optimizer", own.get("_optimizer"))


def _deepspeed_optimizer(optimizer: Any) -> Optional[Any]:
    """The DeepSpeed optimizer (ZeRO, FP16/BF16 wrappers) in ``optimizer``'s wrapper
    chain, or None. A torch optimizer (ZeRO-0 fp32) is not one: plain torch reads it."""
    for opt in _wrapper_chain(optimizer):
        if type(opt).__name__ in _READERS or type(opt).__module__.startswith("deepspeed."):
            return opt
    return None


def _engine_stepping(ds_opt: Any, engine_cls: type) -> Optional[Any]:
    """The ``DeepSpeedEngine`` whose ``optimizer`` is ``ds_opt``. The optimizer keeps no
    reference to its engine, so the engine is found among the objects that refer to it
    (an engine refers to it from its instance dict); this runs once, at ``start()``."""
    import gc

    for ref in gc.get_referrers(ds_opt):
        if isinstance(ref, engine_cls):
            owners = [ref]
        elif isinstance(ref, dict):
            owners = [o for o in gc.get_referrers(ref) if isinstance(o, engine_cls)]
        else:
            continue
        for engine in owners:
            if vars(engine).get("optimizer") is ds_opt:
                return engine
    return None


def _holds_all(engine: Any, chunks: List[torch.nn.Module]) -> bool:
    """Every parameter of ``chunks`` is one the engine's module trains."""
    inside = {id(p) for p in engine.module.parameters()}
    given = [id(p) for c in chunks for p in c.parameters()]
    return bool(given) and all(i in inside for i in given)


class DeepSpeedStack(TrainingStack):
    """The engine and its optimizer; what differs by the optimizer the engine built is
    read by one ``_Reader``, chosen here once (``_READERS``)."""

    name = "deepspeed"

    def __init__(self, chunks: List[torch.nn.Module], optimizer: Any, engine: Any) -> None:
        super().__init__(chunks, optimizer)
        self.engine = engine
        self.ds_optimizer = getattr(engine, "optimizer", None)
        self.inner = getattr(self.ds_optimizer, "optimizer", None)  # the torch optimizer inside a wrapper
        cls = type(self.ds_optimizer).__name__
        reader = _READERS.get(cls)
        if reader is None:
            reader = _TorchReader if isinstance(self.ds_optimizer, torch.optim.Optimizer) else _UnknownReader
        if reader is _UnknownReader:
            self.log_once("kind", "engine.optimizer is a %s, which this version of the monitor does not know; "
                          "'reduced', 'optimizer' and 'param' rows are read as for a plain torch optimizer and "
                          "may be missing", cls)
        self.reader: _Reader = reader(self)
        mine = (self.ds_optimizer, getattr(engine, "basic_optimizer", None))
        if optimizer is not None and not any(o is m for o in _wrapper_chain(optimizer) for m in mine):
            self.log_once("optimizer", "the optimizer passed to start() is neither engine.optimizer nor "
                          "engine.basic_optimizer; the engine's optimizer (%s) is monitored", cls)
        try:
            self.gas = int(engine.gradient_accumulation_steps())
        except Exception:  # noqa: BLE001
            self.gas = None
        self._model_params = self.reader.model_params()

    @classmethod
    def detect(cls, chunks: List[torch.nn.Module], optimizer: Any) -> Optional[TrainingStack]:
        """The engine among ``chunks``; else, when ``optimizer`` is (or wraps) a DeepSpeed
        optimizer, the engine that steps it (frameworks hand out the bare model and a
        wrapper of the ZeRO optimizer: ``trainer.model`` and Accelerate's
        ``DeepSpeedOptimizerWrapper`` under the HF Trainer). Without the engine the flat
        partitions cannot be named nor the step found: ``DeepSpeedWithoutEngine`` says so."""
        engine_cls = _engine_class()
        if engine_cls is None:
            return None
        engines = [c for c in chunks if isinstance(c, engine_cls)]
        if engines:
            return cls(chunks, optimizer, engines[0])
        ds_opt = _deepspeed_optimizer(optimizer)
        if ds_opt is None:
            return None
        engine = _engine_stepping(ds_opt, engine_cls)
        if engine is not None and _holds_all(engine, chunks):
            logger.info("monitor_v2: the model passed to start() is not a DeepSpeedEngine; the engine that steps "
                        "its %s is used (names stay the model's)", type(ds_opt).__name__)
            return cls(chunks, optimizer, engine)
        why = ("no DeepSpeedEngine steps it" if engine is None
               else "the DeepSpeedEngine that steps it trains other parameters than the model given")
        return DeepSpeedWithoutEngine(chunks, optimizer, ds_opt, why)

    # ----------------------------------------------------------------- names
    def optimizer_model_params(self) -> Optional[List[torch.Tensor]]:
        return self._model_params

    def context_defaults(self) -> dict:
        return {"grad_acc_steps": self.gas} if self.gas else {}

    # ---------------------------------------------------------------- layout
    def layout(self, table: ParamTable, doc: Dict[str, Any]) -> None:
        """Groups from the engine, per parameter its full shape and the piece each scope
        class's rows describe (the reader's, see ``_Reader.pieces``)."""
        dp = _group_coords(getattr(self.engine, "seq_data_parallel_group",
                                   getattr(self.engine, "data_parallel_group", None)))
        if dp is None:
            dp_ranks = None
            _unknown(doc, "the engine's data-parallel group (seq_data_parallel_group) could not be read: "
                     "'dp' is taken as the world and the ZeRO partitions are unknown")
        else:
            doc["groups"][lay.DP] = lay.group(dp[0], dp[1])
            dp_ranks = dp[2]
        tp_size = _mpu_groups(getattr(self.engine, "mpu", None), doc)
        tp_sharded = tp_size is None or tp_size > 1
        for info in _layout_params(table):
            p = info.param
            if tp_sharded:
                doc["params"][info.name] = {"shape": lay.UNKNOWN, "pieces": {c: lay.UNKNOWN for c in lay.SCOPE_CLASSES}}
                continue
            try:
                shape = [int(d) for d in (p.ds_shape if hasattr(p, "ds_shape") else p.shape)]
                numel = 1
                for d in shape:
                    numel *= d
                pieces: Dict[str, Any] = {lay.UNREDUCED: lay.piece(numel)}  # the whole local gradient
                pieces.update(self.reader.pieces(p, numel, dp_ranks, doc))
            except self._MOVED as exc:
                _unknown(doc, f"the partition of {info.name} could not be read from "
                         f"{type(self.ds_optimizer).__name__} ({exc!r})")
                shape, pieces = lay.UNKNOWN, {c: lay.UNKNOWN for c in lay.SCOPE_CLASSES}
            doc["params"][info.name] = {"shape": shape, "pieces": pieces}
        if tp_sharded and tp_size is not None:
            _unknown(doc, f"tensor parallelism ({tp_size} ranks, from the engine's mpu): the parameters are the "
                     "model's own tensor-parallel shards, whose full shape and split DeepSpeed does not record")

    # ------------------------------------------------------------------ step
    def install_step_hooks(self, before: Callable[[], None], after: Callable[[], None]) -> Patch:
        engine = self.engine
        if callable(getattr(engine, "_take_model_step", None)):
            return wrap_method(engine, "_take_model_step", before, after)
        self.log_once("step", "DeepSpeedEngine has no _take_model_step; the step is taken as engine.step() at a "
                      "gradient-accumulation boundary, so 'reduced' rows of ZeRO-0 with gradient clipping "
                      "hold the clipped gradient")
        return wrap_method(engine, "step", before, after, when=engine.is_gradient_accumulation_boundary)

    # ------------------------------------------------------------- gradients
    def unreduced_capture(self, table: ParamTable, per_micro_batch: bool, micro_batches: int) -> Optional[UnreducedCapture]:
        if per_micro_batch:
            return None  # the gradient of each pass
        return self.reader.unreduced_capture(table, micro_batches)

    def tensor_hook_capture(self, table: ParamTable, prior: Callable[[torch.Tensor], Optional[torch.Tensor]]
                            ) -> UnreducedCapture:
        """Accumulated local gradient = what the stack accumulated before this pass +
        this pass's gradient, read in a tensor hook (before autograd accumulates it and
        before DeepSpeed's own hooks move it). The sum is built, in the accumulation
        dtype, only for the pass whose row is recorded: the same addition DeepSpeed
        makes, so the value is exact; the temporary is freed once its statistics exist."""
        infos = [i for i in table.model_params()]

        def install(on_micro_batch: Callable, on_accumulated: Callable) -> List[Any]:
            handles = []
            for info in infos:
                def hook(grad: torch.Tensor, info: ParamInfo = info) -> None:
                    on_accumulated(info, lambda: _accumulate(prior(info.param), grad))
                handles.append(info.param.register_hook(hook))
            return handles

        return UnreducedCapture(install=install)

    # The three readings below go through private attributes: one that moved or changed
    # shape in another DeepSpeed version ends that reading with one log line, not an error.
    _MOVED = (AttributeError, KeyError, IndexError, TypeError, RuntimeError)

    def reduced_grads(self, table: ParamTable) -> List[Tuple[ParamInfo, torch.Tensor]]:
        try:
            return self.reader.reduced_grads(table)
        except self._MOVED as exc:
            self.log_once("read:reduced", "cannot read the reduced gradients of %s (%r); 'reduced' rows are not "
                          "written", type(self.ds_optimizer).__name__, exc)
            return []

    def param_values(self, table: ParamTable) -> List[Tuple[ParamInfo, torch.Tensor]]:
        try:
            return self.reader.param_values(table)
        except self._MOVED as exc:
            self.log_once("read:param", "cannot read the weights %s updates (%r); 'param' rows are not written",
                          type(self.ds_optimizer).__name__, exc)
            return []

    def optimizer_states(self, table: ParamTable) -> Iterator[Tuple[ParamInfo, str, torch.Tensor]]:
        try:
            states = list(self.reader.optimizer_states(table))
        except self._MOVED as exc:
            self.log_once("read:state", "cannot read the optimizer state of %s (%r); 'optimizer' rows are not "
                          "written", type(self.ds_optimizer).__name__, exc)
            states = []
        return iter(states)

    # the plain-torch readings, for the readers of a torch optimizer
    def torch_reduced_grads(self, table: ParamTable) -> List[Tuple[ParamInfo, torch.Tensor]]:
        return super().reduced_grads(table)

    def torch_param_values(self, table: ParamTable) -> List[Tuple[ParamInfo, torch.Tensor]]:
        return super().param_values(table)

    def torch_optimizer_states(self, table: ParamTable) -> Iterator[Tuple[ParamInfo, str, torch.Tensor]]:
        return super().optimizer_states(table)


class _Reader:
    """Where one kind of ``engine.optimizer`` keeps the reduced gradients, the values it
    updates and their moments (the table in the module docstring). This base reads a
    torch optimizer (ZeRO-0 fp32) as plain torch does."""

    # the groups of model parameters the optimizer's flat buffers are laid out after
    groups_attr: Optional[str] = None

    def __init__(self, stack: DeepSpeedStack) -> None:
        self.stack = stack
        self.opt = stack.ds_optimizer

    def model_params(self) -> Optional[List[torch.Tensor]]:
        groups = getattr(self.opt, self.groups_attr, None)
        if groups is None:
            self.stack.log_once("params", "%s has no '%s'; 'reduced', 'optimizer' and 'param' rows cannot be "
                                "mapped to parameter names and are not written", type(self.opt).__name__,
                                self.groups_attr)
            return []
        return _flat(groups)

    def unreduced_capture(self, table: ParamTable, micro_batches: int) -> Optional[UnreducedCapture]:
        return None  # .grad accumulating until the boundary: the default hooks

    def pieces(self, param: torch.Tensor, numel: int, dp_ranks: Optional[Tuple[int, ...]],
               doc: Dict[str, Any]) -> Dict[str, Any]:
        """The pieces of ``param`` that the ``reduced``, ``param`` and ``optimizer`` rows
        describe (``numel``: the full tensor's element count; ``dp_ranks``: the global
        ranks of the engine's data-parallel group, None if unread). Here: the whole
        tensor, all-reduced and updated alike on every rank (ZeRO-0)."""
        whole = lay.piece(numel)
        return {lay.REDUCED: whole, lay.PARAM: whole, lay.OPTIMIZER: whole}

    def reduced_grads(self, table: ParamTable) -> List[Tuple[ParamInfo, torch.Tensor]]:
        return self.stack.torch_reduced_grads(table)

    def param_values(self, table: ParamTable) -> List[Tuple[ParamInfo, torch.Tensor]]:
        return self.stack.torch_param_values(table)

    def optimizer_states(self, table: ParamTable) -> Iterator[Tuple[ParamInfo, str, torch.Tensor]]:
        return self.stack.torch_optimizer_states(table)

    def inner_state(self) -> Optional[Any]:
        """The state of the torch optimizer inside ``engine.optimizer`` (None: said once)."""
        state = getattr(self.stack.inner, "state", None)
        if state is None:
            self.stack.log_once("state", "the optimizer inside %s has no 'state'; no optimizer rows",
                                type(self.opt).__name__)
        return state


class _TorchReader(_Reader):
    """A torch optimizer as ``engine.optimizer`` (ZeRO-0, fp32)."""

    def model_params(self) -> Optional[List[torch.Tensor]]:
        return _flat(g["params"] for g in self.opt.param_groups)


class _UnknownReader(_Reader):
    """An optimizer of a DeepSpeed version this monitor does not know: read as plain
    torch (said once, at detection)."""

    def model_params(self) -> Optional[List[torch.Tensor]]:
        return None

    def pieces(self, param: torch.Tensor, numel: int, dp_ranks: Optional[Tuple[int, ...]],
               doc: Dict[str, Any]) -> Dict[str, Any]:
        _unknown(doc, f"engine.optimizer is a {type(self.opt).__name__}, which this version of the monitor does "
                 "not know: what its 'reduced', 'param' and 'optimizer' rows cover is unknown")
        return {lay.REDUCED: lay.UNKNOWN, lay.PARAM: lay.UNKNOWN, lay.OPTIMIZER: lay.UNKNOWN}


class _MastersReader(_Reader):
    """``FP16_UnfusedOptimizer``/``FP16_Optimizer`` (ZeRO-0 bf16/fp16): ``param.grad`` is
    the reduced gradient, the fp32 masters ``fp32_groups`` are aligned with
    ``fp16_groups``."""

    groups_attr = "fp16_groups"

    def masters(self) -> Dict[int, torch.Tensor]:
        lows, masters = getattr(self.opt, "fp16_groups", None), getattr(self.opt, "fp32_groups", None)
        if lows is None or masters is None:
            self.stack.log_once("masters", "%s has no fp16_groups/fp32_groups; parameters and moments are not "
                                "observed", type(self.opt).__name__)
            return {}
        return {id(p): m for p, m in zip(_flat(lows), _flat(masters))}

    def param_values(self, table: ParamTable) -> List[Tuple[ParamInfo, torch.Tensor]]:
        masters = self.masters()
        return [(i, masters[id(i.param)]) for i in table.optimizer_params() if id(i.param) in masters]

    def optimizer_states(self, table: ParamTable) -> Iterator[Tuple[ParamInfo, str, torch.Tensor]]:
        state = self.inner_state()
        if state is None:
            return
        masters = self.masters()
        for info in table.optimizer_params():
            master = masters.get(id(info.param))
            if master is not None:
                for key, value in _moments(state, master):
                    yield info, key, value


class _FragmentReader(_Reader):
    """ZeRO-1/2 and ``BF16_Optimizer``: this rank's fragment of each parameter, through
    the mapping DeepSpeed itself keeps for checkpoints (``param._hp_mapping``)."""

    flats_attr = ""  # this rank's flat fp32 partition of each group, where the moments are kept

    def pieces(self, param: torch.Tensor, numel: int, dp_ranks: Optional[Tuple[int, ...]],
               doc: Dict[str, Any]) -> Dict[str, Any]:
        """This rank's fragment: a range of the flattened parameter, ``lp_fragment_address``
        for the gradient, ``hp_fragment_address`` for the fp32 master and its moments
        (the same range); no fragment (``_hp_mapping`` None): 0 elements, no row."""
        if not hasattr(param, "_hp_mapping"):
            _unknown(doc, f"parameters of {type(self.opt).__name__} carry no _hp_mapping: the fragments its rows "
                     "describe are unknown")
            return _unknown_pieces()
        split = _partition_split(getattr(param, "_dp_group", None), dp_ranks, doc, type(self.opt).__name__)
        if split is None:
            return _unknown_pieces()
        mapping = param._hp_mapping
        lp = 0 if mapping is None else int(mapping.lp_fragment_address.numel)
        hp = 0 if mapping is None else int(mapping.hp_fragment_address.numel)
        return {lay.REDUCED: lay.piece(lp, split), lay.PARAM: lay.piece(hp, split),
                lay.OPTIMIZER: lay.piece(hp, split)}

    def reduced_grads(self, table: ParamTable) -> List[Tuple[ParamInfo, torch.Tensor]]:
        return self.fragments(table, _hp_grad_fragment, "reduced gradients")

    def param_values(self, table: ParamTable) -> List[Tuple[ParamInfo, torch.Tensor]]:
        return self.fragments(table, lambda p, m: m.hp_fragment, "fp32 master weights")

    def optimizer_states(self, table: ParamTable) -> Iterator[Tuple[ParamInfo, str, torch.Tensor]]:
        state = self.inner_state()
        if state is None:
            return
        flats = getattr(self.opt, self.flats_attr, None)
        if flats is None:
            self.stack.log_once("flats", "%s has no '%s'; no optimizer rows", type(self.opt).__name__,
                                self.flats_attr)
            return
        for info in table.optimizer_params():
            mapping = getattr(info.param, "_hp_mapping", None)
            if mapping is None:
                continue  # no fragment of this parameter on this rank
            flat = flats[mapping.param_group_index]
            addr = mapping.hp_fragment_address
            for key, value in _moments(state, flat):
                yield info, key, value.narrow(0, addr.start, addr.numel)

    def fragments(self, table: ParamTable, read: Callable[[torch.Tensor, Any], Optional[torch.Tensor]],
                  what: str) -> List[Tuple[ParamInfo, torch.Tensor]]:
        out = []
        for info in table.optimizer_params():
            if not hasattr(info.param, "_hp_mapping"):
                self.stack.log_once("hp_mapping", "parameters carry no _hp_mapping; %s are not observed", what)
                return []
            mapping = info.param._hp_mapping
            if mapping is None:
                continue  # no fragment of this parameter on this rank
            t = read(info.param, mapping)
            if t is not None:
                out.append((info, t))
        return out


class _Zero12Reader(_FragmentReader):
    """``DeepSpeedZeroOptimizer`` (ZeRO-1/2)."""

    groups_attr = "bit16_groups"
    flats_attr = "single_partition_of_fp32_groups"

    def unreduced_capture(self, table: ParamTable, micro_batches: int) -> Optional[UnreducedCapture]:
        if getattr(self.opt, "partition_gradients", True):  # ZeRO-2
            return _partitioned_unreduced(self.stack, table, micro_batches, 2)
        if getattr(self.opt, "use_grad_accum_attribute", False):
            return self.stack.tensor_hook_capture(table, lambda p: getattr(p, "grad_accum", None))
        return self.stack.tensor_hook_capture(table, lambda p: p.grad)


class _Bf16Reader(_FragmentReader):
    """``BF16_Optimizer`` (ZeRO-1 bf16): the gradients accumulate in its fp32 buffer."""

    groups_attr = "bf16_groups"
    flats_attr = "fp32_groups_flat_partition"

    def unreduced_capture(self, table: ParamTable, micro_batches: int) -> Optional[UnreducedCapture]:
        groups, grads = getattr(self.opt, "bf16_groups", None), getattr(self.opt, "fp32_groups_gradients", None)
        if groups is None or grads is None:
            return UnreducedCapture(not_observable=(
                "BF16_Optimizer has no readable fp32_groups_gradients, where it accumulates local gradients"))
        prior = {id(p): g for group, ggroup in zip(groups, grads) for p, g in zip(group, ggroup)}
        return self.stack.tensor_hook_capture(table, lambda p: prior.get(id(p)))


class _Zero3Reader(_Reader):
    """``DeepSpeedZeroOptimizer_Stage3``: this rank's partition of each parameter, at its
    position in the flat fp32 partition of its group."""

    groups_attr = "fp16_groups"

    def unreduced_capture(self, table: ParamTable, micro_batches: int) -> Optional[UnreducedCapture]:
        return _partitioned_unreduced(self.stack, table, micro_batches, 3)

    def pieces(self, param: torch.Tensor, numel: int, dp_ranks: Optional[Tuple[int, ...]],
               doc: Dict[str, Any]) -> Dict[str, Any]:
        """This rank's partition (``ds_tensor``) without the padding of the last one: the
        same element count ``_zero3_valid`` narrows the rows to."""
        group = getattr(param, "ds_process_group", getattr(self.opt, "dp_process_group", None))
        split = _partition_split(group, dp_ranks, doc, type(self.opt).__name__)
        if split is None or not hasattr(param, "ds_tensor"):
            if split is not None:
                _unknown(doc, "ZeRO-3 parameters carry no ds_tensor: the partitions their rows describe are unknown")
            return _unknown_pieces()
        index = split[0][1]
        partition = int(param.ds_tensor.ds_numel if hasattr(param.ds_tensor, "ds_numel") else param.ds_tensor.numel())
        valid = max(0, min(partition, numel - index * partition))
        own = lay.piece(valid, split)
        return {lay.REDUCED: own, lay.PARAM: own, lay.OPTIMIZER: own}

    def reduced_grads(self, table: ParamTable) -> List[Tuple[ParamInfo, torch.Tensor]]:
        out = []
        opt = self.opt
        groups, grads = getattr(opt, "fp16_groups", None), getattr(opt, "averaged_gradients", None)
        if groups is None or grads is None:
            self.stack.log_once("z3grads", "DeepSpeedZeroOptimizer_Stage3 has no averaged_gradients; 'reduced' "
                                "rows are not written")
            return out
        wanted = {id(i.param): i for i in table.optimizer_params()}
        for g, group in enumerate(groups):
            pieces = grads.get(g)
            if pieces is None:
                if getattr(opt, "offload_optimizer", False):
                    self.stack.log_once("z3offload", "ZeRO-3 with optimizer offload keeps the reduced gradients "
                                        "in the offloaded fp32 buffers; 'reduced' rows are not written")
                continue
            for p, grad in zip(group, pieces):
                info = wanted.get(id(p))
                if info is not None and grad is not None:
                    out.append((info, grad.reshape(-1).narrow(0, 0, _zero3_valid(opt, p, grad.numel()))))
        return out

    def param_values(self, table: ParamTable) -> List[Tuple[ParamInfo, torch.Tensor]]:
        return [(info, flat.narrow(0, offset, numel)) for info, flat, offset, numel in self.positions(table)]

    def optimizer_states(self, table: ParamTable) -> Iterator[Tuple[ParamInfo, str, torch.Tensor]]:
        state = self.inner_state()
        if state is None:
            return
        for info, flat, offset, numel in self.positions(table):
            for key, value in _moments(state, flat):
                yield info, key, value.narrow(0, offset, numel)

    def positions(self, table: ParamTable) -> Iterator[Tuple[ParamInfo, torch.Tensor, int, int]]:
        """``(info, flat master partition, offset, elements)`` of this rank's partition of
        each ZeRO-3 parameter, without the padding of the last partition."""
        opt = self.opt
        flats = getattr(opt, "fp32_partitioned_groups_flat", None)
        positions = getattr(opt, "grad_position", None)
        if flats is None or positions is None:
            self.stack.log_once("z3", "DeepSpeedZeroOptimizer_Stage3 has no fp32_partitioned_groups_flat/"
                                "grad_position; parameters and moments are not observed")
            return
        for info in table.optimizer_params():
            p = info.param
            pos = positions.get(opt.get_param_id(p))
            if pos is None:
                continue
            group, offset, numel = pos
            yield info, flats[group], offset, _zero3_valid(opt, p, numel)


# engine.optimizer's class name -> its reader (a torch optimizer: _TorchReader)
_READERS: Dict[str, type] = {
    "FP16_UnfusedOptimizer": _MastersReader,
    "FP16_Optimizer": _MastersReader,
    "DeepSpeedZeroOptimizer": _Zero12Reader,
    "BF16_Optimizer": _Bf16Reader,
    "DeepSpeedZeroOptimizer_Stage3": _Zero3Reader,
}


def _unknown(doc: Dict[str, Any], why: str) -> None:
    if why not in doc["unknown"]:
        doc["unknown"].append(why)


def _unknown_pieces() -> Dict[str, Any]:
    return {lay.REDUCED: lay.UNKNOWN, lay.PARAM: lay.UNKNOWN, lay.OPTIMIZER: lay.UNKNOWN}


def _layout_params(table: ParamTable) -> List[ParamInfo]:
    """Every parameter a row may be of: the model's, then what only the optimizer holds."""
    infos = list(table.model_params())
    seen = {id(i.param) for i in infos}
    return infos + [i for i in table.optimizer_params() if id(i.param) not in seen]


def _group_coords(group: Any) -> Optional[Tuple[int, int, Tuple[int, ...]]]:
    """``(this rank's index, size, global ranks)`` of a process group (None: the world),
    or None where it cannot be read."""
    import torch.distributed as dist

    try:
        if not (dist.is_available() and dist.is_initialized()):
            return (0, 1, (0,))
        pg = group if group is not None else dist.group.WORLD
        return (int(dist.get_rank(group=pg)), int(dist.get_world_size(group=pg)),
                tuple(int(r) for r in dist.get_process_group_ranks(pg)))
    except Exception:  # noqa: BLE001 - a group of another kind: unknown, said by the caller
        return None


def _partition_split(group: Any, dp_ranks: Optional[Tuple[int, ...]], doc: Dict[str, Any],
                     kind: str) -> Optional[List[List[Any]]]:
    """``[["dp", index, size]]`` for a piece partitioned over ``group``, when that group is
    the engine's data-parallel group; None (said in ``doc``) otherwise: an expert-parallel
    or MiCS shard group is not the ``dp`` the layout names, and is not guessed at."""
    coords = _group_coords(group)
    if coords is None or dp_ranks is None:
        _unknown(doc, f"the process group {kind} partitions over could not be read: its pieces are unknown")
        return None
    index, size, ranks = coords
    if ranks != dp_ranks:
        _unknown(doc, f"{kind} partitions some parameters over a process group other than the engine's "
                 f"data-parallel group (ranks {list(ranks)}, not {list(dp_ranks)}; expert parallelism, MiCS): "
                 "their pieces are unknown")
        return None
    return [[lay.DP, index, size]]


def _mpu_groups(mpu: Any, doc: Dict[str, Any]) -> Optional[int]:
    """Write the ``tp``/``pp`` groups the engine's ``mpu`` exposes (Megatron's
    ``parallel_state``, DeepSpeed's ``PipelineParallelGrid`` or ``utils.groups``) into
    ``doc``; the tensor-parallel size (1 without an mpu, None where the mpu does not say)."""
    if mpu is None:
        return 1
    readers = {
        lay.TP: (("get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size"),
                 ("get_slice_parallel_rank", "get_slice_parallel_world_size"),
                 ("get_model_parallel_rank", "get_model_parallel_world_size")),
        lay.PP: (("get_pipeline_model_parallel_rank", "get_pipeline_model_parallel_world_size"),
                 ("get_pipe_parallel_rank", "get_pipe_parallel_world_size")),
    }
    tp_size = 1
    for name, pairs in readers.items():
        for rank_fn, size_fn in pairs:
            rank_of, size_of = getattr(mpu, rank_fn, None), getattr(mpu, size_fn, None)
            if callable(rank_of) and callable(size_of):
                try:
                    doc["groups"][name] = lay.group(int(rank_of()), int(size_of()))
                except Exception:  # noqa: BLE001 - an mpu not set up: the group stays absent
                    _unknown(doc, f"the engine's mpu ({type(mpu).__name__}) did not answer {rank_fn}/{size_fn}: "
                             f"no '{name}' group")
                break
        if name == lay.TP and name in doc["groups"]:
            tp_size = doc["groups"][name]["size"]
    if lay.TP not in doc["groups"]:
        _unknown(doc, f"the engine's mpu ({type(mpu).__name__}) exposes no tensor-parallel rank: no 'tp' group "
                 "and the parameters' split is unknown")
        return None
    return tp_size


def _partitioned_unreduced(stack: DeepSpeedStack, table: ParamTable, micro_batches: int,
                           stage: int) -> UnreducedCapture:
    """ZeRO-2/3 reduce-scatter each pass's gradient during backward: the accumulated
    local gradient exists only when there is one pass per step."""
    passes = max(stack.gas or 1, micro_batches)
    if passes > 1:
        return UnreducedCapture(not_observable=(
            f"DeepSpeed ZeRO-{stage} reduce-scatters each micro-batch's gradient during backward and never "
            f"holds the accumulated local gradient of a step ({passes} micro-batches per step); set "
            f"monitor_mbs_grad=true for one exact row per micro-batch"))
    # one micro-batch per step: the gradient of the only pass is the accumulated one
    return stack.tensor_hook_capture(table, lambda p: None)


def _hp_grad_fragment(param: torch.Tensor, mapping: Any) -> Optional[torch.Tensor]:
    try:
        grad = mapping.get_lp_grad_fragment(param._index_in_param_group)
    except ValueError:  # no gradients held (e.g. an overflow cleared them)
        return None
    grad = grad.reshape(-1)
    addr = mapping.lp_fragment_address
    if grad.numel() != addr.numel:  # BF16_Optimizer: the whole parameter's fp32 buffer
        grad = grad.narrow(0, addr.start, addr.numel)
    return grad


def _zero3_valid(opt: Any, param: torch.Tensor, partition_numel: int) -> int:
    """Elements of this rank's ZeRO-3 partition that belong to the parameter (the last
    partition is padded up to the partition size)."""
    try:
        rank = opt._get_param_partition_rank(param)
    except Exception:  # noqa: BLE001
        rank = torch.distributed.get_rank(group=getattr(param, "ds_process_group", None))
    total = getattr(param, "ds_numel", partition_numel)
    return max(0, min(partition_numel, total - rank * partition_numel))


def _moments(state: Any, like: torch.Tensor) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the optimizer state kept for ``like`` (an fp32 master or flat
    partition) with its shape: the moments, not the scalar ``step``."""
    for key, value in state.get(like, {}).items():
        if key != "step" and isinstance(value, torch.Tensor) and value.shape == like.shape:
            yield key, value


def _accumulate(prior: Optional[torch.Tensor], grad: torch.Tensor) -> torch.Tensor:
    if prior is None:
        return grad
    return prior + grad.to(prior.dtype).view(prior.shape)


class DeepSpeedWithoutEngine(TrainingStack):
    """A DeepSpeed optimizer given without the engine that steps it. Its param groups
    hold flat fp32 partitions (ZeRO-1/2/3) or masters that the monitor cannot map to
    parameter names, and its gradients live in buffers only the engine's configuration
    explains: rather than misnamed or wrong rows, none of ``reduced``, ``unreduced``,
    ``param`` and ``optimizer`` is written, and one WARNING says so. ``module`` rows and
    the steps (ended at the wrapper's ``step()``) are unaffected."""

    name = "deepspeed"

    def __init__(self, chunks: List[torch.nn.Module], optimizer: Any, ds_opt: Any, why: str) -> None:
        super().__init__(chunks, optimizer)
        self.ds_optimizer = ds_opt
        self.reason = (
            f"the optimizer passed to start() is DeepSpeed's {type(ds_opt).__name__}, but the model is "
            f"{', '.join(type(c).__name__ for c in chunks) or 'missing'}, not a DeepSpeedEngine, and {why}: "
            "'reduced', 'unreduced', 'param' and 'optimizer' rows are not written (they are read through the "
            "engine). Pass the engine as the model: what deepspeed.initialize returned, trainer.deepspeed "
            "(HF Trainer), trainer.strategy.model (Lightning)")
        self.log_once("no-engine", "%s", self.reason)

    def optimizer_model_params(self) -> Optional[List[torch.Tensor]]:
        return []

    def layout(self, table: ParamTable, doc: Dict[str, Any]) -> None:
        """No parameter rows are written (see the class doc), so no parameter is listed;
        ``dp`` is the group the optimizer partitions over, where it says."""
        dp = _group_coords(getattr(self.ds_optimizer, "dp_process_group", None))
        if dp is not None and hasattr(self.ds_optimizer, "dp_process_group"):
            doc["groups"][lay.DP] = lay.group(dp[0], dp[1])
        else:
            _unknown(doc, f"{type(self.ds_optimizer).__name__} names no dp_process_group: 'dp' is taken as the world")
        _unknown(doc, "no parameter rows: " + self.reason)

    def unreduced_capture(self, table: ParamTable, per_micro_batch: bool, micro_batches: int) -> Optional[UnreducedCapture]:
        return UnreducedCapture(not_observable=(
            f"DeepSpeed's {type(self.ds_optimizer).__name__} was given without its DeepSpeedEngine (see the "
            "warning above)"))


STACK = DeepSpeedStack
