"""What every monitor looks like to the trainer, whatever the framework.

The trainer drives monitors through a small lifecycle:

``attach()`` once (install hooks), then for every step ``begin_step(step, active)``,
``before_optimizer_step()`` / ``after_optimizer_step()`` around the optimizer's update,
and ``collect()`` when the step ends; ``detach()`` once at ``stop()``. A monitor does no
work in its hooks when ``active`` is false.
"""

import logging
import os
import traceback
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Callable, ClassVar, List, Mapping, Optional, Sequence, Tuple

from . import native, rows
from .checks import Fields, at_least, check_bool, check_str_list
from .experts import CONFIG_FIELDS as EXPERT_FIELDS
from .backend import Session
from .logonce import LogOnce
# target_hits lives with the structure listing, which must not import the monitors
# (the back-end protocols name its Structure); both select modules with it.
from .model_structure import target_hits
from .param_table import Added
from .stats import Record

logger = logging.getLogger("msprobe.monitor_v2")

DEFAULT_EPS = 1e-8


@dataclass(frozen=True)
class MonitorSettings:
    """The validated entry ``monitors.<name>`` of the config. Defined here, not in
    ``config``: config collects the fields each monitor declares beside its code, so the
    monitors cannot import config."""

    name: str
    enabled: bool
    ops: Tuple[str, ...] = rows.DEFAULT_OPS
    eps: float = DEFAULT_EPS
    options: Mapping[str, Any] = field(default_factory=dict)
    # on for this many steps from the step the entry takes effect, then off (None: no end)
    steps: Optional[int] = None

    def get(self, key: str) -> Any:
        return self.options[key]


def short_error(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message (at file:line in function)``, the message cut
    at ``limit`` characters."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    more = len(text) > 1 or len(first) > limit
    message = f"{type(exc).__name__}: {first[:limit]}" if first else type(exc).__name__
    message += " [...]" if more else ""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    if frames:
        last = frames[-1]
        message += f" (at {os.path.basename(last.filename)}:{last.lineno} in {last.name})"
    return message


class ContainedErrors:
    """Runs hook bodies so that an exception is logged once per site and never reaches
    the training code (non-negotiable: the monitor never breaks training)."""

    def __init__(self) -> None:
        self._reported = LogOnce()
        self.count = 0
        # Wall time spent inside the monitor's hooks: the monitor's own cost, reported at
        # stop() and read by the benchmark (far less noisy than timing whole steps).
        self._busy = 0.0
        # The extension's clock (native BusyClock), where its hooks count their time: they
        # add to a C double, not to a Python attribute (two attribute calls and a float a
        # hook call); ``busy`` includes it.
        self.clock: Optional[Any] = None

    @property
    def busy(self) -> float:
        clock = self.clock
        return self._busy if clock is None else self._busy + clock.seconds

    @busy.setter
    def busy(self, value: float) -> None:
        clock = self.clock
        self._busy = value if clock is None else value - clock.seconds

    def report(self, site: str, exc: BaseException) -> None:
        self.count += 1
        if self._reported.first(site):
            # Short: some framework errors carry kilobytes (PyTorch's list of dispatch keys).
            # The whole error and its traceback go to the DEBUG level.
            logger.error(
                "monitor_v2: error in %s, contained (training goes on; later errors at this site "
                "are not logged again): %s", site, short_error(exc),
            )
            logger.debug("monitor_v2: the error in %s in full", site, exc_info=exc)

    def wrap(self, site: str, fn: Callable[..., Any]) -> Callable[..., None]:
        # No functools.wraps: the module monitor wraps new graph hooks on every written
        # step, and copying the metadata costs more than the rest of the wrapping.
        def guarded(*args: Any, **kwargs: Any) -> None:
            start = perf_counter()
            try:
                fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - containment is the point
                self.report(site, exc)
            self.busy += perf_counter() - start
            return None  # a hook that returns a value could replace a tensor

        return guarded


class ContainedHook:
    """A hook as one object, run the way :meth:`ContainedErrors.wrap` runs a function: it
    returns at once while its monitor is not active (a step that is not written costs one
    attribute read), an exception in :meth:`run` is logged once per site and never reaches
    the training code, and the time is counted in ``busy``. Hooks built for every module
    or parameter on every written step are these objects (with ``__slots__``) rather than a
    closure inside a wrapper: one object instead of several per hook, and one call fewer."""

    __slots__ = ("monitor", "site")

    def __init__(self, monitor: "Monitor", site: str) -> None:
        self.monitor = monitor
        self.site = site

    def __call__(self, *args: Any) -> None:
        monitor = self.monitor
        if not monitor.active:
            return None
        errors = monitor.errors
        start = perf_counter()
        try:
            self.run(*args)
        except Exception as exc:  # noqa: BLE001 - containment is the point
            errors.report(self.site, exc)
        errors.busy += perf_counter() - start
        return None  # a hook that returns a value could replace a tensor

    def run(self, *args: Any) -> None:
        raise NotImplementedError


class Monitor:
    """Base of all monitors; subclasses set ``name`` and override the hooks they need."""

    name: ClassVar[str] = ""
    needs_optimizer: ClassVar[bool] = False

    def __init__(self, settings: MonitorSettings, session: Session, errors: ContainedErrors) -> None:
        self.settings = settings
        self.session = session
        self.errors = errors
        self.active = False
        self.step = 0
        # steps from this one that will not be written, as the schedule says now (set by the
        # trainer before begin_step; 0 on a written step)
        self.idle_ahead = 0
        self._records: List[Record] = []  # what the hooks gathered during the current step

    @property
    def context(self) -> Mapping[str, Any]:
        return self.session.context

    def attach(self) -> None:
        """Install hooks. Called once by ``start()``."""

    def begin_step(self, step: int, active: bool) -> None:
        self.step = step
        self.active = active

    def before_optimizer_step(self) -> None:
        pass

    def after_optimizer_step(self) -> None:
        pass

    def on_added(self, added: Added) -> None:
        """Parameters or modules found after ``start()`` (``param_table.Added``), at the
        beginning of a written step, before ``begin_step``: observe them from this step
        on. Monitors that read the session's table at each step need nothing here."""

    def collect(self) -> List[Record]:
        """Records of the current step (device vectors); resets the step's state."""
        records, self._records = self._records, []
        return records

    def detach(self) -> None:
        """Remove everything ``attach()`` installed. Called once by ``stop()``."""


# ------------------------------------------------------------------------ module
# The module monitor's own config fields (config.py collects every monitor's).
MODULE_CONFIG_FIELDS: Fields = {"targets": (check_str_list, ())}


def module_tags(
    named: List[Tuple[int, str, Any]], qualify: Callable[[int, str], str]
) -> List[Tuple[int, str, Any]]:
    """``(vpp_stage, tag, module)`` of every module, each once, under the name its rows
    carry and ``targets`` are matched against (shared by ``select_modules`` and the
    structure listing, so that both always agree).

    ``named`` is ``(vpp_stage, name, module)`` for every module of every chunk, in
    order; a module reachable under two names is taken once, under the first. The root
    (empty name) is named after its class."""
    tags, seen = [], set()
    for vpp, name, module in named:
        if id(module) in seen:
            continue
        seen.add(id(module))
        tags.append((vpp, qualify(vpp, name or type(module).__name__), module))
    return tags


def select_modules(
    named: List[Tuple[int, str, Any]], targets: Sequence[str], qualify: Callable[[int, str], str]
) -> List[Tuple[int, str, Any]]:
    """``(vpp_stage, tag, module)`` of the modules the ``targets`` select (every module
    for no targets; names as ``module_tags`` gives them). A target selects a module when
    it is a substring of the tag; targets that select nothing are logged once with
    example names.
    """
    selected, matched = [], set()
    for vpp, tag, module in module_tags(named, qualify):
        hits = target_hits(tag, targets)
        if targets and not hits:
            continue
        matched.update(hits)
        selected.append((vpp, tag, module))
    missing = [t for t in targets if t not in matched]
    if missing:
        examples = [qualify(vpp, name) for vpp, name, _ in named if name][:5]
        logger.warning("monitor_v2 module: targets %s match no module name; nothing is recorded for them. "
                       "Names look like %s (\"structure\": true lists them all in rank_<r>/structure.txt; "
                       "msprobe-monitor struct counts what targets select)", missing, examples)
    return selected


# ------------------------------------------------------------------- weight_grad
WEIGHT_GRAD_CONFIG_FIELDS: Fields = {
    "monitor_mbs_grad": (check_bool, False),
    "micro_batch_number": (at_least(1), None),
    "grad_acc_steps": (at_least(1), None),
    **EXPERT_FIELDS,
}


def weight_grad_rows(unreduced: Mapping[Tuple, Record], reduced: List[Record], passes: Mapping[int, int],
                     announced: int) -> List[Record]:
    """The weight_grad records of a step in file order: ``unreduced`` by (parameter,
    micro step, ...) key, then ``reduced``. Accumulated rows (micro step 0 in the key)
    and ``reduced`` rows carry the step's number of micro-batches: the most backward
    passes any parameter saw, or the announced number when none ran."""
    ext = native.extension()
    if ext is not None:  # the same list, ordered in C (about a tenth of the time for 1,000 parameters)
        records = ext.file_order(unreduced, reduced, passes, announced)
        if records is not None:
            return records
    return _weight_grad_rows(unreduced, reduced, passes, announced)


def _weight_grad_rows(unreduced: Mapping[Tuple, Record], reduced: List[Record], passes: Mapping[int, int],
                      announced: int) -> List[Record]:
    """``weight_grad_rows`` in Python."""
    micro = max(passes.values(), default=0) or announced
    keys = sorted(unreduced)  # the keys alone: no (key, record) pair built and compared
    records = list(map(unreduced.__getitem__, keys))
    for key, rec in zip(keys, records):
        if key[1] == 0:
            rec.micro_step = micro
    for rec in reduced:
        rec.micro_step = micro
    records += reduced
    return records
