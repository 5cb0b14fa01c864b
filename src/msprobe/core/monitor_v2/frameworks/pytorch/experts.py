"""The device side of grouped experts' ``expert_norms`` rows (see ``experts.py``): the
vector of the E per-expert norms built from the E records the engine made for the
expert slices, where those records still hold device values (on an accelerator, or
the engine's ATen path on the CPU). The norms are the records' own: nothing reads the
tensor again, nothing is read back to the host; the engine's ``record`` then reduces
the small ``[E]`` vector, and ``to_host`` moves it with the step's other values."""

from typing import Any, List, Optional, Sequence, Tuple

import torch

from ...stats import NORM, Record, record_type
from .stats import outside_training_modes


def _device_norm(vector: Any) -> Optional[torch.Tensor]:
    """The 0-d norm of a record's device vector: a ``[4]`` tensor or the engine's
    per-tensor parts (``(min, max, sum, norm)``); None for anything else."""
    if isinstance(vector, torch.Tensor):
        return vector.reshape(-1)[NORM] if vector.numel() == 4 else None
    parts = getattr(vector, "parts", None)
    if isinstance(parts, tuple) and len(parts) == 4 and isinstance(parts[NORM], torch.Tensor):
        return parts[NORM]
    return None


@outside_training_modes
def norms_of_records(tensor: torch.Tensor, experts: Sequence[Record]) -> torch.Tensor:
    """The ``[E]`` per-expert norms of ``tensor`` from its slices' records (where one is
    not a device value, the norms of ``tensor``'s slices computed again: a second read,
    kept for vectors of a kind this code does not know)."""
    norms: List[Optional[torch.Tensor]] = [_device_norm(r.vector) for r in experts]
    with torch.no_grad():
        if all(n is not None for n in norms):
            first = norms[0]
            assert first is not None
            dtype = torch.float64 if first.dtype == torch.float64 else torch.float32
            return torch.stack([n.to(dtype) for n in norms])  # type: ignore[union-attr]
        flat = tensor.detach().reshape(tensor.shape[0], -1)
        wide = torch.float64 if flat.dtype == torch.float64 else torch.float32
        return torch.linalg.vector_norm(flat, dim=1, dtype=wide)


@outside_training_modes
def expert_slices(tensor: torch.Tensor) -> List[torch.Tensor]:
    """The E slices of a grouped-expert tensor (views, no copy), made outside the
    training's dispatch modes: a mode around the step must not see the monitor's
    ``unbind``."""
    return list(tensor.unbind(0))


def expert_norm_record(engine: Any, tensor: torch.Tensor, experts: Sequence[Record], plan: Any,
                       key: Tuple[int, str, str, Optional[int]]) -> Record:
    """The ``expert_norms`` record of ``tensor`` under ``key``."""
    return engine.record(norms_of_records(tensor, experts), plan, *key)


# each count's temporary (a bool per element) at most this many bytes, as the engine's counts
_COUNT_BYTES = 1 << 23


@outside_training_modes
def device_expert_records(engine: Any, tensor: torch.Tensor, plan: Any,
                          keys: Sequence[Tuple[int, str, str, Optional[int]]]) -> Optional[Tuple[List[Record], Any]]:
    """On an accelerator: the E per-expert records of a grouped tensor in a handful of
    reductions along its expert dimension (min/max, an fp32 sum, the norms, the NaN and
    zero counts, each over the ``[E, n]`` view), not E reads of a slice each (four or five
    launches per slice), and the ``[E]`` norms for its ``expert_norms`` row. Nothing is
    read back. None where the tensor is in host memory (the engine's own reads, one per
    slice, are as fast there) or not of a floating dtype."""
    if engine.on_host(tensor.device) or not tensor.is_floating_point() or tensor.dim() < 1:
        return None
    with torch.no_grad():
        flat = tensor.detach().reshape(tensor.shape[0], -1)
        count, n = flat.shape
        wide = torch.float64 if flat.dtype == torch.float64 else torch.float32
        zero = torch.zeros(count, dtype=wide, device=flat.device)
        if plan.minmax and n:
            mn, mx = torch.aminmax(flat, dim=1)
            mn, mx = mn.to(wide), mx.to(wide)
        else:
            mn = mx = zero
        total = flat.sum(dim=1, dtype=wide) if plan.total else zero
        norms = torch.linalg.vector_norm(flat, dim=1, dtype=wide)
        vectors = torch.stack((mn, mx, total, norms), dim=1)
        rows = max(1, _COUNT_BYTES // max(1, n))
        nans = torch.cat([torch.isnan(p).sum(dim=1) for p in flat.split(rows)]) if plan.nans else None
        zeros = torch.cat([torch.eq(p, 0).sum(dim=1) for p in flat.split(rows)]) if plan.zeros else None
    make = record_type()
    records = [make(*key, vectors[e], None if nans is None else nans[e], n, None if zeros is None else zeros[e])
               for e, key in enumerate(keys)]
    return records, norms
