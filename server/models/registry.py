"""Model families as data: one `ModelFamily` entry per HF `model_type` the server can train and sample.

Adding a family means adding an entry here, not editing the pipeline. The entry says which HF
auto class loads it, where its language model's linear layers live (LoRA targets) and, for
vision-language families, how images enter the sequence: the special tokens around and inside an
image and how rope positions are built. Sizes (patch, merge, min/max pixels) are not here: they
are read from each checkpoint's own preprocessor_config.json. Nothing here loads weights.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from server.models.positions import Segment, mrope_position_ids

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
SHARED_INPUT_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# Qwen3.5's Gated DeltaNet layers: their input projections (q, k and v fused; the output gate; the
# delta rule's beta and decay) and their output projection.
LINEAR_ATTENTION_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


@dataclass(frozen=True)
class VisionSpec:
    """How a vision-language family puts images into its token sequence."""

    image_token: str = "<|image_pad|>"
    """Placeholder repeated once per image token; only image chunks may produce it."""
    vision_start_token: str = "<|vision_start|>"
    vision_end_token: str = "<|vision_end|>"
    reserved_tokens: tuple[str, ...] = ("<|video_pad|>",)
    """Other placeholders a client's text may not contain (the model would take them for media)."""
    position_ids: Callable[[list[Segment], int], torch.Tensor] = mrope_position_ids
    """Rope positions [3, L] of a sequence of text runs and image grids, given the merge size."""
    tower_module: str = "model.visual"
    """Module path of the vision tower (frozen, never adapted, kept whole on every training rank)."""


QWEN_VL = VisionSpec()


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
    shared_input_modules: tuple[tuple[str, ...], ...] = SHARED_INPUT_PROJECTIONS
    """Projections of a decoder block that read the same input: LoRA multiplies it by their A's at once."""
    routed_experts: str = ""
    """Module name of a MoE layer's fused routed experts (LoRA per expert, with the MLP), if any."""
    unembed_module: str = "lm_head"
    vision: VisionSpec | None = None
    """None for text-only families."""
    hybrid: bool = False
    """Some decoder layers are linear attention: their cache is a recurrent state per sequence, which
    cannot be cut at an arbitrary prefix (the embedded engine's prefix cache stays off)."""

    @property
    def recomputes_blocks(self) -> bool:
        """Training always recomputes each decoder block in backward (activation checkpointing). Linear
        attention's PyTorch path keeps ~4x the activations (a Qwen3.5-4B micro-batch of 8,192 tokens ran out
        of an H100's memory without; 16 GiB and no slower with), and routed experts keep every (token, expert)
        pair's inputs and outputs: ~0.2 MiB a token a layer, 77 GiB for 48 layers x 8,192 tokens of
        Qwen3-VL-30B-A3B, which ran out of an H200's memory beside its base (benchmarks/RESULTS.md)."""
        return self.hybrid or bool(self.routed_experts)


_VISION = dict(auto_class="AutoModelForImageTextToText", language_model_prefix="model.language_model.layers.",
               vision=QWEN_VL)
_QWEN3_5 = dict(_VISION, attention_modules=ATTENTION_PROJECTIONS + LINEAR_ATTENTION_PROJECTIONS,
                shared_input_modules=SHARED_INPUT_PROJECTIONS + (LINEAR_ATTENTION_PROJECTIONS[:4],))
_TEXT = dict(auto_class="AutoModelForCausalLM", language_model_prefix="model.layers.")

FAMILIES: dict[str, ModelFamily] = {f.model_type: f for f in [
    ModelFamily(model_type="qwen2_vl", arch="qwen2_vl", **_VISION),
    ModelFamily(model_type="qwen2_5_vl", arch="qwen2_5_vl", **_VISION),
    ModelFamily(model_type="qwen3_vl", arch="qwen3_vl", **_VISION),
    ModelFamily(model_type="qwen3_vl_moe", arch="qwen3_vl_moe", routed_experts="experts", **_VISION),
    # Hybrid: Gated DeltaNet layers (a recurrent state, no KV cache) between gated full-attention layers.
    # `train_attn` covers both kinds of layer; `train_mlp` the dense MLP, or the MoE's experts and shared expert.
    ModelFamily(model_type="qwen3_5", arch="qwen3_5", hybrid=True, **_QWEN3_5),
    ModelFamily(model_type="qwen3_5_moe", arch="qwen3_5_moe", hybrid=True, routed_experts="experts", **_QWEN3_5),
    ModelFamily(model_type="qwen2", arch="qwen2", **_TEXT),
    ModelFamily(model_type="llama", arch="llama", **_TEXT),
    ModelFamily(model_type="qwen3", arch="qwen3", **_TEXT),
]}


def family_for(model_type: str) -> ModelFamily:
    """The registry entry of a checkpoint's `config.model_type`."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(f"unsupported model type {model_type!r}; supported: {sorted(FAMILIES)}") from None
