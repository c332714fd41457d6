"""For the embedded engine's tests: an engine whose forwards report what they are given, and random LoRA
adapters (their B matrices are not zero, so each samples differently from the base model and the others)."""

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from server.config import ModelConfig
from server.lora.layers import LoraAdapter, LoraTarget, select_targets
from server.sampling.embedded import EmbeddedEngine, load_engine_model
from server.sampling.embedded_batch import EngineModel
from server.sampling.types import SamplingRequest

REFUSED_TOKEN_IDS = frozenset({769, 770})  # the tiny models' <|image_pad|> and <|video_pad|>


def logged_engine(base_model: str, models_dir: Path, log: Callable[[EngineModel, dict], None],
                  **engine_options) -> EmbeddedEngine:
    """An engine on the built-in `base_model` whose language model calls `log(engine_model, kwargs)` before
    each forward."""

    return EmbeddedEngine(lambda: with_logged_forwards(load_engine_model(
        ModelConfig(base_model=base_model, model_path=None, model_cache_dir=models_dir), 1 << 26), log),
        **engine_options)


def with_logged_forwards(engine_model: EngineModel, log: Callable[[EngineModel, dict], None]) -> EngineModel:
    """The engine's model, its language model now calling `log(engine_model, kwargs)` before each forward."""
    inner = engine_model.model.model
    forward = inner.forward

    def logged(*args, **call):
        log(engine_model, call)
        return forward(*args, **call)

    inner.forward = logged
    return engine_model


def adapter(targets: list[LoraTarget], seed: int, rank: int, train_unembed: bool = True) -> LoraAdapter:
    chosen = select_targets(targets, train_attn=True, train_mlp=True, train_unembed=train_unembed)
    lora = LoraAdapter.initialize(chosen, rank, alpha=2.0 * rank, seed=seed, device="cpu").frozen_copy()
    generator = torch.Generator().manual_seed(seed)
    for name, lora_B in lora.lora_B.items():
        lora.lora_B[name] = torch.randn(lora_B.shape, generator=generator) * 0.3
    return lora


@contextmanager
def engines_by_mode(make: Callable[[str], EmbeddedEngine], modes: tuple[str, ...]) -> Iterator[dict]:
    """An engine per decode mode (DecodeSettings.mode), closed on exit."""
    made = {mode: make(mode) for mode in modes}
    try:
        yield made
    finally:
        for engine in made.values():
            engine.close()


def join_while_decoding(engine: EmbeddedEngine, first: SamplingRequest, others: list[SamplingRequest]) -> list:
    """Run `first`, and the others joining at once when its first sample has three tokens: they are submitted
    while its token hook holds the engine thread, so they join at that step whatever the machine's load."""
    decoding, submitted, sampled = threading.Event(), threading.Event(), []

    def on_token(sample, *_):
        sampled.append(sample)
        if sample == 0 and sampled.count(0) == 3:
            decoding.set()
            assert submitted.wait(timeout=120)

    future = engine.submit(replace(first, on_token=on_token))
    assert decoding.wait(timeout=120)
    futures = [engine.submit(request) for request in others]
    submitted.set()
    return [future.result()] + [other.result() for other in futures]
