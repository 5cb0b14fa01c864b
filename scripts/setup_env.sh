#!/usr/bin/env bash
# Creates ./.venv (once) and installs what a profile needs, then this package (editable).
#   bash scripts/setup_env.sh demo   torch (CPU wheel, pinned), numpy<2, polars, matplotlib
#   bash scripts/setup_env.sh test   + MindSpore 2.10 (CPU; an 800 MB download the first
#                                    time, 2.5 GB on disk; the whole .venv ends near 4.4 GB),
#                                    pytest, transformers (tests build models from a
#                                    config, no download), matplotlib, and Debian's chromium
#                                    (the HTML report is checked in a headless browser),
#                                    deepspeed 0.19.8 (its tests run it on the CPU),
#                                    megatron-core 0.16.1 (likewise, through a test-only shim),
#                                    accelerate and lightning (integration tests, CPU)
# Both profiles install polars (the analysis engine of msprobe-monitor summary/anomalies)
# and matplotlib (plot): the demo ends with those commands.
# Both profiles install gcc where no C compiler exists: the monitor builds its one-pass
# statistics kernel with it.
# numpy stays <2: MindSpore's C++ is built against NumPy 1.x.
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${1:-test}
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
base=("torch==2.13.0" "numpy<2" "polars==2.1.0" "matplotlib>=3.5")
deps=("${base[@]}")
check="import torch, numpy, polars, matplotlib, msprobe.core.monitor_v2.trainer"
if [ "$profile" = test ]; then
  deps+=("mindspore==2.10.0" "pytest>=7" "transformers>=4.40,<5" "hypothesis>=6.100"
        "deepspeed==0.19.8" "megatron-core==0.16.1" "accelerate==1.15.0" "lightning==2.6.6" "tensorboard==2.21.0" "wandb==0.31.0" "mlflow==3.17.2")
  check="$check, mindspore, pytest, transformers, hypothesis, deepspeed, megatron.core, accelerate, lightning, tensorboard, wandb, mlflow"
fi
stamp=.venv/.msprobe-installed-$profile
want="${deps[*]} $(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # Say what is installed and how big before each step (sizes measured on Linux x86-64,
  # Python 3.11; a step whose packages are already there takes seconds).
  t0=$SECONDS
  echo "setup_env: installing torch 2.13 (CPU) and numpy, with polars and matplotlib for reading" \
       "the results, into .venv (about 270 MB download, 1.3 GB on disk)..."
  .venv/bin/python -m pip install -q --disable-pip-version-check "${base[@]}" 2>&1 | grep -v "is ignored" || true
  if [ "${#deps[@]}" -gt "${#base[@]}" ]; then
    echo "setup_env: installing the test profile: MindSpore 2.10 (CPU, about 800 MB download, 2.5 GB on disk)" \
         "and ${deps[*]:$((${#base[@]} + 1))} (together about 1 GB to download; .venv ends near 4.4 GB)..."
    .venv/bin/python -m pip install -q --disable-pip-version-check "${deps[@]}" 2>&1 | grep -v "is ignored" || true
  fi
  echo "setup_env: installing msprobe-monitor itself (editable, no download)..."
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e . 2>&1 | grep -v "is ignored" || true
  DS_ACCELERATOR=cpu PYTHONWARNINGS=ignore .venv/bin/python -c "$check"
  echo "$want" > "$stamp"
  echo "setup_env: .venv ready in $((SECONDS - t0)) s ($(du -sh .venv 2>/dev/null | cut -f1) on disk)"
fi
# apt_install PACKAGE WHY: installs a Debian package when running as root, or says how.
apt_install() {
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null) \
      || echo "setup_env: could not install $1; $2" >&2
  else
    echo "setup_env: $1 is missing (sudo apt-get install $1); $2" >&2
  fi
}
if ! command -v cc >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1; then
  apt_install gcc "the monitor's one-pass statistics kernel is built with it (without it, statistics are about 3x slower and its tests fail)"
fi
if [ "$profile" = test ] && ! command -v chromium >/dev/null 2>&1; then
  apt_install chromium "the HTML report test needs it"
fi
