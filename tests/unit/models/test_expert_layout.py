"""A checkpoint with per-expert tensors (as releases store them) loads from a fused copy written once in the
model cache, with transformers' own logits; a sharded rank's load leaves only the decoder blocks on the host."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForImageTextToText

from server.config import ModelConfig
from server.models.builtin import ensure_builtin_model
from server.models.expert_layout import INDEX, PER_EXPERT, fused_weights_dir, weight_map
from server.models.loading import load_base_model

INPUT_IDS_BT = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])


@pytest.fixture(scope="module")
def per_expert_dir(models_dir):
    path = ensure_builtin_model("tiny-qwen3.5-moe", models_dir)
    assert any(PER_EXPERT.match(name) for name in weight_map(path))  # saved as releases store experts
    return path


def test_a_per_expert_checkpoint_loads_from_a_fused_copy_with_transformers_own_logits(per_expert_dir, tmp_path):
    config = ModelConfig(base_model="Qwen/Qwen3.6-35B-A3B", model_path=per_expert_dir, model_cache_dir=tmp_path,
                         dtype="float32")
    base = load_base_model(config)
    [fused] = (tmp_path / "fused-experts").glob("*/" + INDEX)
    names = weight_map(fused.parent)
    assert not any(PER_EXPERT.match(name) for name in names)
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in names
    with safe_open(fused.parent / names["model.language_model.layers.0.mlp.experts.gate_up_proj"], "pt") as handle:
        assert handle.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape()[0] == \
            base.model.config.text_config.num_experts
    reference = AutoModelForImageTextToText.from_pretrained(per_expert_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(base.model(input_ids=INPUT_IDS_BT).logits,
                                   reference(input_ids=INPUT_IDS_BT).logits, atol=1e-5, rtol=0)
    assert base.path == per_expert_dir  # tokenizer and processor still come from the original directory

    written = fused.stat().st_mtime_ns
    load_base_model(config)
    assert fused.stat().st_mtime_ns == written  # the second load reuses the copy


def test_a_sharded_rank_leaves_only_the_decoder_blocks_on_the_host(per_expert_dir, tmp_path):
    config = ModelConfig(base_model="Qwen/Qwen3.6-35B-A3B", model_path=per_expert_dir, model_cache_dir=tmp_path)
    base = load_base_model(config, device="meta", blocks_on_host=True)  # "meta" stands for the rank's GPU
    blocks = base.family.language_model_prefix
    on_host = {p.device.type for name, p in base.model.named_parameters() if name.startswith(blocks)}
    elsewhere = {p.device.type for name, p in base.model.named_parameters() if not name.startswith(blocks)}
    assert (on_host, elsewhere) == ({"cpu"}, {"meta"})


def test_per_expert_tensors_named_unlike_the_models_experts_are_left_to_transformers(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    save_file({f"mtp.layers.0.mlp.experts.{e}.{p}.weight": torch.zeros(2, 2) for e in range(2)
               for p in ("gate_proj", "up_proj", "down_proj")}, checkpoint / "model.safetensors")
    shapes = {"model.layers.0.mlp.experts.gate_up_proj": torch.Size([2, 4, 2])}
    assert fused_weights_dir(checkpoint, tmp_path / "cache", lambda: shapes) == checkpoint
    assert not list((tmp_path / "cache" / "fused-experts").glob("*/" + INDEX))
