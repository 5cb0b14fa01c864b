"""Where FSDP keeps the gradients the monitor needs, and how to name them.

FSDP1 (``FullyShardedDataParallel``, ``use_orig_params`` true or false): each unit
owns a ``FlatParameter``. Its post-accumulate-grad hook fires with the *unsharded,
unreduced* flat gradient, before FSDP's own post-backward hook (an autograd-node hook,
which runs after tensor hooks) reduce-scatters it. The flat gradient is cut into views
per original parameter with the layout FSDP records on the flat parameter (``_fqns``,
``_numels_with_padding``, ``_is_padding_mask``, ``_shapes``); after the step, a flat
*shard* (``use_orig_params=False``) is cut with ``_shard_param_infos``.

FSDP2 (``fully_shard``): parameters are DTensor shards whose post-accumulate hooks FSDP2
calls itself *after* the reduce-scatter. The unreduced gradient lands on each
``FSDPParam``'s ``_unsharded_param``, a plain full-shape parameter that exists once the
module has run forward; the monitor hooks it from a forward hook on the FSDP module.

These are private attributes of torch (checked on 2.13); where they are missing, the
monitor logs that ``unreduced`` cannot be observed for those parameters and goes on.
"""

import logging
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from ..naming import clean_path, named_modules, wrapped_module

logger = logging.getLogger("msprobe.monitor_v2")


def _fsdp1_class() -> Optional[type]:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel
    except Exception:  # noqa: BLE001 - torch built without distributed
        return None


def _fsdp2_class() -> Optional[type]:
    for path in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            module = __import__(path, fromlist=["FSDPModule"])
            return getattr(module, "FSDPModule")
        except Exception:  # noqa: BLE001
            continue
    return None


class FlatSegment:
    """One original parameter inside a flat parameter."""

    __slots__ = ("name", "offset", "numel")

    def __init__(self, name: str, offset: int, numel: int) -> None:
        self.name, self.offset, self.numel = name, offset, numel

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.detach().narrow(0, self.offset, self.numel)


class FlatParamLayout:
    """Layout of one FSDP1 flat parameter: unsharded segments and local-shard segments."""

    def __init__(self, prefix: str, flat_param: torch.Tensor, unit: Optional[torch.nn.Module] = None,
                 fsdp_module: Optional[torch.nn.Module] = None) -> None:
        self.flat_param = flat_param
        self.fsdp_module = fsdp_module  # the FullyShardedDataParallel unit (its groups, for the layout)
        # ``_fqns`` are relative to the module the FSDP unit wraps; wrappers inside it
        # (checkpoint_wrapper under FSDP1) are left out of the names as everywhere.
        fqns = [clean_path(unit, f) if unit is not None else f for f in flat_param._fqns]
        names = [f"{prefix}.{f}" if prefix else f for f in fqns]
        self.unsharded: List[FlatSegment] = []
        offset, k = 0, 0
        for numel, is_pad in zip(flat_param._numels_with_padding, flat_param._is_padding_mask):
            if not is_pad:
                self.unsharded.append(FlatSegment(names[k], offset, numel))
                k += 1
            offset += numel
        self.shard: List[FlatSegment] = []
        # (name, full shape or None, elements, elements in this rank's shard) of every
        # original parameter, for the layout; the shapes are read defensively (the rows
        # need only the offsets)
        self.entries: List[Tuple[str, Optional[List[int]], int, int]] = []
        shapes = getattr(flat_param, "_shapes", None)
        shapes = list(shapes) if shapes is not None and len(shapes) == len(names) else [None] * len(names)
        for seg, shape, info in zip(self.unsharded, shapes, flat_param._shard_param_infos):
            in_shard = info.numel_in_shard if info.in_shard and info.numel_in_shard else 0
            self.entries.append((seg.name, None if shape is None else list(shape), seg.numel, in_shard))
            if in_shard:
                self.shard.append(FlatSegment(seg.name, info.offset_in_shard, info.numel_in_shard))

    @property
    def names(self) -> List[str]:
        return [s.name for s in self.unsharded]


def fsdp1_layouts(root: torch.nn.Module) -> List[FlatParamLayout]:
    cls = _fsdp1_class()
    if cls is None:
        return []
    layouts = []
    for path, module in named_modules(root, wrappers=True):
        if not isinstance(module, cls):
            continue
        handle = getattr(module, "_handle", None)
        flat = getattr(handle, "flat_param", None)
        if flat is None:
            continue
        try:
            layouts.append(FlatParamLayout(path, flat, wrapped_module(module), module))
        except AttributeError as exc:
            logger.warning("monitor_v2: cannot read the FSDP flat-parameter layout of '%s' (%r); its "
                           "'unreduced' gradients are not observed", path, exc)
    return layouts


def fsdp1_shard_groups(layout: FlatParamLayout) -> Tuple[str, Tuple[int, int], Optional[Tuple[int, int]]]:
    """``(strategy, (rank, size) in the shard group, (rank, size) in the replicate group
    or None)`` of an FSDP1 unit: the shard group is the unit's process group; hybrid
    strategies replicate the shards over ``_inter_node_pg``."""
    handle = getattr(layout.fsdp_module, "_handle", None)
    strategy = getattr(getattr(handle, "_sharding_strategy", None), "name", None)
    if handle is None or strategy is None:
        raise AttributeError("the FSDP unit's flat-parameter handle or sharding strategy")
    shard = (int(handle.rank), int(handle.world_size))
    replicate = None
    if "HYBRID" in strategy:
        pg = getattr(layout.fsdp_module, "_inter_node_pg", None)
        if pg is None:
            raise AttributeError("the hybrid-sharded FSDP unit's replicate group (_inter_node_pg)")
        replicate = (int(pg.rank()), int(pg.size()))
    return strategy, shard, replicate


def fsdp2_modules(root: torch.nn.Module) -> List[torch.nn.Module]:
    cls = _fsdp2_class()
    if cls is None:
        return []
    return [m for m in root.modules() if isinstance(m, cls)]


def fsdp2_params(module: torch.nn.Module) -> Iterator[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """``(sharded_param, unsharded_param or None)`` for each parameter FSDP2 manages in
    ``module``'s own parameter groups."""
    for fp in _fsdp_params(module):
        yield fp.sharded_param, getattr(fp, "_unsharded_param", None)


def _fsdp_params(module: torch.nn.Module) -> Iterator[Any]:
    """FSDP2's ``FSDPParam`` objects of ``module``'s own parameter groups (one group in
    torch 2.13, a list of them in later versions)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    for group in groups:
        yield from group.fsdp_params


def fsdp2_param_states(root: torch.nn.Module) -> Dict[int, Any]:
    """FSDP2's ``FSDPParam`` of each sharded parameter of ``root``, by the parameter's id."""
    out: Dict[int, Any] = {}
    for module in fsdp2_modules(root):
        try:
            for fp in _fsdp_params(module):
                out[id(fp.sharded_param)] = fp
        except AttributeError:
            continue
    return out


def fsdp2_sharded_params(root: torch.nn.Module) -> List[torch.Tensor]:
    out = []
    for module in fsdp2_modules(root):
        try:
            out.extend(p for p, _ in fsdp2_params(module))
        except AttributeError:
            continue
    return out
