"""The additive SDPA masks every model loads with: the same attention as transformers' boolean masks."""

import torch
from transformers import AutoModelForImageTextToText
from transformers.masking_utils import sdpa_mask

from server.models.attention import ATTENTION, additive_sdpa_mask
from server.models.builtin import ensure_builtin_model


def test_a_padding_mask_becomes_a_zero_or_minimum_bias_of_the_models_dtype():
    padding = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    arguments = dict(batch_size=2, q_length=4, kv_length=4, attention_mask=padding, allow_is_causal_skip=True)
    boolean = sdpa_mask(**arguments)
    additive = additive_sdpa_mask(**arguments, dtype=torch.bfloat16)
    assert boolean.dtype == torch.bool and additive.dtype == torch.bfloat16
    assert torch.equal(additive == 0, boolean)
    assert torch.equal(additive[~boolean], torch.full_like(additive[~boolean], torch.finfo(torch.bfloat16).min))
    # Causal attention without padding needs no mask at all, as before.
    assert additive_sdpa_mask(batch_size=2, q_length=4, kv_length=4, attention_mask=torch.ones(2, 4, dtype=torch.bool),
                              allow_is_causal_skip=True) is None


def test_a_padded_batch_attends_as_with_boolean_masks_forward_and_backward(models_dir):
    path = ensure_builtin_model("tiny-qwen2-vl", models_dir)
    models = [AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation=name)
              for name in ("sdpa", ATTENTION)]
    input_ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 10, 11, 12]])
    padding = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    outputs, gradients = [], []
    for model in models:
        hidden = model.model(input_ids=input_ids, attention_mask=padding).last_hidden_state
        hidden[padding.bool()].square().sum().backward()
        outputs.append(hidden[padding.bool()].detach())
        gradients.append(model.model.language_model.layers[0].self_attn.q_proj.weight.grad)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gradients[1], gradients[0], rtol=1e-4, atol=1e-5)
