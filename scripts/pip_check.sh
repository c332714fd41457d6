#!/usr/bin/env bash
# `pip check` of the current Python, less the four packages that tinker-cookbook asks for and that no
# recipe we run imports (requirements/cookbook.in): fails on any other missing or conflicting package,
# so that a lock that lacks one fails the install instead of a test.
set -euo pipefail
problems=$(python -m pip check \
    | grep -v -E '^No broken requirements found|^tinker-cookbook [^ ]+ requires (aiohttp|cloudpickle|tiktoken|tml-renderers),' || true)
if [ -n "$problems" ]; then
    echo "$problems" >&2
    exit 1
fi
