#!/usr/bin/env bash
# Here, with network: one tar of what a lent GPU machine needs for `--sampler vllm` benchmarks (the server's
# wheels in .whl/ with the vLLM plugin, vLLM 0.26.0 and its dependencies), split into parts that each fit one
# device call beside the working tree (64 MiB a call in all): .stage/part0 ... (git-ignored). Then carry
# .stage/partN one call after another while the machine stays warm, each call
# `mkdir -p /tmp/stage && cp .stage/partN/* /tmp/stage/`, and in the last `bash benchmarks/vllm_install.sh`.
#
#   bash benchmarks/vllm_stage.sh BUNDLE_DIR     BUNDLE_DIR: build_bundle.sh's work folder (W=...), which
#                                                holds bundle/deps/*.whl and bundle/vllm026.tar.xz
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=${1:?the folder build_bundle.sh worked in}/bundle
[ -d .whl ] || bash benchmarks/gpu_wheels.sh
python3 -m pip wheel -q --no-deps --no-build-isolation server/sampling/vllm_plugin -w .whl
work=$(mktemp -d)
mkdir -p "$work/pack"
cp -r .whl "$work/pack/whl" && cp -r "$bundle/deps" "$work/pack/deps" && cp "$bundle/vllm026.tar.xz" "$work/pack/"
tar cf "$work/pack.tar" -C "$work" pack
rm -rf .stage && mkdir -p "$work/parts"
split -b 60000000 -d -a 2 "$work/pack.tar" "$work/parts/pack.part"  # + the tree (~5 MB) < 64 MiB a call
i=0
for part in "$work"/parts/pack.part*; do mkdir -p .stage/part$i && mv "$part" .stage/part$i/; i=$((i + 1)); done
sha256sum "$work/pack.tar" | cut -c1-64 > .stage/part0/pack.sha
rm -rf "$work"
du -sh .stage/part*
