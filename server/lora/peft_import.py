"""A PEFT LoRA adapter made elsewhere (`adapter_config.json` + `adapter_model.safetensors`) -> a `LoraAdapter`
of the served model, checked against its LoRA targets.

Everything that would make the adapter mean something else here, or nothing, is refused by name: another base
model, a rank outside the server's limit or unlike its tensors' shapes, a module that is not one of
the served model's LoRA targets (the vision tower, embeddings), a shape unlike the module's, and the
PEFT options this server's LoRA does not compute (DoRA, rsLoRA, biases, per-module ranks), and weights
that are not finite. Knows nothing about tinker:// paths, tenants or HTTP.
"""

from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from server.errors import InvalidRequest
from server.lora.layers import LoraAdapter, LoraTarget, all_finite
from server.wire.models import LoraConfig

_PREFIX = "base_model.model."
_PARTS = {"lora_A.weight": "lora_A", "lora_B.weight": "lora_B"}
# PEFT options whose default is the only value this server's LoRA computes.
_DEFAULTS = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "bias": "none",
             "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None}


def read_peft_adapter(peft_config: dict[str, Any], weights: bytes, targets: list[LoraTarget],
                      base_model_names: set[str], max_rank: int) -> tuple[LoraAdapter, LoraConfig]:
    """The adapter in host memory and the LoRA config it amounts to, or a 400 that names what does not fit.

    Args:
        base_model_names: the names `base_model_name_or_path` may give for the served model (None is accepted).
    """
    if peft_config.get("peft_type") != "LORA":
        raise InvalidRequest(f"adapter_config.json: peft_type {peft_config.get('peft_type')!r} is not supported; "
                             f"only LORA adapters are imported")
    for option, default in _DEFAULTS.items():
        if peft_config.get(option, default) not in (default, None, {}, [], False):
            raise InvalidRequest(f"adapter_config.json: {option}={peft_config[option]!r} is not supported "
                                 f"(only {default!r})")
    base = peft_config.get("base_model_name_or_path")
    if base is not None and (not isinstance(base, str) or base not in base_model_names):
        raise InvalidRequest(f"adapter_config.json: base_model_name_or_path {base!r} is not the served base model "
                             f"({' or '.join(sorted(map(repr, base_model_names)))})")
    rank, alpha = peft_config.get("r"), peft_config.get("lora_alpha", 8)
    if type(rank) is not int or not 1 <= rank <= max_rank:
        raise InvalidRequest(f"adapter_config.json: rank r={rank!r} must be an integer from 1 to this server's "
                             f"limit of {max_rank} (--max-lora-rank)")
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        raise InvalidRequest(f"adapter_config.json: lora_alpha={alpha!r} must be a positive number")
    try:
        tensors = load_safetensors(weights)
    except (SafetensorError, ValueError) as error:
        raise InvalidRequest(f"adapter_model.safetensors could not be read ({error})") from None
    by_name = {target.name: target for target in targets}
    tables: dict[str, dict[str, torch.Tensor]] = {"lora_A": {}, "lora_B": {}}
    for key, tensor in tensors.items():
        module, part = _split_key(key)
        target = by_name.get(module)
        if target is None:
            raise InvalidRequest(f"adapter_model.safetensors: target module {module!r} is not a LoRA target of the "
                                 f"served model (its targets are the language model's attention and MLP projections "
                                 f"and lm_head, named like {targets[0].name!r})")
        ranks = rank * max(1, target.experts)
        expected = (ranks, target.in_features) if part == "lora_A" else (target.out_features, ranks)
        if tuple(tensor.shape) != expected:
            raise InvalidRequest(f"adapter_model.safetensors: {key} has shape {list(tensor.shape)}; module {module} "
                                 f"at rank {rank} needs {list(expected)} (a rank or shape unlike the served model's)")
        tables[part][module] = tensor.float()
    if not tables["lora_A"]:
        raise InvalidRequest("adapter_model.safetensors holds no LoRA weights")
    if not all_finite([*tables["lora_A"].values(), *tables["lora_B"].values()]):
        raise InvalidRequest("adapter_model.safetensors holds weights that are not finite (NaN or inf); they "
                             "cannot be saved, sampled or trained")
    unpaired = sorted(tables["lora_A"].keys() ^ tables["lora_B"].keys())
    if unpaired:
        raise InvalidRequest(f"adapter_model.safetensors: module {unpaired[0]} has only one of lora_A and lora_B")
    kinds = {by_name[module].kind for module in tables["lora_A"]}
    lora_config = LoraConfig(rank=rank, train_attn="attn" in kinds, train_mlp="mlp" in kinds,
                             train_unembed="unembed" in kinds)
    return LoraAdapter(rank, float(alpha), tables["lora_A"], tables["lora_B"]), lora_config


def _split_key(key: str) -> tuple[str, str]:
    """(module, lora_A | lora_B) of a PEFT tensor name; a 400 for any other tensor (DoRA magnitudes, embeddings)."""
    for suffix, part in _PARTS.items():
        if key.startswith(_PREFIX) and key.endswith("." + suffix):
            return key[len(_PREFIX):-len(suffix) - 1], part
    raise InvalidRequest(f"adapter_model.safetensors: tensor {key!r} is not a LoRA weight this server imports "
                         f"(expected base_model.model.<module>.lora_A.weight / .lora_B.weight)")
