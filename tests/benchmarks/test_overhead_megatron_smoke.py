"""The Megatron-Core overhead benchmark runs end to end in its smoke mode (tiny GPTModel,
one round, 2 ranks), so that it cannot rot; its numbers are not asserted."""

import os
import subprocess
import sys
from pathlib import Path

from support import free_port
from support.extras import require

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "megatron_overhead.py"

require("megatron.core", "the Megatron-Core overhead benchmark's smoke mode runs its GPT on 2 CPU ranks", load=False)


def test_megatron_overhead_benchmark_smoke_mode_prints_its_rows(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(BENCH), "--smoke"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in ("weight_grad (accumulated)", "weight_grad (monitor_mbs_grad)"):
        rows = [line for line in proc.stdout.splitlines() if line.startswith(name)]
        assert len(rows) == 1, proc.stdout[-3000:]
        assert float(rows[0].split("median")[1].split()[0]) > 0
