"""The per-expert rows' benchmark (benchmarks/expert_norms.py) runs end to end in its smoke
mode, so that it cannot rot; its numbers are not asserted (ratios are measured, not tested)."""

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "expert_norms.py"


def test_expert_norms_benchmark_smoke_mode_prints_the_three_reads():
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line.strip() for line in proc.stdout.splitlines() if line.startswith("  ")]
    labels = [line.split(":")[0] for line in lines]
    assert labels == ["whole tensors", "with expert_norms", "with expert_norms and per_expert rows"], proc.stdout
    assert all(re.search(r": [0-9.]+ ms \([0-9.]+ x\)$", line) for line in lines), proc.stdout
