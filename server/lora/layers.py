"""LoRA adapters that many training runs share on one frozen base model.

The base model's target linear layers are wrapped once (`apply_lora_wrappers`); what they add is set for
one forward (and its backward) through the model's `AdapterSlot`: one adapter for every row
(`use_adapter`) or one per row (`use_adapter_rows`, an `AdapterStack`). Adapters are fp32 tensors keyed
by module name, in the standard PEFT layout. Knows nothing about runs, optimizers or files.

Shapes: lora_A is [rank, in_features], lora_B is [out_features, rank]. In an AdapterStack, J = the
ranks of the adapters that adapt a layer, summed; B = rows of the batch (or its positions, when a packed
row holds datums of several runs: a "row" is then one position), N = positions.
"""

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from server.errors import InvalidRequest
from server.lora.experts import ExpertProjection, LoraExperts, is_routed_experts
from server.lora.settings import AdapterSettings
from server.models.registry import ModelFamily

if TYPE_CHECKING:
    from server.lora.adapter_buffers import AdapterBuffers


@dataclass(frozen=True)
class LoraTarget:
    name: str
    """Full module path in the base model, e.g. model.layers.0.self_attn.q_proj."""
    kind: str
    """attn | mlp | unembed: which LoraConfig flag selects it."""
    in_features: int
    out_features: int
    experts: int = 0
    """For a MoE layer's fused routed experts (experts.py): how many; A and B hold that many ranks."""


class AdapterSlot:
    """The LoRA layers of one model copy; what they add is set by `use_adapter` / `use_adapter_rows`.

    Set by the one thread that owns the model copy, for the duration of a `with` block: nothing outlives
    it, and nothing one copy's owner sets is visible to another copy. The tensors belong to the model,
    not to a thread, so activation checkpointing may recompute a layer on autograd's own thread. Both
    paths are autograd-safe: each adapter's gradient lands in its own tensors. The delta is computed in
    the activations' dtype (bf16 on GPUs), with fp32 master weights.
    """

    def __init__(self):
        self.layers: list[LoraLinear | ExpertProjection] = []


class LoraLinear(AdapterSettings, nn.Module):
    """An nn.Linear plus the delta of what `use_adapter` or `use_adapter_rows` put in place.

    The adapter's tensors are plain attributes of the layer while it is in use, so a compiled
    forward sees them as inputs: another adapter of the same rank runs the same compiled code.
    """

    def __init__(self, base: nn.Linear, name: str):
        super().__init__()
        self.base = base
        self.name = name
        self.clear_adapter()
        # The layers of its block that read the same input (q, k, v; gate, up), and its place among them:
        # the same in every block, so that every block runs the same compiled code.
        self.siblings: SharedInput | None = None
        self.sibling_index = 0

    @property
    def device(self) -> torch.device:
        return self.base.weight.device

    @staticmethod
    def stacked(lora_As: list[torch.Tensor], lora_Bs: list[torch.Tensor],
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Several adapters' factors side by side: A [J, in] and B [out, J]."""
        return torch.cat(lora_As).to(dtype), torch.cat(lora_Bs, dim=1).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.adapted:
            return y
        mid = self.siblings.intermediate(self, x) if self.siblings is not None else intermediates([self], x)[0]
        lora_B = self.grouped_B if self.grouped_A is not None else self.lora_B.to(x.dtype)
        # A plain sum, not addmm: addmm first copies y into its output, and compiled, the sum fuses into
        # whatever reads the output next (a norm, the gating, the residual add), so the delta costs one
        # write and one read of the output's width.
        return y + (mid @ lora_B.T).view_as(y)

    def active_delta(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """What the layer adds in the current setting, for callers that apply it themselves (the fused
        unembedding): A [J, in] and B [out, J] in `dtype`, and for per-row adapters each row's scale on
        each column [B, J] (None: one adapter, its scale folded into A). None: nothing."""
        if self.grouped_A is not None:
            return self.grouped_A.to(dtype), self.grouped_B.to(dtype), self.row_scale_BJ.to(dtype)
        if self.lora_A is None:
            return None
        return (self.lora_A * self.scale).to(dtype), self.lora_B.to(dtype), None


def intermediates(layers: list[LoraLinear], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The scaled rank-wide intermediates [..., J] of adapted layers that read the same input `x`, from
    one product with it (the scale is applied to the rank-wide intermediate, never to the output)."""
    if layers[0].grouped_A is not None:
        rows = layers[0].row_scale_BJ.shape[0]
        lora_A = _joined([layer.grouped_A for layer in layers])
        scale_BJ = _joined([layer.row_scale_BJ for layer in layers], dim=1)
        mid = (x.reshape(rows, -1, x.shape[-1]) @ lora_A.T) * scale_BJ[:, None, :]
    else:
        mid = x @ _joined([layer.lora_A * layer.scale for layer in layers]).to(x.dtype).T
    return mid.split([(layer.grouped_A if layer.grouped_A is not None else layer.lora_A).shape[0]
                      for layer in layers], dim=-1)


def _joined(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """The tensors side by side; one alone as it is (no copy: in eager mode every copy is a launch)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim)


class SharedInput:
    """LoRA layers of one block that read the same input (q, k and v; gate and up).

    The first of them called with an input computes the intermediates of all of them in one product;
    the others, called next with the same tensor, take theirs. The input is read once instead of once
    per layer, in forward and (one product, one gradient) in backward. Anything else (another input,
    a layer called twice) computes afresh, so the order of the calls does not matter.
    """

    def __init__(self, layers: list[LoraLinear]):
        self.layers = layers
        self.clear()

    def clear(self) -> None:
        """Drop what a forward left for layers not called yet (one that stopped half-way, say)."""
        self._input: torch.Tensor | None = None
        self._waiting: list[torch.Tensor | None] = [None] * len(self.layers)

    def intermediate(self, layer: LoraLinear, x: torch.Tensor) -> torch.Tensor:
        index = layer.sibling_index
        if x is self._input and self._waiting[index] is not None:
            mid, self._waiting[index] = self._waiting[index], None
            if all(waiting is None for waiting in self._waiting):
                self._input = None  # nothing of the input is kept past its last reader
            return mid
        adapted = [i for i, other in enumerate(self.layers) if other.adapted]
        mids = intermediates([self.layers[i] for i in adapted], x)
        self._waiting = [None] * len(self.layers)
        for i, mid in zip(adapted, mids):
            if i != index:
                self._waiting[i] = mid
        self._input = x if len(adapted) > 1 else None
        return mids[adapted.index(index)]


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element is a finite number: the largest magnitude is NaN or inf exactly when some element
    is, so one reduction covers every tensor."""
    return not tensors or math.isfinite(float(torch.nn.utils.get_total_norm(tensors, norm_type=math.inf)))


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
            ranks = rank * max(1, target.experts)  # routed experts: one rank-r pair per expert
            bound = 1.0 / math.sqrt(target.in_features)  # kaiming_uniform with a=sqrt(5), as PEFT does
            a = (torch.rand(ranks, target.in_features, generator=generator) * 2 - 1) * bound
            lora_A[target.name] = a.to(device).requires_grad_(True)
            lora_B[target.name] = torch.zeros(target.out_features, ranks, device=device, requires_grad=True)
        return cls(rank, alpha, lora_A, lora_B)

    def parameters(self) -> list[torch.Tensor]:
        """Trainable tensors in a fixed order (the optimizer's order)."""
        return [t for name in sorted(self.lora_A) for t in (self.lora_A[name], self.lora_B[name])]

    def check_finite(self, whose: str) -> None:
        """Non-finite weights are never saved, served or loaded (optim_step refuses to make them; a checkpoint
        written before it did may hold them)."""
        if not all_finite(self.parameters()):
            raise InvalidRequest(f"{whose} are not finite; they cannot be saved, sampled or trained. Load a "
                                 f"checkpoint saved before the run went bad")

    def frozen_copy(self, device: torch.device | str | None = None) -> "LoraAdapter":
        """A detached snapshot (on `device`, by default where it is), unaffected by later optimizer steps."""
        def copy(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.detach().to(device if device is not None else tensor.device, copy=True)

        return LoraAdapter(self.rank, self.alpha, {k: copy(v) for k, v in self.lora_A.items()},
                           {k: copy(v) for k, v in self.lora_B.items()})

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


Columns = tuple[int, ...]
"""Which adapters (by index in the stack) adapt a layer, in column order."""


class AdapterStack:
    """Several adapters side by side per layer, for batches whose rows use different adapters.

    For each layer, the adapters that adapt it contribute their ranks as columns: A [J, in] and
    B [out, J]. A row multiplies by all of A, scales its own adapter's columns by its scale and the
    others' by 0, and multiplies by B: two dense matmuls for the whole batch whatever the mix of
    adapters, ranks and targets, and no per-row copy of any weight (lm_head's B is the vocabulary
    wide). A None adapter, or one that does not adapt a layer, has no columns there (the base model).
    Built with differentiable ops from the adapters' own tensors (one concatenation and one cast per
    tensor), so under autograd each adapter's gradient lands in its own lora_A / lora_B. Layers that
    the same adapters adapt share one column layout, whose row scales are computed once per forward.

    A stack costs a few operations per layer, not a few per adapter and layer: in eager mode on a GPU
    every operation is a launch (and a node of the backward), and a pass over 8 runs of a 36-layer
    model would otherwise spend more time launching the stack than computing it.
    """

    def __init__(self, slot: AdapterSlot, adapters: Sequence["LoraAdapter | None"], dtype: torch.dtype):
        self.adapters = list(adapters)
        self.lora_A: dict[str, torch.Tensor] = {}
        self.lora_B: dict[str, torch.Tensor] = {}
        self.columns: dict[str, Columns] = {}
        self._column_scales: dict[Columns, tuple[torch.Tensor, torch.Tensor]] = {}
        """Per layout: which adapter each column is [J] and its scale [J], on the device."""
        for layer in slot.layers:
            adapting = [index for index, adapter in enumerate(self.adapters)
                        if adapter is not None and layer.name in adapter.lora_A]
            if not adapting:
                continue  # no adapter of the batch adapts this layer
            self.lora_A[layer.name], self.lora_B[layer.name] = layer.stacked(
                [self.adapters[i].lora_A[layer.name] for i in adapting],
                [self.adapters[i].lora_B[layer.name] for i in adapting], dtype)
            columns = self.columns[layer.name] = tuple(adapting)
            if columns not in self._column_scales:
                owners = [i for i in columns for _ in range(self.adapters[i].rank)]
                device = layer.device
                self._column_scales[columns] = (
                    torch.tensor(owners, device=device),
                    torch.tensor([self.adapters[i].scale for i in owners], dtype=dtype, device=device))

    def row_scales(self, row_adapter_B: torch.Tensor) -> dict[Columns, torch.Tensor]:
        """Per layout, each row's scale on each column [B, J]: its adapter's scale on its adapter's columns, else 0."""
        return {columns: (row_adapter_B[:, None] == owner_J[None, :]) * scale_J
                for columns, (owner_J, scale_J) in self._column_scales.items()}


@contextmanager
def use_adapter(slot: AdapterSlot, adapter: LoraAdapter | None) -> Iterator[None]:
    """Run the enclosed calls of the slot's model with `adapter` on every row (None: the base model)."""
    for layer in slot.layers:
        if adapter is not None and layer.name in adapter.lora_A:
            layer.put_adapter(lora_A=adapter.lora_A[layer.name], lora_B=adapter.lora_B[layer.name], scale=adapter.scale)
    try:
        yield
    finally:
        _clear(slot)


@contextmanager
def use_adapter_rows(slot: AdapterSlot, stack: "AdapterStack | AdapterBuffers | None",
                     row_adapter_B: torch.Tensor) -> Iterator[None]:
    """Run the enclosed calls with adapter `stack.adapters[row_adapter_B[b]]` on row b of every input (for
    AdapterBuffers, the adapter whose index `use` gave); no stack: the base model on every row.

    One entry per position instead (a packed row) works the same way: each position is a row of one.
    """
    if stack is None:
        yield
        return
    row_scales = stack.row_scales(row_adapter_B)
    for layer in slot.layers:
        if layer.name in stack.columns:
            layer.put_adapter(grouped_A=stack.lora_A[layer.name], grouped_B=stack.lora_B[layer.name],
                              row_scale_BJ=row_scales[stack.columns[layer.name]])
    try:
        yield
    finally:
        _clear(slot)


def _clear(slot: AdapterSlot) -> None:
    for layer in slot.layers:
        layer.clear_adapter()
        if layer.siblings is not None:
            layer.siblings.clear()


def apply_lora_wrappers(model: nn.Module, family: ModelFamily) -> tuple[list[LoraTarget], AdapterSlot]:
    """Wrap every layer LoRA may target (decoder attention/MLP, a MoE's routed experts, the unembedding),
    and join the wrappers of each block that read the same input (`family.shared_input_modules`).

    Returns the targets and the slot through which callers choose the adapter these layers add.
    """
    kinds = {**{m: "attn" for m in family.attention_modules}, **{m: "mlp" for m in family.mlp_modules}}
    slot = AdapterSlot()
    targets = []
    for name, module in list(model.named_modules()):
        leaf = name.rpartition(".")[2]
        if name.startswith(family.language_model_prefix) and leaf == family.routed_experts \
                and is_routed_experts(module):
            wrapper = LoraExperts(module, name)
            setattr(model.get_submodule(name.rpartition(".")[0]), leaf, wrapper)
            for projection in (wrapper.gate_up, wrapper.down):
                slot.layers.append(projection)
                targets.append(LoraTarget(projection.name, "mlp", projection.in_features, projection.out_features,
                                          projection.num_experts))
            continue
        if not isinstance(module, nn.Linear):
            continue
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
    by_name = {layer.name: layer for layer in slot.layers}
    for layer in slot.layers:
        parent, _, leaf = layer.name.rpartition(".")
        for group in family.shared_input_modules:
            if leaf != group[0] or not all(f"{parent}.{member}" in by_name for member in group):
                continue
            members = [by_name[f"{parent}.{member}"] for member in group]
            shared = SharedInput(members)
            for index, member in enumerate(members):
                member.siblings, member.sibling_index = shared, index
    return targets, slot


def select_targets(targets: list[LoraTarget], *, train_attn: bool, train_mlp: bool,
                   train_unembed: bool) -> list[LoraTarget]:
    """The targets a LoraConfig's train_* flags ask for."""
    wanted = {"attn": train_attn, "mlp": train_mlp, "unembed": train_unembed}
    return [t for t in targets if wanted[t.kind]]
