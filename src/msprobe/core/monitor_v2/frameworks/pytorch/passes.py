"""Passes a framework runs through the model for itself: they are not training.

Some frameworks call the model outside the training loop to learn shapes, on memory that
holds no data. ``torch.distributed.pipelining``'s ``PipelineStage`` runs a metadata
(shape) inference forward and backward at its first step: stage 0 on a detached copy of
micro-batch 0, the other stages on ``torch.empty`` inputs built from the shapes they
receive. Recorded, such a pass is a false alarm (NaN or 1e37 values) and counts a
micro-batch twice.

The rule (``internal_pass``): a call of a model chunk is framework-internal when

- one of its tensor inputs holds no data: a ``meta`` tensor or a fake tensor (shape
  propagation under ``FakeTensorMode``); or
- it is made from one of the framework functions listed in ``_INTERNAL_CALLERS``: the
  functions that build such inputs and call the model with them.

Nothing in the tensors is read: the device and the type of each input, and the names of
the calling frames (a bounded walk up the Python stack, once per chunk call).
"""

import os
import sys
from typing import Any, Dict, Optional, Tuple

import torch

from ...structure import flatten_tensors

# Function name -> path fragment of the file defining it (both must match).
_PIPELINING = os.path.join("torch", "distributed", "pipelining", "")
_INTERNAL_CALLERS: Dict[str, Tuple[str, str]] = {
    # torch 2.13: PipelineStage._prepare_forward_infra runs it at the first step; the
    # backward inference that follows only differentiates its outputs.
    "_forward_metadata_inference": (_PIPELINING, "torch.distributed.pipelining shape inference"),
    # Earlier torch releases: PipelineStage._shape_inference, same purpose.
    "_shape_inference": (_PIPELINING, "torch.distributed.pipelining shape inference"),
}
# The frame walk runs only once a package defining such a caller is imported.
_CALLER_PACKAGES = ("torch.distributed.pipelining",)
# Frames between the hook and the framework's call of the model: the monitor's wrappers,
# Module._wrapped_call_impl/_call_impl, and a few wrappers' forwards (DDP, compile, FSDP).
_MAX_FRAMES = 48

try:  # private module; without it fake tensors are simply not recognised
    from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor  # type: ignore
except Exception:  # noqa: BLE001
    _FakeTensor = ()  # type: ignore


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _holds_no_data(t: torch.Tensor) -> bool:
    if t.is_meta:
        return True
    kind = type(t)
    # the subclass check only for subclasses: it is slow on plain tensors' hot path
    return kind is not torch.Tensor and kind is not torch.nn.Parameter and isinstance(t, _FakeTensor)


def _internal_caller() -> Optional[str]:
    if not any(name in sys.modules for name in _CALLER_PACKAGES):
        return None
    frame = sys._getframe(2)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        code = frame.f_code
        known = _INTERNAL_CALLERS.get(code.co_name)
        if known is not None and known[0] in code.co_filename:
            return known[1]
        frame = frame.f_back
    return None


def internal_pass(args: Tuple[Any, ...], kwargs: Optional[Dict[str, Any]] = None) -> Optional[str]:
    """What framework-internal pass a model call with these inputs is (a short
    description for the log), or None for a real pass. Call it from the chunk's forward
    pre-hook."""
    if any(_holds_no_data(t) for t in flatten_tensors((args, kwargs or {}), _is_tensor)):
        return "a pass on meta or fake tensors (no data)"
    return _internal_caller()
