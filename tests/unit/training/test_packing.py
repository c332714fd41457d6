"""Packed micro-batches against padded rows, on the tiny vision-language models: the same per-datum
logprobs, losses and LoRA gradients (fp32), with images, uneven lengths and two runs in one micro-batch;
on the CPU the per-datum SDPA attention (the varlen one is tested on a GPU: tests/gpu/test_packed_varlen_gpu.py).

Each trainer holds its own copy of the base model and builds the same two runs from the same seeds.
"""

import numpy as np
import pytest
import torch

from server.config import TrainerConfig
from server.training.packing import cumulative_lengths, pack_balanced, packed_attention

from support.packing import build_trainer, step_two_runs


@pytest.mark.parametrize("name", ["builtin:tiny-qwen2-vl", "builtin:tiny-qwen3-vl"])
def test_packed_micro_batches_give_the_padded_rows_logprobs_losses_and_gradients_with_images_and_two_runs(
        models_dir, name):
    results = {}
    for layout in ("padded", "packed"):
        trainer = build_trainer(name, models_dir, layout)
        assert trainer.packed == (layout == "packed")
        assert trainer.packed_attention == "sdpa"  # on the CPU, one SDPA call per datum
        results[layout] = step_two_runs(trainer)
    (padded, padded_grads), (packed, packed_grads) = results["padded"], results["packed"]
    for padded_result, packed_result in zip(padded, packed, strict=True):
        for a, b in zip(packed_result.outputs, padded_result.outputs, strict=True):
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=0, atol=1e-5)
            np.testing.assert_allclose(a["elementwise_loss"], b["elementwise_loss"], rtol=0, atol=1e-5)
        assert packed_result.loss == pytest.approx(padded_result.loss, abs=1e-4)
    for run_packed, run_padded in zip(packed_grads, padded_grads, strict=True):
        for a, e in zip(run_packed, run_padded, strict=True):
            assert (a - e).norm() <= 1e-5 * max(e.norm(), 1.0)


def test_packed_rows_keep_one_sdpa_call_per_datum_where_the_varlen_kernel_cannot_run():
    cpu = torch.device("cpu")
    assert packed_attention("auto", cpu, torch.bfloat16) == "sdpa"
    assert packed_attention("sdpa", cpu, torch.float32) == "sdpa"
    with pytest.raises(ValueError, match="--packed-attention varlen needs"):
        packed_attention("varlen", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="packed_attention must be"):
        TrainerConfig(packed_attention="flash")


def test_cumulative_lengths_give_each_datums_start_and_the_rows_end_as_int32():
    cu_seqlens = cumulative_lengths(torch.tensor([5, 1, 30, 1]), torch.device("cpu"))
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == [0, 5, 6, 36, 37]


def test_packing_puts_a_longer_datum_alone_and_fills_no_more_micro_batches_than_first_fit():
    assert pack_balanced([50, 200, 70, 30, 90, 10], 100) == [[1], [4], [2, 5], [0, 3]]  # first fit: 4 bins too


def test_packing_evens_the_micro_batches_tokens_instead_of_leaving_a_small_last_one():
    # First fit would give [4000, 4000] and [2000]: a small micro-batch costs the host nearly a full one's time.
    bins = pack_balanced([4000, 4000, 1000, 1000], 8192)
    assert sorted(sorted(b) for b in bins) == [[0, 2], [1, 3]]


def test_packing_falls_back_to_first_fit_where_evening_out_would_overflow_a_micro_batch():
    lengths = [5, 5, 4, 3, 3]  # first fit: [5, 5], [4, 3, 3]; longest first into the emptiest: 5+3+3 > 10
    bins = pack_balanced(lengths, 10)
    assert sorted(sorted(b) for b in bins) == [[0, 1], [2, 3, 4]]
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
