"""The analysis benchmark at a tiny size: its synthetic output holds a NaN, a spike and a
rank disagreement at known places, and both engines must find exactly those (the
benchmark exits 1 otherwise); its model-parallel output (TP 2 x PP 2 x DP 2, with
layout.json files) must merge, with each implementation, to the whole tensors' norms
with the one injected replica disagreement. Timings are printed, never asserted."""

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
    # anomalies: columnar, reference, on the Parquet export; merge: Polars and pure Python
    assert proc.stdout.count("| as injected |") == 5
    merge_rows = [line for line in proc.stdout.splitlines() if line.startswith("| merge |")]
    assert [line.split(" | ")[1] for line in merge_rows] == ["polars", "python"]
    assert all(line.endswith("| as injected |") for line in merge_rows)
    assert "8 ranks = TP 2 x PP 2 x DP 2" in proc.stdout  # the model-parallel run, with its layout.json files
    assert "OK: findings as injected" in proc.stdout
