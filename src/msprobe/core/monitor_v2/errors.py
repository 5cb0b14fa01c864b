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


class ScalarError(MonitorError, ValueError):
    """``log_scalars()`` was given a step, a name or a value it cannot write (a name that
    is not a non-empty string of printable characters, a value that is neither a real
    number nor a one-element tensor). ``name`` is the offending scalar's name (None for
    the step)."""

    def __init__(self, message: str, name: "str | None" = None) -> None:
        self.name = name
        super().__init__(message)


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


class NonFiniteGradientError(MonitorError, FloatingPointError):
    """Raised from the optimizer pre-step hook with ``"alert": {"stop_on_nonfinite": true}``
    when a gradient the optimizer is about to apply holds a NaN or Inf: the update is not
    applied. ``step``, ``names`` (the non-finite gradients, in parameter order) and
    ``dump`` (the dump directory, or None) say what happened and where the evidence is."""

    def __init__(self, step: int, nonfinite: int, total: int, names: "list[str]", dump: "str | None") -> None:
        self.step = step
        self.names = list(names)
        self.dump = dump
        shown = ", ".join(self.names[:5]) + (f" and {len(self.names) - 5} more" if len(self.names) > 5 else "")
        where = f"; the tensors of this step before the update are in {dump}" if dump else \
            "; set \"alert\": {\"dump\": true} to keep the tensors of this step"
        super().__init__(
            f"monitor_v2: step {step}: {nonfinite} of {total} gradient(s) are non-finite before the optimizer step "
            f"(first: {shown}); the update was not applied (alert.stop_on_nonfinite){where}")
