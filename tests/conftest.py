"""Shared fixtures: tiny real models, config files, reading the CSV output."""

import csv
import json
import os
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch


class TinyMLP(torch.nn.Module):
    """Two linear layers and an in-place ReLU; deterministic weights from ``seed``."""

    def __init__(self, d_in: int = 6, d_hidden: int = 10, d_out: int = 3, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = torch.nn.Linear(d_in, d_hidden)
        self.act = torch.nn.ReLU(inplace=True)
        self.fc2 = torch.nn.Linear(d_hidden, d_out)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def make_batches(n: int, batch: int = 4, d_in: int = 6, d_out: int = 3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=g), torch.randn(batch, d_out, generator=g)) for _ in range(n)]


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


@pytest.fixture
def write_config(tmp_path: Path):
    """Write a config dict to a JSON file; ``output_dir`` defaults to ``tmp_path/out``."""

    def write(cfg: Dict[str, Any], name: str = "monitor_v2_config.json") -> str:
        cfg = dict(cfg)
        cfg.setdefault("output_dir", str(tmp_path / "out"))
        path = tmp_path / name
        path.write_text(json.dumps(cfg))
        return str(path)

    return write


def read_csv(path) -> List[Dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_rank_dir(out_dir, rank: int = 0) -> Dict[str, List[Dict[str, str]]]:
    """All CSV files of a rank directory: file name -> rows."""
    d = Path(out_dir) / f"rank_{rank}"
    return {p.name: read_csv(p) for p in sorted(d.glob("*.csv"))}


def rows_of(out_dir, monitor: str, rank: int = 0) -> List[Dict[str, str]]:
    """Every row a monitor wrote on a rank, in file order (files sorted by first step)."""
    d = Path(out_dir) / f"rank_{rank}"
    files = sorted(d.glob(f"{monitor}_step*.csv"), key=lambda p: int(p.name.split("step")[1].split("-")[0]))
    rows: List[Dict[str, str]] = []
    for p in files:
        rows.extend(read_csv(p))
    return rows


def find_row(rows, **match) -> Dict[str, str]:
    found = [r for r in rows if all(r[k] == str(v) for k, v in match.items())]
    assert len(found) == 1, f"expected exactly one row matching {match}, found {len(found)}"
    return found[0]


def numpy_stats(t: torch.Tensor) -> Dict[str, float]:
    """Independent reference: the five statistics with NumPy (fp64) on a copy."""
    import numpy as np

    a = t.detach().to(torch.float64).cpu().numpy().copy().ravel()
    if a.size == 0:
        return {"min": float("nan"), "max": float("nan"), "mean": float("nan"), "norm": 0.0, "nans": 0}
    return {
        "min": float(np.min(a)),
        "max": float(np.max(a)),
        "mean": float(np.mean(a)),
        "norm": float(np.sqrt(np.sum(a * a))),
        "nans": int(np.isnan(a).sum()),
    }


def assert_row_matches(row: Dict[str, str], expected: Dict[str, float], rtol: float = 1e-5, atol: float = 1e-7) -> None:
    import math

    for op, want in expected.items():
        if op not in row:
            continue
        got = float(row[op]) if op != "nans" else int(row[op])
        if isinstance(want, float) and math.isnan(want):
            assert math.isnan(got), f"{op}: expected nan, got {row[op]}"
        elif isinstance(want, float) and math.isinf(want):
            assert got == want, f"{op}: expected {want}, got {row[op]}"
        else:
            assert math.isclose(got, want, rel_tol=rtol, abs_tol=atol), f"{op}: expected {want}, got {row[op]} (row {row})"


# ----------------------------------------------------------------- torchrun launcher
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script, *args, nproc: int = 2, cwd=None, timeout: int = 240, env=None):
    """Run ``script`` under ``torchrun --nproc_per_node=nproc`` (gloo, CPU) and fail the
    test with every rank's output when any rank fails."""
    import subprocess
    import sys
    import tempfile

    log_dir = tempfile.mkdtemp(prefix="torchrun_logs_")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1", f"--master_port={_free_port()}", f"--log-dir={log_dir}",
        "--redirects=3", str(script), *map(str, args),
    ]
    # PYTHONFAULTHANDLER: a rank killed by a signal prints every thread's stack into its log.
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    full_env.pop("RANK", None)
    full_env.update(env or {})
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"torchrun timed out after {timeout}s: {' '.join(cmd)}\n{_rank_logs(log_dir)}\n{exc.stderr or ''}")
    if proc.returncode != 0:
        pytest.fail(
            f"torchrun failed (exit {proc.returncode}): {' '.join(cmd)}\n"
            f"--- launcher stderr (tail) ---\n{proc.stderr[-4000:]}\n{_rank_logs(log_dir)}"
        )
    return proc


def _rank_logs(log_dir: str) -> str:
    parts = []
    for path in sorted(Path(log_dir).rglob("std*.log")):
        text = path.read_text(errors="replace")
        if text.strip():
            parts.append(f"--- {path.relative_to(log_dir)} (tail) ---\n{text[-6000:]}")
    return "\n".join(parts) or "(no rank output)"


# -------------------------------------------------------------------- msrun launcher
def run_msrun(script, *args, nproc: int = 2, cwd=None, timeout: int = 240, env=None):
    """Run ``script`` under MindSpore's ``msrun`` with ``nproc`` local workers (CPU) and
    fail the test with every rank's log when the job fails.

    msrun starts the workers with the ``python`` found on ``PATH``, so the directory of
    this interpreter goes first on ``PATH``; each worker's output is in
    ``<log_dir>/worker_<i>.log``."""
    import shutil
    import signal
    import subprocess
    import sys
    import tempfile

    log_dir = tempfile.mkdtemp(prefix="msrun_logs_")
    bin_dir = os.path.dirname(sys.executable)
    msrun = shutil.which("msrun", path=bin_dir) or shutil.which("msrun")
    if msrun is None:
        pytest.skip("msrun (MindSpore) is not installed")
    cmd = [
        msrun, f"--worker_num={nproc}", f"--local_worker_num={nproc}", "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}", f"--log_dir={log_dir}", "--join=True", "--cluster_time_out=90",
        str(script), *map(str, args),
    ]
    # PYTHONFAULTHANDLER: a rank killed by a signal prints every thread's stack into its log.
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    full_env["PATH"] = bin_dir + os.pathsep + full_env.get("PATH", "")
    for var in ("RANK", "RANK_ID", "RANK_SIZE", "LOCAL_RANK", "WORLD_SIZE"):
        full_env.pop(var, None)
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # msrun and the workers it started (its own session)
        stdout, stderr = proc.communicate()
        pytest.fail(f"msrun timed out after {timeout}s: {' '.join(cmd)}\n{_msrun_logs(log_dir)}\n{stderr[-4000:]}")
    if proc.returncode != 0:  # msrun --join=True exits non-zero when a worker fails
        pytest.fail(
            f"msrun failed (exit {proc.returncode}): {' '.join(cmd)}\n"
            f"--- launcher output (tail) ---\n{stdout[-2000:]}\n{stderr[-2000:]}\n{_msrun_logs(log_dir)}"
        )
    return proc


def _msrun_logs(log_dir: str) -> str:
    parts = []
    for path in sorted(Path(log_dir).glob("*.log")):
        lines = path.read_text(errors="replace").splitlines()
        # MindSpore's INFO/WARNING lines drown the Python output: keep the rest, then the tail
        kept = [ln for ln in lines if not ln.startswith(("[INFO]", "[WARNING]"))]
        text = "\n".join(kept[-150:])
        if text.strip():
            parts.append(f"--- {path.name} (tail, without MindSpore INFO/WARNING lines) ---\n{text[-6000:]}")
    return "\n".join(parts) or "(no rank output)"
