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


def is_dtensor(t: Any) -> bool:
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def full_shape(t: torch.Tensor) -> List[int]:
    return list(t.shape)  # a DTensor's shape is the full tensor's


__all__ = ["MeshDim", "Unknown", "dtensor_piece", "full_shape", "fsdp2_dims", "group_of_name",
           "is_dtensor", "mesh_dims", "unreduced_piece"]
