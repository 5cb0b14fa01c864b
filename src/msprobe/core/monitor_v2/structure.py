"""Flattening nested inputs/outputs into a stable list of tensors, for any framework.

Order: positional arguments, then keyword arguments in call order; tuples and lists in
order, dicts (including Hugging Face ``ModelOutput``, an ordered dict) by insertion
order, dataclasses by field order. Everything that is not a tensor is skipped.

Names (``named_outputs``): tensors are numbered in that order (``output.0``,
``output.1``...), except under a mapping returned by the module itself (a dict, an
``OrderedDict``, a ``ModelOutput``, at the top or inside such a mapping): there each
entry is named by its key, so that a module returning ``{"logits": y}`` on one call and
``{"aux": a, "logits": y}`` on the next writes ``output.logits`` both times. A tensor
value is ``output.<key>``; a container value numbers its own tensors
(``output.<key>.0``...); a mapping inside a mapping adds its key
(``output.<key>.<key2>``). A mapping inside a tuple or list is numbered with the rest of
the tuple, as before.

Containers nested deeper than ``MAX_DEPTH`` levels (or referring to themselves) are not
followed; the first time that drops a container at a place (e.g. ``fc1.output``) it is said at WARNING.
"""

import dataclasses
import logging
from typing import Any, Callable, List, Mapping, Tuple

from .logonce import warn_once

logger = logging.getLogger("msprobe.monitor_v2")

MAX_DEPTH = 16  # guards against self-referencing containers


def flatten_tensors(obj: Any, is_tensor: Callable[[Any], bool], where: str = "") -> List[Any]:
    """The tensors in ``obj``; ``where`` (e.g. ``"fc1.output"``) names it when too deep."""
    out: List[Any] = []
    _flatten(obj, is_tensor, out, 0, where)
    return out


def named_outputs(obj: Any, is_tensor: Callable[[Any], bool], prefix: str) -> List[Tuple[str, Any]]:
    """``(name, tensor)`` of a module's output, named as the module doc says."""
    out: List[Tuple[str, Any]] = []
    _name(obj, is_tensor, prefix, out, 0)
    return out


def _name(obj: Any, is_tensor: Callable[[Any], bool], prefix: str, out: List[Tuple[str, Any]], depth: int) -> None:
    if is_tensor(obj):  # the common case first: an ABC isinstance check costs more
        out.append((f"{prefix}.0", obj))
        return
    if isinstance(obj, Mapping):
        if depth >= MAX_DEPTH:
            _too_deep(prefix)
            return
        for key, value in obj.items():
            name = f"{prefix}.{key}"
            if is_tensor(value):
                out.append((name, value))
            else:
                _name(value, is_tensor, name, out, depth + 1)
        return
    out.extend((f"{prefix}.{i}", t) for i, t in enumerate(flatten_tensors(obj, is_tensor, prefix)))


def _too_deep(where: str) -> None:
    # process-wide: said once per place
    warn_once(("too-deep", where), "monitor_v2 module: %s holds containers nested deeper than %d levels; the "
              "tensors below that depth are not recorded. Logged once.", where or "an input or output", MAX_DEPTH)


def _flatten(obj: Any, is_tensor: Callable[[Any], bool], out: List[Any], depth: int, where: str) -> None:
    if is_tensor(obj):
        out.append(obj)
        return
    if obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    container = isinstance(obj, (list, tuple, Mapping)) or (dataclasses.is_dataclass(obj) and not isinstance(obj, type))
    if depth >= MAX_DEPTH:
        if container and obj:
            _too_deep(where)
        return
    if isinstance(obj, (list, tuple)):
        for item in obj:
            _flatten(item, is_tensor, out, depth + 1, where)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            _flatten(item, is_tensor, out, depth + 1, where)
    elif container:
        for f in dataclasses.fields(obj):
            _flatten(getattr(obj, f.name, None), is_tensor, out, depth + 1, where)
