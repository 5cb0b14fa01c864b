"""Every command the tool prints runs as printed, in the environment that printed it
(issue 26, items 2 and 3): a training script started as ``.venv/bin/python train.py``
(venv not activated, so ``msprobe-monitor`` is not on PATH) is told the full path; the
end-of-run line counts what reached the disk and offers no command when nothing did.

Each case runs a real training script in a subprocess with a PATH that lacks the venv's
``bin``, then runs the printed command through ``sh`` with that same environment."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from support.extras import needs_polars, require_command

SRC = str(Path(__file__).resolve().parents[2] / "src")
BARE_PATH = "/usr/bin:/bin"  # no venv bin directory on it

SCRIPT = """
import sys, torch
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
mon = TrainerMonitorV2({"output_dir": sys.argv[1], "start_step": int(sys.argv[2]),
                        "monitors": {"weight_grad": {"enabled": True}}})
mon.start(model=model, optimizer=opt)
for _ in range(4):
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
mon.stop()
"""


def _env(path: str = BARE_PATH) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "PATH": path, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}


def _train(python: str, out: Path, env: dict, start_step: int = 0) -> str:
    """The end-of-run line of a real 4-step run."""
    proc = subprocess.run([python, "-c", SCRIPT, str(out), str(start_step)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if "stopped after" in ln]
    return line


def _run_printed(command: str, env: dict) -> subprocess.CompletedProcess:
    """Run a printed command the way a user pastes it: a shell without PYTHONPATH (the
    command carries what it needs) and with the same PATH."""
    shell_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    return subprocess.run(["sh", "-c", command], env=shell_env, capture_output=True, text=True, timeout=300)


def _csv_rows(rank_dir: Path) -> int:
    return sum(len(f.read_text().splitlines()) - 1 for f in rank_dir.glob("*.csv"))


@needs_polars  # the printed summary and anomalies commands run
def test_commands_printed_without_an_activated_venv_run_as_printed(tmp_path):
    out = tmp_path / "my out"  # a space: the printed path must be quoted
    env = _env()
    assert shutil.which("msprobe-monitor", path=env["PATH"]) is None
    line = _train(sys.executable, out, env)
    rows = _csv_rows(out / "rank_0")
    assert rows == 4 * 4 * 2  # 4 steps x 4 parameters x (unreduced, reduced)
    assert f"stopped after 4 steps; wrote {rows} rows of 4 step(s) to {out / 'rank_0'}" in line
    command = line.split("Read them: ", 1)[1]
    assert not command.startswith("msprobe-monitor ")  # not on this PATH: it would be "command not found"
    summary = _run_printed(command, env)
    assert summary.returncode == 0, (command, summary.stderr)
    assert "Collected:" in summary.stdout and f"{rows} rows" in summary.stdout
    # summary's own hint runs as well
    (details,) = [ln for ln in summary.stdout.splitlines() if ln.startswith("Details: ")]
    anomalies = _run_printed(details[len("Details: "):], env)
    assert anomalies.returncode in (0, 1), (details, anomalies.stderr)  # 1: anomalies found, by design
    assert anomalies.stdout.startswith("msprobe-monitor anomalies ")


@needs_polars
def test_bare_name_when_path_finds_this_installation(tmp_path):
    bindir = os.path.dirname(sys.executable)
    require_command("msprobe-monitor", f"this test needs the script next to {sys.executable}", bindir)
    env = _env(f"{bindir}:{BARE_PATH}")
    line = _train(sys.executable, tmp_path / "out", env)
    command = line.split("Read them: ", 1)[1]
    assert re.match(r"(PYTHONPATH=\S+ )?msprobe-monitor summary ", command), command
    assert _run_printed(command, env).returncode == 0


@needs_polars
def test_module_form_where_the_environment_has_no_script(tmp_path):
    """An interpreter with the packages but no ``msprobe-monitor`` script next to it (the
    package used from a checkout): ``python -m msprobe.core.monitor_v2.analysis``."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    real_prefix = Path(sys.prefix)
    shutil.copy(real_prefix / "pyvenv.cfg", venv / "pyvenv.cfg")
    (venv / "lib").symlink_to(real_prefix / "lib")
    python = venv / "bin" / "python"
    python.symlink_to(os.path.realpath(sys.executable))
    env = _env()
    line = _train(str(python), tmp_path / "out", env)
    command = line.split("Read them: ", 1)[1]
    assert f"{python} -m msprobe.core.monitor_v2.analysis summary " in command, command
    res = _run_printed(command, env)
    assert res.returncode == 0, (command, res.stderr)


def test_nothing_written_says_so_and_offers_no_command(tmp_path):
    out = tmp_path / "out"
    line = _train(sys.executable, out, _env(), start_step=100)  # the window is never reached
    assert f"stopped after 4 steps; wrote no rows to {out / 'rank_0'}: see the warning above" in line
    assert "Read them" not in line and "summary" not in line
