"""Tests for the built-in tiny models: offline build, determinism, and loading with transformers."""

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from server.models import builtin, tiny
from server.models.builtin import ensure_builtin_model
from server.models.tiny import BUILTIN_FAMILIES, SPECIAL_TOKENS, build_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[3]
VISION_NAMES = [name for name, family in BUILTIN_FAMILIES.items() if family != "qwen3"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("builtin-models")
    for name in BUILTIN_FAMILIES:
        ensure_builtin_model(name, cache)
    return cache


def _load_model(path: Path):
    meta = json.loads((path / "tiny_model_meta.json").read_text())
    model_class = AutoModelForCausalLM if meta["family"] == "qwen3" else AutoModelForImageTextToText
    return model_class.from_pretrained(path).eval(), meta


def _files(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


def test_models_dir_build_deterministically(cache_dir, tmp_path):
    for name, family in BUILTIN_FAMILIES.items():
        rebuilt = build_tiny_model(family, tmp_path / name)
        assert _files(rebuilt) == _files(cache_dir / name), name


def test_a_different_seed_gives_different_weights(cache_dir, tmp_path):
    other = build_tiny_model("qwen3", tmp_path / "seed1", seed=1)
    assert (other / "model.safetensors").read_bytes() != (cache_dir / "tiny-qwen3" / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (cache_dir / "tiny-qwen3" / "tokenizer.json").read_bytes()


def test_ensure_builtin_model_reuses_the_cache_and_leaves_no_staging_dirs(cache_dir):
    weights = cache_dir / "tiny-qwen3" / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert ensure_builtin_model("tiny-qwen3", cache_dir) == cache_dir / "tiny-qwen3"
    assert weights.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in cache_dir.iterdir()) == sorted(BUILTIN_FAMILIES)


def test_ensure_builtin_model_keeps_the_copy_of_a_concurrent_build(cache_dir, tmp_path, monkeypatch):
    def build_while_another_process_wins(family, out, seed=0):
        shutil.copytree(cache_dir / "tiny-qwen3", tmp_path / "tiny-qwen3")
        return build_tiny_model(family, out, seed)

    monkeypatch.setattr(tiny, "build_tiny_model", build_while_another_process_wins)
    assert ensure_builtin_model("tiny-qwen3", tmp_path) == tmp_path / "tiny-qwen3"
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-qwen3"]


def test_a_builtin_built_from_another_builtin_builds_both_into_a_fresh_cache(tmp_path, monkeypatch):
    # SmolLM2's VLM is built from its language model, itself a built-in of the same cache: the build lock
    # that the first holds must not make the second wait for it.
    monkeypatch.setitem(builtin.BUILTIN_MODELS, "tiny-qwen2-vl-on-qwen3", lambda out, cache: shutil.copytree(
        ensure_builtin_model("tiny-qwen3", cache), out, dirs_exist_ok=True))
    built = []
    worker = threading.Thread(target=lambda: built.append(ensure_builtin_model("tiny-qwen2-vl-on-qwen3", tmp_path)),
                              daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert built == [tmp_path / "tiny-qwen2-vl-on-qwen3"], "the nested build is still waiting for its own lock"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-qwen2-vl-on-qwen3", "tiny-qwen3"]


def test_an_interrupted_build_leaves_nothing_in_the_cache(tmp_path, monkeypatch):
    def interrupted_build(family, out, seed=0):
        (Path(out) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny, "build_tiny_model", interrupted_build)
    with pytest.raises(KeyboardInterrupt):
        ensure_builtin_model("tiny-qwen3", tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_building_does_not_disturb_the_callers_torch_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model("qwen3", tmp_path / "model", seed=7)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", list(BUILTIN_FAMILIES))
def test_every_builtin_loads_with_transformers_and_runs_forward(cache_dir, name):
    path = cache_dir / name
    tokenizer = AutoTokenizer.from_pretrained(path)
    model, meta = _load_model(path)
    ids = meta["special_token_ids"]
    assert meta["family"] == BUILTIN_FAMILIES[name]
    assert list(ids) == SPECIAL_TOKENS
    assert len(tokenizer) == meta["tokenizer_len"]
    assert meta["model_vocab_size"] % 64 == 0 and meta["model_vocab_size"] >= len(tokenizer)
    assert tokenizer.eos_token_id == ids["<|im_end|>"] and tokenizer.pad_token_id == ids["<|endoftext|>"]
    assert model.generation_config.eos_token_id == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    text_config = model.config.get_text_config()
    # Qwen2/2.5-VL have no head_dim field; theirs is hidden_size / num_attention_heads.
    assert getattr(text_config, "head_dim", text_config.hidden_size // text_config.num_attention_heads) == 64
    assert meta["num_parameters"] == sum(p.numel() for p in model.parameters())

    text = "Hello world! What colour is the square? 1234 <|im_start|>user\nhi<|im_end|><think>x</think>"
    encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(encoded) == text
    assert ids["<|im_start|>"] in encoded and ids["<|im_end|>"] in encoded

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the answer?"}], add_generation_prompt=True, return_dict=True,
        return_tensors="pt")
    header = "<|im_start|>assistant\n" + ("<think>\n" if name.startswith("tiny-qwen3.5") else "")
    assert tokenizer.decode(prompt["input_ids"][0]).endswith("<|im_end|>\n" + header)
    with torch.no_grad():
        logits = model(input_ids=prompt["input_ids"]).logits
    assert logits.shape == (1, prompt["input_ids"].shape[1], meta["model_vocab_size"])
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", VISION_NAMES)
def test_vision_builtins_take_an_image_in_the_forward(cache_dir, name):
    path = cache_dir / name
    preprocessor = json.loads((path / "preprocessor_config.json").read_text())
    model, meta = _load_model(path)
    image_pad = meta["special_token_ids"]["<|image_pad|>"]
    assert model.config.image_token_id == image_pad
    # One still image of 4x4 patches: 16 patches merge 2x2 into 4 image tokens.
    patch, temporal = preprocessor["patch_size"], preprocessor["temporal_patch_size"]
    image_grid_thw = torch.tensor([[1, 4, 4]])
    pixel_values = torch.randn(16, 3 * temporal * patch * patch, generator=torch.Generator().manual_seed(0))
    ids = meta["special_token_ids"]
    input_ids = torch.tensor([[ids["<|im_start|>"], ids["<|vision_start|>"], *[image_pad] * 4,
                               ids["<|vision_end|>"], ids["<|im_end|>"]]])
    with torch.no_grad():
        with_image = model(input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                           mm_token_type_ids=(input_ids == image_pad).int()).logits
        other_image = model(input_ids=input_ids, pixel_values=pixel_values + 1, image_grid_thw=image_grid_thw,
                            mm_token_type_ids=(input_ids == image_pad).int()).logits
    assert with_image.shape == (1, input_ids.shape[1], meta["model_vocab_size"])
    assert not torch.allclose(with_image[0, -1], other_image[0, -1])


def test_moe_experts_are_saved_in_the_released_layout_and_reload_unchanged(cache_dir):
    path = cache_dir / "tiny-qwen3-vl-moe"
    with safe_open(str(path / "model.safetensors"), "pt") as weights:
        shapes = {k: weights.get_slice(k).get_shape() for k in weights.keys() if ".experts." in k}
    assert shapes["model.language_model.layers.0.mlp.experts.gate_up_proj"] == [4, 128, 192]
    assert shapes["model.language_model.layers.0.mlp.experts.down_proj"] == [4, 96, 128]
    loaded, _ = _load_model(path)
    torch.manual_seed(0)
    fresh = AutoModelForImageTextToText.from_config(loaded.config)
    for (name, expected), actual in zip(fresh.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(expected, actual), name


def test_qwen3_chat_template_drops_old_thinking_and_can_disable_it(cache_dir):
    tokenizer = AutoTokenizer.from_pretrained(cache_dir / "tiny-qwen3")
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nhello"},
        {"role": "user", "content": "again"},
    ]
    history = ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
               "<|im_start|>user\nagain<|im_end|>\n")
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == history + "<|im_start|>assistant\n"
    no_thinking = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                enable_thinking=False)
    assert no_thinking == history + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    last_turn = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert last_turn.endswith("<|im_start|>assistant\n<think>\nhmm\n</think>\n\nhello<|im_end|>\n")


def test_vl_chat_templates_put_one_image_pad_per_image(cache_dir):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    for name in VISION_NAMES:
        rendered = AutoTokenizer.from_pretrained(cache_dir / name).apply_chat_template(messages, tokenize=False)
        system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" if "qwen2" in name else ""
        assert rendered == system + "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe.<|im_end|>\n"


def test_unknown_builtin_name_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="tiny-qwen2.5-vl"):
        ensure_builtin_model("tiny-llama", tmp_path)
    with pytest.raises(ValueError, match="qwen3-vl-moe"):
        build_tiny_model("llama", tmp_path / "llama")


def test_cli_writes_a_model_directory(cache_dir, tmp_path):
    out = tmp_path / "cli-model"
    subprocess.run([sys.executable, "-m", "server.models.tiny", "--family", "qwen3", "--out", str(out)],
                   cwd=REPO_ROOT, check=True, capture_output=True)
    # A separate process reproduces the in-process build byte for byte.
    assert _files(out) == _files(cache_dir / "tiny-qwen3")


@pytest.mark.parametrize("renderer_name", ["qwen3_5", "qwen3_5_disable_thinking"])
def test_qwen3_5_chat_template_renders_the_cookbooks_generation_prompt(cache_dir, renderer_name):
    from tinker_cookbook.image_processing_utils import get_image_processor
    from tinker_cookbook.renderers import get_renderer

    path = cache_dir / "tiny-qwen3.5"
    tokenizer = AutoTokenizer.from_pretrained(path)
    renderer = get_renderer(renderer_name, tokenizer, image_processor=get_image_processor(str(path)))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": " again "}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             enable_thinking=renderer_name == "qwen3_5")
    assert renderer.build_generation_prompt(messages).to_ints() == list(expected["input_ids"])
