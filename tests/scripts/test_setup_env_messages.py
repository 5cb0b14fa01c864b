"""scripts/setup_env.sh says what it installs, and how big, before every pip step, for
both profiles (run for real, with a stand-in interpreter in .venv that records its
calls instead of downloading anything)."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAKE_PYTHON = """#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "PIP $*"; fi
exit 0
"""


@pytest.mark.parametrize("profile", ["demo", "test"])
def test_every_pip_step_is_announced_with_its_size(tmp_path, profile):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup_env.sh", repo / "scripts")
    shutil.copy(ROOT / "pyproject.toml", repo)
    python = repo / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    tools = tmp_path / "bin"  # present, so that nothing is installed with apt-get
    tools.mkdir()
    for name in ("cc", "chromium"):
        (tools / name).write_text("#!/bin/sh\n")
        (tools / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "scripts/setup_env.sh", profile], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    pip_steps = [i for i, line in enumerate(lines) if line.startswith("PIP ")]
    assert len(pip_steps) == (3 if profile == "test" else 2), lines
    for i in pip_steps:
        assert i > 0 and lines[i - 1].startswith("setup_env: installing "), lines
    announced = "\n".join(lines[i - 1] for i in pip_steps)
    assert "torch 2.13 (CPU) and numpy" in announced and "MB download" in announced
    assert ("MindSpore 2.10" in announced and "GB on disk" in announced) == (profile == "test")
    assert lines[-1].startswith("setup_env: .venv ready in ")
    # a second run finds everything installed and says nothing
    again = subprocess.run(["bash", "scripts/setup_env.sh", profile], cwd=repo, env=env, capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 0 and again.stdout == ""
