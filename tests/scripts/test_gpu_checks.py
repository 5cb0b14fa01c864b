"""scripts/gpu_checks.sh runs as it is on a GPU machine without network access: it installs
nothing, uses the interpreter it is given (the machine's python3) with the checkout's src/ on
PYTHONPATH, builds the C kernel into a cache under its results, and ends with one table. Here
its dry mode (GPU_CHECKS_DRY=1) runs every command on the CPU at tiny sizes."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_checks.sh"


def _run(tmp_path: Path, python: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MSPROBE_MONITOR_CACHE_DIR", "VIRTUAL_ENV")}
    return subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True, timeout=3000,
                          env={**base, "GPU_CHECKS_DRY": "1", "PYTHON": python, "OUT": str(tmp_path / "out"), **env})


def test_the_script_parses_and_installs_nothing():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    commands = [line for line in SCRIPT.read_text().splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in commands if re.search(r"\bpip\b|\bvenv\b|setup_env|apt-get|conda ", line)]


def test_dry_mode_runs_every_part_from_the_checkout_and_prints_one_table_last(tmp_path):
    proc = _run(tmp_path, sys.executable)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    parts = dict(line.split("\t")[:2] for line in (out / "parts.tsv").read_text().splitlines())
    for part in ("environment", "no_sync_tests", "device_cost", "overhead_default", "deep_overhead",
                 "overhead_1b_bf16"):
        assert parts[part] == "ok", (part, (out / f"{part}.txt").read_text()[-3000:])
    assert "triton_kernel" in parts
    env = (out / "environment.txt").read_text()
    assert f"msprobe from {ROOT / 'src'}" in env
    assert f"C kernel: built in {out / 'cache'}" in env
    assert any((out / "cache").rglob("*.so"))  # built where the script said, not in a home directory
    # the no-sync tests ran (and skipped: no CUDA here)
    assert re.search(r"\d+ skipped", (out / "no_sync_tests.txt").read_text())
    # the last lines printed are the one table: every part, then the benchmarks' rows
    tail = proc.stdout.rstrip().splitlines()
    assert tail[-1].startswith("results in ")
    header = "| part | status | seconds | result |"
    start = len(tail) - 1 - tail[::-1].index(header)
    table = tail[start:-1]
    assert all(line.startswith("|") for line in table)
    names = [line.split("|")[1].strip() for line in table[2:]]
    assert {"environment", "device_cost", "overhead_default", "deep_overhead", "overhead_1b_bf16"} <= set(names)
    assert "weight_grad" in names and "40 tensors, weight_grad" in names
    assert "same, ATen fallback" in names
    assert (out / "summary.md").read_text().strip().splitlines()[-1] == table[-1]
    assert (out / "device_cost.json").exists()


def test_without_torch_it_says_so_and_stops(tmp_path):
    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S -I "$@"\n')  # no site-packages: no torch
    bare.chmod(0o755)
    proc = _run(tmp_path, str(bare))
    assert proc.returncode == 1
    assert "has no torch: nothing can run (this script installs nothing)" in proc.stdout
