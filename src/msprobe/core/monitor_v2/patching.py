"""Everything the monitor installs on the user's objects, and its undo.

Each install returns a :class:`Patch`: one handle whose ``remove()`` undoes exactly what
the install did and nothing else, and is harmless when called again. A patch has the
same ``remove()`` as torch's and MindSpore's hook handles, so monitors keep patches and
framework hook handles in one list and undo them with :func:`remove_all`.

- :func:`hooks` groups framework hook handles (forward hooks, optimizer step hooks,
  tensor hooks) into one patch.
- :func:`replace_attribute` sets an attribute (an instance's method, a function of a
  module such as ``torch.distributed.all_reduce``); removal puts back the object's own
  attribute, or deletes ours so the inherited one shows again. One replaced again by
  someone else after us is left as it is (their replacement wins).
- :func:`wrap_method` calls ``before``/``after`` around an instance's method.
- ``keep_out_of_copies`` keeps such an attribute out of copies and pickles of the
  instance (``copy.deepcopy``, ``torch.save``), so they are what they would be without
  the monitor (:class:`StateWithout`).

Nothing here imports a framework.
"""

import logging
from typing import Any, Callable, Dict, Iterable, List, Optional, Set

logger = logging.getLogger("msprobe.monitor_v2")


class Patch:
    """An installed change and its undo. ``remove()`` runs the undo once; a second call
    does nothing (``installed`` then is False)."""

    __slots__ = ("_undo",)

    def __init__(self, undo: Optional[Callable[[], Any]] = None) -> None:
        self._undo = undo

    @property
    def installed(self) -> bool:
        return self._undo is not None

    def remove(self) -> None:
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()


def remove_all(handles: List[Any]) -> None:
    """Remove every handle (a :class:`Patch` or a framework hook handle), last first, and
    empty the list."""
    while handles:
        handles.pop().remove()


def hooks(handles: Iterable[Any]) -> Patch:
    """One patch for framework hook handles (anything with ``remove()``), removed in the
    reverse order of installation."""
    pending = list(handles)
    return Patch(lambda: remove_all(pending))


_MISSING = object()


class StateWithout:
    """An object's ``__getstate__`` (instance attribute) that leaves out the monitor's
    hook entries (``hook_ids`` in the dictionaries named ``hook_dicts``) and puts back the
    instance attributes the monitor replaced (``attrs``: name -> value before the
    monitor, or ``_MISSING``).

    A previous instance-level ``__getstate__`` (another tool doing the same) is called
    instead of the class's and put back by :meth:`release`. Two monitors on one object
    share one; it is removed when the last of them releases it (a reference count, not
    a handle: the :class:`Patch` that installed it releases it)."""

    __slots__ = ("owner", "hook_ids", "hook_dicts", "attrs", "previous", "users")

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.hook_ids: Set[int] = set()
        self.hook_dicts: tuple = ()
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
            for name in self.hook_dicts:
                entries = state.get(name)
                if entries and not self.hook_ids.isdisjoint(entries):
                    state[name] = type(entries)((k, v) for k, v in entries.items() if k not in self.hook_ids)
        return state

    def leave_out(self, name: str, leave: bool = True) -> None:
        """Copies and pickles get no instance attribute ``name`` (one the monitor set where the
        object had none) while ``leave``; with ``leave`` False, the attribute as it is again."""
        if leave:
            self.attrs[name] = _MISSING
        else:
            self.attrs.pop(name, None)

    @classmethod
    def install(cls, owner: Any) -> "StateWithout":
        getstate = vars(owner).get("__getstate__")
        if not (isinstance(getstate, cls) and getstate.owner is owner):
            getstate = cls(owner)
            object.__setattr__(owner, "__getstate__", getstate)  # not a parameter or submodule
        getstate.users += 1
        return getstate

    def release(self) -> None:
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


def _set_without_copy(owner: Any, name: str, value: Any) -> Optional[StateWithout]:
    """Set the instance attribute ``name`` of ``owner`` so that copies and pickles of
    ``owner`` get the attribute as it was before (or none); the returned object's
    ``release()`` ends that, once the attribute is restored. None when ``owner`` has no
    ``__dict__`` (the attribute is then only set)."""
    before = vars(owner).get(name, _MISSING) if hasattr(owner, "__dict__") else _MISSING
    setattr(owner, name, value)
    if not hasattr(owner, "__dict__"):
        return None
    state = StateWithout.install(owner)
    state.attrs.setdefault(name, before)
    return state


def replace_attribute(owner: Any, attr: str, value: Any, *, keep_out_of_copies: bool = False,
                      if_replaced: Optional[Callable[[], None]] = None) -> Patch:
    """Set ``owner.<attr>`` to ``value``; the patch's removal restores ``owner`` as it
    was: its own previous attribute, or none (the inherited one shows again). When the
    attribute no longer is ``value`` at removal (someone replaced it after us), it is left
    as it is and ``if_replaced()`` is called (to say so). ``keep_out_of_copies``: copies
    and pickles of ``owner`` get the attribute as it was before (:class:`StateWithout`)."""
    had_own = attr in vars(owner)
    previous = vars(owner).get(attr)
    copy_state: Optional[StateWithout] = None
    if keep_out_of_copies:
        copy_state = _set_without_copy(owner, attr, value)
    else:
        setattr(owner, attr, value)

    def undo() -> None:
        if copy_state is not None:
            copy_state.release()
        if vars(owner).get(attr) is not value:
            if if_replaced is not None:
                if_replaced()
            return
        if had_own:
            setattr(owner, attr, previous)
        else:
            delattr(owner, attr)

    return Patch(undo)


def wrap_method(obj: Any, method: str, before: Callable[[], None], after: Callable[[], None],
                when: Optional[Callable[[], bool]] = None) -> Patch:
    """Wrap ``obj.<method>`` at instance level with ``before``/``after`` (only for calls
    where ``when()`` is true, if given); the patch's removal restores the instance exactly
    as it was (or leaves a later replacement alone, with a warning). Copies and pickles
    of ``obj`` get the method as it was before."""
    def replaced() -> None:
        logger.warning("monitor_v2: %s.%s was replaced after start(); leaving it as it is",
                       type(obj).__name__, method)

    wrapper = _PatchedMethod(getattr(obj, method), before, after, when)
    return replace_attribute(obj, method, wrapper, keep_out_of_copies=True, if_replaced=replaced)


class _PatchedMethod:
    """The instance-level method put by ``wrap_method``: ``before()``, the original,
    ``after()`` (when ``when()`` is true or not given)."""

    __slots__ = ("original", "before", "after", "when")

    def __init__(self, original: Callable[..., Any], before: Callable[[], None], after: Callable[[], None],
                 when: Optional[Callable[[], bool]]) -> None:
        self.original = original
        self.before = before
        self.after = after
        self.when = when

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hooked = self.when is None or self.when()
        if hooked:
            self.before()
        result = self.original(*args, **kwargs)
        if hooked:
            self.after()
        return result
