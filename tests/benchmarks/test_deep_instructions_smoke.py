"""The instruction-count benchmark (benchmarks/deep_instructions.py) runs end to end in its
smoke mode (a 40-tensor model, all monitors, one counted step under Valgrind's callgrind),
so that it cannot rot. The counts are deterministic, but only their shape is asserted:
what a build costs is measured, not tested."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "deep_instructions.py"


def test_deep_instructions_benchmark_smoke_mode_counts_plain_and_monitored_steps(tmp_path):
    assert shutil.which("valgrind"), "valgrind is missing: scripts/setup_env.sh test installs it (Debian: valgrind)"
    out = tmp_path / "instructions.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = [line.split("|") for line in proc.stdout.splitlines() if line.startswith("| ") and "config" not in line]
    assert [(cells[1].strip(), cells[2].strip()) for cells in table] == [("40", "all")]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["tensors"], row["config"]) for row in rows] == [(40, "all")]
    row = rows[0]
    assert row["plain"] > 1e6 and row["monitored"] > row["plain"], "a training step is millions of instructions"
    assert abs(row["ratio"] - row["monitored"] / row["plain"]) < 1e-12
    assert abs(row["extra_per_tensor"] - (row["monitored"] - row["plain"]) / 40) < 1e-6


def test_per_monitor_configs_are_each_monitor_of_the_all_config_alone(tmp_path):
    sys.path.insert(0, str(BENCH.parent))
    try:
        import deep_instructions
        from deep_overhead import CONFIGS
    finally:
        sys.path.remove(str(BENCH.parent))
    from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

    alone = deep_instructions._monitor_configs()
    every = CONFIGS["all"]["monitors"]
    assert sorted(alone) == sorted(f"{name} alone" for name in every)
    for name, settings in every.items():
        config = alone[f"{name} alone"]
        assert config == {"monitors": {name: settings}}
        TrainerMonitorV2({**config, "output_dir": str(tmp_path / name)})  # a valid config: checked at construction
    args = deep_instructions.parse_args(["--per-monitor", "--only", "module alone"])
    assert args.per_monitor and args.only == ["module alone"]
