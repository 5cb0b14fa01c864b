"""The main job's demo (examples/train_gpt.py) with its fault-injection flags: the analysis
finds the injected NaN at the chosen step and layer (a small model, so that it is quick)."""

import subprocess
import sys
from pathlib import Path

from analysis_helpers import cli
from support.extras import needs_polars

DEMO = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
TINY = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--vocab", "64", "--context", "16", "--batch", "4",
        "--steps", "6", "--step-interval", "1", "--log-every", "100"]


def run_demo(*args):
    return subprocess.run([sys.executable, str(DEMO), *TINY, *map(str, args)], capture_output=True, text=True,
                          timeout=180, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})


@needs_polars
def test_demo_injected_nan_is_found(tmp_path):
    out = tmp_path / "demo"
    proc = run_demo("--out", out, "--inject-nan-step", 3, "--inject-nan-layer", "blocks.1.mlp.fc",
                    "--inject-nan-micro", 1)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fault injection: blocks.1.mlp.fc output x NaN at step 3, micro-batch 1" in proc.stdout
    res = cli("anomalies", out, "--json")
    assert res.code == 1
    first = res.json()["nonfinite"]["first"]
    assert (first["step"], first["monitor"], first["scope"], first["tensor"]) == \
        (3, "module", "forward", "blocks.1.mlp.fc.output.0")
    summary = cli("summary", out)
    assert "first NaN/Inf:     rank 0, step 3, forward: blocks.1.mlp.fc.output.0" in summary.out


def test_demo_injection_layer_is_checked(tmp_path):
    proc = run_demo("--out", tmp_path / "d", "--inject-nan-step", 3, "--inject-nan-layer", "nope")
    assert proc.returncode == 2 and "no such module" in proc.stderr
