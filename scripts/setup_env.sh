#!/usr/bin/env bash
# Creates ./.venv (once) and installs what a profile needs, then this package (editable).
#   bash scripts/setup_env.sh demo   torch (CPU wheel, pinned), numpy<2
#   bash scripts/setup_env.sh test   + MindSpore 2.10 (CPU; an 800 MB download the first
#                                    time), pytest, transformers (tests build models from a
#                                    config, no download), matplotlib, polars (the analysis
#                                    engine), and Debian's chromium
#                                    (the HTML report is checked in a headless browser)
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
deps=("torch==2.13.0" "numpy<2")
check="import torch, numpy, msprobe.core.monitor_v2.trainer"
if [ "$profile" = test ]; then
  deps+=("mindspore==2.10.0" "pytest>=7" "transformers>=4.40,<5" "matplotlib>=3.5" "polars==2.1.0")
  check="$check, mindspore, pytest, transformers, matplotlib, polars"
fi
stamp=.venv/.msprobe-installed-$profile
want="${deps[*]} $(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "${deps[@]}" 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e . 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -c "$check"
  echo "$want" > "$stamp"
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
