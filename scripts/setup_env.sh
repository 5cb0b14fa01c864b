#!/usr/bin/env bash
# Creates ./.venv (once) and installs what a profile needs, then this package (editable).
#   bash scripts/setup_env.sh demo   torch (CPU wheel, pinned), numpy<2, polars, matplotlib
#   bash scripts/setup_env.sh test   + MindSpore 2.10 (CPU; an 800 MB download the first
#                                    time, 2.5 GB on disk; the whole .venv ends near 5.5 GB),
#                                    pytest, transformers 5 with its hub kernels and TRL
#                                    (tests build models from a config or save and load
#                                    them locally, no download), TorchTitan 0.3.0 with
#                                    triton (its real Trainer runs on the CPU in a test),
#                                    matplotlib, and Debian's chromium
#                                    (the HTML report is checked in a headless browser),
#                                    deepspeed 0.19.8 (its tests run it on the CPU),
#                                    megatron-core 0.16.1 (likewise, through a test-only shim),
#                                    accelerate and lightning (integration tests, CPU),
#                                    and Debian's valgrind (the instruction-count benchmark)
# Both profiles install polars (the analysis engine of msprobe-monitor summary/anomalies)
# and matplotlib (plot): the demo ends with those commands.
# Both profiles install gcc where no C compiler exists, and python3-dev where Debian's
# interpreter lacks Python.h: the monitor builds its one-pass statistics kernel with them;
# and g++ where no C++ compiler exists: the module monitor's graph hooks are built with it.
# numpy stays <2: MindSpore's C++ is built against NumPy 1.x.
#
# torch: a torch the interpreter already has is reused, not downloaded again (demo: any
# 2.x >= 2.1; test: 2.13, the version the suite is pinned to): .venv is then created with
# --system-site-packages. MSPROBE_REUSE_TORCH=0 installs the pinned torch instead.
# Otherwise torch==2.13.0 comes from pip's indexes. On Linux x86-64, plain PyPI has only
# the CUDA build (2.7 GB with the CUDA 13 libraries); the script says so before the
# download starts, and MSPROBE_TORCH_INDEX=https://download.pytorch.org/whl/cpu installs
# the CPU build (about 190 MB) from that index instead. Nothing else ever leaves pip's
# configured indexes. Downloads of a first run (measured: sizes of the wheels pip picks):
# demo about 300 MB with the CPU torch (2.8 GB with the CUDA one), test about 1.2 GB
# (3.7 GB).
# Every step is announced before it runs: what, why, how big, about how long.
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${1:-test}
PY=${PYTHON:-python3}
say() { echo "setup_env: $*"; }
# pip's own progress ("Collecting", "Downloading", "Installing"), minus the noise; never
# a silent minute
pip_quiet() {
  .venv/bin/python -m pip install --disable-pip-version-check --progress-bar off "$@" 2>&1 \
    | grep --line-buffered -v -E -e "is ignored|^Requirement already satisfied|^ *Using cached|^Looking in|^Processing " \
        -e "^Obtaining|^  (Installing build|Checking if|Getting requirements|Preparing|Building|Created wheel|Stored in)" \
        -e "^Building wheels|^Successfully built|^ *(Attempting uninstall|Found existing|Uninstalling|Successfully uninstalled)" \
    || true
}
# torch_ok PYTHON: prints "VERSION PATH" of PYTHON's torch when it fits the profile
torch_ok() {
  "$1" -c 'import sys, torch
v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
ok = v == (2, 13) if sys.argv[1] == "test" else (2, 1) <= v < (3, 0)
print(torch.__version__, torch.__file__) if ok else sys.exit(1)' "$profile" 2>/dev/null | tail -n 1
}
if [ ! -x .venv/bin/python ]; then
  found=""
  if [ "${MSPROBE_REUSE_TORCH:-1}" != 0 ]; then
    found=$(torch_ok "$PY" || true)
  fi
  if [ -n "$found" ]; then
    say "reusing torch ${found%% *} that $PY already has (${found#* }): .venv is created with" \
        "--system-site-packages and downloads no torch (MSPROBE_REUSE_TORCH=0 installs the pinned torch 2.13.0 instead)"
    "$PY" -m venv --system-site-packages .venv
  else
    say "creating .venv with $PY (a few seconds)..."
    "$PY" -m venv .venv
  fi
fi
base=("torch==2.13.0" "numpy<2" "polars==2.1.0" "matplotlib>=3.5")
deps=("${base[@]}")
check="import torch, numpy, polars, matplotlib, msprobe.core.monitor_v2.trainer"
if [ "$profile" = test ]; then
  # transformers 5 (what users install; its hub `kernels` come with it) and TRL on top of it;
  # TorchTitan 0.3.0's own requirements and triton (TorchTitan imports triton unconditionally;
  # the CPU torch wheel does not bring it). TorchTitan itself installs below without its
  # datasets<4.8 pin: datasets 4.7 needs huggingface-hub<2, transformers 5.25 >=2.4, and the
  # tests feed TorchTitan random tokens (its datasets loader is never used).
  titan="torchtitan==0.3.0"
  deps+=("mindspore==2.10.0" "pytest>=7" "transformers==5.25.0" "kernels==0.19.1" "trl==1.16.0"
        "triton==3.7.1" "torchdata>=0.8.0" "torch_checkpointing>=0.1.0" "tyro" "einops" "spmd_types==0.2.3"
        "hypothesis>=6.100"
        "deepspeed==0.19.8" "megatron-core==0.16.1" "accelerate==1.16.0" "lightning==2.6.6"
        "tensorboard==2.21.0" "wandb==0.31.0" "mlflow==3.17.2")
  # SwanLab 0.10.3 pins protobuf<7 and MindSpore 2.10 protobuf>=7.34.1, so pip refuses
  # both in one environment; SwanLab runs (offline, as its test does) with protobuf 7:
  # its other requirements join the test profile, and SwanLab itself installs without them.
  swanlab="swanlab==0.10.3"
  deps+=("click" "nvidia-ml-py" "orjson" "platformdirs>=4.2.0" "psutil>=5.0.0" "pwinput>=1.0.3"
         "pydantic-settings>=2.8.1" "pydantic~=2.0" "pyecharts>=2.0.0" "pyroaring>=1.0.0,<1.0.4" "pyyaml"
         "requests>=2.28.0" "rich>=13.6.0" "setuptools" "urllib3>=1.26.0" "watchdog" "wrapt>=1.17.0")
  check="$check, mindspore, pytest, transformers, kernels, trl, torchtitan, triton, hypothesis, deepspeed, megatron.core, accelerate, lightning, tensorboard, wandb, mlflow, swanlab"
fi
stamp=.venv/.msprobe-installed-$profile
want="${deps[*]} ${swanlab:-} ${titan:-} $(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # Sizes measured on Linux x86-64, Python 3.11; times on a 2-core machine with a fast
  # link (a step whose packages are already there takes seconds).
  t0=$SECONDS
  have=$(torch_ok .venv/bin/python || true)
  rest=("${base[@]:1}")
  build=cpu
  if [ -n "$have" ]; then
    say "torch ${have%% *} is already there (${have#* }): no torch download"
  elif [ -n "${MSPROBE_TORCH_INDEX:-}" ]; then
    say "installing torch 2.13.0 from MSPROBE_TORCH_INDEX=$MSPROBE_TORCH_INDEX (the CPU build from" \
        "download.pytorch.org/whl/cpu is about 190 MB, 750 MB on disk; about a minute)..."
    pip_quiet --index-url "$MSPROBE_TORCH_INDEX" "${base[0]}"
  else
    say "asking pip which torch 2.13.0 build it would install (a dry run, about 10 s)..."
    report=$(.venv/bin/python -m pip install --disable-pip-version-check --dry-run --no-deps --ignore-installed \
             --quiet --report - "${base[0]}" 2>/dev/null || true)
    if printf '%s' "$report" | grep -qE '"(nvidia-[a-z0-9-]+|cuda-toolkit)[=<>~ ;\[]'; then
      build=cuda
      say "NOTE: pip's indexes offer only the CUDA build of torch 2.13.0 here (plain PyPI on Linux x86-64):" \
          "about 2.7 GB to download (2.2 GB of it the CUDA 13 libraries, cuDNN, NCCL and triton), several GB on disk," \
          "several minutes. The monitor and its tests need only the CPU build (about 190 MB): to get it, stop now" \
          "(Ctrl-C) and run: MSPROBE_TORCH_INDEX=https://download.pytorch.org/whl/cpu bash scripts/setup_env.sh $profile"
    fi
    rest=("${base[@]}")
  fi
  if [ "${rest[0]}" = "${base[0]}" ] && [ "$build" = cuda ]; then
    say "installing torch 2.13 (the CUDA build: about 2.7 GB, see the note above) and numpy, with polars and" \
        "matplotlib for reading the results, into .venv (2.8 GB download in all; several minutes)..."
  elif [ "${rest[0]}" = "${base[0]}" ]; then
    say "installing torch 2.13 (CPU) and numpy, with polars and matplotlib for reading the results, into .venv" \
        "(about 300 MB download where pip has the CPU build, 1.3 GB on disk; about 20 s, longer on a slow link)..."
  else
    say "installing ${rest[*]} into .venv (about 110 MB download, seconds where already there; about 10 s)..."
  fi
  pip_quiet "${rest[@]}"
  if [ "${#deps[@]}" -gt "${#base[@]}" ]; then
    say "installing the test profile: MindSpore 2.10 (CPU, about 800 MB download, 2.5 GB on disk)" \
        "and ${deps[*]:$((${#base[@]} + 1))} (together about 900 MB to download; .venv ends near 5.5 GB;" \
        "about 1.5 min on a fast link)..."
    pip_quiet "${deps[@]}"
    say "installing $swanlab without its protobuf<7 pin (MindSpore needs protobuf 7; a 1 MB download, seconds)..."
    pip_quiet --no-deps "$swanlab"
    say "installing $titan without its datasets<4.8 pin (transformers 5 needs a newer huggingface-hub; a 1 MB" \
        "download, seconds)..."
    pip_quiet --no-deps "$titan"
  fi
  say "installing msprobe-monitor itself (editable, no download, a few seconds)..."
  pip_quiet --no-deps -e .
  DS_ACCELERATOR=cpu PYTHONWARNINGS=ignore .venv/bin/python -c "$check"
  echo "$want" > "$stamp"
  say ".venv ready in $((SECONDS - t0)) s ($(du -sh .venv 2>/dev/null | cut -f1) on disk)"
fi
# apt_install PACKAGE SIZE WHY: installs a Debian package when running as root (saying so
# first), or says how.
apt_install() {
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Debian's $1 with apt-get (running as root): $3; $2, about a minute..."
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null) \
      || echo "setup_env: could not install $1; $3" >&2
  else
    echo "setup_env: $1 is missing (sudo apt-get install $1); $3" >&2
  fi
}
if ! command -v cc >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1; then
  apt_install gcc "about 40 MB with the packages it needs" \
    "the monitor's one-pass statistics kernel is built with it (without it, statistics are about 3x slower and its tests fail)"
fi
if ! command -v c++ >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1 && ! command -v clang++ >/dev/null 2>&1; then
  apt_install g++ "about 20 MB with the packages it needs" \
    "the module monitor's graph hooks are built with it against torch's headers (without it, torch's Python API: the same rows at a higher cost per module call, and their tests fail)"
fi
# Python's headers: the kernel is built as a CPython extension with them (faster calls, rows
# formatted in C); without them the ctypes build is used. Only Debian's own interpreter
# gets them from apt (python3-dev); another one (pyenv, conda) ships its own.
if ! .venv/bin/python -c "import os, sysconfig; raise SystemExit(not os.path.isfile(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" 2>/dev/null; then
  if .venv/bin/python -c "import sys; raise SystemExit(not sys.base_prefix == '/usr')" 2>/dev/null; then
    apt_install python3-dev "about 30 MB with the packages it needs" \
      "the monitor builds its statistics kernel as a Python extension with Python's headers (without them: the ctypes build, the same numbers at a higher cost per tensor, and the extension's tests fail)"
  else
    echo "setup_env: this interpreter has no Python.h; the monitor uses the ctypes build of its kernel (the extension's tests fail)" >&2
  fi
fi
if [ "$profile" = test ] && ! command -v chromium >/dev/null 2>&1; then
  apt_install chromium "an 81 MB package plus the libraries it needs on a minimal system" \
    "the HTML report test opens the report in a headless browser"
fi
if [ "$profile" = test ] && { ! command -v valgrind >/dev/null 2>&1 || [ ! -f /usr/include/valgrind/callgrind.h ]; }; then
  apt_install valgrind "about 70 MB" \
    "the instruction-count benchmark (benchmarks/deep_instructions.py) and its smoke test run under callgrind"
fi
