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
import re
import sys
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from .... import layout as lay
from .... import rows
from ....param_table import ParamInfo, ParamTable
from .. import naming
from .base import GradCallback, TrainingStack, UnreducedCapture, inner_optimizers, tensor_states
from .native_layout import group_coordinates

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

    __slots__ = ("model_param", "value", "torch_optimizer", "grad_range", "shard_group")

    def __init__(self, model_param: torch.Tensor, value: torch.Tensor, torch_optimizer: Any,
                 grad_range: Optional[Tuple[int, int]] = None,
                 shard_group: Optional[Tuple[int, int]] = None) -> None:
        self.model_param = model_param
        self.value = value
        self.torch_optimizer = torch_optimizer
        self.grad_range = grad_range
        # (rank, size) in the group the distributed optimizer shards over (None: not read)
        self.shard_group = shard_group

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


def leaf_optimizers(optimizer: Any) -> List[Any]:
    """The optimizers inside (nested) ``ChainedOptimizer``s, stubs left out (the walk
    every container of optimizers gets: ``base.inner_optimizers``)."""
    inner = inner_optimizers(optimizer)
    if inner is not None:
        return inner
    return [] if getattr(optimizer, "is_stub_optimizer", False) else [optimizer]


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
        shard_group = group_coordinates(getattr(opt, "data_parallel_group", None))
        entries = []
        for p, shard in pairs:
            if shard is None:
                self.log_once("no-master", "%s keeps no fp32 master shards here (precision-aware optimizer: "
                              "they live inside the fused optimizer): their optimizer and param rows are not "
                              "written. Logged once.", type(opt).__name__)
                continue
            rng = opt._get_model_param_range_map(p)["param"]
            entries.append(MasterEntry(p, shard, opt.optimizer, (rng.start, rng.end), shard_group))
        return entries

    def _pairs_for(self, table: ParamTable) -> Iterator[Tuple[ParamInfo, MasterEntry]]:
        for e in self.entries:
            try:
                info = table.info(e.model_param)
            except KeyError:  # a parameter of a model chunk not given to start()
                continue
            yield info, e

    # ---------------------------------------------------------------- layout
    def layout(self, table: ParamTable, doc: dict) -> None:
        """Megatron-Core's layout: the groups of ``parallel_state`` ("dp" is data parallel
        with context parallel: the group Megatron's DDP reduces gradients over), each
        chunk's global layers (``TransformerLayer.layer_number``, 1-based and global), the
        renames to global layer numbers, and each parameter's pieces from the attributes
        Megatron's tensor-parallel layers set (``tensor_model_parallel``,
        ``partition_dim``, ``partition_stride``, ``sequence_parallel``) and the distributed
        optimizer's ranges. Anything not read is "unknown", with the reason in the document."""
        groups, why = _parallel_groups()
        if groups is not None:
            doc["groups"] = groups
            why = self._check_ddp_groups(groups)
        if why:
            doc["unknown"].append(f"parallel groups: {why}; every parameter's pieces are unknown")
            groups = None
        self._layout_chunks(table, doc)
        if groups is not None:
            self._layout_experts(table, doc, groups)
        doc["unknown"].extend(self._layout_params(table, doc, groups))
        if groups is not None:
            self._layout_modules(table, doc, groups)

    def _check_ddp_groups(self, groups: Dict[str, Dict[str, int]]) -> Optional[str]:
        """Megatron's DDP may be given its own process groups (``pg_collection``): the
        groups it reduces over must be those of ``parallel_state`` read above."""
        for chunk in self.ddp_chunks:
            for attr, name in (("dp_cp_group", lay.DP), ("tp_group", lay.TP)):
                coords = group_coordinates(getattr(chunk, attr, None))
                if coords is not None and name in groups and coords != (groups[name]["rank"], groups[name]["size"]):
                    return (f"Megatron's DistributedDataParallel.{attr} (rank {coords[0]} of {coords[1]}) is not "
                            f"parallel_state's {name} group (rank {groups[name]['rank']} of {groups[name]['size']})")
        return None

    def _layout_chunks(self, table: ParamTable, doc: dict) -> None:
        """Chunks and renames from each chunk's ``TransformerLayer`` modules: the layer at
        ``<path>.<i>`` of chunk ``N`` is the model's layer ``layer_number - 1``."""
        chunks, rename = [], []
        found = False
        for vpp, chunk in enumerate(self.chunks):
            numbers = []
            for name, module in naming.named_modules(naming.unwrap(chunk)):
                number = _layer_number(module)
                if number is None or not name:
                    continue
                path, _, index = name.rpartition(".")
                if not index.isdigit():
                    continue
                numbers.append(number)
                local, global_ = table.qualify(vpp, name) + ".", f"{path + '.' if path else ''}{number - 1}."
                if local != global_:  # a rule only where the name changes (not under TP alone)
                    rename.append([local, global_])
            found = found or bool(numbers)
            chunks.append({"vpp_stage": vpp, "layer_offset": min(numbers) - 1 if numbers else None,
                           "layers": len(numbers)})
            if table.is_chunk_list:
                rename.append([rows.chunk_name(vpp, ""), ""])
        if found:
            doc["chunks"] = chunks
        else:
            doc["unknown"].append("chunks: no Megatron TransformerLayer (with layer_number) in the model chunks; "
                                  "layer names are not renamed to global layer numbers")
            rename = [r for r in rename if r[1] == ""]
        doc["rename"] = sorted(rename, key=lambda r: -len(r[0]))

    def _layout_params(self, table: ParamTable, doc: dict,
                       groups: Optional[Dict[str, Dict[str, int]]]) -> List[str]:
        """Per parameter its full shape and the piece each scope class's rows describe;
        the reasons for what is unknown (one line per kind)."""
        reasons: Dict[str, List[str]] = {}
        entries = {id(e.model_param): e for e in self.entries}
        distopt = [e.shard_group for e in self.entries if e.grad_range is not None]
        for info in table.model_params():
            p = info.param
            why = self._piece_unknown(p, groups)
            if why is not None:
                reasons.setdefault(why, []).append(info.name)
                doc["params"][info.name] = {"shape": lay.UNKNOWN, "pieces": {c: lay.UNKNOWN for c in lay.SCOPE_CLASSES}}
                continue
            assert groups is not None
            tp = groups[lay.TP]
            shape = list(p.shape)
            tp_split: List[List[Any]] = []
            if getattr(p, "tensor_model_parallel", False) and tp["size"] > 1:
                shape[int(p.partition_dim)] *= tp["size"]
                tp_split = [[lay.TP, tp["rank"], tp["size"]]]
            local = p.numel()
            # A sequence-parallel norm's local gradient is this rank's part of a sum over tp
            # (Megatron all-reduces it over tp in finalize_model_grads).
            seq = bool(getattr(p, "sequence_parallel", False)) and tp["size"] > 1
            unreduced = (lay.piece(local, [[lay.TP, tp["rank"], tp["size"]]], partial=True) if seq
                         else lay.piece(local, tp_split))
            whole = lay.piece(local, tp_split)
            e = entries.get(id(p))
            # Under the distributed optimizer a parameter this rank holds none of has no entry.
            if (e is not None and e.grad_range is not None) or (e is None and distopt):
                shard = e.shard_group if e is not None else (distopt[0] if len(set(distopt)) == 1 else None)
                dp = groups[lay.DP]
                if shard is None or shard[1] != dp["size"]:
                    # several optimizer instances (partial data parallelism), or a group not read
                    held = "not read" if shard is None else f"{shard[1]} ranks, dp has {dp['size']}"
                    why = f"the distributed optimizer shards over a group that is not the data-parallel group ({held})"
                    reasons.setdefault(why, []).append(info.name)
                    sharded: Any = lay.UNKNOWN
                else:
                    # this rank's range of the flattened tp-local tensor (none: it writes no row)
                    held_numel = e.grad_range[1] - e.grad_range[0] if e is not None else 0
                    sharded = lay.piece(held_numel, tp_split + [[lay.DP, shard[0], shard[1]]])
                pieces = {lay.UNREDUCED: unreduced, lay.REDUCED: sharded, lay.PARAM: sharded, lay.OPTIMIZER: sharded}
            else:
                pieces = {lay.UNREDUCED: unreduced, lay.REDUCED: whole, lay.PARAM: whole, lay.OPTIMIZER: whole}
            doc["params"][info.name] = {"shape": shape, "pieces": pieces}
        return [f"{why}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''} ({len(names)} parameters)"
                for why, names in reasons.items()]

    def _layout_experts(self, table: ParamTable, doc: dict, groups: Dict[str, Dict[str, int]]) -> None:
        """Expert parallelism: each MoE layer's local experts under their global indices,
        and what the router's token counts are a part of.

        Every expert-parallel rank holds ``E_local`` of the ``E`` experts of a layer, local
        expert ``i`` being the model's ``ep_rank * E_local + i`` (Megatron's sharded state
        dict numbers them so): ``rename`` rules give ``SequentialMLP``'s
        ``local_experts.<i>.`` and ``TEGroupedMLP``'s ``linear_fc1.weight<i>`` (and
        ``bias<i>``) their global index, composed with the layer renames under pipeline
        parallelism, so each expert's rows carry one name on every rank and the ranks of one
        expert-parallel coordinate are its replicas (expert data parallelism). The document's
        ``moe`` names each router (``TopKRouter``) with its experts, their parameters, this
        rank's ``local_experts`` ``[first, count]``, and ``tokens``: the groups over which
        ranks route different tokens (``dp``, which holds context parallelism, and ``tp``
        with sequence parallelism), whose counts ``merge`` sums."""
        ep = groups.get(lay.EP, {"rank": 0, "size": 1})
        rules = [tuple(r) for r in doc.get("rename", [])]
        added: List[List[str]] = []
        for vpp, chunk in enumerate(self.chunks):
            for name, module in naming.named_modules(naming.unwrap(chunk)):
                classes = _megatron_classes(module)
                if "TopKRouter" in classes and name:
                    self._layout_router(table, doc, groups, vpp, name, module)
                if not ({"SequentialMLP", "TEGroupedMLP"} & classes) or not name:
                    continue
                local = int(getattr(module, "num_local_experts", 0) or 0)
                if local <= 0:
                    continue
                first = ep["rank"] * local
                prefix = table.qualify(vpp, name) + "."
                global_prefix = lay.rename(prefix, rules)
                for pname, _ in module.named_parameters():
                    m = _LOCAL_EXPERT.match(pname) or _GROUPED_EXPERT.match(pname)
                    if m is None or first == 0:
                        continue
                    head, index = m.group(1), int(m.group(2))
                    local_name = prefix + head + str(index) + ("." if head.endswith(".") else "")
                    global_name = global_prefix + head + str(first + index) + ("." if head.endswith(".") else "")
                    if [local_name, global_name] not in added:
                        added.append([local_name, global_name])
        if added:
            doc["rename"] = sorted([list(r) for r in rules] + added, key=lambda r: -len(r[0]))

    def _layout_router(self, table: ParamTable, doc: dict, groups: Dict[str, Dict[str, int]], vpp: int, name: str,
                       router: torch.nn.Module) -> None:
        config = getattr(router, "config", None)
        total = int(getattr(config, "num_moe_experts", 0) or 0)
        ep = groups.get(lay.EP, {"rank": 0, "size": 1})
        local = total // max(1, ep["size"])
        path = name.rpartition(".")[0]
        experts = f"{path}.experts" if path else "experts"
        params = [table.qualify(vpp, f"{experts}.{n}") for n, _ in _named_params_under(self.chunks[vpp], experts)]
        tokens = [[lay.DP, groups[lay.DP]["rank"], groups[lay.DP]["size"]]]
        tp = groups[lay.TP]
        if getattr(config, "sequence_parallel", False) and tp["size"] > 1:
            tokens.append([lay.TP, tp["rank"], tp["size"]])
        entry = lay.moe_entry(doc, table.qualify(vpp, name))
        entry.setdefault("num_experts", total)
        entry.setdefault("top_k", int(getattr(config, "moe_router_topk", 0) or 0))
        entry.setdefault("score", str(getattr(config, "moe_router_score_function", "softmax")))
        entry.setdefault("experts", table.qualify(vpp, experts))
        entry["expert_params"] = params
        entry["local_experts"] = [ep["rank"] * local, local]
        entry["tokens"] = {"split": tokens, "partial": True}

    def _piece_unknown(self, p: torch.Tensor, groups: Optional[Dict[str, Dict[str, int]]]) -> Optional[str]:
        """Why the pieces of ``p`` cannot be told (None: they can)."""
        if groups is None:
            return "parallel groups not read"
        if self.fsdp:
            return "Megatron FSDP (use_megatron_fsdp) shards parameters its own way, not read in this version"
        if not getattr(p, "allreduce", True):
            if lay.EP not in groups:
                return "expert parameters (allreduce=False) without a readable expert-parallel group"
            if getattr(p, "tensor_model_parallel", False) and _expert_tp_size() != groups[lay.TP]["size"]:
                return ("expert parameters under an expert tensor-parallel size that differs from the "
                        "tensor-parallel size (expert_tensor_parallel_size), not read in this version")
        if getattr(p, "tensor_model_parallel", False):
            try:
                dim, stride = int(p.partition_dim), int(getattr(p, "partition_stride", 1))
            except (AttributeError, TypeError, ValueError):
                return "tensor-parallel parameters without a readable partition_dim"
            if stride != 1:
                return "tensor-parallel parameters with partition_stride != 1 (strided shards)"
            if not 0 <= dim < p.dim():
                return "tensor-parallel parameters whose partition_dim is not one of their dimensions"
        return None

    def _layout_modules(self, table: ParamTable, doc: dict, groups: Dict[str, Dict[str, int]]) -> None:
        """Module rows whose tensor is cut evenly over tp.

        - A ``ColumnParallelLinear``'s output (unless it gathers it; its bias output when
          it returns the bias: the local part of it) and, under sequence parallelism, its
          input; a ``RowParallelLinear``'s input when it is parallel and, under sequence
          parallelism, its output. Gradients follow their tensors.
        - Inside an attention or MLP block (between its column- and row-parallel layers
          every tensor is this rank's heads or columns): the tensors of the modules this
          version knows (core attention's query, key, value and output, its softmax and
          dropout, per-head norms); any other module there has its rows "unknown" (the
          merge leaves them out rather than take them for replicas).
        - Under sequence parallelism the activations outside those blocks are split along
          the sequence: rows of the other modules are "unknown" too.
        - Under pipeline parallelism the modules above the transformer layers (the model
          itself, its ``decoder``) exist on every stage under one name but see each
          stage's own tensors (the hidden states a stage receives, the loss or the hidden
          states it sends): neither replicas nor pieces of one tensor, so "unknown"."""
        tp = groups[lay.TP]
        staged = groups[lay.PP]["size"] > 1
        split = {"split": [[lay.TP, tp["rank"], tp["size"]]]}
        out = doc["modules"]
        said = set()
        for vpp, chunk in enumerate(self.chunks):
            named = list(naming.named_modules(naming.unwrap(chunk)))
            seq = any(getattr(getattr(m, "config", None), "sequence_parallel", False) is True for _, m in named)
            regions = [n + "." for n, m in named if n and _is_tp_block(m)] if tp["size"] > 1 else []
            layers = [n for n, m in named if _layer_number(m) is not None]
            for name, module in named:
                if staged and any(not name or layer.startswith(name + ".") for layer in layers):
                    why = ("module rows of the modules above the transformer layers under pipeline parallelism "
                           "(each stage's own tensors under one name)")
                    if why not in said:
                        said.add(why)
                        doc["unknown"].append(why)
                    tag = table.qualify(vpp, name or naming.class_name(module))
                    out[lay.every_row(tag)] = lay.UNKNOWN
                    continue
                tag = table.qualify(vpp, name or naming.class_name(module))
                kinds = _split_module_rows(module)
                if kinds is not None:  # a tensor-parallel linear layer
                    for kind, index in kinds:
                        out[rows.module_row(tag, kind, index)] = split
                    continue
                inside = any(name.startswith(r) for r in regions)
                local = _TP_LOCAL_ROWS.get(type(module).__name__) if inside else None
                if local is not None:
                    for kind, indices in local.items():
                        for index in indices:
                            out[rows.module_row(tag, kind, index)] = split
                    continue
                if not inside and not seq:
                    continue  # a replica over tp
                why = (f"module rows inside tensor-parallel blocks of modules this version does not know "
                       f"(e.g. {type(module).__name__})" if inside else
                       "module rows under sequence parallelism (split along the sequence) except the "
                       "tensor-parallel linear layers'")
                if why not in said:
                    said.add(why)
                    doc["unknown"].append(why)
                out.setdefault(lay.every_row(tag), lay.UNKNOWN)

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
        # main_grad is reduced only by finish_grad_sync(), after backward: a pass's
        # accumulated values can be read at its end, in one batch
        return UnreducedCapture(install=functools.partial(self._install_unreduced, per_micro_batch, table),
                                stable_in_pass=True)

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


def _parallel_groups() -> Tuple[Optional[Dict[str, Dict[str, int]]], Optional[str]]:
    """This rank's coordinates in Megatron's groups, read from ``parallel_state`` if the
    user imported and initialised it; else None and why."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None:
        return None, "megatron.core.parallel_state is not imported"
    try:
        if not ps.model_parallel_is_initialized():
            return None, "megatron.core.parallel_state is not initialized (initialize_model_parallel not called)"
        readers = (
            (lay.DP, lambda: ps.get_data_parallel_group(with_context_parallel=True)),
            (lay.TP, lambda: ps.get_tensor_model_parallel_group(check_initialized=False)),
            (lay.PP, lambda: ps.get_pipeline_model_parallel_group(check_initialized=False)),
            (lay.CP, lambda: ps.get_context_parallel_group(check_initialized=False)),
            (lay.EP, lambda: ps.get_expert_model_parallel_group(check_initialized=False)),
        )
        groups: Dict[str, Dict[str, int]] = {}
        for name, read in readers:
            coords = group_coordinates(read())
            if coords is not None:
                groups[name] = lay.group(*coords)
    except Exception as exc:  # noqa: BLE001 - a parallel_state this monitor does not know
        return None, f"megatron.core.parallel_state could not be read ({exc!r})"
    missing = [g for g in (lay.DP, lay.TP, lay.PP) if g not in groups]
    if missing:
        return None, f"megatron.core.parallel_state has no {'/'.join(missing)} process group"
    return groups, None


# a parameter of SequentialMLP's local expert <i>, or TEGroupedMLP's weight<i>/bias<i>
_LOCAL_EXPERT = re.compile(r"^(local_experts\.)(\d+)\.")
_GROUPED_EXPERT = re.compile(r"^(linear_fc[12]\.(?:weight|bias))(\d+)$")


def _named_params_under(chunk: torch.nn.Module, path: str) -> List[Tuple[str, torch.nn.Parameter]]:
    root = naming.unwrap(chunk)
    try:
        module = root.get_submodule(path)
    except AttributeError:
        return []
    return list(module.named_parameters())


def _expert_tp_size() -> int:
    ps = sys.modules.get("megatron.core.parallel_state")
    try:
        return int(ps.get_expert_tensor_parallel_world_size())  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - an older parallel_state: experts use the tp size
        return -1


def _layer_number(module: torch.nn.Module) -> Optional[int]:
    """A Megatron ``TransformerLayer``'s global, 1-based ``layer_number`` (None for any
    other module)."""
    if not any(c.__name__ == "TransformerLayer" and c.__module__.startswith("megatron.")
               for c in type(module).__mro__):
        return None
    number = getattr(module, "layer_number", None)
    return number if isinstance(number, int) and not isinstance(number, bool) and number >= 1 else None


def _megatron_classes(module: torch.nn.Module) -> set:
    return {c.__name__ for c in type(module).__mro__ if c.__module__.startswith("megatron.")}


def _is_tp_block(module: torch.nn.Module) -> bool:
    """A Megatron attention or MLP block: between its column- and row-parallel linear
    layers the tensors are this rank's heads or hidden columns."""
    return bool(_megatron_classes(module) & {"Attention", "MLP"})


# Modules of Megatron-Core's local layer spec found inside an attention or MLP block, and
# the (kind: indices) of their rows that are this rank's heads; their other rows (the
# attention mask) are replicas.
_HEADS_0 = {rows.INPUT: (0,), rows.OUTPUT: (0,), rows.GRAD_INPUT: (0,), rows.GRAD_OUTPUT: (0,)}
_TP_LOCAL_ROWS: Dict[str, Dict[str, Tuple[int, ...]]] = {
    "DotProductAttention": {rows.INPUT: (0, 1, 2), rows.OUTPUT: (0,), rows.GRAD_INPUT: (0, 1, 2),
                            rows.GRAD_OUTPUT: (0,)},
    "FusedScaleMaskSoftmax": _HEADS_0,
    "Dropout": _HEADS_0,
    "IdentityOp": _HEADS_0,  # q/k layernorm when off
    "LayerNorm": _HEADS_0,   # per-head q/k layernorm
    "RMSNorm": _HEADS_0,
}


def _split_module_rows(module: torch.nn.Module) -> Optional[List[Tuple[str, int]]]:
    """(kind, index) of the module rows of a Megatron tensor-parallel linear layer whose
    tensors are this rank's even part over tp (see ``MegatronStack._layout_modules``);
    None for any other module."""
    names = _megatron_classes(module)
    seq = bool(getattr(module, "sequence_parallel", False))
    out: List[Tuple[str, int]] = []
    if "ColumnParallelLinear" in names:
        if not getattr(module, "gather_output", False):
            out += [(rows.OUTPUT, 0), (rows.GRAD_OUTPUT, 0)]
            if getattr(module, "skip_bias_add", False) and getattr(module, "bias", None) is not None:
                out += [(rows.OUTPUT, 1), (rows.GRAD_OUTPUT, 1)]  # the returned bias: this rank's part
        if seq:
            out += [(rows.INPUT, 0), (rows.GRAD_INPUT, 0)]
        return out
    if "RowParallelLinear" in names:
        if getattr(module, "input_is_parallel", False):
            out += [(rows.INPUT, 0), (rows.GRAD_INPUT, 0)]
        if seq:
            out += [(rows.OUTPUT, 0), (rows.GRAD_OUTPUT, 0)]
        return out
    return None


def _grad_accumulator(p: torch.Tensor) -> Optional[Any]:
    """The gradient accumulator node of a leaf parameter: the same node Megatron's DDP
    hooked (it keeps a reference to it, so autograd hands out that node again)."""
    with torch.enable_grad():
        grad_fn = p.expand_as(p).grad_fn
    if grad_fn is None or not grad_fn.next_functions:
        return None
    return grad_fn.next_functions[0][0]


STACK = MegatronStack
