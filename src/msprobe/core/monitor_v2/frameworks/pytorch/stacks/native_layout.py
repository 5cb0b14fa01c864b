"""``layout.json`` of torch's own parallelism (``TrainingStack.layout``): plain torch and
DDP (every parameter whole, replicated over the data-parallel group), FSDP1 flat
parameters, and DTensor parameters (FSDP2, tensor parallel; ``dtensor.py``).

Each entry describes exactly the tensors the rows are of:

- plain and DDP: the parameter, its gradient and its optimizer state, whole. ``dp`` is
  DDP's process group where the model is wrapped in DDP, else the world.
- FSDP1 (``use_orig_params`` true or false): rows carry the original parameters' names
  (``fsdp.FlatParamLayout``). ``unreduced`` rows are views of the unsharded flat
  gradient: whole parameters. ``reduced``, ``param`` and ``optimizer`` rows are this
  rank's part of the flat shard: a flat range of the parameter, ``[dp, rank, size]``
  (``[dp_shard, ...]`` under hybrid sharding, whole under ``NO_SHARD``); a rank that
  holds none of a parameter writes no row (piece of 0 elements).
- DTensor: ``dtensor.dtensor_piece`` / ``dtensor.unreduced_piece`` and the mesh's groups.
- module rows: those of modules ``parallelize_module`` made tensor parallel are named in
  ``modules`` (``dtensor.tensor_parallel_module_rows``); the rest are replicas. A module
  without a style that computes on a sharded activation (an activation module between
  a column- and a row-parallel one) cannot be told from its hooks: its rows are taken as
  replicas while the ranks agree, and ``merge`` leaves them out as unknown where they
  differ (``layout.module_entry``).
- ``moe`` (DTensor runs): each router beside its experts (TorchTitan's MoE block), the
  groups whose ranks route different tokens and this rank's experts (``_moe_routers``).
"""

from typing import Any, Dict, List, Optional, Tuple

import torch

from ....layout import (CP, DP, EP, PARAM, OPTIMIZER, PP, REDUCED, SCOPE_CLASSES, TP, UNKNOWN, UNREDUCED, group,
                        moe_entry, piece)
from ....monitor import module_tags
from ....param_table import ParamTable
from ....rows import MODULE_KINDS, module_row
from ..naming import class_name, named_modules, unwrap
from . import dtensor
from .fsdp import FlatParamLayout, fsdp1_layouts, fsdp1_shard_groups, fsdp2_param_states

_SHARDED = (REDUCED, PARAM, OPTIMIZER)  # the scope classes of the optimizer's (sharded) tensors


def fill(chunks: List[torch.nn.Module], table: ParamTable, doc: Dict[str, Any]) -> None:
    """Fill ``doc`` (``layout.new_document``) for the model ``chunks`` as given to ``start()``."""
    ddp = _ddp_group(chunks)
    if ddp is not None:
        doc["groups"][DP] = group(*ddp)
    flat_ids, by_name = _fsdp1(chunks, table, doc)
    fsdp2 = {}
    for chunk in chunks:
        fsdp2.update(fsdp2_param_states(chunk))
    mesh_groups: Dict[str, Dict[str, int]] = {}
    meshes_cover_world = False
    seen = set()
    params = doc["params"]
    for info in table.model_params() + table.optimizer_params():
        p = info.param
        if info.index in seen or id(p) in flat_ids:
            continue  # a flat parameter's rows carry the original parameters' names (by_name)
        seen.add(info.index)
        if info.name in by_name:
            continue
        if dtensor.is_dtensor(p):
            params[info.name] = _dtensor_entry(info.name, p, fsdp2.get(id(p)), mesh_groups, doc)
            meshes_cover_world |= p.device_mesh.size() == doc["world_size"]
            continue
        whole = piece(p.numel())
        params[info.name] = {"shape": list(p.shape), "pieces": {c: whole for c in SCOPE_CLASSES}}
    params.update(by_name)
    _tensor_parallel_modules(chunks, table, doc, mesh_groups)
    if mesh_groups:
        _set_mesh_groups(doc, mesh_groups, meshes_cover_world, ddp is not None)
        if DP in doc["groups"]:
            _moe_routers(chunks, table, doc)


def group_coordinates(group: Any) -> Optional[Tuple[int, int]]:
    """``(this rank's index, size)`` in a process group, for ``layout.json``; None for no
    group, before ``init_process_group``, or for an object torch does not take as one."""
    dist = torch.distributed
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return int(dist.get_rank(group=group)), int(dist.get_world_size(group=group))
    except Exception:  # noqa: BLE001 - not a process group this torch knows
        return None


def _ddp_group(chunks: List[torch.nn.Module]) -> Optional[Tuple[int, int]]:
    """``(rank, size)`` in the process group of the first DDP wrapper in ``chunks``."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ddp = torch.nn.parallel.DistributedDataParallel
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, ddp):
                pg = getattr(m, "process_group", None)
                return group_coordinates(pg if pg is not None else dist.group.WORLD)
    return None


def _fsdp1(chunks: List[torch.nn.Module], table: ParamTable,
           doc: Dict[str, Any]) -> Tuple[set, Dict[str, Dict[str, Any]]]:
    """The ids of FSDP1 flat parameters, and the entries of their original parameters by row name."""
    flat_ids, by_name = set(), {}
    for vpp, chunk in enumerate(chunks):
        for fl in fsdp1_layouts(chunk):
            flat_ids.add(id(fl.flat_param))
            try:
                strategy, shard, replicate = fsdp1_shard_groups(fl)
            except AttributeError as exc:
                doc["unknown"].append(f"FSDP1 unit of {_names(fl)}: its sharding is not readable ({exc}); "
                                      "pieces of its reduced gradients, parameters and optimizer states unknown")
                strategy, shard, replicate = None, None, None
            split = _fsdp1_split(doc, strategy, shard, replicate)
            for name, shape, numel, in_shard in fl.entries:
                if shape is None:
                    doc["unknown"].append(f"{table.qualify(vpp, name)}: FSDP1 does not say its shape (_shapes)")
                sharded = UNKNOWN if split is None else piece(in_shard if split else numel, split)
                by_name[table.qualify(vpp, name)] = {
                    "shape": UNKNOWN if shape is None else shape,
                    "pieces": {UNREDUCED: piece(numel), **{c: sharded for c in _SHARDED}}}
    return flat_ids, by_name


def _fsdp1_split(doc: Dict[str, Any], strategy: Optional[str], shard: Optional[Tuple[int, int]],
                 replicate: Optional[Tuple[int, int]]) -> Optional[List[list]]:
    """The split of an FSDP1 unit's shard (None: unknown) and the groups it implies."""
    if strategy is None or shard is None:
        return None
    if strategy == "NO_SHARD":
        return []
    if replicate is None:
        doc["groups"][DP] = group(*shard)
        return [[DP, shard[0], shard[1]]]
    # hybrid: shards within "dp_shard", replicated over "dp_replicate"; dp is both
    doc["groups"]["dp_shard"] = group(*shard)
    doc["groups"]["dp_replicate"] = group(*replicate)
    doc["groups"][DP] = group(replicate[0] * shard[1] + shard[0], replicate[1] * shard[1])
    return [["dp_shard", shard[0], shard[1]]]


def _dtensor_entry(name: str, p: Any, fsdp_param: Any, mesh_groups: Dict[str, Dict[str, int]],
                   doc: Dict[str, Any]) -> Dict[str, Any]:
    shape = dtensor.full_shape(p)
    try:
        fsdp_dims = dtensor.fsdp2_dims(p.device_mesh, fsdp_param) if fsdp_param is not None else []
        dims, groups = dtensor.mesh_dims(p.device_mesh, fsdp_dims)
        sharded = dtensor.dtensor_piece(p, dims)
        unreduced = dtensor.unreduced_piece(p, dims, fsdp_dims) if fsdp_param is not None else sharded
    except (dtensor.Unknown, AttributeError, TypeError, ValueError, IndexError) as exc:  # private state, read defensively
        doc["unknown"].append(f"{name}: how this DTensor is split is not readable ({exc})")
        return {"shape": shape, "pieces": {c: UNKNOWN for c in SCOPE_CLASSES}}
    for g, value in groups.items():
        known = mesh_groups.setdefault(g, value)
        if known != value:
            doc["unknown"].append(f"{name}: its device mesh puts this rank at {g} {value}, another "
                                  f"parameter's at {known}; the first is kept")
    return {"shape": shape, "pieces": {UNREDUCED: unreduced, **{c: sharded for c in _SHARDED}}}


def _tensor_parallel_modules(chunks: List[torch.nn.Module], table: ParamTable, doc: Dict[str, Any],
                             mesh_groups: Dict[str, Dict[str, int]]) -> None:
    """``doc["modules"]``: the rows of modules ``parallelize_module`` made tensor parallel
    (``dtensor.tensor_parallel_style``); every other module row stays a replica."""
    named = [(vpp, name or class_name(m), m) for vpp, chunk in enumerate(chunks)
             for name, m in named_modules(unwrap(chunk))]
    for _, tag, module in module_tags(named, table.qualify):
        try:
            style = dtensor.tensor_parallel_style(module)
            if style is None:
                continue
            doc["modules"].update(dtensor.tensor_parallel_module_rows(tag, style))
            _, groups = dtensor.mesh_dims(style.mesh)
            for g, value in groups.items():
                mesh_groups.setdefault(g, value)
        except (dtensor.Unknown, AttributeError, TypeError, ValueError) as exc:  # private state, read defensively
            doc["unknown"].append(f"module {tag}: its tensor-parallel activations are not described ({exc})")
            for kind in MODULE_KINDS:
                doc["modules"][module_row(tag, kind, 0)] = UNKNOWN


def _set_mesh_groups(doc: Dict[str, Any], mesh_groups: Dict[str, Dict[str, int]], cover_world: bool,
                     has_ddp: bool) -> None:
    """The device meshes' groups; without a data-parallel dimension, ``dp`` is a group of
    one where a mesh spans the world (no data parallelism) and unknown otherwise."""
    groups = doc["groups"]
    groups.update({g: v for g, v in mesh_groups.items() if g != DP or not has_ddp})
    if DP in mesh_groups or has_ddp:
        return
    if cover_world:
        groups[DP] = group(0, 1)
        return
    doc["unknown"].append("the device meshes name no data-parallel dimension and span only part of the "
                          "world: the data-parallel group is not known, the DTensor pieces are not either")
    for entry in doc["params"].values():
        if any(isinstance(p, dict) and p.get("split") for p in entry["pieces"].values()):
            entry["pieces"] = {c: UNKNOWN for c in SCOPE_CLASSES}


# a mixture-of-experts block's children: its router, and its experts (TorchTitan's
# ``routed_experts``; ``experts`` elsewhere)
_ROUTER_CHILD = "router"
_EXPERTS_CHILDREN = ("routed_experts", "experts")


def _moe_routers(chunks: List[torch.nn.Module], table: ParamTable, doc: Dict[str, Any]) -> None:
    """``doc["moe"]`` of DTensor runs (TorchTitan's MoE: a block with a ``router`` child and
    its ``routed_experts``): for each router, ``tokens``, the groups whose ranks route
    different tokens, whose counts ``merge`` sums, and, where expert parallelism shards
    the grouped experts (``Shard(0)`` along ``ep``), this rank's ``local_experts``.

    The tokens differ over the data-parallel dimensions (``dp``: TorchTitan's ``fsdp``
    holds ``dp_shard`` and ``cp``, HSDP adds ``dp_replicate``; expert parallelism is
    carved out of them, so ``ep`` adds nothing), over ``cp`` where a mesh names it apart
    (TorchTitan's ``full_dtensor`` meshes), and over ``tp`` where expert and tensor
    parallelism run together: TorchTitan then feeds the router a sequence shard along the
    ``tp`` axis (``moe_sharding``: the router's input ``Shard(1)``); without expert
    parallelism its router sees the whole sequence on every ``tp`` rank (replicas)."""
    groups = doc["groups"]
    dp = groups[DP]
    tokens: List[list] = [[DP, dp["rank"], dp["size"]]]
    sizes = {g: groups.get(g, {"size": 1})["size"] for g in (CP, TP, PP, EP)}
    # a cp named apart from dp: unless dp already holds it (then dp x cp x tp x pp exceeds the world)
    if sizes[CP] > 1 and dp["size"] * sizes[CP] * sizes[TP] * sizes[PP] <= doc["world_size"]:
        tokens.append([CP, groups[CP]["rank"], sizes[CP]])
    if sizes[TP] > 1 and sizes[EP] > 1:
        tokens.append([TP, groups[TP]["rank"], sizes[TP]])
    ep = groups.get(EP)
    for vpp, chunk in enumerate(chunks):
        for name, block in named_modules(unwrap(chunk)):
            children = dict(block.named_children())
            router = children.get(_ROUTER_CHILD)
            experts_name = next((c for c in _EXPERTS_CHILDREN if c in children), None)
            if router is None or experts_name is None:
                continue
            prefix = f"{name}." if name else ""
            entry = moe_entry(doc, table.qualify(vpp, prefix + _ROUTER_CHILD))
            entry["tokens"] = {"split": [list(t) for t in tokens], "partial": True}
            experts = children[experts_name]
            entry["experts"] = table.qualify(vpp, prefix + experts_name)
            params = [p for p in experts.parameters() if p in table]
            entry["expert_params"] = [table.info(p).name for p in params]
            local = _local_expert_count(params, ep)
            if local is not None:
                entry["local_experts"] = [ep["rank"] * local, local]


def _local_expert_count(params: List[torch.Tensor], ep: Optional[Dict[str, int]]) -> Optional[int]:
    """The experts this rank holds where expert parallelism shards them: the local first
    dimension of grouped-expert DTensors cut ``Shard(0)`` along the ``ep`` mesh dimension
    (None: not sharded so, or not readable)."""
    if ep is None or ep["size"] <= 1:
        return None
    for p in params:
        if not dtensor.is_dtensor(p) or p.dim() < 3:
            continue
        names = p.device_mesh.mesh_dim_names or ()
        for i, placement in enumerate(p.placements):
            if (i < len(names) and dtensor.group_of_name(names[i]) == EP and placement.is_shard()
                    and placement.dim == 0 and p.shape[0] % ep["size"] == 0):
                return int(p.shape[0]) // ep["size"]
    return None


def _names(fl: FlatParamLayout) -> str:
    return ", ".join(fl.names[:3]) + (", ..." if len(fl.names) > 3 else "")
