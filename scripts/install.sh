#!/usr/bin/env bash
# Install the server (editable) into the current Python (>= 3.11) with the versions of
# requirements/server.lock, every file checked against its hash, then check that nothing is missing.
# torch comes first and alone (requirements/torch.txt); a torch already installed (a GPU build, say)
# is kept.
#
#   bash scripts/install.sh [LOCK ...]    more locks to install with the server's (scripts/test.sh
#                                         adds the test tools' and the cookbook's)
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
if ! python -c "import torch" 2>/dev/null; then
    python -m pip install --quiet -r requirements/torch.txt
fi
locks=(requirements/server.lock "$@")
python -m pip install --quiet --require-hashes --no-deps "${locks[@]/#/--requirement=}"
python -m pip install --quiet --no-deps --no-build-isolation -e .
bash scripts/pip_check.sh
