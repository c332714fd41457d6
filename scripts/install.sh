#!/usr/bin/env bash
# Install the server (editable) and its test dependencies into the current Python (>= 3.11).
# torch is installed first and pinned, so that no other package pulls a newer (CUDA) build.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
if ! python -c "import torch" 2>/dev/null; then
    python -m pip install --quiet "torch==2.13.0"
fi
python -m pip install --quiet -e ".[test]"
