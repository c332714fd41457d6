"""Random LoRA adapters for the sampling engines' tests: their B matrices are not zero, so each samples
differently from the base model and from the others."""

import torch

from server.training.lora import LoraAdapter, LoraTarget, select_targets


def adapter(targets: list[LoraTarget], seed: int, rank: int, train_unembed: bool = True) -> LoraAdapter:
    chosen = select_targets(targets, train_attn=True, train_mlp=True, train_unembed=train_unembed)
    lora = LoraAdapter.initialize(chosen, rank, alpha=2.0 * rank, seed=seed, device="cpu").frozen_copy()
    generator = torch.Generator().manual_seed(seed)
    for name, lora_B in lora.lora_B.items():
        lora.lora_B[name] = torch.randn(lora_B.shape, generator=generator) * 0.3
    return lora
