"""Nothing lost silently (issue 20): an interrupted drain, a forked child.

Each scenario is a real training process (``drain_and_fork_worker.py``): a real SIGINT
(KeyboardInterrupt) in the main thread while ``stop()`` waits for the async writer's
backlog, and a real ``os.fork()`` of a training process whose child trains. The files
are read back with the CLI's reader.
"""

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from msprobe.core.monitor_v2.analysis.reader import FILE_RE, CsvFile, Problems, iter_rows

WORKER = Path(__file__).with_name("drain_and_fork_worker.py")
ROWS_PER_STEP = 8  # weight_grad of TinyMLP: fc1/fc2 weight and bias, unreduced and reduced


def run(scenario, out):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, str(WORKER), scenario, str(out)], capture_output=True, text=True,
                          timeout=240, env=env)
    return proc


def rows_by_step(out):
    """Row keys per step of every weight_grad file, read with the CLI's reader (no problem allowed)."""
    steps = collections.defaultdict(list)
    for p in sorted((out / "rank_0").glob("*.csv")):
        m = FILE_RE.match(p.name)
        f = CsvFile(0, "weight_grad", int(m.group("a")), int(m.group("b")), str(p))
        for row in iter_rows(f, Problems(strict=True)):
            steps[row.step].append((row.name, row.scope, row.micro))
    return steps


@pytest.mark.parametrize("scenario", ["again", "exit"])
def test_an_interrupted_stop_finishes_the_drain_later(tmp_path, scenario):
    proc = run(scenario, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr
    assert "STOP INTERRUPTED" in err and "END OF PROGRAM" in err, err[-3000:]
    said = [line for line in err.splitlines() if "stop() was interrupted" in line]
    assert len(said) == 1 and "call stop() again" in said[0], said
    queued = int(re.search(r"while (\d+) step\(s\) \((\d+) row", said[0]).group(1))
    assert 0 < queued < 60
    steps = rows_by_step(tmp_path / "out")
    assert sorted(steps) == list(range(60))
    assert all(len(keys) == ROWS_PER_STEP == len(set(keys)) for keys in steps.values())
    assert "were lost" not in err and "lost:" not in err
    if scenario == "again":
        assert "STOP AGAIN RETURNED" in err
        assert "stopped after 60 steps, 60 written" in err


def test_an_exit_drain_interrupted_too_counts_the_loss_exactly(tmp_path):
    proc = run("exit-interrupted", tmp_path / "out")
    err = proc.stderr
    assert "STOP INTERRUPTED" in err and "END OF PROGRAM" in err, err[-3000:]
    lost = [line for line in err.splitlines() if "of output were lost" in line]
    assert len(lost) == 1, err[-3000:]
    m = re.search(r"(\d+) step\(s\) of output were lost \((\d+) row\(s\)\)", lost[0])
    lost_steps, lost_rows = int(m.group(1)), int(m.group(2))
    steps = rows_by_step(tmp_path / "out")
    written = sum(len(k) for k in steps.values())
    assert lost_steps > 0 and lost_rows == ROWS_PER_STEP * lost_steps
    assert len(steps) + lost_steps == 60 and written + lost_rows == 60 * ROWS_PER_STEP
    # the lost steps are the last ones (the queue is written in order), and named
    first_lost = 60 - lost_steps
    assert sorted(steps) == list(range(first_lost))
    assert (f"steps {first_lost}-59" in lost[0]) if lost_steps > 1 else (f"steps {first_lost}." in lost[0])


@pytest.mark.parametrize("scenario", ["fork-sync", "fork-async"])
def test_a_forked_child_that_trains_writes_nothing(tmp_path, scenario):
    proc = run(scenario, tmp_path / "out")
    err = proc.stderr
    assert proc.returncode == 0 and "CHILD_STATUS 0" in err, err[-3000:]
    child = re.search(r"CHILD (\d+) done", err).group(1)
    said = [line for line in err.splitlines() if "forked from the training process" in line]
    assert len(said) == 1 and said[0].startswith(f"{child} WARNING"), said
    assert "records and writes nothing" in said[0]
    steps = rows_by_step(tmp_path / "out")
    assert sorted(steps) == list(range(6))  # the parent's 6 steps, once each
    assert all(len(keys) == ROWS_PER_STEP == len(set(keys)) for keys in steps.values()), steps
    ends = [line for line in err.splitlines() if "stopped after" in line]
    assert len(ends) == 1 and "stopped after 6 steps, 6 written" in ends[0] and not ends[0].startswith(child), ends
    assert "were lost" not in err and "lost:" not in err
