#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what it needs, then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
exec .venv/bin/python -m pytest "$@"
