"""The alternating-window loop of the overhead benchmarks (benchmarks/alternating.py):
the order of the two windows flips every round, and each round's numbers are the ones
its own two windows measured."""

import importlib.util
import statistics
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[2] / "benchmarks" / "alternating.py"


def load_harness():
    # benchmarks/ is a folder of scripts, not a package: load the module by its path.
    spec = importlib.util.spec_from_file_location("alternating", HARNESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("rounds", [1, 4, 5])
def test_windows_alternate_and_each_round_divides_its_own_windows(rounds):
    alternating = load_harness()
    calls = []
    wall = {False: [2.0, 4.0, 8.0, 10.0, 6.0], True: [3.0, 5.0, 12.0, 11.0, 9.0]}
    own = [0.5, 1.0, 2.0, 1.5, 3.0]

    def window(monitored):
        calls.append(monitored)
        return wall[monitored][len([c for c in calls if c == monitored]) - 1]

    result = alternating.alternate(window, lambda: own[len(calls) // 2 - 1], rounds, steps_per_window=4)
    assert calls == [m for r in range(rounds) for m in ((False, True) if r % 2 == 0 else (True, False))]
    ratios = [wall[True][r] / wall[False][r] for r in range(rounds)]
    assert result.ratios == ratios
    assert result.busy == [own[r] / wall[False][r] for r in range(rounds)]
    assert result.plain == [wall[False][r] / 4 for r in range(rounds)]
    assert (result.median, result.min, result.max) == (statistics.median(ratios), min(ratios), max(ratios))
    assert result.busy_ms == pytest.approx(statistics.median(result.busy) * statistics.median(result.plain) * 1e3)
    assert result.more_ratios == []


def test_further_measures_of_a_window_come_back_as_their_own_ratios():
    alternating = load_harness()
    times = iter([(1.0, 0.5), (2.0, 1.5), (4.0, 3.0), (2.0, 1.0)])  # round 0: off, on; round 1: on, off
    result = alternating.alternate(lambda monitored: next(times), lambda: 0.0, 2, steps_per_window=1)
    assert result.ratios == [2.0, 2.0]
    assert result.more_ratios == [[3.0, 3.0]]
    assert result.plain == [1.0, 2.0]
