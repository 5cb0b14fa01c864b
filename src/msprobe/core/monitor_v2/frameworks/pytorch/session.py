"""What the PyTorch monitors share during one ``start()``/``stop()``: the model chunks,
parameter names, the optimizer, the statistics engine, and the optimizer-step hooks
(``backend.Session``). Parameter names are a ``ParamTable``, which the training stack
reads at each hook point; the stack never sees the session. Parameters and modules added
after ``start()`` are found at the beginning of written steps (``find_added``)."""

import logging
import weakref
from itertools import repeat
from operator import attrgetter, is_, itemgetter
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from ... import layout, rows
from ...errors import ConfigError
from ...model_structure import ParamEntry, Structure, module_entries
from ...monitor import module_tags
from ...param_table import Added, ParamInfo, ParamTable, unique
from ...patching import Patch
from .. import rank_from_environment
from .stacks.fsdp import FlatParamLayout, fsdp1_layouts, fsdp2_modules, fsdp2_params, fsdp2_sharded_params
from . import naming
from .naming import class_name, named_parameters, unwrap
from .stacks import TrainingStack, detect_stack
from .stats import _PLAIN_TYPES, TorchStatsEngine

logger = logging.getLogger("msprobe.monitor_v2")

_FIRST, _SECOND, _INDEX = itemgetter(0), itemgetter(1), attrgetter("index")
_PARAM, _GRAD = attrgetter("param"), attrgetter("grad")
_PARAMS, _TRAINS = itemgetter("params"), attrgetter("param.requires_grad")
_LISTED_NAMES = 8  # names in a log line about added parameters or modules; the rest counted


def _listed(names: Sequence[str], what: str) -> str:
    """``3 parameters (a, b, c)``: at most ``_LISTED_NAMES`` names, then how many more."""
    shown = ", ".join(names[:_LISTED_NAMES]) + (f" and {len(names) - _LISTED_NAMES} more"
                                                 if len(names) > _LISTED_NAMES else "")
    return f"{len(names)} {what}{'s' if len(names) != 1 else ''} ({shown})"


def _registration_hook(session: "TorchSession", method: str) -> Callable[[torch.nn.Module, str, Any], None]:
    """A registration hook calling ``session.<method>(module, value)``, holding the session
    by a weak reference (the hook is global: it must not keep a dropped session alive). It
    runs inside the user's ``module.x = ...``: it never raises, and returns None (a value
    returned would replace the one registered). A failure counts as a change: the next
    written step's walk, whose errors are contained and said, looks."""
    ref = weakref.ref(session)

    def hook(module: torch.nn.Module, name: str, value: Any) -> None:
        owner = ref()
        if owner is None:
            return None
        try:
            getattr(owner, method)(module, value)
        except Exception:  # noqa: BLE001 - never into the user's assignment
            owner._grew = True
        return None

    return hook


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
            self._list_optimizer_params()
        self._watch_growth()

    def _list_optimizer_params(self) -> None:
        """The table's optimizer parameters, in the optimizer's order."""
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

    # ------------------------------------------- parameters and modules added after start()
    def _watch_growth(self) -> None:
        """What ``find_added`` compares at each written step, and torch's global
        registration hooks that say when a module of the chunks gains a submodule or a
        parameter (``model.head2 = nn.Linear(...)``, ``ModuleList.append``, a parameter
        assigned): a flag, so that the check costs no walk over the model while nothing
        changed. Removed by ``close()``."""
        self._known_modules: Set[int] = {id(m) for chunk in self.chunks for m in chunk.modules()}
        self._grew = False
        self._optimizer_shape = self._optimizer_shape_now()
        self._frozen = self._frozen_optimizer_params()
        self._unmonitored: Set[int] = set()  # ids of parameters said not to be monitored (said once)
        self._growth_hooks: List[Any] = []  # finalizers that remove them
        registry = torch.nn.modules.module
        for register, method in (("register_module_module_registration_hook", "_on_module_registered"),
                                 ("register_module_parameter_registration_hook", "_on_param_registered")):
            if hasattr(registry, register):
                handle = getattr(registry, register)(_registration_hook(self, method))
                # removed by close(), or when a session whose start() failed is collected
                self._growth_hooks.append(weakref.finalize(self, handle.remove))

    # torch's registration hooks run for every module of the process (each module built
    # registers its parameters), before the registration: only a module of the chunks
    # gaining one it did not hold counts (FSDP1 sets its known parameters again around
    # every pass).
    def _on_module_registered(self, module: torch.nn.Module, value: Any) -> None:
        if value is not None and id(module) in self._known_modules and id(value) not in self._known_modules:
            self._grew = True

    def _on_param_registered(self, module: torch.nn.Module, value: Any) -> None:
        if (value is not None and id(module) in self._known_modules and value not in self.table
                and id(value) not in self._unmonitored):
            self._grew = True

    def _optimizer_shape_now(self) -> Tuple[int, ...]:
        """How many tensors each param group of the optimizer holds (``add_param_group``
        adds a group; a group's list may grow): compared at each written step."""
        if self.optimizer is None:
            return ()
        return tuple(map(len, map(_PARAMS, self.stack.optimizer_param_groups())))

    def _frozen_optimizer_params(self) -> List[ParamInfo]:
        """Parameters the optimizer updates that do not train now (frozen): one that
        starts to (``requires_grad_(True)``, gradual unfreezing without a new param
        group) gets its ``unreduced`` hooks then. Empty in the usual case (an optimizer
        built from the trainable parameters only), so the check is free there."""
        return [i for i in self.table.optimizer_params() if not i.param.requires_grad]

    def find_added(self) -> Optional[Added]:
        """At the beginning of a written step: what was added to the model chunks or the
        optimizer since ``start()`` (or since the last call that found something), None
        where nothing was. While nothing changed this compares the optimizer's group sizes
        and reads a flag: no walk over the model (1,000 parameters: a few microseconds).

        New parameters join the table under their model names (a tensor only the new
        param groups hold, by its place: ``param_groups.<g>.params.<i>``), and the
        optimizer's parameters are listed again, so the ``param``, ``optimizer`` and
        ``reduced`` rows include them. Where a stack keeps the optimizer's tensors in
        buffers or shards laid out at ``start()`` (FSDP, DeepSpeed, Megatron-Core), the
        parameters are not monitored: said once, naming them and why. Modules are found
        on any stack."""
        shape = self._optimizer_shape_now()
        frozen = self._frozen
        regrouped = shape != self._optimizer_shape
        if not (self._grew or regrouped or (frozen and any(map(_TRAINS, frozen)))):
            return None
        self._grew = False
        self._optimizer_shape = shape
        return self._walk_added(regrouped)

    def _walk_added(self, regrouped: bool) -> Added:
        """``find_added``'s walk, once something changed: the model chunks' parameters and
        modules against the table and the modules known, the optimizer listed again."""
        table = self.table
        # FSDP2 swaps its unsharded parameters into the modules around each forward and
        # backward: never a parameter of the user's; one said unmonitored is said once
        skipped = self._unmonitored | self.fsdp_managed | self._fsdp2_unsharded()
        new_params = [(vpp, name, p) for vpp, root in enumerate(self.roots) for name, p in named_parameters(root)
                      if p not in table and id(p) not in skipped]
        modules = [(vpp, name, m) for vpp, name, m in self.named_modules() if id(m) not in self._known_modules]
        self._known_modules.update(id(m) for chunk in self.chunks for m in chunk.modules())
        now_training = [i for i in self._frozen if i.param.requires_grad]
        why = self._why_added_params_unmonitored(new_params)
        if why is not None:
            self._frozen = [i for i in self._frozen if not i.param.requires_grad]
            self._unmonitored.update(id(p) for _, _, p in new_params)
            names = [table.qualify(vpp, name) for vpp, name, _ in new_params]
            if names or regrouped:
                logger.warning("monitor_v2: %s added after start() %s not monitored by weight_grad, param or "
                               "optimizer (the module monitor's rows of new modules are written): %s",
                               _listed(names, "parameter") if names else "tensors in new optimizer param groups",
                               "is" if len(names) == 1 else "are", why)
            return Added([], modules)
        held = {i.index for i in table.optimizer_params()}
        found = []
        for vpp in range(len(self.roots)):
            found += table.add_model_params(vpp, ((name, p) for v, name, p in new_params if v == vpp))
        if self.optimizer is not None and regrouped:
            self._list_optimizer_params()
        self._frozen = self._frozen_optimizer_params()
        found += [i for i in table.optimizer_params() if i.index not in held] + now_training
        added = Added(unique(found), modules)
        if added:
            parts = []
            if added.params:
                parts.append(_listed([i.name for i in added.params], "parameter"))
            if modules:
                parts.append(_listed([table.qualify(vpp, name) for vpp, name, _ in modules], "module"))
            logger.info("monitor_v2: found after start(): %s; monitored from this step on", " and ".join(parts))
        return added

    def _fsdp2_unsharded(self) -> Set[int]:
        """The ids of the unsharded parameters FSDP2 holds now (private attributes: none
        where this torch does not have them)."""
        found: Set[int] = set()
        for _, module in self.fsdp2_modules:
            try:
                found.update(id(u) for _, u in fsdp2_params(module) if u is not None)
            except AttributeError:
                continue
        return found

    def _why_added_params_unmonitored(self, new_params: Sequence[Tuple[int, str, torch.nn.Parameter]]) -> Optional[str]:
        """Why parameters added after ``start()`` cannot be monitored on this stack, or None."""
        if type(self.stack) is not TrainingStack:
            return (f"the {self.stack.name} adapter maps the optimizer's flat buffers and their partitions to "
                    f"parameter names once, at start(); start a new monitor after adding parameters")
        if self.flat_layouts or self.fsdp2_modules or any(
                hasattr(p, "to_local") or getattr(p, "_is_flat_param", False) for _, _, p in new_params):
            return ("the monitor reads FSDP's flat parameters and shards through the layout it found at start(); "
                    "start a new monitor after adding parameters")
        return None

    def close(self) -> None:
        """Remove what ``_watch_growth`` installed (``stop()``)."""
        hooks, self._growth_hooks = self._growth_hooks, []
        for remove in hooks:
            remove()

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

    def expert_norm_vector(self, tensor: torch.Tensor, experts: Sequence[Any], plan: Any,
                           key: Tuple[int, str, str, Optional[int]]) -> Any:
        """The ``expert_norms`` record of a grouped-expert tensor from its slices' device
        records (``experts.py``; the torch part in ``frameworks/pytorch/experts.py``)."""
        from .experts import expert_norm_record

        return expert_norm_record(self.engine, tensor, experts, plan, key)

    def expert_slices(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        """A grouped-expert tensor's E slices, as views (``experts.py``)."""
        from .experts import expert_slices

        return expert_slices(tensor)

    def expert_device_records(self, tensor: torch.Tensor, plan: Any,
                              keys: Sequence[Tuple[int, str, str, Optional[int]]]) -> Any:
        """A grouped-expert tensor's per-expert records read along its expert dimension on
        an accelerator, with its ``[E]`` norms (None in host memory: ``experts.py``)."""
        from .experts import device_expert_records

        return device_expert_records(self.engine, tensor, plan, keys)

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
