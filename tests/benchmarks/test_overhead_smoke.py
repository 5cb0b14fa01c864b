"""The overhead benchmark runs end to end in its smoke mode (tiny sizes, one round), so
that it cannot rot; its numbers are not asserted (ratios are measured, not tested)."""

import re
import subprocess

import pytest
import sys
from pathlib import Path

from support.extras import require


BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "overhead.py"


@pytest.mark.parametrize("flags, statistics", [
    ([], "one-pass C kernel"),
    (["--no-native"], "ATen reductions only (--no-native)"),
], ids=["native", "aten"])
def test_overhead_benchmark_smoke_mode_prints_every_config(flags, statistics):
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", *flags], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"CPU statistics: {statistics}" in proc.stdout
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "config" not in line]
    names = [line.split("|")[1].strip() for line in table]
    assert names == ["weight_grad", "optimizer", "param", "module (2 layers)", "module (every module)",
                     "all monitors", "all, step outside window", "all, step_interval 4"]
    for line in table:
        ratio = float(line.split("|")[2])
        assert ratio > 0
    assert re.search(r"statistics engine, \d+ tensors, .* ratio \d+\.\d+", proc.stdout)


def test_overhead_benchmark_smoke_mode_with_sinks():
    for lib in ("tensorboard", "wandb", "mlflow"):
        require(lib, "the overhead benchmark's --sinks rows write to the TensorBoard, W&B and MLflow sinks", load=False)
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--sinks", "--only", "all monitors", "--only",
                           "all +", "--skip-engine"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "config" not in line]
    assert [line.split("|")[1].strip() for line in table] == [
        "all monitors", "all + tensorboard sink", "all + wandb sink", "all + mlflow sink",
        "all + tensorboard, wandb, mlflow sinks"]
    assert "sink failed" not in proc.stderr, proc.stderr[-4000:]
