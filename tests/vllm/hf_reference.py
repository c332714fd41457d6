"""The HF transformers side of the vLLM parity tests: teacher-forced logprobs, images, adapters.

Images go through the processor-free path a server uses: the image processor alone, each single
<|image_pad|> expanded to the image's token count, and `mm_token_type_ids` marking the pads.
Logprobs are of the server's distribution: the media placeholders masked (zero probability), and
0 where the target is one (an image position).
"""

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText

from server.lora.checkpoint_io import load_checkpoint, save_peft_adapter
from server.lora.layers import LoraAdapter, apply_lora_wrappers, select_targets, use_adapter
from server.models.registry import family_for

# Tensor shape suffixes: T = sequence positions, V = vocabulary.

IMAGE_PAD = "<|image_pad|>"
REFUSED_TOKEN_IDS = [769, 770]  # the tiny models' <|image_pad|> and <|video_pad|>


def load_model(model_dir: Path, with_lora_wrappers: bool = False) -> torch.nn.Module:
    """The tiny model in fp32, optionally with the trainer's LoRA wrappers (inactive until use_adapter)."""
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    if with_lora_wrappers:
        _, model.lora_slot = apply_lora_wrappers(model, family_for(model.config.model_type))
    return model


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    """Random RGB noise: any resampling or preprocessing difference would show in the logprobs."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def image_inputs(model_dir: Path, images: list[Image.Image]) -> dict[str, torch.Tensor]:
    """pixel_values and image_grid_thw from the image processor alone."""
    processor = AutoImageProcessor.from_pretrained(model_dir)
    return dict(processor(images=images, return_tensors="pt"))


def expand_image_pads(token_ids: list[int], image_pad_id: int, image_grid_thw: torch.Tensor,
                      merge_size: int = 2) -> list[int]:
    """Replace the i-th single pad by as many pads as image i has tokens (what vLLM does)."""
    counts = (image_grid_thw.prod(dim=-1) // merge_size**2).tolist()
    assert token_ids.count(image_pad_id) == len(counts)
    expanded = []
    for token in token_ids:
        expanded.extend([token] * counts.pop(0) if token == image_pad_id else [token])
    return expanded


def full_logprobs(model: torch.nn.Module, token_ids: list[int], images: dict[str, torch.Tensor] | None = None,
                  adapter: LoraAdapter | None = None) -> torch.Tensor:
    """Masked log_softmax over the vocabulary at every position (row t predicts token t + 1); ids are expanded."""
    input_ids = torch.tensor([token_ids])
    kwargs = {}
    if images:
        kwargs = dict(images, mm_token_type_ids=(input_ids == model.config.image_token_id).int())
    with torch.no_grad(), use_adapter(model.lora_slot, adapter) if adapter is not None else torch.no_grad():
        logits_TV = model(input_ids=input_ids, **kwargs).logits[0].float()
    return logits_TV.index_fill(-1, torch.tensor(REFUSED_TOKEN_IDS), float("-inf")).log_softmax(dim=-1)


def unmasked_probs(model: torch.nn.Module, token_ids: list[int], adapter: LoraAdapter | None = None) -> torch.Tensor:
    """The model's own softmax at every position, placeholders included (what an unmasked sampler draws from)."""
    with torch.no_grad(), use_adapter(model.lora_slot, adapter) if adapter is not None else torch.no_grad():
        return model(input_ids=torch.tensor([token_ids])).logits[0].float().softmax(dim=-1)


def teacher_forced_logprobs(model: torch.nn.Module, token_ids: list[int], images: dict[str, torch.Tensor] | None = None,
                            adapter: LoraAdapter | None = None) -> torch.Tensor:
    """logprob of token t given the tokens before it, for t >= 1 (entry 0 is nan)."""
    logprobs_TV = full_logprobs(model, token_ids, images, adapter)
    targets = torch.tensor(token_ids[1:])
    picked = logprobs_TV[torch.arange(len(token_ids) - 1), targets]
    picked = picked.masked_fill(torch.isin(targets, torch.tensor(REFUSED_TOKEN_IDS)), 0.0)
    return torch.cat([torch.tensor([float("nan")]), picked])


def write_adapter(model_dir: Path, out: Path, seed: int, *, train_unembed: bool = False, rank: int = 8) -> Path:
    """A PEFT adapter written by the trainer's checkpoint_io, with random non-zero B so it changes outputs."""
    model = load_model(model_dir)
    targets, _ = apply_lora_wrappers(model, family_for(model.config.model_type))
    targets = select_targets(targets, train_attn=True, train_mlp=True, train_unembed=train_unembed)
    adapter = LoraAdapter.initialize(targets, rank, alpha=2.0 * rank, seed=seed, device="cpu")
    generator = torch.Generator().manual_seed(seed)
    for name, lora_B in adapter.lora_B.items():
        adapter.lora_B[name] = torch.randn(lora_B.shape, generator=generator) * 0.5
    save_peft_adapter(out, adapter, base_model=f"tiny:{model_dir.name}")
    return out


def read_adapter(directory: Path) -> LoraAdapter:
    return load_checkpoint(directory, "cpu", with_optimizer=False).adapter
