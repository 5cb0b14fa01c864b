"""Exceptions raised by Monitor V2.

Every error a user can cause (a bad config, a wrong argument to ``start()``) is a
``MonitorError``; configuration errors name the offending field, its value and what is
allowed, so that they can be fixed without reading the source.
"""


class MonitorError(Exception):
    """Base class of every error raised by msprobe-monitor."""


class ConfigError(MonitorError, ValueError):
    """The configuration (file, dict or ``start()`` context) is invalid.

    ``field`` is the dotted path of the offending field (``monitors.weight_grad.ops``),
    or ``None`` when the error concerns the config as a whole.
    """

    def __init__(self, message: str, field: "str | None" = None) -> None:
        self.field = field
        super().__init__(message)


class MonitorStateError(MonitorError, RuntimeError):
    """The monitor was used in a way its lifecycle does not allow (e.g. ``start()`` twice)."""


class OutputError(MonitorError, OSError):
    """The output directory cannot be used when monitoring starts (e.g. a file stands
    where ``<output_dir>/rank_<r>`` should be). Raised by ``start()``; once training
    runs, output problems are logged and counted instead, never raised."""


class MissingDependencyError(MonitorError, ImportError):
    """An optional integration was used without the library it integrates with; the
    message names the package to install."""


class UnsafePathError(OutputError):
    """A path this package would write (or read a config from) is refused because using
    it would be unsafe on a shared machine: a symbolic link, a FIFO or device, a directory
    another user owns or can write. ``why`` says which, ``path`` names it."""

    def __init__(self, message: str, path: str, why: str = "") -> None:
        super().__init__(message)
        self.strerror = message
        self.filename = path
        self.path = path
        self.why = why or message

    def __str__(self) -> str:
        return self.strerror
