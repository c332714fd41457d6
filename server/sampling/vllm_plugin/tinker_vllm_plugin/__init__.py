"""vLLM plugin: model variants that adapt lm_head with LoRA and never produce media placeholders.

vLLM loads `register` in every process it starts (API server, engine core, workers) through its
`vllm.general_plugins` entry point. It registers, for each supported architecture `X`, a variant
named `Tinker` + `X` (see `models.py`); the server selects it with
`--hf-overrides {"architectures": ["TinkerX"], "tinker_masked_token_ids": [...]}`, so that a vLLM
without this plugin refuses to start instead of sampling differently. Runs inside vLLM's venv:
imports nothing of the server.
"""

ARCHITECTURES = (
    ("Qwen2VLForConditionalGeneration", "vllm.model_executor.models.qwen2_vl"),
    ("Qwen2_5_VLForConditionalGeneration", "vllm.model_executor.models.qwen2_5_vl"),
    ("Qwen3VLForConditionalGeneration", "vllm.model_executor.models.qwen3_vl"),
    ("Qwen3VLMoeForConditionalGeneration", "vllm.model_executor.models.qwen3_vl_moe"),
    ("Qwen3_5ForConditionalGeneration", "vllm.model_executor.models.qwen3_5"),
    ("Qwen3_5MoeForConditionalGeneration", "vllm.model_executor.models.qwen3_5"),
    ("Qwen2ForCausalLM", "vllm.model_executor.models.qwen2"),
    ("Qwen3ForCausalLM", "vllm.model_executor.models.qwen3"),
    ("LlamaForCausalLM", "vllm.model_executor.models.llama"),
)
PREFIX = "Tinker"


def register() -> None:
    from vllm import ModelRegistry

    for architecture, _ in ARCHITECTURES:
        # Lazy ("module:class"): the variant's module imports vLLM's model module on first use only.
        ModelRegistry.register_model(PREFIX + architecture, f"tinker_vllm_plugin.models:{PREFIX}{architecture}")
