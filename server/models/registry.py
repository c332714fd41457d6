"""Model families as data: one `ModelFamily` entry per HF `model_type` the server can train and sample.

Adding a family means adding an entry here, not editing the pipeline. The entry says which HF
auto class loads it, where its language model's linear layers live (LoRA targets) and whether it
takes images. Nothing here loads weights.
"""

from dataclasses import dataclass

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    """`config.model_type` of the checkpoint."""
    arch: str
    """Short name reported by get_info's `model_data.arch`."""
    auto_class: str
    """Name of the transformers auto class that loads the checkpoint."""
    language_model_prefix: str
    """Module path prefix of the decoder layers; LoRA never touches modules outside it (vision tower)."""
    attention_modules: tuple[str, ...] = ATTENTION_PROJECTIONS
    mlp_modules: tuple[str, ...] = MLP_PROJECTIONS
    unembed_module: str = "lm_head"
    takes_images: bool = False


_VISION = dict(auto_class="AutoModelForImageTextToText", language_model_prefix="model.language_model.layers.",
               takes_images=True)
_TEXT = dict(auto_class="AutoModelForCausalLM", language_model_prefix="model.layers.")

FAMILIES: dict[str, ModelFamily] = {f.model_type: f for f in [
    ModelFamily(model_type="qwen2_vl", arch="qwen2_vl", **_VISION),
    ModelFamily(model_type="qwen2_5_vl", arch="qwen2_5_vl", **_VISION),
    ModelFamily(model_type="qwen3_vl", arch="qwen3_vl", **_VISION),
    # Experts are fused 3-D tensors, not nn.Linear: MLP LoRA has no targets in this family.
    ModelFamily(model_type="qwen3_vl_moe", arch="qwen3_vl_moe", mlp_modules=(), **_VISION),
    ModelFamily(model_type="qwen2", arch="qwen2", **_TEXT),
    ModelFamily(model_type="qwen3", arch="qwen3", **_TEXT),
]}


def family_for(model_type: str) -> ModelFamily:
    """The registry entry of a checkpoint's `config.model_type`."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(f"unsupported model type {model_type!r}; supported: {sorted(FAMILIES)}") from None
