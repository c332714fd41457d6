"""Packed micro-batches against padded rows, on the tiny vision-language models: the same per-datum
logprobs, losses and LoRA gradients (fp32), with images, uneven lengths and two runs in one micro-batch.

Each trainer holds its own copy of the base model and builds the same two runs from the same seeds.
"""

import numpy as np
import pytest
import torch

from server.config import ModelConfig, TrainerConfig
from server.models.loading import load_base_model
from server.models.vision_features import VisionEncoder
from server.rendering.chunks import render_model_input
from server.rendering.training import TrainingExample, render_training_datum
from server.training.operations import ForwardBackward
from server.training.packing import pack_first_fit
from server.training.parallel import free_port, init_training_group
from server.training.trainer import Trainer
from server.wire.model_input import EncodedTextChunk, ImageChunk, ModelInput
from server.wire.models import LoraConfig
from server.wire.training import Datum

from support.vision import context_for, encode, noise_image


def build_trainer(name: str, models_dir, layout: str) -> Trainer:
    base = load_base_model(ModelConfig(base_model=name, model_path=None, model_cache_dir=models_dir))
    # Micro-batches of at most 160 tokens: several datums share one, and the longest needs one alone.
    config = TrainerConfig(microbatch_layout=layout, max_tokens_per_microbatch=160, logprob_chunk_size=7)
    return Trainer(base, config, init_training_group(0, 1, "cpu", "127.0.0.1", free_port()),
                   VisionEncoder(base.model, 1 << 24))


def datums(trainer: Trainer, seed: int, shapes: list[tuple[int, int]]) -> list[TrainingExample]:
    """Datums of (text tokens, images) each: text, the images, text again; random targets and weights."""
    generator = torch.Generator().manual_seed(seed)
    context = context_for(trainer.base)
    examples = []
    for index, (num_tokens, num_images) in enumerate(shapes):
        def text(n):
            return EncodedTextChunk(tokens=torch.randint(10, 200, (n,), generator=generator).tolist())
        images = [ImageChunk(data=encode(noise_image(28 + 14 * i, 28, seed=seed + index + i)), format="png")
                  for i in range(num_images)]
        model_input = ModelInput(chunks=[text(num_tokens // 2), *images, text(num_tokens - num_tokens // 2)])
        num_positions = len(render_model_input(model_input, context, "datum").expanded_token_ids())
        inputs = {"target_tokens": torch.randint(10, 200, (num_positions,), generator=generator),
                  "weights": torch.randn(num_positions, generator=generator)}
        examples.append(render_training_datum(Datum(model_input=model_input, loss_fn_inputs=inputs), index, context,
                                              ("weights",)))
    return examples


@pytest.mark.parametrize("name", ["builtin:tiny-qwen2-vl", "builtin:tiny-qwen3-vl"])
def test_packed_micro_batches_give_the_padded_rows_logprobs_losses_and_gradients_with_images_and_two_runs(
        models_dir, name):
    results = {}
    for layout in ("padded", "packed"):
        trainer = build_trainer(name, models_dir, layout)
        assert trainer.packed == (layout == "packed")
        model_ids = []
        for i in range(2):
            trainer.create_model(f"run-{i}", LoraConfig(rank=4, seed=i, train_unembed=True))
            adapter = trainer.models[f"run-{i}"].adapter
            generator = torch.Generator().manual_seed(10 + i)
            with torch.no_grad():  # B away from zero, so that each run's adapter changes the model
                for key in sorted(adapter.lora_B):
                    adapter.lora_B[key].copy_(torch.randn(adapter.lora_B[key].shape, generator=generator) * 0.05)
            model_ids.append(f"run-{i}")
        batches = [datums(trainer, 1, [(30, 1), (7, 0), (60, 2)]), datums(trainer, 2, [(12, 0), (25, 1)])]
        passed = trainer.forward_backward_pass([ForwardBackward(model_id, batch, "cross_entropy", None, False)
                                                for model_id, batch in zip(model_ids, batches)])
        gradients = [[p.grad.clone() for p in trainer.models[model_id].adapter.parameters()] for model_id in model_ids]
        results[layout] = passed, gradients
    (padded, padded_grads), (packed, packed_grads) = results["padded"], results["packed"]
    for padded_result, packed_result in zip(padded, packed, strict=True):
        for a, b in zip(packed_result.outputs, padded_result.outputs, strict=True):
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=0, atol=1e-5)
            np.testing.assert_allclose(a["elementwise_loss"], b["elementwise_loss"], rtol=0, atol=1e-5)
        assert packed_result.loss == pytest.approx(padded_result.loss, abs=1e-4)
    for run_packed, run_padded in zip(packed_grads, padded_grads, strict=True):
        for a, e in zip(run_packed, run_padded, strict=True):
            assert (a - e).norm() <= 1e-5 * max(e.norm(), 1.0)


def test_first_fit_fills_micro_batches_up_to_the_budget_and_puts_a_longer_datum_alone():
    assert pack_first_fit([50, 200, 70, 30, 90, 10], 100) == [[1], [4, 5], [2, 3], [0]]
