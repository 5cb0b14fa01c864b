"""scripts/setup_env.sh says what it installs, and how big, before every step (pip and
apt-get), for both profiles; it reuses a torch the interpreter already has, and says
before the download when pip would fetch the multi-GB CUDA build (run for real, with
stand-in interpreters and tools that record their calls instead of downloading or
installing anything)."""

import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A stand-in interpreter: records pip and venv calls; answers the torch probe with
# $FAKE_TORCH ("VERSION PATH", none when empty) and pip's dry run with a report naming
# the CUDA libraries when $FAKE_TORCH_BUILD is "cuda".
FAKE_PYTHON = r"""#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "PIP $*"
  case "$*" in *--dry-run*)
    if [ "$FAKE_TORCH_BUILD" = cuda ]; then
      echo '{"install": [{"metadata": {"name": "torch", "version": "2.13.0", "requires_dist": ["nvidia-cudnn-cu13==9.20.0.48; platform_system == \"Linux\""]}}]}'
    else
      echo '{"install": [{"metadata": {"name": "torch", "version": "2.13.0+cpu", "requires_dist": ["filelock"]}}]}'
    fi;;
  esac
  exit 0
fi
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  echo "VENV $*"
  for last in "$@"; do :; done
  mkdir -p "$last/bin" && cp "$0" "$last/bin/python"
  exit 0
fi
if [ "$1" = "-c" ]; then
  case "$2" in *torch.__version__*) [ -n "$FAKE_TORCH" ] && echo "$FAKE_TORCH" && exit 0; exit 1;; esac
fi
exit 0
"""


def _exe(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _repo(tmp_path: Path, with_venv: bool = True) -> Path:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup_env.sh", repo / "scripts")
    shutil.copy(ROOT / "pyproject.toml", repo)
    if with_venv:
        _exe(repo / ".venv" / "bin" / "python", FAKE_PYTHON)
    return repo


def _tools(tmp_path: Path, names=("cc", "chromium")) -> Path:
    tools = tmp_path / "bin"  # present, so that nothing is installed with apt-get
    tools.mkdir(exist_ok=True)
    for name in names:
        _exe(tools / name, "#!/bin/sh\n")
    return tools


def _run(repo: Path, profile: str, tools: Path, extra: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}", "FAKE_TORCH": "", "FAKE_TORCH_BUILD": "",
           **(extra or {})}
    env.pop("MSPROBE_TORCH_INDEX", None)
    env.pop("MSPROBE_REUSE_TORCH", None)
    env.update(extra or {})
    return subprocess.run(["bash", "scripts/setup_env.sh", profile], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=60)


def _installs(lines: List[str]) -> List[int]:
    return [i for i, line in enumerate(lines) if line.startswith("PIP ") and "--dry-run" not in line]


@pytest.mark.parametrize("profile", ["demo", "test"])
def test_every_pip_step_is_announced_with_its_size(tmp_path, profile):
    repo = _repo(tmp_path)
    tools = _tools(tmp_path)
    proc = _run(repo, profile, tools)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    pip_steps = [i for i, line in enumerate(lines) if line.startswith("PIP ")]
    # test: + SwanLab without its protobuf pin and TorchTitan without its datasets pin, each announced
    assert len(_installs(lines)) == (5 if profile == "test" else 2)
    assert len(pip_steps) == len(_installs(lines))
    # the dry run that finds which torch build pip picks (its report is read, not shown) is announced first
    assert lines[0] == "setup_env: asking pip which torch 2.13.0 build it would install (a dry run, about 10 s)..."
    for i in pip_steps:
        assert i > 0 and lines[i - 1].startswith("setup_env: "), lines
    for i in _installs(lines):
        assert lines[i - 1].startswith("setup_env: installing "), lines
        assert "--progress-bar off" in lines[i] and " -q " not in lines[i]  # pip's progress shows
    announced = "\n".join(lines[i - 1] for i in _installs(lines))
    assert "torch 2.13 (CPU) and numpy" in announced and "MB download" in announced
    assert ("MindSpore 2.10" in announced and "GB on disk" in announced) == (profile == "test")
    assert ("torchtitan==0.3.0 without its datasets<4.8 pin" in announced) == (profile == "test")
    assert "about 20 s" in announced and ("about 1.5 min" in announced) == (profile == "test")
    assert "CUDA" not in proc.stdout  # pip's indexes have the CPU build here
    assert lines[-1].startswith("setup_env: .venv ready in ")
    # a second run finds everything installed and says nothing
    again = _run(repo, profile, tools)
    assert again.returncode == 0 and again.stdout == ""


def test_cuda_build_is_announced_before_the_download_with_the_cpu_alternative(tmp_path):
    repo = _repo(tmp_path)
    proc = _run(repo, "demo", _tools(tmp_path), {"FAKE_TORCH_BUILD": "cuda"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    (note,) = [i for i, line in enumerate(lines) if "only the CUDA build" in line]
    first_install = _installs(lines)[0]
    assert note < first_install and "torch==2.13.0" in lines[first_install]
    assert "the CUDA build" in lines[first_install - 1] and "(CPU)" not in lines[first_install - 1]
    assert "2.7 GB to download" in lines[note]
    assert "MSPROBE_TORCH_INDEX=https://download.pytorch.org/whl/cpu bash scripts/setup_env.sh demo" in lines[note]


def test_cpu_index_installs_torch_from_it_and_nothing_else(tmp_path):
    repo = _repo(tmp_path)
    index = "https://download.pytorch.org/whl/cpu"
    proc = _run(repo, "demo", _tools(tmp_path), {"MSPROBE_TORCH_INDEX": index})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    installs = [lines[i] for i in _installs(lines)]
    assert f"--index-url {index} torch==2.13.0" in installs[0]
    assert all("--index-url" not in line and "torch==" not in line for line in installs[1:]), installs
    assert not any("asking pip which torch" in line for line in lines)  # no dry run: the index decides


def test_a_torch_the_interpreter_has_is_reused(tmp_path):
    repo = _repo(tmp_path, with_venv=False)
    system = _exe(tmp_path / "sys" / "python3", FAKE_PYTHON)
    proc = _run(repo, "demo", _tools(tmp_path), {"PYTHON": str(system), "FAKE_TORCH": "2.5.1 /usr/lib/torch/__init__.py"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    (venv,) = [line for line in lines if line.startswith("VENV ")]
    assert "--system-site-packages" in venv
    assert any(line.startswith("setup_env: reusing torch 2.5.1 that ") and "MSPROBE_REUSE_TORCH=0" in line
               for line in lines), lines
    installs = [lines[i] for i in _installs(lines)]
    assert installs and not any("torch==" in line for line in installs), installs
    # the test profile is pinned to 2.13: a 2.5 is not reused there
    repo2 = tmp_path / "other"
    shutil.copytree(repo, repo2, ignore=shutil.ignore_patterns(".venv"))
    proc = _run(repo2, "test", _tools(tmp_path), {"PYTHON": str(system), "FAKE_TORCH": ""})
    lines = proc.stdout.splitlines()
    assert "--system-site-packages" not in "\n".join(lines) and any("torch==2.13.0" in lines[i] for i in _installs(lines))
    # and reuse can be turned off
    repo3 = tmp_path / "third"
    shutil.copytree(repo2, repo3, ignore=shutil.ignore_patterns(".venv"))
    proc = _run(repo3, "demo", _tools(tmp_path), {"PYTHON": str(system), "MSPROBE_REUSE_TORCH": "0",
                                                    "FAKE_TORCH": "2.5.1 /usr/lib/torch/__init__.py"})
    (venv,) = [line for line in proc.stdout.splitlines() if line.startswith("VENV ")]
    assert "--system-site-packages" not in venv


def _shell_basics(tmp_path: Path) -> Path:
    """A directory of links to the commands the script needs from the system, and nothing
    else: a PATH made of it and the stand-in tools lacks what the test leaves out."""
    basics = tmp_path / "basics"
    basics.mkdir()
    for name in ("bash", "sh", "cat", "cut", "sha1sum", "du", "grep", "id", "tail", "mkdir", "cp", "dirname"):
        real = shutil.which(name)
        assert real, name
        os.symlink(real, basics / name)
    return basics


def _run_as_root_with_apt(tmp_path, present):
    """setup_env.sh's test profile as root, with a stand-in apt-get that records its calls
    (``APT <args>`` lines), the tools ``present`` and the shell's basics alone on the PATH;
    ``(lines of its output, where the APT lines are)``."""
    if os.geteuid() != 0:
        pytest.skip("the apt-get path runs only as root; as another user the script only says how")
    repo = _repo(tmp_path)
    tools = _tools(tmp_path, names=present)
    _exe(tools / "apt-get", '#!/bin/sh\necho "APT $*"\n')
    basics = _shell_basics(tmp_path)
    proc = _run(repo, "test", tools, {"PATH": f"{tools}{os.pathsep}{basics}"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    return lines, [i for i, line in enumerate(lines) if line.startswith("APT ")]


def test_apt_get_is_announced_before_it_runs(tmp_path):
    """As root with apt-get and without chromium: the announcement comes first (what, why,
    how big), then apt-get (a stand-in that records its calls)."""
    lines, apt = _run_as_root_with_apt(tmp_path, ("cc", "c++"))  # compilers there: chromium is the one to install
    assert apt, lines
    announce = [i for i, line in enumerate(lines) if line.startswith("setup_env: installing Debian's chromium with apt-get")]
    assert announce and announce[0] < apt[0], lines
    assert "headless browser" in lines[announce[0]] and "81 MB" in lines[announce[0]]


def test_a_missing_cpp_compiler_is_announced_before_apt_get_installs_it(tmp_path):
    """As root with apt-get and without c++, g++ or clang++: g++ is announced (why: the
    module monitor's graph hooks), then installed."""
    lines, apt = _run_as_root_with_apt(tmp_path, ("cc", "chromium"))  # the install's own output is hidden
    announce = [i for i, line in enumerate(lines) if line.startswith("setup_env: installing Debian's g++ with apt-get")]
    assert announce and apt and announce[0] < apt[0], lines
    assert "graph hooks" in lines[announce[0]]
