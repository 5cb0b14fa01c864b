"""The MindSpore per-tensor benchmark (benchmarks/ms_record_many.py) runs end to end in its
smoke mode (8 blocks, one round), so that it cannot rot; its numbers are not asserted
(ratios are measured, not tested)."""

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "ms_record_many.py"


def test_ms_record_many_benchmark_smoke_mode_reports_every_monitor_and_the_engine():
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    for monitor in ("weight_grad", "param", "optimizer"):
        line = next(l for l in lines if l.strip().startswith(monitor))
        assert "current / reference" in line and "step ratio" in line, line
    for tensors in ("parameters", "gradients", "moments"):
        line = next(l for l in lines if l.strip().startswith(tensors))
        assert float(line.split("current / reference")[1].split()[0]) > 0, line
