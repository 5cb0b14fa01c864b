"""The MoE benchmark (benchmarks/moe_overhead.py) runs end to end in its smoke mode (a
one-layer Mixtral from a config, one round of two-step windows), so that it cannot rot;
its numbers are not asserted (ratios are measured, not tested)."""

import json
import subprocess
import sys
from pathlib import Path

from support.extras import require

require("transformers", "the MoE benchmark trains a transformers Mixtral built from a config", load=False)

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_overhead.py"


def test_moe_overhead_benchmark_smoke_mode(tmp_path):
    out = tmp_path / "moe.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--per-expert", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert any(line.startswith("| moe on/off |") for line in proc.stdout.splitlines())
    numbers = json.loads(out.read_text())
    assert numbers["ratio_median"] > 0 and numbers["plain_ms_per_step"] > 0 and numbers["monitor_ms_per_step"] >= 0
