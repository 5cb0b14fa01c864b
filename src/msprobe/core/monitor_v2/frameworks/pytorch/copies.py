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
optimizer that is not a ``torch.optim.Optimizer`` (``patching.replace_attribute``).
"""

from typing import Any, Callable, Dict, List, Set

import torch

from ...patching import StateWithout

# The dictionaries of a module that hold forward hooks or their flags, by handle id.
_HOOK_DICTS = (
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
)


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
            state.hook_dicts = _HOOK_DICTS
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
            state.release()
        self._states.clear()
        self._ids.clear()

    def remove(self) -> None:
        """The same ``remove()`` as a ``patching.Patch``: a ``ModuleHooks`` sits in a list of handles."""
        self.remove_all()
