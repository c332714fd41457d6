"""LoRA adapters that many training runs share on one frozen base model.

The base model's target linear layers are wrapped once (`apply_lora_wrappers`); `use_adapter` puts
one adapter's tensors in place in every wrapper of that model (its `AdapterSlot`). They belong to
the model, not to a thread, so activation checkpointing may recompute a layer on autograd's own
thread. Adapters are plain fp32 tensors keyed by module name, saved in the standard PEFT layout;
their delta is computed in the activations' dtype (bf16 on GPUs), with fp32 master weights.

Shapes: lora_A is [rank, in_features], lora_B is [out_features, rank].
"""

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from server.models.registry import ModelFamily


@dataclass(frozen=True)
class LoraTarget:
    name: str
    """Full module path in the base model, e.g. model.layers.0.self_attn.q_proj."""
    kind: str
    """attn | mlp | unembed: which LoraConfig flag selects it."""
    in_features: int
    out_features: int


class AdapterSlot:
    """Which adapter the LoRA layers of one model add (None: the base model)."""

    def __init__(self):
        self.adapter: LoraAdapter | None = None
        self.layers: list[LoraLinear] = []


class LoraLinear(nn.Module):
    """An nn.Linear plus the delta of the adapter `use_adapter` put in place, if it adapts this module.

    The adapter's tensors are plain attributes of the layer while it is in use, so a compiled
    forward sees them as inputs: another adapter of the same rank runs the same compiled code.
    """

    def __init__(self, base: nn.Linear, name: str):
        super().__init__()
        self.base = base
        self.name = name
        self.lora_A: torch.Tensor | None = None
        self.lora_B: torch.Tensor | None = None
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.lora_A is None:
            return y
        lora_A, lora_B = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        # Scale the rank-wide intermediate, not the output, and let the second matmul add into y:
        # no extra pass over the (wide) output in forward or backward.
        scaled = (x @ lora_A.T) * self.scale
        return torch.addmm(y.reshape(-1, y.shape[-1]), scaled.reshape(-1, scaled.shape[-1]), lora_B.T).view_as(y)


class LoraAdapter:
    """One run's LoRA weights (fp32), keyed by target module name."""

    def __init__(self, rank: int, alpha: float, lora_A: dict[str, torch.Tensor], lora_B: dict[str, torch.Tensor]):
        assert lora_A.keys() == lora_B.keys()
        self.rank = rank
        self.alpha = alpha
        self.scale = alpha / rank
        self.lora_A = lora_A
        self.lora_B = lora_B

    @classmethod
    def initialize(cls, targets: list[LoraTarget], rank: int, alpha: float, seed: int,
                   device: torch.device | str) -> "LoraAdapter":
        """Fresh trainable adapter: A from a seeded Kaiming-uniform draw, B zero, so it starts as the base model."""
        generator = torch.Generator().manual_seed(seed)
        lora_A, lora_B = {}, {}
        for target in targets:
            bound = 1.0 / math.sqrt(target.in_features)  # kaiming_uniform with a=sqrt(5), as PEFT does
            a = (torch.rand(rank, target.in_features, generator=generator) * 2 - 1) * bound
            lora_A[target.name] = a.to(device).requires_grad_(True)
            lora_B[target.name] = torch.zeros(target.out_features, rank, device=device, requires_grad=True)
        return cls(rank, alpha, lora_A, lora_B)

    def parameters(self) -> list[torch.Tensor]:
        """Trainable tensors in a fixed order (the optimizer's order)."""
        return [t for name in sorted(self.lora_A) for t in (self.lora_A[name], self.lora_B[name])]

    def frozen_copy(self) -> "LoraAdapter":
        """A detached snapshot for sampling, unaffected by later optimizer steps."""
        return LoraAdapter(self.rank, self.alpha, {k: v.detach().clone() for k, v in self.lora_A.items()},
                           {k: v.detach().clone() for k, v in self.lora_B.items()})

    def peft_state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors under PEFT's key names, as adapter_model.safetensors holds them."""
        state = {}
        for name in self.lora_A:
            state[f"base_model.model.{name}.lora_A.weight"] = self.lora_A[name].detach().float().cpu().contiguous()
            state[f"base_model.model.{name}.lora_B.weight"] = self.lora_B[name].detach().float().cpu().contiguous()
        return state

    @classmethod
    def from_peft_state_dict(cls, state: dict[str, torch.Tensor], rank: int, alpha: float,
                             device: torch.device | str, trainable: bool) -> "LoraAdapter":
        """Inverse of `peft_state_dict`."""
        lora_A, lora_B = {}, {}
        for key, tensor in state.items():
            name, _, part = key.removeprefix("base_model.model.").rpartition(".lora_")
            table = lora_A if part == "A.weight" else lora_B
            table[name] = tensor.float().to(device).requires_grad_(trainable)
        return cls(rank, alpha, lora_A, lora_B)


@contextmanager
def use_adapter(slot: AdapterSlot, adapter: LoraAdapter | None) -> Iterator[None]:
    """Run the enclosed calls of the slot's model with `adapter` (None: the base model)."""
    previous = slot.adapter
    _put_in_place(slot, adapter)
    try:
        yield
    finally:
        _put_in_place(slot, previous)


def _put_in_place(slot: AdapterSlot, adapter: LoraAdapter | None) -> None:
    slot.adapter = adapter
    for layer in slot.layers:
        adapted = adapter is not None and layer.name in adapter.lora_A
        layer.lora_A = adapter.lora_A[layer.name] if adapted else None
        layer.lora_B = adapter.lora_B[layer.name] if adapted else None
        layer.scale = adapter.scale if adapted else 1.0


def apply_lora_wrappers(model: nn.Module, family: ModelFamily) -> tuple[list[LoraTarget], AdapterSlot]:
    """Wrap every linear layer LoRA may target (decoder attention/MLP and the unembedding).

    Returns the targets and the slot through which callers choose the adapter these layers add.
    """
    kinds = {**{m: "attn" for m in family.attention_modules}, **{m: "mlp" for m in family.mlp_modules}}
    slot = AdapterSlot()
    targets = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        leaf = name.rpartition(".")[2]
        if name == family.unembed_module:
            kind = "unembed"
        elif name.startswith(family.language_model_prefix) and leaf in kinds:
            kind = kinds[leaf]
        else:
            continue
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        wrapper = LoraLinear(module, name)
        setattr(parent, leaf, wrapper)
        slot.layers.append(wrapper)
        targets.append(LoraTarget(name, kind, module.in_features, module.out_features))
    return targets, slot


def select_targets(targets: list[LoraTarget], *, train_attn: bool, train_mlp: bool,
                   train_unembed: bool) -> list[LoraTarget]:
    """The targets a LoraConfig's train_* flags ask for."""
    wanted = {"attn": train_attn, "mlp": train_mlp, "unembed": train_unembed}
    return [t for t in targets if wanted[t.kind]]
