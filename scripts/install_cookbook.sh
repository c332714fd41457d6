#!/usr/bin/env bash
# Install tinker-cookbook 0.6.x into the current Python the way a user would, for the recipe tests.
# Its tml-renderers>=0.4.1 requirement is not on the package index, and only the Inkling/audio
# renderers import it, so the wheel goes in with --no-deps and the dependencies the verified
# recipes import are named here (floors from the wheel's own metadata). The torch already installed
# is pinned so that nothing swaps it. A second run only checks that everything imports.
set -euo pipefail
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
COOKBOOK="tinker-cookbook==0.6.1"
# chz: every CLI; datasets, blobfile: data loading; termcolor: multiplayer_rl; math-verify,
# pylatexenc, sympy: math_rl (the cookbook's math-rl extra); pyrage: weights.download; tinker comes
# with the server's test extra.
DEPS=("chz>=0.4.0" "datasets>=2.14.0" "blobfile>=3.0.0" "termcolor>=2.0.0"
      "math-verify>=0.5.0" "pylatexenc>=2.0" "sympy>=1.12.0" "pyrage>=1.2")

if python - 2>/dev/null <<'EOF'
import importlib.metadata
assert importlib.metadata.version("tinker-cookbook").startswith("0.6.")
import blobfile, chz, datasets, math_verify, pylatexenc, pyrage, sympy, termcolor
EOF
then
    exit 0
fi
# Dependencies first: pip then has no half-installed cookbook to report conflicts about.
python -m pip install --quiet -c <(python -c "import torch; print('torch==' + torch.__version__)") "${DEPS[@]}"
python -m pip install --quiet --no-deps "$COOKBOOK"
