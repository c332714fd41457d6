"""On a CUDA device in bf16 (run on the lent GPU machine: `pytest -m gpu tests/gpu/test_packed_varlen_gpu.py`): a
packed row's attention as ONE varlen flash call per layer gives what one SDPA call per datum gives, and a
training step of the tiny models on packed rows with it gives the padded rows' results.

Stated tolerances (bf16): the attention's output and its gradients to q, k and v stray from an fp32 reference at
most twice as far as the per-datum SDPA path's own, plus 1e-3 (FlashAttention's own test rule); a datum that saw
another would stray by the size of the values. A training step's logprobs on packed rows (varlen) are within
0.1 nat of the padded rows', its losses within 2 % of the sum of their terms' sizes, and every LoRA gradient
within 5 % of its norm (the two-GPU test's bounds: padded rows take another kernel, bf16 rounds differently).
"""

import numpy as np
import pytest
import torch

from server.training import packing
from server.training.packing import cumulative_lengths, packed_attention, segment_attention

from support.packing import build_trainer, step_two_runs

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
LENGTHS = [1, 37, 1, 256, 5, 129, 1]  # 1-token datums first, inside and last; not multiples of flash's blocks


@pytest.fixture(autouse=True)
def varlen_runs_here():
    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA device")
    assert packed_attention("auto", CUDA, torch.bfloat16) == "varlen", "no varlen flash kernel on this GPU"


def attention_and_gradients(query, key, value, grad_output, **row) -> list[torch.Tensor]:
    """A packed row's attention output [1, T, H, D] (fp32) and its gradients to query, key and value."""
    leaves = [x.detach().requires_grad_() for x in (query, key, value)]
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = query.shape[1] // key.shape[1], True
    output, _ = segment_attention(module, *leaves, None, scaling=query.shape[-1] ** -0.5, **row)
    output.backward(grad_output.to(output.dtype))
    return [output.float()] + [leaf.grad.float() for leaf in leaves]


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 8, 64), (8, 2, 128), (2, 1, 64)])
def test_one_varlen_call_gives_the_per_datum_sdpa_output_and_gradients(heads, kv_heads, head_dim):
    generator = torch.Generator(CUDA).manual_seed(0)
    num_positions = sum(LENGTHS)
    # Laid out as in the decoder: query and key [1, H, T, D] as rope leaves them, value a view of its projection.
    query, key = (torch.randn(1, h, num_positions, head_dim, device=CUDA, generator=generator)
                  for h in (heads, kv_heads))
    value = torch.randn(1, num_positions, kv_heads, head_dim, device=CUDA, generator=generator).transpose(1, 2)
    grad_output = torch.randn(1, num_positions, heads, head_dim, device=CUDA, generator=generator)
    lengths = torch.tensor(LENGTHS)
    bf16 = [x.bfloat16() for x in (query, key, value)]
    reference = attention_and_gradients(*(x.float() for x in bf16), grad_output, segment_lengths=lengths)
    per_datum = attention_and_gradients(*bf16, grad_output, segment_lengths=lengths)
    varlen = attention_and_gradients(*bf16, grad_output, segment_lengths=lengths,
                                     cu_seqlens=cumulative_lengths(lengths, CUDA))
    for name, ref, sdpa, one_call in zip(("output", "query", "key", "value"), reference, per_datum, varlen):
        assert one_call.shape == ref.shape, name
        allowed = 2 * (sdpa - ref).abs().max().item() + 1e-3
        worst = (one_call - ref).abs().max().item()
        print(f"{name}: varlen {worst:.2e}, per-datum sdpa {(sdpa - ref).abs().max().item():.2e}")
        assert worst <= allowed, name


@pytest.mark.parametrize("name", ["builtin:tiny-qwen2-vl", "builtin:tiny-qwen3-vl"])
def test_a_packed_varlen_training_step_gives_the_padded_rows_results_within_bf16_rounding(models_dir, monkeypatch,
                                                                                        name):
    varlen_calls = []
    one_call = packing.varlen_attention
    monkeypatch.setattr(packing, "varlen_attention",
                        lambda *args, **kwargs: varlen_calls.append(1) or one_call(*args, **kwargs))
    runs = {}
    for layout, attention in (("padded", "auto"), ("packed", "varlen")):
        trainer = build_trainer(name, models_dir, layout, device="cuda", dtype="bfloat16", packed_attention=attention)
        runs[layout] = step_two_runs(trainer)
        del trainer
    assert varlen_calls  # the packed micro-batches went through the varlen kernel (one call per layer)
    (padded, padded_grads), (packed, packed_grads) = runs["padded"], runs["packed"]
    for padded_result, packed_result in zip(padded, packed, strict=True):
        for a, e in zip(packed_result.outputs, padded_result.outputs, strict=True):
            np.testing.assert_allclose(a["logprobs"], e["logprobs"], rtol=0, atol=0.1)
        # The loss is a sum of terms of either sign (random weights): its scale is the sum of their sizes.
        scale = sum(np.abs(np.asarray(e["elementwise_loss"])).sum() for e in padded_result.outputs)
        assert abs(packed_result.loss - padded_result.loss) <= 2e-2 * scale
    worst = max(float((a - e).float().norm() / e.float().norm())
                for run_packed, run_padded in zip(packed_grads, padded_grads, strict=True)
                for a, e in zip(run_packed, run_padded, strict=True))
    print("worst relative difference of a LoRA gradient", worst)
    assert worst < 5e-2
