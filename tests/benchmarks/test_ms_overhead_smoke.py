"""The MindSpore overhead benchmark runs end to end in its smoke mode (tiny sizes, one
round), so that it cannot rot; its numbers are not asserted (ratios are measured, not
tested)."""

import subprocess
import sys
from pathlib import Path

from support.extras import require

require("mindspore", "the MindSpore overhead benchmark's smoke mode trains with it")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "ms_overhead.py"


def test_ms_overhead_benchmark_smoke_mode_prints_every_config():
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "CPU statistics: " in proc.stdout
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "config" not in line]
    names = [line.split("|")[1].strip() for line in table]
    assert names == ["weight_grad", "optimizer", "param", "module (2 layers)", "module (every module)",
                     "all monitors", "all, step outside window", "all, step_interval 4"]
    for line in table:
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert float(cells[1]) > 0  # median ratio
        assert cells[5].endswith("%)") and "MiB" in cells[6]  # monitor code, memory
