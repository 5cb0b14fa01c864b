"""Which training steps are written, and into which file window.

The schedule is a pure function of the step number, so the decision for step ``s``
is known before its forward pass starts and hooks can skip all work on other steps.
"""

from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class StepSchedule:
    """Step selection of the spec.

    A step ``s`` is written iff ``start_step <= s < stop_step``,
    ``(s - start_step) % step_interval == 0`` and fewer than ``collect_times`` steps
    were written before it. ``None`` means "no bound" for ``stop_step`` and
    ``collect_times``.
    """

    start_step: int = 0
    stop_step: Optional[int] = None
    step_interval: int = 1
    step_count_per_record: int = 1
    collect_times: Optional[int] = None

    @property
    def effective_stop_step(self) -> Optional[int]:
        """First step never written, combining ``stop_step`` and ``collect_times``."""
        bounds = []
        if self.stop_step is not None:
            bounds.append(self.stop_step)
        if self.collect_times is not None:
            bounds.append(self.start_step + self.collect_times * self.step_interval)
        return min(bounds) if bounds else None

    def is_written(self, step: int) -> bool:
        if step < self.start_step:
            return False
        stop = self.effective_stop_step
        if stop is not None and step >= stop:
            return False
        return (step - self.start_step) % self.step_interval == 0

    def window(self, step: int) -> Tuple[int, int]:
        """``(a, b)`` of the file ``<monitor>_step<a>-<b>.csv`` that holds ``step``."""
        n = self.step_count_per_record
        a = self.start_step + ((step - self.start_step) // n) * n
        return a, a + n - 1

    def is_finished(self, step: int) -> bool:
        """True when no step ``>= step`` will ever be written."""
        stop = self.effective_stop_step
        return stop is not None and step >= stop
