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
removes the hooks and the attribute. The same is done for the ``step`` wrapper put on an
optimizer that is not a ``torch.optim.Optimizer``.
"""

from typing import Any, Callable, Dict, List, Optional, Set

import torch

# The dictionaries of a module that hold forward hooks or their flags, by handle id.
_HOOK_DICTS = (
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
)


_MISSING = object()


class StateWithout:
    """An object's ``__getstate__`` (instance attribute) that leaves out the monitor's
    hook entries (``hook_ids`` in the hook dictionaries) and puts back the instance
    attributes the monitor replaced (``attrs``: name -> value before the monitor, or
    ``_MISSING``).

    A previous instance-level ``__getstate__`` (another tool doing the same) is called
    instead of the class's and put back by :meth:`uninstall`. Two monitors on one object
    share one; it is removed when the last of them uninstalls it."""

    __slots__ = ("owner", "hook_ids", "attrs", "previous", "users")

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.hook_ids: Set[int] = set()
        self.attrs: Dict[str, Any] = {"__getstate__": _MISSING}
        self.previous = vars(owner).get("__getstate__")
        self.users = 0

    def __call__(self) -> Any:
        owner = self.owner
        if self.previous is not None:
            state = self.previous()
        else:
            class_getstate = getattr(type(owner), "__getstate__", None)  # object has none before 3.11
            state = class_getstate(owner) if class_getstate is not None else vars(owner)
        if not isinstance(state, dict):
            return state
        state = dict(state)
        for name, before in self.attrs.items():
            if before is _MISSING:
                state.pop(name, None)
            else:
                state[name] = before
        if self.hook_ids:
            for name in _HOOK_DICTS:
                hooks = state.get(name)
                if hooks and not self.hook_ids.isdisjoint(hooks):
                    state[name] = type(hooks)((k, v) for k, v in hooks.items() if k not in self.hook_ids)
        return state

    @classmethod
    def install(cls, owner: Any) -> "StateWithout":
        getstate = vars(owner).get("__getstate__")
        if not (isinstance(getstate, cls) and getstate.owner is owner):
            getstate = cls(owner)
            object.__setattr__(owner, "__getstate__", getstate)  # not a parameter or submodule
        getstate.users += 1
        return getstate

    def uninstall(self) -> None:
        self.users -= 1
        if self.users > 0:
            return
        owner = self.owner
        if vars(owner).get("__getstate__") is not self:
            return  # replaced by someone else after us: theirs stays
        if self.previous is not None:
            object.__setattr__(owner, "__getstate__", self.previous)
        else:
            object.__delattr__(owner, "__getstate__")


class ModuleHooks:
    """Forward hooks on modules that copies and pickles of the modules leave out."""

    def __init__(self) -> None:
        self._handles: List[Any] = []
        self._states: Dict[int, StateWithout] = {}  # id(module) -> its __getstate__
        self._ids: Dict[int, Set[int]] = {}  # id(module) -> ids of the hooks added here

    def _track(self, module: torch.nn.Module, handle: Any) -> Any:
        state = self._states.get(id(module))
        if state is None:
            state = self._states[id(module)] = StateWithout.install(module)
            self._ids[id(module)] = set()
        state.hook_ids.add(handle.id)
        self._ids[id(module)].add(handle.id)
        self._handles.append(handle)
        return handle

    def forward_pre(self, module: torch.nn.Module, hook: Callable[..., None], **kwargs: Any) -> Any:
        return self._track(module, module.register_forward_pre_hook(hook, **kwargs))

    def forward(self, module: torch.nn.Module, hook: Callable[..., None], **kwargs: Any) -> Any:
        return self._track(module, module.register_forward_hook(hook, **kwargs))

    def remove_all(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        for key, state in self._states.items():
            state.hook_ids -= self._ids[key]
            state.uninstall()
        self._states.clear()
        self._ids.clear()


def set_without_copy(owner: Any, name: str, value: Any) -> Optional[StateWithout]:
    """Set the instance attribute ``name`` of ``owner`` so that copies and pickles of
    ``owner`` get the attribute as it was before (or none); the returned object's
    ``uninstall()`` ends that, once the attribute is restored. None when ``owner`` has no
    ``__dict__`` (the attribute is then only set)."""
    before = vars(owner).get(name, _MISSING) if hasattr(owner, "__dict__") else _MISSING
    setattr(owner, name, value)
    if not hasattr(owner, "__dict__"):
        return None
    state = StateWithout.install(owner)
    state.attrs.setdefault(name, before)
    return state
