"""Flattening nested inputs/outputs into a stable list of tensors, for any framework.

Order: positional arguments, then keyword arguments in call order; tuples and lists in
order, dicts (including Hugging Face ``ModelOutput``, an ordered dict) by insertion
order, dataclasses by field order. Everything that is not a tensor is skipped.
"""

import dataclasses
from typing import Any, Callable, List, Mapping

_MAX_DEPTH = 16  # guards against self-referencing containers


def flatten_tensors(obj: Any, is_tensor: Callable[[Any], bool]) -> List[Any]:
    out: List[Any] = []
    _flatten(obj, is_tensor, out, 0)
    return out


def _flatten(obj: Any, is_tensor: Callable[[Any], bool], out: List[Any], depth: int) -> None:
    if is_tensor(obj):
        out.append(obj)
        return
    if depth >= _MAX_DEPTH or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    if isinstance(obj, (list, tuple)):
        for item in obj:
            _flatten(item, is_tensor, out, depth + 1)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            _flatten(item, is_tensor, out, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _flatten(getattr(obj, f.name, None), is_tensor, out, depth + 1)
