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

Everything below reads private attributes, defensively: one missing in another version
is logged once, naming what is not observed, and training goes on.
"""

import logging
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from ....patching import Patch, wrap_method
from .base import TrainingStack, UnreducedCapture

logger = logging.getLogger("msprobe.monitor_v2")

_KINDS = {
    "FP16_UnfusedOptimizer": "masters",
    "FP16_Optimizer": "masters",
    "DeepSpeedZeroOptimizer": "zero12",
    "BF16_Optimizer": "bf16",
    "DeepSpeedZeroOptimizer_Stage3": "zero3",
}


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
        if type(opt).__name__ in _KINDS or type(opt).__module__.startswith("deepspeed."):
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
    name = "deepspeed"

    def __init__(self, chunks: List[torch.nn.Module], optimizer: Any, engine: Any) -> None:
        super().__init__(chunks, optimizer)
        self.engine = engine
        self.ds_optimizer = getattr(engine, "optimizer", None)
        self.inner = getattr(self.ds_optimizer, "optimizer", None)  # the torch optimizer inside a wrapper
        cls = type(self.ds_optimizer).__name__
        if isinstance(self.ds_optimizer, torch.optim.Optimizer) and cls not in _KINDS:
            self.kind = "torch"
        else:
            self.kind = _KINDS.get(cls, "unknown")
        if self.kind == "unknown":
            self.log_once("kind", "engine.optimizer is a %s, which this version of the monitor does not know; "
                          "'reduced', 'optimizer' and 'param' rows are read as for a plain torch optimizer and "
                          "may be missing", cls)
        mine = (self.ds_optimizer, getattr(engine, "basic_optimizer", None))
        if optimizer is not None and not any(o is m for o in _wrapper_chain(optimizer) for m in mine):
            self.log_once("optimizer", "the optimizer passed to start() is neither engine.optimizer nor "
                          "engine.basic_optimizer; the engine's optimizer (%s) is monitored", cls)
        try:
            self.gas = int(engine.gradient_accumulation_steps())
        except Exception:  # noqa: BLE001
            self.gas = None
        self._model_params = self._read_model_params()

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
    def unwrap(self, chunk: torch.nn.Module) -> torch.nn.Module:
        if chunk is self.engine:
            return getattr(chunk, "module", chunk)
        return super().unwrap(chunk)

    def _read_model_params(self) -> Optional[List[torch.Tensor]]:
        opt = self.ds_optimizer
        attr = {"masters": "fp16_groups", "zero12": "bit16_groups", "bf16": "bf16_groups", "zero3": "fp16_groups"}
        if self.kind in attr:
            groups = getattr(opt, attr[self.kind], None)
            if groups is None:
                self.log_once("params", "%s has no '%s'; 'reduced', 'optimizer' and 'param' rows cannot be "
                              "mapped to parameter names and are not written", type(opt).__name__, attr[self.kind])
                return []
            return _flat(groups)
        if self.kind == "torch":
            return _flat(g["params"] for g in opt.param_groups)
        return None

    def optimizer_model_params(self) -> Optional[List[torch.Tensor]]:
        return self._model_params

    def context_defaults(self) -> dict:
        return {"grad_acc_steps": self.gas} if self.gas else {}

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
    def unreduced_capture(self, session: Any, per_micro_batch: bool, micro_batches: int) -> Optional[UnreducedCapture]:
        if self.kind in ("torch", "masters", "unknown") or per_micro_batch:
            return None  # the gradient of each pass, or .grad accumulating until the boundary
        opt = self.ds_optimizer
        partitions_grads = self.kind == "zero3" or (self.kind == "zero12" and getattr(opt, "partition_gradients", True))
        if partitions_grads:
            passes = max(self.gas or 1, micro_batches)
            if passes > 1:
                stage = 3 if self.kind == "zero3" else 2
                return UnreducedCapture(not_observable=(
                    f"DeepSpeed ZeRO-{stage} reduce-scatters each micro-batch's gradient during backward and never "
                    f"holds the accumulated local gradient of a step ({passes} micro-batches per step); set "
                    f"monitor_mbs_grad=true for one exact row per micro-batch"))
            # one micro-batch per step: the gradient of the only pass is the accumulated one
            return self._tensor_hook_capture(session, lambda p: None)
        if self.kind == "bf16":
            prior = self._bf16_accumulation_buffers()
            if prior is None:
                return UnreducedCapture(not_observable=(
                    "BF16_Optimizer has no readable fp32_groups_gradients, where it accumulates local gradients"))
            return self._tensor_hook_capture(session, lambda p: prior.get(id(p)))
        if getattr(opt, "use_grad_accum_attribute", False):
            return self._tensor_hook_capture(session, lambda p: getattr(p, "grad_accum", None))
        return self._tensor_hook_capture(session, lambda p: p.grad)

    def _bf16_accumulation_buffers(self) -> Optional[Dict[int, torch.Tensor]]:
        opt = self.ds_optimizer
        groups, grads = getattr(opt, "bf16_groups", None), getattr(opt, "fp32_groups_gradients", None)
        if groups is None or grads is None:
            return None
        return {id(p): g for group, ggroup in zip(groups, grads) for p, g in zip(group, ggroup)}

    def _tensor_hook_capture(self, session: Any, prior: Callable[[torch.Tensor], Optional[torch.Tensor]]
                             ) -> UnreducedCapture:
        """Accumulated local gradient = what the stack accumulated before this pass +
        this pass's gradient, read in a tensor hook (before autograd accumulates it and
        before DeepSpeed's own hooks move it). The sum is built, in the accumulation
        dtype, only for the pass whose row is recorded: the same addition DeepSpeed
        makes, so the value is exact; the temporary is freed once its statistics exist."""
        infos = [i for i in session.model_params()]

        def install(on_micro_batch: Callable, on_accumulated: Callable) -> List[Any]:
            handles = []
            for info in infos:
                def hook(grad: torch.Tensor, info: Any = info) -> None:
                    on_accumulated(info, lambda: _accumulate(prior(info.param), grad))
                handles.append(info.param.register_hook(hook))
            return handles

        return UnreducedCapture(install=install)

    # The three readers below go through private attributes: one that moved or changed
    # shape in another DeepSpeed version ends that reader with one log line, not an error.
    _MOVED = (AttributeError, KeyError, IndexError, TypeError, RuntimeError)

    def reduced_grads(self, session: Any) -> List[Tuple[Any, torch.Tensor]]:
        try:
            return self._reduced_grads(session)
        except self._MOVED as exc:
            self.log_once("read:reduced", "cannot read the reduced gradients of %s (%r); 'reduced' rows are not "
                          "written", type(self.ds_optimizer).__name__, exc)
            return []

    def param_values(self, session: Any) -> List[Tuple[Any, torch.Tensor]]:
        try:
            return self._param_values(session)
        except self._MOVED as exc:
            self.log_once("read:param", "cannot read the weights %s updates (%r); 'param' rows are not written",
                          type(self.ds_optimizer).__name__, exc)
            return []

    def optimizer_states(self, session: Any) -> Iterator[Tuple[Any, str, torch.Tensor]]:
        try:
            states = list(self._optimizer_states(session))
        except self._MOVED as exc:
            self.log_once("read:state", "cannot read the optimizer state of %s (%r); 'optimizer' rows are not "
                          "written", type(self.ds_optimizer).__name__, exc)
            states = []
        return iter(states)

    def _reduced_grads(self, session: Any) -> List[Tuple[Any, torch.Tensor]]:
        if self.kind in ("zero12", "bf16"):
            return self._fragments(session, self._hp_grad_fragment, "reduced gradients")
        if self.kind == "zero3":
            return self._zero3_pieces(session, "averaged_gradients")
        return super().reduced_grads(session)

    # ------------------------------------------------------ optimizer, params
    def _param_values(self, session: Any) -> List[Tuple[Any, torch.Tensor]]:
        if self.kind in ("zero12", "bf16"):
            return self._fragments(session, lambda p, m: m.hp_fragment, "fp32 master weights")
        if self.kind == "zero3":
            return self._zero3_pieces(session, "masters")
        if self.kind == "masters":
            masters = self._unfused_masters()
            return [(i, masters[id(i.param)]) for i in session.optimizer_params() if id(i.param) in masters]
        return super().param_values(session)

    def _optimizer_states(self, session: Any) -> Iterator[Tuple[Any, str, torch.Tensor]]:
        state = getattr(self.inner, "state", None)
        if self.kind in ("torch", "unknown"):
            yield from super().optimizer_states(session)
            return
        if state is None:
            self.log_once("state", "the optimizer inside %s has no 'state'; no optimizer rows",
                          type(self.ds_optimizer).__name__)
            return
        if self.kind == "masters":
            masters = self._unfused_masters()
            for info in session.optimizer_params():
                master = masters.get(id(info.param))
                if master is not None:
                    for key, value in _moments(state, master):
                        yield info, key, value
            return
        if self.kind in ("zero12", "bf16"):
            attr = "single_partition_of_fp32_groups" if self.kind == "zero12" else "fp32_groups_flat_partition"
            flats = getattr(self.ds_optimizer, attr, None)
            if flats is None:
                self.log_once("flats", "%s has no '%s'; no optimizer rows", type(self.ds_optimizer).__name__, attr)
                return
            for info in session.optimizer_params():
                mapping = getattr(info.param, "_hp_mapping", None)
                if mapping is None:
                    continue  # no fragment of this parameter on this rank
                flat = flats[mapping.param_group_index]
                addr = mapping.hp_fragment_address
                for key, value in _moments(state, flat):
                    yield info, key, value.narrow(0, addr.start, addr.numel)
            return
        if self.kind == "zero3":
            for info, flat, offset, numel in self._zero3_positions(session):
                for key, value in _moments(state, flat):
                    yield info, key, value.narrow(0, offset, numel)

    # --------------------------------------------------------------- helpers
    def _unfused_masters(self) -> Dict[int, torch.Tensor]:
        opt = self.ds_optimizer
        lows, masters = getattr(opt, "fp16_groups", None), getattr(opt, "fp32_groups", None)
        if lows is None or masters is None:
            self.log_once("masters", "%s has no fp16_groups/fp32_groups; parameters and moments are not observed",
                          type(opt).__name__)
            return {}
        return {id(p): m for p, m in zip(_flat(lows), _flat(masters))}

    def _hp_grad_fragment(self, param: torch.Tensor, mapping: Any) -> Optional[torch.Tensor]:
        try:
            grad = mapping.get_lp_grad_fragment(param._index_in_param_group)
        except ValueError:  # no gradients held (e.g. an overflow cleared them)
            return None
        grad = grad.reshape(-1)
        addr = mapping.lp_fragment_address
        if grad.numel() != addr.numel:  # BF16_Optimizer: the whole parameter's fp32 buffer
            grad = grad.narrow(0, addr.start, addr.numel)
        return grad

    def _fragments(self, session: Any, read: Callable[[torch.Tensor, Any], Optional[torch.Tensor]],
                   what: str) -> List[Tuple[Any, torch.Tensor]]:
        """This rank's fragment of each parameter (ZeRO-1/2, BF16_Optimizer), through the
        mapping DeepSpeed itself keeps for checkpoints (``param._hp_mapping``)."""
        out = []
        for info in session.optimizer_params():
            if not hasattr(info.param, "_hp_mapping"):
                self.log_once("hp_mapping", "parameters carry no _hp_mapping; %s are not observed", what)
                return []
            mapping = info.param._hp_mapping
            if mapping is None:
                continue  # no fragment of this parameter on this rank
            t = read(info.param, mapping)
            if t is not None:
                out.append((info, t))
        return out

    def _zero3_positions(self, session: Any) -> Iterator[Tuple[Any, torch.Tensor, int, int]]:
        """``(info, flat master partition, offset, elements)`` of this rank's partition of
        each ZeRO-3 parameter, without the padding of the last partition."""
        opt = self.ds_optimizer
        flats = getattr(opt, "fp32_partitioned_groups_flat", None)
        positions = getattr(opt, "grad_position", None)
        if flats is None or positions is None:
            self.log_once("z3", "DeepSpeedZeroOptimizer_Stage3 has no fp32_partitioned_groups_flat/grad_position; "
                          "parameters and moments are not observed")
            return
        for info in session.optimizer_params():
            p = info.param
            pos = positions.get(opt.get_param_id(p))
            if pos is None:
                continue
            group, offset, numel = pos
            yield info, flats[group], offset, _zero3_valid(opt, p, numel)

    def _zero3_pieces(self, session: Any, what: str) -> List[Tuple[Any, torch.Tensor]]:
        out = []
        if what == "masters":
            for info, flat, offset, numel in self._zero3_positions(session):
                out.append((info, flat.narrow(0, offset, numel)))
            return out
        opt = self.ds_optimizer
        groups, grads = getattr(opt, "fp16_groups", None), getattr(opt, "averaged_gradients", None)
        if groups is None or grads is None:
            self.log_once("z3grads", "DeepSpeedZeroOptimizer_Stage3 has no averaged_gradients; 'reduced' rows "
                          "are not written")
            return out
        wanted = {id(i.param): i for i in session.optimizer_params()}
        for g, group in enumerate(groups):
            pieces = grads.get(g)
            if pieces is None:
                if getattr(opt, "offload_optimizer", False):
                    self.log_once("z3offload", "ZeRO-3 with optimizer offload keeps the reduced gradients in the "
                                  "offloaded fp32 buffers; 'reduced' rows are not written")
                continue
            for p, grad in zip(group, pieces):
                info = wanted.get(id(p))
                if info is not None and grad is not None:
                    out.append((info, grad.reshape(-1).narrow(0, 0, _zero3_valid(opt, p, grad.numel()))))
        return out


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

    def unreduced_capture(self, session: Any, per_micro_batch: bool, micro_batches: int) -> Optional[UnreducedCapture]:
        return UnreducedCapture(not_observable=(
            f"DeepSpeed's {type(self.ds_optimizer).__name__} was given without its DeepSpeedEngine (see the "
            "warning above)"))


STACK = DeepSpeedStack
