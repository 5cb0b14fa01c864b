"""The analysis benchmark at a tiny size: its synthetic output holds a NaN, a spike and a
rank disagreement at known places, and both engines must find exactly those (the
benchmark exits 1 otherwise). Timings are printed, never asserted."""

import subprocess
import sys
from pathlib import Path

from support.extras import POLARS_ENGINE, require

require("polars", POLARS_ENGINE)

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "analysis_throughput.py"


def test_benchmark_smoke_finds_the_injected_anomalies(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--dir", str(tmp_path / "bench")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "findings of the two engines: identical" in proc.stdout
    assert proc.stdout.count("| as injected |") == 3  # anomalies: columnar, reference, on the Parquet export
    assert "OK: findings as injected" in proc.stdout
