#!/usr/bin/env bash
# Is the world moving under the locks? Resolve the newest versions that pyproject.toml and
# requirements/*.in allow into a scratch venv, run the quick tier there, and name what changed.
# Not part of CI: run it now and then (and before `bash scripts/lock.sh`), so that a new release that
# breaks the server is found here, with the package named, before a user finds it.
#
#   bash scripts/check_latest.sh [VENV_DIR]     (default: a temporary directory, removed after)
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
VENV=${1:-$(mktemp -d)/venv}
python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install --quiet -r requirements/torch.txt
# Unpinned, newest first: what `pip install -e .[test]` gives a user who does not use the locks.
"$PY" -m pip install --quiet --upgrade -e ".[test]" -r requirements/cookbook.in
"$PY" -m pip install --quiet --no-deps "$(grep -oE '^tinker-cookbook==[^ ]+' requirements/cookbook.lock)"
echo "differs from requirements/test.lock:" >&2
"$PY" - <<'PY' >&2
import importlib.metadata as metadata, re
from packaging.markers import Marker
locked = {}
for name, version, marker in re.findall(r"^([a-z0-9._-]+)==([^ ;\\]+)(?: ; ([^\\]+?))? \\$", open("requirements/test.lock").read(),
                                        re.MULTILINE):
    if not marker or Marker(marker).evaluate():
        locked[name] = version
for dist in sorted(metadata.distributions(), key=lambda d: d.metadata["Name"].lower()):
    name = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
    if name in locked and locked[name] != dist.version:
        print(f"  {name}: {locked[name]} -> {dist.version}")
PY
TEST_DATABASES=sqlite OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" TINKER_TELEMETRY=0 \
    "$PY" -m pytest tests/unit -q -p no:cacheprovider -x  # the quick tier, as scripts/test.sh --quick runs it
