"""What every monitor looks like to the trainer, whatever the framework.

The trainer drives monitors through a small lifecycle:

``attach()`` once (install hooks), then for every step ``begin_step(step, active)``,
``before_optimizer_step()`` / ``after_optimizer_step()`` around the optimizer's update,
and ``collect()`` when the step ends; ``detach()`` once at ``stop()``. A monitor does no
work in its hooks when ``active`` is false.
"""

import functools
import logging
from typing import Any, Callable, ClassVar, List, Mapping, Set

from .config import MonitorSettings
from .stats import Record

logger = logging.getLogger("msprobe.monitor_v2")


class ContainedErrors:
    """Runs hook bodies so that an exception is logged once per site and never reaches
    the training code (non-negotiable: the monitor never breaks training)."""

    def __init__(self) -> None:
        self._reported: Set[str] = set()
        self.count = 0

    def report(self, site: str, exc: BaseException) -> None:
        self.count += 1
        if site not in self._reported:
            self._reported.add(site)
            logger.error(
                "monitor_v2: error in %s, contained (training goes on; later errors at this site "
                "are not logged again): %r", site, exc, exc_info=exc,
            )

    def wrap(self, site: str, fn: Callable[..., Any]) -> Callable[..., None]:
        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> None:
            try:
                fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - containment is the point
                self.report(site, exc)
            return None  # a hook that returns a value could replace a tensor

        return guarded


class Monitor:
    """Base of all monitors; subclasses set ``name`` and override the hooks they need."""

    name: ClassVar[str] = ""
    with_micro_step: ClassVar[bool] = False
    needs_optimizer: ClassVar[bool] = False

    def __init__(self, settings: MonitorSettings, session: Any, errors: ContainedErrors) -> None:
        self.settings = settings
        self.session = session
        self.errors = errors
        self.active = False
        self.step = 0

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

    def collect(self) -> List[Record]:
        """Records of the current step (device vectors); resets the step's state."""
        return []

    def detach(self) -> None:
        """Remove everything ``attach()`` installed. Called once by ``stop()``."""


def remove_all(handles: List[Any]) -> None:
    while handles:
        handles.pop().remove()
