"""The DeepSpeed overhead benchmark runs end to end in its smoke mode (tiny GPT, one
round, 2 ranks), so that it cannot rot; its numbers are not asserted."""

import os
import subprocess
import sys
from pathlib import Path

from support import free_port
from support.extras import require

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "overhead_deepspeed.py"

require("deepspeed", "the DeepSpeed overhead benchmark's smoke mode runs ZeRO on 2 CPU ranks", load=False)


def test_deepspeed_overhead_benchmark_smoke_mode_prints_its_row(tmp_path):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(BENCH), "--smoke"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ZeRO-1 fp32, gas 2")]
    assert len(rows) == 1, proc.stdout[-3000:]
    assert float(rows[0].split("|")[2]) > 0
