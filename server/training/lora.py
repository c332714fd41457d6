"""LoRA adapters that many training runs share on one frozen base model.

The base model's target linear layers are wrapped once (`apply_lora_wrappers`). What the wrappers
add is set for the duration of a forward (and its backward) by the one thread that owns that model
copy, through the model's `AdapterSlot`: `use_adapter` puts one adapter in place for every row,
`use_adapter_rows` gives each row of the batch its own adapter (an `AdapterStack`: the adapters
zero-padded to the largest rank and stacked, gathered per row, so the delta is two batched matmuls
whatever the mix). Nothing outlives the `with` block, and nothing one model copy's owner sets is
visible to another copy. The tensors belong to the model, not to a thread, so activation
checkpointing may recompute a layer on autograd's own thread. Both paths are autograd-safe: the
gradient of each adapter lands in its own tensors.

Adapters are plain fp32 tensors keyed by module name, saved in the standard PEFT layout; their
delta is computed in the activations' dtype (bf16 on GPUs), with fp32 master weights.

Shapes: lora_A is [rank, in_features], lora_B is [out_features, rank]. In an AdapterStack,
K = adapters (None entries included), R = the largest rank, B = rows of the batch.
"""

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
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
    """The LoRA layers of one model copy; what they add is set by `use_adapter` / `use_adapter_rows`."""

    def __init__(self):
        self.layers: list[LoraLinear] = []


class LoraLinear(nn.Module):
    """An nn.Linear plus the delta of what `use_adapter` or `use_adapter_rows` put in place.

    The adapter's tensors are plain attributes of the layer while it is in use, so a compiled
    forward sees them as inputs: another adapter of the same rank runs the same compiled code.
    """

    def __init__(self, base: nn.Linear, name: str):
        super().__init__()
        self.base = base
        self.name = name
        # One adapter for every row (use_adapter):
        self.lora_A: torch.Tensor | None = None
        self.lora_B: torch.Tensor | None = None
        self.scale = 1.0
        # One adapter per row (use_adapter_rows): stacked [K, R, in] (scale folded in) and [K, out, R],
        # and each row's index into them.
        self.stacked_A: torch.Tensor | None = None
        self.stacked_B: torch.Tensor | None = None
        self.row_adapter_B: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.stacked_A is not None:
            return y + self._per_row_delta(x).view_as(y)
        if self.lora_A is None:
            return y
        lora_A, lora_B = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        # Scale the rank-wide intermediate, not the output, and let the second matmul add into y:
        # no extra pass over the (wide) output in forward or backward.
        scaled = (x @ lora_A.T) * self.scale
        return torch.addmm(y.reshape(-1, y.shape[-1]), scaled.reshape(-1, scaled.shape[-1]), lora_B.T).view_as(y)

    def _per_row_delta(self, x: torch.Tensor) -> torch.Tensor:
        """Row b's delta with adapter row_adapter_B[b]: x [B, ..., in] (a 2-D x is B rows of one token)."""
        rows = self.row_adapter_B.shape[0]
        lora_A_BRI = self.stacked_A.index_select(0, self.row_adapter_B)
        lora_B_BOR = self.stacked_B.index_select(0, self.row_adapter_B)
        x_BTI = x.reshape(rows, -1, x.shape[-1])
        return torch.bmm(torch.bmm(x_BTI, lora_A_BRI.transpose(1, 2)), lora_B_BOR.transpose(1, 2))


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


class AdapterStack:
    """Several adapters stacked per layer of one model, for batches whose rows use different adapters.

    Entry k of every layer is adapter k zero-padded to the largest rank, with its scale folded into A;
    a None adapter, and an adapter that does not adapt the layer, give zeros (the base model). Built
    with differentiable ops from the adapters' own tensors, so under autograd each adapter's
    gradient lands in its own lora_A / lora_B.
    """

    def __init__(self, slot: AdapterSlot, adapters: Sequence["LoraAdapter | None"], dtype: torch.dtype):
        self.adapters = list(adapters)
        real = [a for a in self.adapters if a is not None]
        rank = max((a.rank for a in real), default=0)
        self.lora_A: dict[str, torch.Tensor] = {}
        self.lora_B: dict[str, torch.Tensor] = {}
        for layer in slot.layers:
            if not any(layer.name in a.lora_A for a in real):
                continue  # no adapter of the batch adapts this layer
            weight = layer.base.weight
            zeros_A = weight.new_zeros(rank, layer.base.in_features, dtype=dtype)
            zeros_B = weight.new_zeros(layer.base.out_features, rank, dtype=dtype)
            pieces_A, pieces_B = [], []
            for adapter in self.adapters:
                if adapter is None or layer.name not in adapter.lora_A:
                    pieces_A.append(zeros_A)
                    pieces_B.append(zeros_B)
                    continue
                padding = rank - adapter.rank
                pieces_A.append(F.pad(adapter.lora_A[layer.name] * adapter.scale, (0, 0, 0, padding)).to(dtype))
                pieces_B.append(F.pad(adapter.lora_B[layer.name], (0, padding)).to(dtype))
            self.lora_A[layer.name] = torch.stack(pieces_A)
            self.lora_B[layer.name] = torch.stack(pieces_B)


@contextmanager
def use_adapter(slot: AdapterSlot, adapter: LoraAdapter | None) -> Iterator[None]:
    """Run the enclosed calls of the slot's model with `adapter` on every row (None: the base model)."""
    for layer in slot.layers:
        adapted = adapter is not None and layer.name in adapter.lora_A
        layer.lora_A = adapter.lora_A[layer.name] if adapted else None
        layer.lora_B = adapter.lora_B[layer.name] if adapted else None
        layer.scale = adapter.scale if adapted else 1.0
    try:
        yield
    finally:
        _clear(slot)


@contextmanager
def use_adapter_rows(slot: AdapterSlot, stack: AdapterStack, row_adapter_B: torch.Tensor) -> Iterator[None]:
    """Run the enclosed calls with adapter `stack.adapters[row_adapter_B[b]]` on row b of every input."""
    for layer in slot.layers:
        layer.stacked_A = stack.lora_A.get(layer.name)
        layer.stacked_B = stack.lora_B.get(layer.name)
        layer.row_adapter_B = row_adapter_B if layer.stacked_A is not None else None
    try:
        yield
    finally:
        _clear(slot)


def _clear(slot: AdapterSlot) -> None:
    for layer in slot.layers:
        layer.lora_A = layer.lora_B = layer.stacked_A = layer.stacked_B = layer.row_adapter_B = None
        layer.scale = 1.0


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
