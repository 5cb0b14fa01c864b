"""Whether an object implements a ``typing.Protocol`` member by member: every declared
attribute present, every declared method present with a compatible signature.

``isinstance`` against a ``runtime_checkable`` protocol only checks that the names
exist; a method that takes other arguments passes it. Here each method's parameters are
compared with ``inspect.signature``: the same names, kinds and order, a default where
the protocol has one; an implementation may add parameters only with defaults."""

import inspect
from typing import Any, List


def _members(protocol: type) -> List[str]:
    names = []
    for klass in protocol.__mro__:
        if klass is object or klass.__name__ in ("Protocol", "Generic"):
            continue
        names += [n for n in vars(klass) if not n.startswith("_") and n not in names]
        names += [n for n in getattr(klass, "__annotations__", {}) if not n.startswith("_") and n not in names]
    return names


def _parameters(fn: Any, unbound: bool) -> List[inspect.Parameter]:
    params = list(inspect.signature(fn).parameters.values())
    return params[1:] if unbound else params  # drop ``self``


def _signature_problems(name: str, declared: List[inspect.Parameter],
                        actual: List[inspect.Parameter]) -> List[str]:
    problems = []
    for i, want in enumerate(declared):
        if i >= len(actual):
            problems.append(f"{name}: parameter '{want.name}' missing")
            continue
        got = actual[i]
        if (got.name, got.kind) != (want.name, want.kind):
            problems.append(f"{name}: parameter {i} is {got.name} ({got.kind.name}), declared "
                            f"{want.name} ({want.kind.name})")
        elif want.default is not inspect.Parameter.empty and got.default != want.default:
            problems.append(f"{name}: '{want.name}' defaults to {got.default!r}, declared {want.default!r}")
    for extra in actual[len(declared):]:
        if extra.default is inspect.Parameter.empty and extra.kind not in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            problems.append(f"{name}: extra parameter '{extra.name}' has no default")
    return problems


def protocol_mismatches(obj: Any, protocol: type) -> List[str]:
    """What ``obj`` (an instance, or a class for its methods only) lacks or declares
    differently from ``protocol``; empty when it implements every member."""
    problems = []
    is_class = isinstance(obj, type)
    for name in _members(protocol):
        declared = inspect.getattr_static(protocol, name, None)
        if not callable(declared):  # an attribute
            if not is_class and not hasattr(obj, name):
                problems.append(f"attribute '{name}' missing")
            continue
        actual = getattr(obj, name, None)
        if not callable(actual):
            problems.append(f"method '{name}' missing")
            continue
        problems += _signature_problems(name, _parameters(declared, True), _parameters(actual, is_class))
    return problems
