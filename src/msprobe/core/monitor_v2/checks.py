"""The checks of config values: each takes the field's dotted path and its value, and
returns the parsed value or raises a ``ConfigError`` naming the field, the value and
what is allowed.

Shared by ``config`` and the monitors, which declare their own fields (``CONFIG_FIELDS``
beside each monitor's code) with these checkers: a module of its own, so that neither
has to import the other.
"""

import math
import re
import reprlib
from typing import Any, Callable, Dict, Mapping, Tuple

from .errors import ConfigError

# Step counts, ranks and micro-batch counts are int64 in every framework: a larger value
# is a typo (and one with thousands of digits cannot even be printed by Python's repr).
MAX_INT = 2**63 - 1
CODELINE_PATTERN = re.compile(r"^(?P<file>.+)\[(?P<line>[0-9]+)\]$")

# A checker: (dotted path, value) -> parsed value. A field: (checker, default).
Checker = Callable[[str, Any], Any]
Fields = Dict[str, Tuple[Checker, Any]]

_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxstring = 120
_SHORT_REPR.maxother = 120
_SHORT_REPR.maxlevel = 3


def describe(value: Any) -> str:
    """A short, always printable description of a config value (nested or huge values
    are cut: a message must never fail, nor fill a screen)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        return f"an integer of about {int(abs(value).bit_length() * math.log10(2)) + 1} digits (int)"
    try:
        text = _SHORT_REPR.repr(value)
    except (ValueError, RecursionError):  # e.g. a huge integer deep inside a list
        text = f"<{type(value).__name__}>"
    return f"{text} ({type(value).__name__})"


def fail(path: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(
        f"monitor_v2 config: field '{path}' = {describe(value)}: {allowed}", field=path
    )


def check_int(path: str, value: Any, minimum: int) -> int:
    # bool is a subclass of int; "true" is never a step count.
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_INT:
        raise fail(path, value, f"must be an integer >= {minimum} (at most {MAX_INT})")
    return value


def check_bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise fail(path, value, "must be true or false")
    return value


def check_positive_number(path: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(path, value, "must be a number > 0")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond the range of a float
        number = math.inf
    if not math.isfinite(number) or number <= 0:
        raise fail(path, value, "must be a finite number > 0")
    return number


def check_str_list(path: str, value: Any) -> Tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise fail(path, value, "must be a list of strings")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise fail(f"{path}[{i}]", item, "must be a string")
    return tuple(value)


def check_rank_list(path: str, value: Any) -> Tuple[int, ...]:
    """An int or a list of ints >= 0."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (check_int(path, value, 0),)
    if not isinstance(value, (list, tuple)):
        raise fail(path, value, "must be a rank (integer >= 0) or a list of ranks")
    return tuple(check_int(f"{path}[{i}]", r, 0) for i, r in enumerate(value))


def check_codelines(path: str, value: Any) -> Tuple[Tuple[str, int], ...]:
    lines = check_str_list(path, value)
    parsed = []
    for i, entry in enumerate(lines):
        match = CODELINE_PATTERN.match(entry.strip())
        if not match:
            raise fail(
                f"{path}[{i}]", entry, "must have the form 'file.py[line]', e.g. 'train.py[23]'"
            )
        if len(match.group("line")) > 18:
            raise fail(f"{path}[{i}]", entry, "has a line number too large to be a line of a file")
        parsed.append((match.group("file"), int(match.group("line"))))
    return tuple(parsed)


def check_keys(path: str, raw: Mapping) -> None:
    """Keys of a config object are strings (a dict config may hold anything)."""
    for key in raw:
        if not isinstance(key, str):
            where = f"'{path}'" if path else "the config"
            raise ConfigError(
                f"monitor_v2 config: {where} has the key {describe(key)}: keys must be strings "
                f"(field names)", field=path or None)


def at_least(minimum: int) -> Checker:
    """The checker of an integer field >= ``minimum``."""
    def check(path: str, value: Any) -> int:
        return check_int(path, value, minimum)
    return check
