#!/usr/bin/env bash
# Make sure a headless Chromium is there for the dashboard's browser test, and print its path as the
# last line of stdout. Chromium comes from Debian's packages (installed when absent; needs root);
# Playwright drives it by path and never downloads a browser of its own.
set -euo pipefail
find_chromium() {
    command -v chromium || command -v chromium-browser || true
}
CHROMIUM=$(find_chromium)
if [ -z "$CHROMIUM" ]; then
    echo "no Chromium; installing Debian's chromium package" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >&2
    CHROMIUM=$(find_chromium)
fi
echo "$CHROMIUM"
