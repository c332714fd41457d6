"""Checkpoint files: the adapter in the standard PEFT layout, plus AdamW moments for training checkpoints.

A sampler checkpoint is `adapter_config.json` + `adapter_model.safetensors`, loadable by PEFT and
vLLM as it is. A training checkpoint adds `optimizer.safetensors` and `checkpoint_meta.json`
(LoRA config, step count). Files are written from an `AdapterState`, a copy in host memory, so
the training thread only takes the copy and the disk is someone else's wait. Knows nothing about
tinker:// paths or the database.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load, save_file

from server.errors import InvalidRequest
from server.lora.experts import peft_target_parameters
from server.lora.layers import LoraAdapter
from server.models.registry import ATTENTION_PROJECTIONS, LINEAR_ATTENTION_PROJECTIONS, MLP_PROJECTIONS
from server.wire.models import LoraConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
OPTIMIZER_STATE = "optimizer.safetensors"
META = "checkpoint_meta.json"
_MOMENTS = ("exp_avg", "exp_avg_sq", "step")


@dataclass
class AdapterState:
    """A run's adapter, and for a training checkpoint its AdamW moments, copied to host memory."""

    adapter: LoraAdapter
    lora_config: LoraConfig
    num_steps: int
    base_model: str
    moments: dict[str, torch.Tensor] | None
    """Keyed `{module}.{lora_A|lora_B}.{exp_avg|exp_avg_sq|step}`; None for a sampler checkpoint."""


def copy_state(adapter: LoraAdapter, optimizer: torch.optim.AdamW | None, lora_config: LoraConfig, num_steps: int,
               base_model: str) -> AdapterState:
    """The adapter (and, given the optimizer, its moments) copied to host memory."""
    moments = None
    if optimizer is not None:
        state = optimizer.state_dict()["state"]
        moments = {}
        for index, (name, part) in enumerate(_parameter_names(adapter)):
            for moment, value in state.get(index, {}).items():
                value = value.detach().to("cpu", torch.float32, copy=True)
                moments[f"{name}.{part}.{moment}"] = value.reshape(1) if moment == "step" else value
    return AdapterState(adapter.frozen_copy("cpu"), lora_config, num_steps, base_model, moments)


def _parameter_names(adapter: LoraAdapter) -> list[tuple[str, str]]:
    """(module, lora_A | lora_B) in the adapter's parameter order, the optimizer's."""
    return [(name, part) for name in sorted(adapter.lora_A) for part in ("lora_A", "lora_B")]


@dataclass
class LoadedCheckpoint:
    adapter: LoraAdapter
    lora_config: LoraConfig
    optimizer_state: dict[str, torch.Tensor] | None
    num_steps: int


def _directory_size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file())


def save_peft_adapter(directory: Path, adapter: LoraAdapter, base_model: str, lora_config: LoraConfig | None = None,
                      num_steps: int = 0, dtype: torch.dtype | None = None) -> int:
    """Write the adapter (and its config) in PEFT's layout, its tensors as `dtype` if given (else as trained);
    returns the directory's size in bytes."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = adapter.peft_state_dict()
    if dtype is not None:
        weights = {name: tensor.to(dtype) for name, tensor in weights.items()}
    save_file(weights, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    experts = peft_target_parameters(list(adapter.lora_A))
    peft_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": adapter.rank, "lora_alpha": adapter.alpha, "lora_dropout": 0.0, "bias": "none",
        # Full module paths: short names like "gate_proj" would also match the vision tower.
        "target_modules": sorted(set(adapter.lora_A) - set(experts)), "fan_in_fan_out": False,
        "use_rslora": False, "init_lora_weights": True, "modules_to_save": None,
    }
    if experts:  # a MoE's routed experts: fused 3-D parameters, not modules
        peft_config["target_parameters"] = sorted(experts.values())
    (directory / ADAPTER_CONFIG).write_text(json.dumps(peft_config, indent=2))
    if lora_config is not None:
        (directory / META).write_text(json.dumps({"format": 1, "base_model": base_model, "num_steps": num_steps,
                                                  "lora_config": lora_config.model_dump()}, indent=2))
    return _directory_size(directory)


def save_state(directory: Path, state: AdapterState) -> int:
    """A training checkpoint (adapter + AdamW moments keyed by module name) when the state holds the
    moments, else a sampler checkpoint; returns the directory's size in bytes."""
    if state.moments is None:
        return save_peft_adapter(directory, state.adapter, state.base_model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state.moments, str(directory / OPTIMIZER_STATE))
    return save_peft_adapter(directory, state.adapter, state.base_model, state.lora_config, state.num_steps)


CheckpointFiles = dict[str, bytes]
"""A checkpoint's files by name, as read from disk: what rank 0 sends the other training ranks, so that
only its own node needs the checkpoint directory."""


def read_checkpoint(directory: Path, with_optimizer: bool) -> CheckpointFiles:
    """The files that loading a checkpoint needs; `with_optimizer` needs a training checkpoint."""
    directory = Path(directory)
    if with_optimizer and not (directory / OPTIMIZER_STATE).exists():
        raise InvalidRequest("this checkpoint has no optimizer state (it is a sampler checkpoint); "
                             "load it without the optimizer")
    names = [ADAPTER_CONFIG, ADAPTER_WEIGHTS] + ([OPTIMIZER_STATE] if with_optimizer else [])
    if (directory / META).exists():  # a PEFT adapter made elsewhere has none
        names.append(META)
    return {name: (directory / name).read_bytes() for name in names}


def parse_checkpoint(files: CheckpointFiles, device: torch.device | str) -> LoadedCheckpoint:
    """A checkpoint's adapter (and optimizer moments, if its files hold them) on `device`."""
    peft_config = json.loads(files[ADAPTER_CONFIG])
    adapter = LoraAdapter.from_peft_state_dict(load(files[ADAPTER_WEIGHTS]), peft_config["r"],
                                               peft_config["lora_alpha"], device, trainable=True)
    if META in files:
        meta = json.loads(files[META])
        lora_config, num_steps = LoraConfig.model_validate(meta["lora_config"]), meta["num_steps"]
    else:
        lora_config, num_steps = _inferred_lora_config(adapter), 0
    optimizer_state = None
    if OPTIMIZER_STATE in files:
        optimizer_state = {name: tensor.to(device) for name, tensor in load(files[OPTIMIZER_STATE]).items()}
    return LoadedCheckpoint(adapter, lora_config, optimizer_state, num_steps)


def _inferred_lora_config(adapter: LoraAdapter) -> LoraConfig:
    """The train_* flags of an adapter saved without them (a sampler checkpoint, a PEFT adapter made elsewhere),
    from its modules' names: a MoE's routed experts (fused, named by their module) count as its MLP."""
    experts = peft_target_parameters(list(adapter.lora_A))
    leaves = {name.rpartition(".")[2] for name in adapter.lora_A if name not in experts}
    return LoraConfig(rank=adapter.rank, train_unembed="lm_head" in leaves,
                      train_attn=bool(leaves & {*ATTENTION_PROJECTIONS, *LINEAR_ATTENTION_PROJECTIONS}),
                      train_mlp=bool(experts) or bool(leaves & set(MLP_PROJECTIONS)))


def load_checkpoint(directory: Path, device: torch.device | str, with_optimizer: bool) -> LoadedCheckpoint:
    """Read a checkpoint written by this module; `with_optimizer` needs a training checkpoint."""
    return parse_checkpoint(read_checkpoint(directory, with_optimizer), device)


def optimizer_moments(adapter: LoraAdapter, moments: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Saved moments as the `state` part of an AdamW state_dict, in the adapter's parameter order."""
    state = {}
    for index, (name, part) in enumerate(_parameter_names(adapter)):
        entry = {m: moments[f"{name}.{part}.{m}"] for m in _MOMENTS if f"{name}.{part}.{m}" in moments}
        if entry:
            entry["step"] = entry["step"].reshape(()).cpu()
            state[index] = entry
    return state
