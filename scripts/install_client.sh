#!/usr/bin/env bash
# Install the README's client environment into the current Python: the tinker SDK, Pillow and
# transformers (the examples make an image and count its tokens with them) and the tinker-cookbook
# with what its recipes import, torch included, at the versions of requirements/client.lock, every file
# checked against its hash. A torch already installed is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
if ! python -c "import torch" 2>/dev/null; then
    python -m pip install --quiet -r requirements/torch.txt
fi
python -m pip install --quiet --require-hashes --no-deps -r requirements/client.lock -r requirements/cookbook.lock
bash scripts/pip_check.sh
