"""The alternating-window loop shared by the overhead benchmarks.

Every round times one window of training steps without the monitor and one with it, on
the same model and optimizer; the order flips every round, so that a slow drift of the
machine (clocks, caches, other work) weighs on both sides alike. A round's ratio is
time(with) / time(without).

    from alternating import alternate
    result = alternate(bench.window, lambda: bench.busy, rounds=7, steps_per_window=3)
    result.median, result.min, result.max, result.busy_ms

Each window calls ``settle()`` right before its clock starts, on both sides.
"""

import gc
import statistics
from dataclasses import dataclass, field
from typing import Callable, List, Sequence, Union

Seconds = Union[float, Sequence[float]]


@dataclass
class Alternation:
    """The per-round numbers of one alternating run."""

    ratios: List[float] = field(default_factory=list)  # wall time with / without
    # Further measures a window may return after the wall time (e.g. the process's CPU
    # time), as ratios with / without, one list per measure.
    more_ratios: List[List[float]] = field(default_factory=list)
    busy: List[float] = field(default_factory=list)  # the monitor's own code / wall time without
    plain: List[float] = field(default_factory=list)  # seconds per step without the monitor

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def min(self) -> float:
        return min(self.ratios)

    @property
    def max(self) -> float:
        return max(self.ratios)

    @property
    def busy_median(self) -> float:
        return statistics.median(self.busy)

    @property
    def plain_median(self) -> float:
        return statistics.median(self.plain)

    @property
    def busy_ms(self) -> float:
        """Milliseconds per step spent in the monitor's own code (timed inside it: the
        direct part of the overhead, without the machine's run-to-run noise)."""
        return self.busy_median * self.plain_median * 1e3


def settle() -> None:
    """A full collection of Python's garbage, outside the timed part of a window.

    Starting and stopping a monitor between windows makes and frees tens of thousands of
    objects; the full collection they trigger sooner or later costs about 150 ms in a
    process that has imported torch (350,000 objects on the development machine), as
    long as three steps of the small models here, and lands in whichever window comes
    next, with or without the monitor. Collected before each window, on both sides, that
    debt is paid outside the clocks. What the monitor's own steady-state garbage costs
    (the collections its objects cause during training) still falls inside them, but a
    window starts from an empty young generation: a long run's rare full collection is
    under-counted, and is measured apart (docs/performance.md)."""
    gc.collect()


def _as_tuple(seconds: Seconds) -> Sequence[float]:
    return (seconds,) if isinstance(seconds, (int, float)) else tuple(seconds)


def alternate(window: Callable[[bool], Seconds], busy: Callable[[], float], rounds: int,
              steps_per_window: int) -> Alternation:
    """Run ``rounds`` rounds of ``window(False)`` and ``window(True)`` (monitor off, on),
    the order flipped every round.

    ``window(monitored)`` trains ``steps_per_window`` steps and returns their wall time in
    seconds, or a sequence whose first item is the wall time and whose others are further
    measures; ``busy()``, read after each round, is the monitor's own seconds in the
    round's monitored window."""
    result = Alternation()
    for r in range(rounds):
        times = {}
        for monitored in ((False, True) if r % 2 == 0 else (True, False)):
            times[monitored] = _as_tuple(window(monitored))
        on, off = times[True], times[False]
        result.ratios.append(on[0] / off[0])
        for k in range(1, len(off)):
            if len(result.more_ratios) < k:
                result.more_ratios.append([])
            result.more_ratios[k - 1].append(on[k] / off[k])
        result.busy.append(busy() / off[0])
        result.plain.append(off[0] / steps_per_window)
    return result
