"""The ``layout.json`` pieces of DTensor parameters: FSDP2 ``fully_shard`` and
``parallelize_module`` tensor parallelism, alone or together on one ``DeviceMesh``.

A DTensor says everything the layout needs: its mesh (each dimension's name, this
rank's coordinate and the dimension's size), its full shape (``DTensor.shape``) and, per
mesh dimension, a placement. The monitors' rows are of the *local* tensor
(``to_local()``, see ``stats._prepared``), so a row's piece is, per mesh dimension:

- ``Shard(d)`` or FSDP2's ``_StridedShard(d)``: cut along that dimension's group,
  ``[group, coordinate, size]`` (a strided shard is not one contiguous range, which the
  merge does not need: only which piece and how many elements);
- ``Replicate()``: a replica dimension (not named in ``split``);
- ``Partial()``: the full tensor is a sum over that group, not combinable (``partial``).

Mesh dimension names become the layout's groups where they say which (``"dp"``,
``"data_parallel"``, ``"dp_shard"``, ``"fsdp"`` -> ``dp``; ``"tp"`` -> ``tp``...); a name
not recognised stays a group under its own name. Where one mesh has several
data-parallel dimensions (HSDP's ``dp_replicate`` x ``dp_shard``), they keep their own
names and ``dp``, the group gradients are reduced over, is their product.

FSDP2's *unreduced* gradient is that of the unsharded parameter FSDP2 all-gathers for
forward: whole along FSDP's own mesh dimensions, still cut along the others (tensor
parallel): see ``unreduced_piece``.

Module rows of a tensor-parallel module (``ColwiseParallel``, ``RowwiseParallel``,
``SequenceParallel``) are of the activations as the module computes with them and
returns them: ``tensor_parallel_module_rows``.
"""

import functools
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ....layout import CP, DP, EP, PP, TP, group, piece

# Mesh dimension names that say which parallel group they are (compared in lower case).
_GROUP_OF_NAME: Dict[str, str] = {}
for _group, _names in (
        (DP, ("dp", "data_parallel", "ddp", "fsdp", "dp_shard", "dp_replicate", "hsdp", "dp_cp",
              "dp_shard_cp")),
        (TP, ("tp", "tensor_parallel")),
        (PP, ("pp", "pipeline_parallel")),
        (CP, ("cp", "context_parallel")),
        (EP, ("ep", "expert_parallel"))):
    for _name in _names:
        _GROUP_OF_NAME[_name] = _group


def group_of_name(name: str) -> str:
    """The layout group a mesh dimension called ``name`` is (its own name if not recognised)."""
    return _GROUP_OF_NAME.get(name.lower(), name)


@functools.lru_cache(maxsize=None)
def dtensor_class() -> Optional[type]:
    for path in ("torch.distributed.tensor", "torch.distributed._tensor"):
        try:
            return getattr(__import__(path, fromlist=["DTensor"]), "DTensor")
        except Exception:  # noqa: BLE001 - torch built without distributed
            continue
    return None


@functools.lru_cache(maxsize=None)
def strided_shard_class() -> Optional[type]:
    try:
        from torch.distributed.tensor.placement_types import _StridedShard

        return _StridedShard
    except Exception:  # noqa: BLE001 - older or newer torch: only Shard then
        return None


class MeshDim:
    """One dimension of a DTensor's mesh: the group it is, this rank's coordinate, its size."""

    __slots__ = ("group", "rank", "size")

    def __init__(self, group_name: str, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group_name, rank, size


class Unknown(Exception):
    """What the layout cannot tell, and why (said in ``doc["unknown"]``)."""


def mesh_dims(mesh: Any, fsdp_dims: Sequence[int] = ()) -> Tuple[List[MeshDim], Dict[str, Dict[str, int]]]:
    """The dimensions of ``mesh`` as layout groups, and the groups they give this rank
    (``{"dp": {"rank", "size"}, ...}``). ``fsdp_dims``: the dimensions FSDP2 shards
    over, data parallel even where the mesh does not name them (``fully_shard`` without
    a mesh makes an unnamed one). ``Unknown`` if a dimension is neither named nor FSDP's."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise Unknown("this rank is not in the parameter's device mesh")
    names = mesh.mesh_dim_names
    raw: List[str] = []
    for i in range(mesh.ndim):
        name = names[i] if names else None
        if name is None:
            if i not in fsdp_dims:
                raise Unknown(f"mesh dimension {i} of the parameter's device mesh has no name")
            name = DP if len(fsdp_dims) == 1 else ("dp_replicate" if i == min(fsdp_dims) else "dp_shard")
        raw.append(str(name))
    canonical = [group_of_name(n) for n in raw]
    dims: List[MeshDim] = []
    for i, name in enumerate(raw):
        # Two dimensions of one group (HSDP's replicate x shard) keep their own names.
        g = canonical[i] if canonical.count(canonical[i]) == 1 else name
        dims.append(MeshDim(g, int(coordinate[i]), int(mesh.size(i))))
    groups = {d.group: group(d.rank, d.size) for d in dims}
    dp_dims = [d for d, c in zip(dims, canonical) if c == DP]
    if len(dp_dims) > 1:  # gradients are reduced over all of them: dp is their product, row-major
        rank, size = 0, 1
        for d in dp_dims:
            rank, size = rank * d.size + d.rank, size * d.size
        groups[DP] = group(rank, size)
    return dims, groups


def _split(placements: Sequence[Any], dims: Sequence[MeshDim], skip: Sequence[int] = ()) -> Tuple[List[list], bool]:
    """``split`` and ``partial`` of a piece under ``placements`` (mesh dims in ``skip`` left whole)."""
    split, partial = [], False
    for i, (p, d) in enumerate(zip(placements, dims)):
        if i in skip:
            continue
        if p.is_shard() or _is_strided(p):
            split.append([d.group, d.rank, d.size])
        elif p.is_partial():
            split.append([d.group, d.rank, d.size])
            partial = True
        elif not p.is_replicate():
            raise Unknown(f"placement {p!r} is not one this version of the monitor reads")
    return split, partial


def dtensor_piece(t: Any, dims: Sequence[MeshDim]) -> Dict[str, Any]:
    """The piece a row of ``t``'s local tensor describes."""
    split, partial = _split(t.placements, dims)
    return piece(t.to_local().numel(), split, partial)


def unreduced_piece(t: Any, dims: Sequence[MeshDim], fsdp_dims: Sequence[int]) -> Dict[str, Any]:
    """The piece of FSDP2's unsharded gradient: ``t`` unsharded along ``fsdp_dims``, its
    other placements kept; the element count is the local size under those placements
    (plain ``Shard``, torch's chunking: ``ceil(n / size)`` per coordinate, the last ones
    shorter or empty)."""
    placements = t.placements
    split, partial = _split(placements, dims, skip=fsdp_dims)
    shape = list(t.shape)
    for i, (p, d) in enumerate(zip(placements, dims)):
        if i in fsdp_dims or not (p.is_shard() or _is_strided(p)):
            continue
        if _is_strided(p):
            raise Unknown(f"a strided shard {p!r} outside FSDP's own mesh dimensions")
        n = shape[p.dim]
        chunk = -(-n // d.size) if n else 0
        shape[p.dim] = max(0, min(n, (d.rank + 1) * chunk) - d.rank * chunk)
    return piece(math.prod(shape), split, partial)


def _is_strided(p: Any) -> bool:
    strided = strided_shard_class()
    return strided is not None and isinstance(p, strided)


def fsdp2_dims(mesh: Any, fsdp_param: Any) -> List[int]:
    """The dimensions of a sharded parameter's ``mesh`` that FSDP2 itself shards or
    replicates over: the dimensions of FSDP's data-parallel mesh (``mesh_info.mesh``),
    found by name where both are named, else the leading ones (FSDP2 puts its mesh
    first when it adds tensor-parallel dimensions)."""
    info = getattr(fsdp_param, "mesh_info", None)
    fsdp_mesh = getattr(info, "mesh", None)
    if fsdp_mesh is None:
        raise Unknown("FSDP2's data-parallel mesh of the parameter (mesh_info.mesh) is not readable")
    spmd = getattr(info, "dp_mesh_dims", None)
    names = mesh.mesh_dim_names
    if spmd is not None and names:  # fully_shard(dp_mesh_dims=...): one mesh, data-parallel dims by name
        dp_names = list(getattr(spmd, "shard_names", ()) or ()) + list(getattr(spmd, "replicate_names", ()) or ())
        return [i for i, n in enumerate(names) if n in dp_names]
    fsdp_names = fsdp_mesh.mesh_dim_names
    if names and fsdp_names and all(n in names for n in fsdp_names):
        return [names.index(n) for n in fsdp_names]
    return list(range(fsdp_mesh.ndim))


# ----------------------------------------------------------- tensor-parallel modules
# ``parallelize_module`` leaves no record of a module's style but the hooks
# ``distribute_module`` registers: lambdas closing over the style's input/output
# functions (partials of its static methods, holding its layouts) and the device mesh.
# The partial's arguments that hold the layouts the module sees: the desired input
# layouts (a tuple) and the output layouts (a tuple).
_INPUT_LAYOUTS = {"ColwiseParallel._prepare_input_fn": 1, "RowwiseParallel._prepare_input_fn": 1,
                  "SequenceParallel._prepare_input_fn": 0}
_OUTPUT_LAYOUTS = {"ColwiseParallel._prepare_output_fn": 0, "RowwiseParallel._prepare_output_fn": 0}
_STYLES_PACKAGE = "torch.distributed.tensor.parallel"


class TensorParallelStyle:
    """What ``parallelize_module`` made of one module: the style's name, the mesh, and
    the placements of the input the module computes with and of the output it returns
    (None where the style does not say)."""

    def __init__(self, style: str, mesh: Any, input_placement: Any, output_placement: Any) -> None:
        self.style, self.mesh = style, mesh
        self.input_placement, self.output_placement = input_placement, output_placement


def tensor_parallel_style(module: torch.nn.Module) -> Optional[TensorParallelStyle]:
    """The style ``parallelize_module`` applied to ``module``, read from its forward
    hooks; None for a module it did not touch. ``Unknown`` for a style this version does
    not read (its rows cannot be described)."""
    found: Dict[str, Any] = {}
    mesh = None
    hooks = list(getattr(module, "_forward_pre_hooks", {}).values()) + list(getattr(module, "_forward_hooks", {}).values())
    for hook in hooks:
        for cell in getattr(hook, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, functools.partial):
                func = value.func
                if str(getattr(func, "__module__", "")).startswith(_STYLES_PACKAGE):
                    found[getattr(func, "__qualname__", repr(func))] = value.args
            elif type(value).__name__ == "DeviceMesh":
                mesh = value
    if not found:
        return None
    style = next(iter(found)).split(".")[0]
    inputs = [(q, a) for q, a in found.items() if q in _INPUT_LAYOUTS]
    outputs = [(q, a) for q, a in found.items() if q in _OUTPUT_LAYOUTS]
    if mesh is None or not inputs or mesh.ndim != 1:
        raise Unknown(f"tensor-parallel style {style} of this module is not one this version reads")
    try:
        q, args = inputs[0]
        placement_in = args[_INPUT_LAYOUTS[q]][0]
        placement_out = outputs[0][1][_OUTPUT_LAYOUTS[outputs[0][0]]][0] if outputs else None
    except (IndexError, TypeError) as exc:
        raise Unknown(f"the layouts of tensor-parallel style {style} are not readable ({exc!r})") from None
    if style == "SequenceParallel":  # a norm or dropout keeps its input's sequence sharding
        placement_out = placement_in
    return TensorParallelStyle(style, mesh, placement_in, placement_out)


def tensor_parallel_module_rows(tag: str, tp: TensorParallelStyle) -> Dict[str, Any]:
    """``layout["modules"]`` entries of a tensor-parallel module's rows (index 0: the
    styles read here apply to ``Linear``, ``Embedding`` and norms, one input and one
    output). A sharded activation and its gradient are cut along the mesh's group; a
    replicated one is a replica (not named), except the gradient a column-parallel
    module sends to its replicated input: each rank's is a partial sum (its columns'
    share), not combinable."""
    (dim,), _ = mesh_dims(tp.mesh)
    split = [[dim.group, dim.rank, dim.size]]
    out: Dict[str, Any] = {}

    def put(kind: str, placement: Any, grad_of_replicated: Optional[Dict[str, Any]] = None) -> None:
        if placement is None:
            out[f"{tag}.{kind}.0"] = UNKNOWN_ENTRY
        elif placement.is_shard():
            out[f"{tag}.{kind}.0"] = {"split": split}
        elif placement.is_partial():
            out[f"{tag}.{kind}.0"] = {"split": split, "partial": True}
        elif grad_of_replicated is not None:
            out[f"{tag}.{kind}.0"] = grad_of_replicated
        elif not placement.is_replicate():
            out[f"{tag}.{kind}.0"] = UNKNOWN_ENTRY

    put("input", tp.input_placement)
    put("grad_input", tp.input_placement,
        {"split": split, "partial": True} if tp.style == "ColwiseParallel" else UNKNOWN_ENTRY)
    put("output", tp.output_placement)
    put("grad_output", tp.output_placement)
    return out


UNKNOWN_ENTRY = "unknown"


def is_dtensor(t: Any) -> bool:
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def full_shape(t: torch.Tensor) -> List[int]:
    return list(t.shape)  # a DTensor's shape is the full tensor's


__all__ = ["MeshDim", "TensorParallelStyle", "UNKNOWN_ENTRY", "Unknown", "tensor_parallel_module_rows",
           "tensor_parallel_style", "dtensor_piece", "full_shape", "fsdp2_dims", "group_of_name",
           "is_dtensor", "mesh_dims", "unreduced_piece"]
