"""Multi-process launchers: ``torchrun`` (gloo, CPU) and MindSpore's ``msrun``.

Both put ``tests/`` first on the workers' ``PYTHONPATH``, so that a worker script imports
``support`` (models, rows, ``finish()``) without editing ``sys.path``."""

import os
from pathlib import Path

import pytest

from support.extras import require_command

TESTS = str(Path(__file__).resolve().parent.parent)  # the directory that holds ``support``


def worker_env() -> dict:
    """The environment of a launched job: this one, one OpenMP thread, unbuffered output,
    ``PYTHONFAULTHANDLER`` (a rank killed by a signal prints every thread's stack into its
    log) and ``tests/`` first on ``PYTHONPATH``."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, full_env.get("PYTHONPATH", "")) if p)
    return full_env


# ----------------------------------------------------------------- torchrun launcher
def free_port() -> int:
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
        "--master_addr=127.0.0.1", f"--master_port={free_port()}", f"--log-dir={log_dir}",
        "--redirects=3", str(script), *map(str, args),
    ]
    full_env = worker_env()
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
    msrun = shutil.which("msrun", path=bin_dir) or require_command("msrun", "MindSpore's launcher starts these workers")
    cmd = [
        msrun, f"--worker_num={nproc}", f"--local_worker_num={nproc}", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}", f"--log_dir={log_dir}", "--join=True", "--cluster_time_out=90",
        str(script), *map(str, args),
    ]
    full_env = worker_env()
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
