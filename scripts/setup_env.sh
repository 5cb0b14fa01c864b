#!/usr/bin/env bash
# Creates ./.venv (once) with what the project needs: torch (CPU wheel, pinned for
# development and CI), MindSpore 2.10 (CPU; an 800 MB download the first time), numpy<2
# (MindSpore's C++ needs NumPy 1.x), pytest, transformers (tests build a model from a
# config, no download), and this package in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.msprobe-installed
deps=("torch==2.13.0" "mindspore==2.10.0" "numpy<2" "pytest>=7" "transformers>=4.40,<5")
want="${deps[*]} $(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "${deps[@]}" 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e . 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -c "import torch, mindspore, numpy, pytest, transformers, msprobe.core.monitor_v2.trainer"
  echo "$want" > "$stamp"
fi
