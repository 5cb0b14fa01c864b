#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what it needs, then runs pytest.
# Measured on a 2-core CI-size machine (load average 2-3) from a fresh clone on 2026-12-08: about 25 min
# (setup about 150 s from pip's cache, pytest 1,355 s for 3,030 tests); a loaded machine takes several times that.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
echo "test.sh: running pytest $* on $(nproc 2>/dev/null || echo '?') core(s): about 20-25 min for the whole suite on a" \
     "2-core machine (much longer on a loaded one); -v names each test as it starts, and the 15 slowest" \
     "are listed at the end"
# every optional library is installed above: a test that needs one which is missing fails
# instead of skipping (tests/support/extras.py), so that nothing goes quiet in CI
export MSPROBE_TEST_PROFILE=full
# --durations: where the time goes, so that a slow test is seen, not guessed
exec .venv/bin/python -m pytest --durations=15 "$@"
