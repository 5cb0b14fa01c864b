"""The optimizer's per-parameter state tensors, listed once and found again at later steps.

Listing them is a Python walk over every parameter's state (a dict lookup, a type check
and a ``dim()`` call per entry): about 7,000 instructions a state tensor, 14 M a step
for AdamW on 1,000 parameters. The optimizer keeps the same tensors from step to step
(its updates are in place), so ``StateListing`` remembers where each tensor was found
and checks, at the next step, that the state still holds the same parameters in the
same order, as many entries, and the same tensors at those places: about 700
instructions a state tensor, in one call of the native extension
(``native/python_ext.c``: ``entries_again``), or in Python with ``map`` where the
extension is not built. Any difference (a parameter's first step, an entry added or
taken away, ``load_state_dict`` or ``state.clear()``, a tensor re-assigned) lists the
state again.

It holds no reference to a state tensor or a per-parameter dict, only the tensors' ids:
when the optimizer drops its state, its memory goes with it. (An id can be taken again
by a new object once the old one is freed; such an object stands at the same place
under the same name, and is checked to be a tensor.)"""

from itertools import chain, repeat
from operator import is_
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import torch

from .... import native
from ....param_table import ParamInfo

State = Tuple[ParamInfo, str, torch.Tensor]


def is_state_tensor(key: Any, value: Any) -> bool:
    """A tensor of the parameter's values; the scalar ``step`` is not one."""
    return key != "step" and isinstance(value, torch.Tensor) and value.ndim > 0


class StateListing:
    def __init__(self, infos: Sequence[ParamInfo], params: List[Any], entries: int,
                 where: List[int], found: List[State]) -> None:
        self.infos = list(infos)
        self.params = params  # the keys of optimizer.state: model parameters, which the table holds anyway
        self.entries = entries  # how many entries all the parameters' states have
        # each found tensor's place among all the state's values: an entry added or taken
        # away moves the tensors after it, whose ids then differ
        self.where = where
        self.found_infos = [info for info, _, _ in found]
        self.found_keys = [key for _, key, _ in found]
        self.ids = [id(value) for _, _, value in found]

    @classmethod
    def of(cls, state: Mapping[Any, Mapping[str, Any]], infos: Sequence[ParamInfo]) -> Tuple[
            List[State], "StateListing"]:
        """The state tensors of the parameters ``infos``, in their order (each parameter's
        in its state's order), and the listing to find them again."""
        by_id = {id(p): s for p, s in state.items()}
        offsets, offset = {}, 0
        for s in state.values():
            offsets[id(s)] = offset
            offset += len(s)
        found: List[State] = []
        where: List[int] = []
        for info in infos:
            s = by_id.get(id(info.param))
            if not s:
                continue
            n = offsets[id(s)]
            for key, value in s.items():
                if is_state_tensor(key, value):
                    found.append((info, key, value))
                    where.append(n)
                n += 1
        return found, cls(infos, list(state), offset, where, found)

    def again(self, state: Mapping[Any, Mapping[str, Any]], infos: Sequence[ParamInfo]) -> Optional[List[State]]:
        """The state tensors as ``of`` would list them now, or None where the state or
        the parameters changed since this listing."""
        if len(infos) != len(self.infos) or not all(map(is_, infos, self.infos)):
            return None
        ext = native.extension()
        if ext is not None and isinstance(state, dict):  # the same checks in one C call
            return ext.entries_again(state, self.params, self.entries, self.where, self.ids, torch.Tensor,
                                     self.found_infos, self.found_keys)
        if len(state) != len(self.params) or not all(map(is_, state, self.params)):
            return None
        try:
            values = list(chain.from_iterable(map(dict.values, state.values())))
        except TypeError:  # a state of another shape than torch's (not dicts): listed at every step
            return None
        if len(values) != self.entries:
            return None
        now = list(map(values.__getitem__, self.where))
        if list(map(id, now)) != self.ids or not all(map(isinstance, now, repeat(torch.Tensor))):
            return None
        return list(zip(self.found_infos, self.found_keys, now))
