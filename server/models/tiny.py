"""Built-in tiny models: random-weight, deterministic members of each supported family, built offline.

Owns what is on disk for the `builtin:tiny-*` base models: a locally trained byte-level BPE with the
real Qwen special tokens and chat templates, hand-written configs and seeded weights (`builtin.py`
caches them by name). Knows nothing about how the server trains or samples them, and nothing about
image preprocessing beyond writing preprocessor_config.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

BUILTIN_FAMILIES: dict[str, str] = {
    "tiny-qwen2-vl": "qwen2-vl",
    "tiny-qwen2.5-vl": "qwen2.5-vl",
    "tiny-qwen3-vl": "qwen3-vl",
    "tiny-qwen3-vl-moe": "qwen3-vl-moe",
    "tiny-qwen3.5": "qwen3.5",
    "tiny-qwen3.5-moe": "qwen3.5-moe",
    "tiny-qwen3": "qwen3",
}
FAMILIES = tuple(BUILTIN_FAMILIES.values())

# Special tokens in the same order (so the same relative offsets) as the real Qwen2/2.5/3(-VL)
# tokenizers, appended right after the trained BPE vocab. In the real checkpoints <|endoftext|>
# is 151643 and <|image_pad|> is 151655.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Non-special added tokens that the real Qwen2.5/Qwen3 tokenizers also carry.
EXTRA_ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]

# Qwen2Tokenizer's pre-tokenizer regex, kept literal so the tokenizer trained here encodes the
# same whether loaded from tokenizer.json or rebuilt by transformers from vocab and merges.
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

BPE_VOCAB_SIZE = 1000
HIDDEN_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 2
NUM_KV_HEADS = 1
VISION_DEPTH = 2
VISION_WIDTH = 64
VISION_HEADS = 2

# Qwen-VL chat template: string content or a list of parts; an image part becomes
# <|vision_start|><|image_pad|><|vision_end|> with ONE pad, which the processor (or vLLM)
# expands later. No whitespace control on purpose: every newline below is literal text.
VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' and __DEFAULT_SYSTEM__ %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}"
    "{{ part['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3 chat template, reduced to what the real one does without tools: no default system
# prompt; assistant turns before the last user turn lose their <think>...</think> block;
# enable_thinking=false pre-fills an empty think block in the generation prompt.
QWEN3_CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query_index=-1) %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and loop.index0 < ns.last_query_index and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

# Qwen3.5 / Qwen3.6 chat template, reduced to what the real one does without tools or reasoning
# fields: no default system prompt, content trimmed, assistant turns after the last user turn carry
# an (empty) think block, and the generation prompt opens a think block (closed at once when
# enable_thinking=false), as the cookbook's qwen3_5 renderers write it.
QWEN3_5_CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query_index=-1) %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = namespace(text='') %}"
    "{%- if message['content'] is string %}"
    "{%- set content.text = message['content'] %}"
    "{%- else %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part %}"
    "{%- set content.text = content.text + '<|vision_start|><|image_pad|><|vision_end|>' %}"
    "{%- elif 'text' in part %}"
    "{%- set content.text = content.text + part['text'] %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{%- set text = content.text | trim %}"
    "{%- if message['role'] == 'assistant' and loop.index0 > ns.last_query_index and '<think>' not in text %}"
    "{%- set text = '<think>\\n\\n</think>\\n\\n' + text %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

# Image preprocessing of the real checkpoints (their preprocessor_config.json values).
VISION_DEFAULTS = {
    "qwen2-vl": dict(processor_class="Qwen2VLProcessor", patch_size=14, merge_size=2, temporal_patch_size=2,
                     min_pixels=56 * 56, max_pixels=28 * 28 * 1280,
                     image_mean=[0.48145466, 0.4578275, 0.40821073],
                     image_std=[0.26862954, 0.26130258, 0.27577711]),
    "qwen2.5-vl": dict(processor_class="Qwen2_5_VLProcessor", patch_size=14, merge_size=2, temporal_patch_size=2,
                       min_pixels=56 * 56, max_pixels=28 * 28 * 1280,
                       image_mean=[0.48145466, 0.4578275, 0.40821073],
                       image_std=[0.26862954, 0.26130258, 0.27577711]),
    "qwen3-vl": dict(processor_class="Qwen3VLProcessor", patch_size=16, merge_size=2, temporal_patch_size=2,
                     min_pixels=65536, max_pixels=16777216,
                     image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]),
}
# Qwen3-VL-MoE (e.g. Qwen3-VL-30B-A3B) and Qwen3.5 / Qwen3.6 (dense and MoE) share the Qwen3-VL
# image processor and its settings.
for _family in ("qwen3-vl-moe", "qwen3.5", "qwen3.5-moe"):
    VISION_DEFAULTS[_family] = VISION_DEFAULTS["qwen3-vl"]

_WORDS = (
    "the a an of to and in is it that for on with as was at by this be are from or have not but "
    "image picture photo red green blue square circle color shape left right top bottom small big "
    "what which describe answer question user assistant system you i we they he she yes no maybe "
    "one two three four five six seven eight nine ten zero hello world model tinker train sample "
    "reward policy token loss gradient step learn rate batch size number count there here where"
).split()


def _training_corpus(num_lines: int = 4000) -> list[str]:
    # A fixed generated corpus, so the BPE merges (and thus every token id) never change.
    rng = random.Random(0)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randint(0, len(words)), str(rng.randint(0, 9999)))
        line = " ".join(words)
        line = line[0].upper() + line[1:] + rng.choice([".", "?", "!", ",", ":", ";"])
        if rng.random() < 0.2:
            line = f'"{line}" ({rng.choice(_WORDS)}) [{rng.randint(0, 99)}] {{x: {rng.random():.3f}}}\n'
        lines.append(line)
    return lines


def chat_template_for(family: str) -> str:
    """The family's chat template: Qwen2-VL / Qwen2.5-VL insert a default system prompt; Qwen3(-VL) do not."""
    if family == "qwen3":
        return QWEN3_CHAT_TEMPLATE
    if family.startswith("qwen3.5"):
        return QWEN3_5_CHAT_TEMPLATE
    default_system = "true" if family in ("qwen2-vl", "qwen2.5-vl") else "false"
    return VL_CHAT_TEMPLATE.replace("__DEFAULT_SYSTEM__", default_system)


def _build_tokenizer(family: str):
    """Train the byte-level BPE with Qwen2's pipeline and wrap it as an HF fast tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, so any text encodes
        special_tokens=[],
    )
    backend.train_from_iterator(_training_corpus(), trainer=trainer)
    # Like Qwen: regular vocab first, then the special tokens, then the extra added tokens.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in EXTRA_ADDED_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",  # instruct checkpoints stop on <|im_end|>
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        chat_template=chat_template_for(family),
    )


def _build_config(family: str, token_ids: dict[str, int], vocab_size: int):
    """Hand-written HF config for one family at the tiny sizes above."""
    # head_dim 64: vLLM's CPU attention backend only takes head sizes 32, 64, 80, 96, 112, 128, ...
    # (16 fails at run time), and FlashAttention / FlashInfer on GPU are happiest with 64/128.
    # The vision tower's head dim is VISION_WIDTH / VISION_HEADS = 32.
    head_dim = HIDDEN_SIZE // NUM_HEADS
    text = dict(
        vocab_size=vocab_size, hidden_size=HIDDEN_SIZE, intermediate_size=HIDDEN_SIZE * 2,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=4096, rms_norm_eps=1e-6,
        bos_token_id=token_ids["<|endoftext|>"], eos_token_id=token_ids["<|im_end|>"],
        pad_token_id=token_ids["<|endoftext|>"],
    )
    if family == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**text, head_dim=head_dim, attention_bias=False, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})

    half = head_dim // 2
    # mrope_section splits the rotary half-dim into temporal/height/width parts.
    mrope_section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    top = dict(
        image_token_id=token_ids["<|image_pad|>"], video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"], vision_end_token_id=token_ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    vd = VISION_DEFAULTS[family]
    patches = dict(patch_size=vd["patch_size"], spatial_merge_size=vd["merge_size"],
                   temporal_patch_size=vd["temporal_patch_size"])
    if family == "qwen2-vl":
        from transformers import Qwen2VLConfig

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope_section}
        vision = dict(depth=VISION_DEPTH, embed_dim=VISION_WIDTH, hidden_size=HIDDEN_SIZE, num_heads=VISION_HEADS,
                      mlp_ratio=2, in_channels=3, **patches)
        return Qwen2VLConfig(text_config=text, vision_config=vision, **top)
    if family == "qwen2.5-vl":
        from transformers import Qwen2_5_VLConfig

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope_section}
        vision = dict(depth=VISION_DEPTH, hidden_size=VISION_WIDTH, intermediate_size=2 * VISION_WIDTH,
                      num_heads=VISION_HEADS, out_hidden_size=HIDDEN_SIZE, window_size=112,
                      fullatt_block_indexes=[VISION_DEPTH - 1], tokens_per_second=2, hidden_act="silu", **patches)
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **top)

    if family.startswith("qwen3.5"):
        return _qwen3_5_config(family, text, top, patches)
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    text.update(head_dim=head_dim, attention_bias=False,
                rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                 "mrope_section": mrope_section, "mrope_interleaved": True})
    vision = dict(depth=VISION_DEPTH, hidden_size=VISION_WIDTH, intermediate_size=2 * VISION_WIDTH,
                  num_heads=VISION_HEADS, out_hidden_size=HIDDEN_SIZE, num_position_embeddings=64,
                  deepstack_visual_indexes=[0], hidden_act="gelu_pytorch_tanh", **patches)
    if family == "qwen3-vl":
        return Qwen3VLConfig(text_config=text, vision_config=vision, **top)
    # 4 tiny experts, top-2, every layer sparse; moe_intermediate_size is chosen so that no expert
    # tensor is square (see _to_hub_expert_layout).
    text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=HIDDEN_SIZE * 3 // 4,
                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    return Qwen3VLMoeConfig(text_config=text, vision_config=vision, **top)


def _qwen3_5_config(family: str, text: dict, top: dict, patches: dict):
    """Qwen3.5 / Qwen3.6: a Gated DeltaNet (linear attention) layer, then a gated full-attention layer
    (the real checkpoints repeat three linear to one full), partial M-RoPE on a quarter of each head."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    rotary_half = text["hidden_size"] // NUM_HEADS // 8  # partial_rotary_factor 0.25 of head_dim, halved
    text.update(head_dim=HIDDEN_SIZE // NUM_HEADS, attention_bias=False, layer_types=["linear_attention",
                                                                                      "full_attention"],
                linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
                linear_num_key_heads=2, linear_num_value_heads=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                 # [11, 11, 10] of the real 32, [3, 3, 2] of the tiny 8
                                 "mrope_section": [(rotary_half + 2) // 3, (rotary_half + 1) // 3, rotary_half // 3],
                                 "mrope_interleaved": True})
    vision = dict(depth=VISION_DEPTH, hidden_size=VISION_WIDTH, intermediate_size=2 * VISION_WIDTH,
                  num_heads=VISION_HEADS, out_hidden_size=HIDDEN_SIZE, num_position_embeddings=64,
                  hidden_act="gelu_pytorch_tanh", **patches)
    if family == "qwen3.5":
        return Qwen3_5Config(text_config=text, vision_config=vision, **top)
    # 4 tiny experts, top-2, and a shared expert; no expert tensor is square (see _to_hub_expert_layout).
    text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=HIDDEN_SIZE * 3 // 4,
                shared_expert_intermediate_size=HIDDEN_SIZE // 2)
    del text["intermediate_size"]
    return Qwen3_5MoeConfig(text_config=text, vision_config=vision, **top)


def _to_hub_expert_layout(safetensors_path: Path, hidden: int, moe_intermediate: int) -> None:
    """Rewrite fused MoE expert tensors in the layout of the released Qwen3-VL-MoE checkpoints
    (`hub_expert_layout`)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(safetensors_path))
    tensors = {name: hub_expert_layout(name, tensor, hidden, moe_intermediate) for name, tensor in tensors.items()}
    save_file(tensors, str(safetensors_path), metadata={"format": "pt"})


def hub_expert_layout(name: str, tensor: torch.Tensor, hidden: int, moe_intermediate: int) -> torch.Tensor:
    """A Qwen3-VL-MoE tensor as the released checkpoints store it.

    transformers v5 keeps experts as gate_up_proj [E, 2I, H] / down_proj [E, H, I] in memory and
    converts from the Hub layout (gate_up_proj [E, H, 2I], down_proj [E, I, H]) on load with a
    shape-checked transpose. Its save_pretrained (5.23) writes the in-memory layout back unchanged
    (the reverse op sees matching shapes and skips), which transformers reloads fine but vLLM
    (is_fused_checkpoint_transposed=True) rejects, or silently misreads if a tensor happens to be
    square. Judged by shape, so a tensor already in the Hub layout is left alone.
    """
    want = {"mlp.experts.gate_up_proj": (hidden, 2 * moe_intermediate),
            "mlp.experts.down_proj": (moe_intermediate, hidden)}
    for suffix, (dim1, dim2) in want.items():
        if not name.endswith(suffix):
            continue
        if tuple(tensor.shape[1:]) == (dim2, dim1):
            return tensor.transpose(1, 2).contiguous()
        if tuple(tensor.shape[1:]) != (dim1, dim2):
            raise ValueError(f"unexpected expert shape {name}: {tuple(tensor.shape)}")
    return tensor


def write_preprocessor_config(out: Path, family: str) -> None:
    vd = VISION_DEFAULTS[family]
    config = {
        # Same keys as the real checkpoints; both the torchvision and PIL backends of transformers'
        # Qwen2VLImageProcessor (and vLLM, which wraps it) read them.
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": vd["processor_class"],
        "do_convert_rgb": True,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": vd["image_mean"],
        "image_std": vd["image_std"],
        "resample": 3,
        "patch_size": vd["patch_size"],
        "temporal_patch_size": vd["temporal_patch_size"],
        "merge_size": vd["merge_size"],
        "min_pixels": vd["min_pixels"],
        "max_pixels": vd["max_pixels"],
        "size": {"shortest_edge": vd["min_pixels"], "longest_edge": vd["max_pixels"]},
    }
    (out / "preprocessor_config.json").write_text(json.dumps(config, indent=2))


def build_tiny_model(family: str, out: Path, seed: int = 0) -> Path:
    """Write a complete, deterministic tiny HF model directory of `family` to `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if family not in FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; known: {', '.join(FAMILIES)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _build_tokenizer(family)
    token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    # Padded past the tokenizer length, like Qwen's 151936 > len(tokenizer).
    model_vocab_size = math.ceil(len(tokenizer) / 64) * 64
    config = _build_config(family, token_ids, model_vocab_size)
    model_class = AutoModelForCausalLM if family == "qwen3" else AutoModelForImageTextToText
    # Seed a forked RNG so the weights depend only on `seed` and the caller's RNG is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class.from_config(config)
    model.generation_config.eos_token_id = [token_ids["<|im_end|>"], token_ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = token_ids["<|endoftext|>"]
    model.save_pretrained(out)
    if family == "qwen3-vl-moe":
        _to_hub_expert_layout(out / "model.safetensors", HIDDEN_SIZE, config.text_config.moe_intermediate_size)

    tokenizer.save_pretrained(out)
    # Look like a real Qwen checkpoint. transformers v5 rebuilds Qwen2Tokenizer from vocab/merges
    # with the same regex/NFC/ByteLevel pipeline trained above, so encodings are identical.
    tokenizer_config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text())
    tokenizer_config.update(tokenizer_class="Qwen2Tokenizer", errors="replace", add_prefix_space=False)
    tokenizer_config_path.write_text(json.dumps(tokenizer_config, indent=2))
    if family != "qwen3":
        # v5 writes chat_template.jinja; older processor loaders read the JSON copy.
        (out / "chat_template.json").write_text(json.dumps({"chat_template": tokenizer.chat_template}, indent=2))
        write_preprocessor_config(out, family)
    meta = {
        "family": family,
        "special_token_ids": token_ids,
        "tokenizer_len": len(tokenizer),
        "model_vocab_size": model_vocab_size,
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    (out / "tiny_model_meta.json").write_text(json.dumps(meta, indent=2))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Build a tiny random-weight model directory offline.")
    parser.add_argument("--family", required=True, choices=FAMILIES)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build_tiny_model(args.family, args.out, args.seed))
