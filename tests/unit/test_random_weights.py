"""The benchmarks' random checkpoints (benchmarks/random_weights.py, train_throughput.py's write_model): made
module by module from a model on the meta device, they hold the model's state dict (a tied unembedding once),
initialized at transformers' scales, and the directory they fill loads in the server with its experts fused."""

import pytest
import torch
import transformers

from benchmarks.random_weights import random_state_dict
from benchmarks.train_throughput import write_model
from server.config import ModelConfig
from server.models.builtin import ensure_builtin_model
from server.models.expert_layout import weight_map
from server.models.loading import load_base_model


@pytest.mark.parametrize("builtin", ["tiny-qwen3-vl", "tiny-qwen3.5-moe"])  # norms of 1 / zero-centred; MoE
def test_random_weights_are_the_state_dict_transformers_initializes(builtin, models_dir):
    config = transformers.AutoConfig.from_pretrained(ensure_builtin_model(builtin, models_dir))
    torch.manual_seed(0)
    reference = transformers.AutoModelForImageTextToText.from_config(config)
    unique = {}  # a tied tensor under its first name, as save_pretrained writes it
    for name, tensor in reference.state_dict().items():
        unique.setdefault(tensor.data_ptr(), (name, tensor))
    expected = dict(unique.values())
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    made = list(random_state_dict(model, "cpu"))

    names = [name for name, _ in made]
    assert len(names) == len(set(names)) and set(names) == set(expected)  # each once
    assert "lm_head.weight" not in names  # tied: the embedding's tensor
    for name, tensor in made:
        want = expected[name]
        assert (tensor.shape, tensor.dtype, tensor.device.type) == (want.shape, want.dtype, "cpu"), name
        assert torch.isfinite(tensor).all(), name
        if tensor.dim() >= 2:  # drawn here: normal, at transformers' scale (within about 4 standard errors)
            spread = 4 / tensor.numel() ** 0.5
            assert tensor.std().item() == pytest.approx(want.std().item(), rel=spread), name
            assert abs(tensor.mean().item()) < spread * want.std().item(), name
        elif not name.endswith("A_log"):  # norms, biases, dt_bias: transformers' own init (A_log is random)
            torch.testing.assert_close(tensor, want, msg=name)


def test_a_written_moe_checkpoint_loads_fused_in_the_server_with_finite_logits(tmp_path):
    model_dir = write_model("tiny-moe", tmp_path / "model", "cpu")
    names = weight_map(model_dir)
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in names and "lm_head.weight" in names  # untied
    base = load_base_model(ModelConfig(base_model="bench/tiny-moe", model_path=model_dir,
                                       model_cache_dir=tmp_path / "cache", dtype="float32"))
    assert not (tmp_path / "cache" / "fused-experts").exists()  # loaded as written, no conversion
    with torch.no_grad():
        logits = base.model(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10]])).logits
    assert torch.isfinite(logits).all() and logits.std() > 0
