"""Hooks that copies of the model do not carry.

``torch.save(model)``, ``copy.deepcopy(model)`` and EMA/SWA copies
(``torch.optim.swa_utils.AveragedModel``) take a module's state from
``module.__getstate__()``: its ``__dict__``, hook dictionaries included. The monitor's
hooks are closures over the monitor, so a pickle would fail, and a deep copy would share
them: the copy's forward passes would be recorded under the original's names, and the
copy would keep the hooks after ``stop()``.

Python looks ``__getstate__`` up on the instance before the class, so each module the
monitor hooks gets an instance attribute ``__getstate__`` that returns the state its
class would return, without the monitor's hook entries and without itself. Copies and
checkpoints are then exactly what they would be without the monitor (other libraries'
hooks are copied as usual), and loading a checkpoint does not need msprobe. ``stop()``
removes the hooks and the attribute. The same is done for the monitor's ``forward`` set in a
module's instance dictionary (the module monitor's call wrapper) and for the ``step``
wrapper put on an optimizer that is not a ``torch.optim.Optimizer``
(``patching.replace_attribute``).
"""

from itertools import repeat
from operator import is_, itemgetter
from typing import Any, Callable, Dict, List, Tuple

import torch

from ... import native
from ...patching import StateWithout

# The dictionaries of a module that hold forward hooks or their flags, by handle id.
_HOOK_DICTS = (
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
)


_REPLICATE = "_replicate_for_data_parallel"
_MODULE, _WRAPPER = itemgetter(0), itemgetter(1)


class _Replicate:
    """A wrapped module's ``_replicate_for_data_parallel`` (an instance attribute beside the
    wrapper). torch's ``DataParallel`` makes its replicas by copying each module's instance
    dictionary: a replica would then call the wrapper of the module it was made from, which
    runs that module's forward, with that module's parameters, on its device. The replica gets
    a wrapper of its own (the same hooks) instead."""

    __slots__ = ("module", "wrapper")

    def __init__(self, module: torch.nn.Module, wrapper: Any) -> None:
        self.module = module
        self.wrapper = wrapper

    def __call__(self) -> torch.nn.Module:
        module, wrapper = self.module, self.wrapper
        replica = type(module)._replicate_for_data_parallel(module)
        entries = vars(replica)
        if entries.get(_REPLICATE) is self:
            del entries[_REPLICATE]
        if entries.get("forward") is wrapper:
            entries["forward"] = wrapper.bound_to(replica)
        return replica


class ModuleHooks:
    """Forward hooks on modules, and wrappers set as a module's ``forward``, that copies and
    pickles of the modules leave out."""

    def __init__(self) -> None:
        self._handles: List[Any] = []
        self._states: Dict[int, StateWithout] = {}  # id(module) -> its __getstate__
        self._ids: Dict[int, List[int]] = {}  # id(module) -> ids of the hooks added here, in order
        self._wrapped: List[Tuple[torch.nn.Module, Any]] = []  # (module, its forward set here)

    def _state(self, module: torch.nn.Module) -> StateWithout:
        state = self._states.get(id(module))
        if state is None:
            state = self._states[id(module)] = StateWithout.install(module)
            state.hook_dicts = _HOOK_DICTS
            self._ids[id(module)] = []
        return state

    def _track(self, module: torch.nn.Module, handle: Any) -> Any:
        self._state(module).hook_ids.add(handle.id)
        self._ids[id(module)].append(handle.id)
        self._handles.append(handle)
        return handle

    def forward_pre(self, module: torch.nn.Module, hook: Callable[..., None], **kwargs: Any) -> Any:
        return self._track(module, module.register_forward_pre_hook(hook, **kwargs))

    def forward(self, module: torch.nn.Module, hook: Callable[..., None], **kwargs: Any) -> Any:
        return self._track(module, module.register_forward_hook(hook, **kwargs))

    def wrap_forward(self, module: torch.nn.Module, wrapper: Any) -> None:
        """``wrapper`` as ``module.forward``: an entry of the module's instance dictionary, set
        there directly (no ``__setattr__`` of a subclass runs), which its class's forward is
        found behind again once the entry is deleted."""
        state = self._state(module)
        entries = vars(module)
        entries["forward"] = wrapper
        entries[_REPLICATE] = _Replicate(module, wrapper)
        state.leave_out("forward")
        state.leave_out(_REPLICATE)
        self._wrapped.append((module, wrapper))

    def wrapped(self) -> List[Tuple[torch.nn.Module, Any]]:
        """``(module, wrapper)`` of each forward set here."""
        return list(self._wrapped)

    def replaced(self) -> List[Tuple[torch.nn.Module, Any]]:
        """``(module, wrapper)`` of each forward set here that is no longer the module's: a check
        before every model chunk's call on written steps, one pass in C over the modules'
        dictionaries (the extension's ``forwards_replaced``: a wrapper is the extension's, so it
        is there wherever one is; else the same pass through ``vars``)."""
        wrapped = self._wrapped
        if not wrapped:
            return []
        ext = native.extension()
        if ext is not None:
            return ext.forwards_replaced(wrapped)
        found = map(dict.get, map(vars, map(_MODULE, wrapped)), repeat("forward"))
        if all(map(is_, found, map(_WRAPPER, wrapped))):
            return []
        return [(m, w) for m, w in wrapped if vars(m).get("forward") is not w]

    def unwrap(self, module: torch.nn.Module, wrapper: Any) -> bool:
        """Take ``wrapper`` out of ``module.forward``; False where something else replaced it
        meanwhile (its replacement stays: the caller disarms the wrapper)."""
        self._wrapped = [(m, w) for m, w in self._wrapped if w is not wrapper]
        state = self._states.get(id(module))
        if state is not None:
            state.leave_out("forward", False)
            state.leave_out(_REPLICATE, False)
        entries = vars(module)
        replicate = entries.get(_REPLICATE)
        if isinstance(replicate, _Replicate) and replicate.wrapper is wrapper:
            del entries[_REPLICATE]
        if entries.get("forward") is wrapper:
            del entries["forward"]
            return True
        return False

    def remove_all(self) -> List[Tuple[torch.nn.Module, Any]]:
        """Remove every hook and wrapper; ``(module, wrapper)`` of the wrappers that could not
        be taken out (``unwrap``)."""
        left = [(m, w) for m, w in self.wrapped() if not self.unwrap(m, w)]
        while self._handles:
            self._handles.pop().remove()
        for key, state in self._states.items():
            state.hook_ids -= set(self._ids[key])
            state.release()
        self._states.clear()
        self._ids.clear()
        return left

    def replace(self, swap: Callable[[Any], Any]) -> None:
        """Each hook added here replaced by ``swap(hook)`` where that is not None, in the same
        place among its module's hooks (and under the same handle)."""
        for handle in self._handles:
            hooks = handle.hooks_dict_ref()
            if hooks is not None and handle.id in hooks:
                new = swap(hooks[handle.id])
                if new is not None:
                    hooks[handle.id] = new

    def handle_ids(self) -> Dict[int, List[int]]:
        """id(module) -> the ids of the hooks added here on it, in the order they were added."""
        return {key: list(ids) for key, ids in self._ids.items()}

    def modules(self) -> List[torch.nn.Module]:
        """The modules that carry hooks or wrappers added here."""
        return [state.owner for state in self._states.values()]

    def remove(self) -> None:
        """The same ``remove()`` as a ``patching.Patch``: a ``ModuleHooks`` sits in a list of handles."""
        self.remove_all()


# The dictionaries whose order is the order a module's forward hooks run in.
_ORDERED_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")


def hook_order(module: torch.nn.Module) -> Dict[str, List[int]]:
    """The order of ``module``'s forward hooks (handle ids), to give back with ``restore_order``."""
    return {name: list(getattr(module, name, None) or ()) for name in _ORDERED_HOOK_DICTS}


def restore_order(module: torch.nn.Module, order: Dict[str, List[int]], renamed: Dict[int, int]) -> None:
    """Put ``module``'s forward hooks back in ``order`` (``hook_order``'s, taken when some
    of them were removed), where ``renamed`` maps a removed hook's id to the id of the same
    hook added again: each runs where it ran before, as if it had never been removed.
    Hooks added since go where they went: first if they were prepended before every hook
    of ``order``, else after them; hooks removed since stay removed."""
    for name, before in order.items():
        hooks = getattr(module, name, None)
        if not isinstance(hooks, dict) or not hooks:
            continue
        current = list(hooks)
        kept = [renamed.get(k, k) for k in before]
        kept = [k for k in kept if k in hooks]
        known = set(kept)
        first = next((i for i, k in enumerate(current) if k in known), len(current))
        wanted = ([k for k in current[:first] if k not in known] + kept +
                  [k for k in current[first:] if k not in known])
        if wanted != current:
            items = [(k, hooks[k]) for k in wanted]
            hooks.clear()
            hooks.update(items)
