"""The per-tensor-cost benchmark (benchmarks/deep_overhead.py) runs end to end in its
smoke mode (a 40-tensor model, one round of two-step windows), so that it cannot rot;
its numbers are not asserted (ratios are measured, not tested)."""

import gc
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "deep_overhead.py"


def test_deep_overhead_benchmark_smoke_mode_prints_every_config_and_writes_json(tmp_path):
    out = tmp_path / "deep.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = [line.split("|") for line in proc.stdout.splitlines() if line.startswith("| ") and "config" not in line]
    assert [(cells[1].strip(), cells[2].strip()) for cells in table] == [
        ("40", "weight_grad"), ("40", "all"), ("40", "all, step outside window")]
    for cells in table:
        assert float(cells[3]) > 0
        assert float(cells[5]) > 0  # the ratio of the steps after a window's first (two steps a window)
        assert float(cells[6]) > 0  # the CPU-time ratio
        assert cells[9].strip().endswith(" us")
        assert cells[10].strip().endswith(" us")  # the monitor's time per tensor after a window's first step
        plain_gc, monitored_gc = cells[11].strip().removesuffix(" ms").split(" -> ")  # the collector's time a step
        assert float(plain_gc) >= 0 and float(monitored_gc) >= 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["config"] for row in rows] == ["weight_grad", "all", "all, step outside window"]
    assert all(row["tensors"] == 40 and row["own_us_per_tensor"] >= 0 for row in rows)
    assert all(row["later_median"] > 0 and row["later_us_per_tensor"] >= 0 for row in rows)
    assert all(row["gc_plain_ms"] >= 0 and row["gc_monitored_ms"] >= 0 for row in rows)


def test_the_garbage_collector_clock_counts_the_collections_inside_its_block_only():
    sys.path.insert(0, str(BENCH.parent))
    try:
        from deep_overhead import GcClock
    finally:
        sys.path.remove(str(BENCH.parent))
    with GcClock() as clock:
        gc.collect()
    inside = clock.seconds
    assert inside > 0
    gc.collect()  # after the block: not counted, and the callback is gone
    assert clock.seconds == inside and clock._callback not in gc.callbacks


def test_deep_overhead_under_ddp_trains_the_model_wrapped_in_a_one_process_group(tmp_path):
    out = tmp_path / "deep.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--ddp", "--only", "weight_grad", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "under DDP, " in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["ddp"] == "default"
    assert [(row["tensors"], row["config"]) for row in doc["rows"]] == [(40, "weight_grad")]
    assert doc["rows"][0]["median"] > 0
