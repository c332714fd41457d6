"""Trainers on the tiny vision-language models and one forward_backward pass of two runs over datums of
uneven lengths with images: what packed micro-batches are compared on, against padded rows."""

import torch

from server.config import ModelConfig, TrainerConfig
from server.models.loading import load_base_model
from server.models.vision_features import VisionEncoder
from server.rendering.chunks import render_model_input
from server.rendering.training import TrainingExample, render_training_datum
from server.training.operations import ForwardBackward
from server.training.parallel import free_port, init_training_group
from server.training.trainer import ForwardBackwardResult, Trainer
from server.wire.model_input import EncodedTextChunk, ImageChunk, ModelInput
from server.wire.models import LoraConfig
from server.wire.training import Datum

from support.vision import context_for, encode, noise_image


def build_trainer(name: str, models_dir, layout: str, device: str = "cpu", dtype: str = "float32",
                  packed_attention: str = "auto") -> Trainer:
    """A trainer of its own copy of the base model, micro-batches of at most 160 tokens: several datums share
    one, and the longest needs one alone."""
    base = load_base_model(ModelConfig(base_model=name, model_path=None, model_cache_dir=models_dir, device=device,
                                       dtype=dtype))
    config = TrainerConfig(microbatch_layout=layout, packed_attention=packed_attention, max_tokens_per_microbatch=160,
                           logprob_chunk_size=7)
    return Trainer(base, config, init_training_group(0, 1, device, "127.0.0.1", free_port()),
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


def step_two_runs(trainer: Trainer) -> tuple[list[ForwardBackwardResult], list[list[torch.Tensor]]]:
    """Two runs built from the same seeds on every trainer, one forward_backward pass of both (five datums of
    7-60 text tokens and 0-2 images, one of 1 token); their results and each run's LoRA gradients."""
    model_ids = []
    for i in range(2):
        trainer.create_model(f"run-{i}", LoraConfig(rank=4, seed=i, train_unembed=True))
        adapter = trainer.models[f"run-{i}"].adapter
        generator = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():  # B away from zero, so that each run's adapter changes the model
            for key in sorted(adapter.lora_B):
                adapter.lora_B[key].copy_(torch.randn(adapter.lora_B[key].shape, generator=generator) * 0.05)
        model_ids.append(f"run-{i}")
    batches = [datums(trainer, 1, [(30, 1), (7, 0), (60, 2)]), datums(trainer, 2, [(1, 0), (12, 0), (25, 1)])]
    passed = trainer.forward_backward_pass([ForwardBackward(model_id, batch, "cross_entropy", None, False)
                                            for model_id, batch in zip(model_ids, batches)])
    gradients = [[p.grad.clone() for p in trainer.models[model_id].adapter.parameters()] for model_id in model_ids]
    return passed, gradients
