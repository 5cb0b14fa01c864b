#!/usr/bin/env bash
# The main job: train a small GPT on synthetic data with Monitor V2 on, then summarise
# the CSV files it wrote. From a fresh machine: creates .venv (once), then runs the demo.
# Arguments go to examples/train_gpt.py (see --help), e.g. bash scripts/demo.sh --steps 100
set -euo pipefail
export MSPROBE_DEMO_CALLER_CWD="$PWD"  # the demo prints its next commands relative to this
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh demo
exec .venv/bin/python examples/train_gpt.py "$@"
