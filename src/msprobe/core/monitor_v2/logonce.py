"""Messages said once: what cannot be observed is said at the first occasion, not at
every step (a hook runs thousands of times).

A :class:`LogOnce` belongs to whatever decides what "once" means: a monitor or a writer
(once per run), an adapter (once per key), the process (:func:`warn_once`, for what
outlives a monitor, such as compiled code).
"""

import logging
from typing import Any, Hashable, Set

logger = logging.getLogger("msprobe.monitor_v2")


class LogOnce:
    """The keys already said. ``warning(key, msg, *args)`` (and ``info``, ``error``) logs
    ``msg % args`` the first time ``key`` is given and returns True; later calls with the
    same key log nothing and return False. ``first(key)`` only marks the key, for a site
    that does more than one log call the first time."""

    __slots__ = ("_said",)

    def __init__(self) -> None:
        # No lock: a forked child must never wait on a lock held at the fork, and two
        # threads meeting a new key at the same instant at worst say it twice.
        self._said: Set[Hashable] = set()

    def first(self, key: Hashable = None) -> bool:
        """True the first time ``key`` is given (and marks it), False after."""
        if key in self._said:
            return False
        self._said.add(key)
        return True

    def __contains__(self, key: Hashable) -> bool:
        return key in self._said

    def _log(self, level: int, key: Hashable, msg: str, args: Any, stacklevel: int) -> bool:
        if not self.first(key):
            return False
        # the record names the line that asked for the message, not this module
        logger.log(level, msg, *args, stacklevel=stacklevel)
        return True

    def log(self, level: int, key: Hashable, msg: str, *args: Any) -> bool:
        return self._log(level, key, msg, args, 3)

    def warning(self, key: Hashable, msg: str, *args: Any) -> bool:
        return self._log(logging.WARNING, key, msg, args, 3)

    def info(self, key: Hashable, msg: str, *args: Any) -> bool:
        return self._log(logging.INFO, key, msg, args, 3)

    def error(self, key: Hashable, msg: str, *args: Any) -> bool:
        return self._log(logging.ERROR, key, msg, args, 3)


_PROCESS = LogOnce()


def warn_once(key: Hashable, msg: str, *args: Any) -> bool:
    """Warn once per process and key: for what outlives one monitor (compiled code, a
    module-level limit)."""
    return _PROCESS._log(logging.WARNING, key, msg, args, 3)


def log_once(level: int, key: Hashable, msg: str, *args: Any) -> bool:
    """``warn_once`` at another level."""
    return _PROCESS._log(level, key, msg, args, 3)
