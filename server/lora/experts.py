"""LoRA on a mixture-of-experts block's routed experts: per-expert A and B inside the expert computation.

transformers keeps a MoE layer's routed experts as two fused tensors, gate_up_proj [E, 2I, H] and
down_proj [E, H, I]. `LoraExperts` replaces the experts module's forward with the same computation plus,
for each expert, the delta of its own LoRA factors on both projections, for one adapter or one per row:
one grouped GEMM per projection and factor over every expert (with a loop over the 256 experts, the
35B-A3B's training step took ten times as long; benchmarks/RESULTS.md).

Shapes: E experts, N tokens (rows x positions, flattened), K experts per token, A (token, expert) pairs
(N x K, grouped by expert), T rows of a grouped product, H hidden, I expert intermediate, J stacked LoRA
columns, B rows of the batch.
"""

import torch
import torch.nn.functional as F
from torch import nn

from server.lora.settings import AdapterSettings

# An adapter stores each projection's factors in PEFT's layout for fused expert parameters (its
# `target_parameters`), which vLLM also reads: for the module path P of the experts, `P.base_layer` is
# gate_up_proj and `P` is down_proj, with A [E * r, in] (expert-major rows, expert e's A is rows e*r to
# e*r + r) and B [out, r * E] (column k*E + e is column k of expert e's B).
GATE_UP_SUFFIX = ".base_layer"


def peft_target_parameters(names: list[str]) -> dict[str, str]:
    """Of an adapter's module names, those of fused expert projections, each with the parameter PEFT's
    `target_parameters` names for it (P.base_layer -> P.gate_up_proj, P -> P.down_proj)."""
    fused = {name.removesuffix(GATE_UP_SUFFIX) for name in names if name.endswith(GATE_UP_SUFFIX)}
    return {**{name + GATE_UP_SUFFIX: name + ".gate_up_proj" for name in fused},
            **{name: name + ".down_proj" for name in fused if name in names}}


def is_routed_experts(module: nn.Module) -> bool:
    """transformers' fused experts: 3-D gate_up_proj and down_proj parameters."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3


class ExpertProjection(AdapterSettings):
    """One fused projection of the experts (gate_up or down): what an adapter adds to it, per expert.

    Holds the same settings as a LoraLinear (`use_adapter` / `use_adapter_rows` put them in place), so
    that the adapter machinery treats both alike; it computes nothing on its own (LoraExperts does).
    """

    def __init__(self, name: str, experts: nn.Module, in_features: int, out_features: int):
        self.name = name
        self.experts = experts
        self.num_experts = experts.gate_up_proj.shape[0]
        self.in_features = in_features
        self.out_features = out_features
        self.clear_adapter()  # grouped_A is [E, J, in] here, grouped_B [E, out, J]
        self.siblings = None  # experts share no input with another LoRA layer

    @property
    def device(self) -> torch.device:
        """Where the experts are now (a sharded rank's are moved after wrapping)."""
        return self.experts.gate_up_proj.device

    def per_expert(self, lora_A: torch.Tensor, lora_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One adapter's factors as [E, r, in] and [E, out, r]."""
        return (lora_A.view(self.num_experts, -1, self.in_features),
                lora_B.view(self.out_features, -1, self.num_experts).permute(2, 0, 1))

    def stacked(self, lora_As: list[torch.Tensor], lora_Bs: list[torch.Tensor],
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Several adapters' factors side by side per expert: [E, J, in] and [E, out, J]."""
        pairs = [self.per_expert(a, b) for a, b in zip(lora_As, lora_Bs)]
        return (torch.cat([a for a, _ in pairs], dim=1).to(dtype), torch.cat([b for _, b in pairs], dim=2).to(dtype))

    def factors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A [E, J, in] and B [E, out, J] in `dtype`, and each row's scale on each column [B, J] (None: one
        adapter, its scale folded into A)."""
        if self.grouped_A is not None:
            return self.grouped_A.to(dtype), self.grouped_B.to(dtype), self.row_scale_BJ.to(dtype)
        lora_A, lora_B = self.per_expert(self.lora_A * self.scale, self.lora_B)
        return lora_A.to(dtype), lora_B.to(dtype), None


class LoraExperts(nn.Module):
    """A MoE layer's routed experts with per-expert LoRA on gate_up_proj and down_proj."""

    def __init__(self, base: nn.Module, name: str):
        super().__init__()
        self.base = base
        _, double_intermediate, hidden = base.gate_up_proj.shape
        self.gate_up = ExpertProjection(name + GATE_UP_SUFFIX, base, hidden, double_intermediate)
        self.down = ExpertProjection(name, base, double_intermediate // 2, hidden)

    def forward(self, hidden_NH: torch.Tensor, top_k_index_NK: torch.Tensor,
                top_k_weights_NK: torch.Tensor) -> torch.Tensor:
        if not (self.gate_up.adapted or self.down.adapted):
            return self.base(hidden_NH, top_k_index_NK, top_k_weights_NK)
        gate_up = self.gate_up.factors(hidden_NH.dtype) if self.gate_up.adapted else None
        down = self.down.factors(hidden_NH.dtype) if self.down.adapted else None
        num_experts, k = self.base.gate_up_proj.shape[0], top_k_index_NK.shape[1]
        # Per-row adapters: the flattened tokens are rows of equal length, one after another.
        row_scales = [f[2] for f in (gate_up, down) if f is not None and f[2] is not None]
        tokens_per_row = hidden_NH.shape[0] // (row_scales[0].shape[0] if row_scales else 1)
        # Every (token, choice) pair grouped by expert; offsets_E: where each expert's group ends. One
        # grouped GEMM per projection covers every expert, with no wait on the device for the counts.
        expert_A, order_A = torch.sort(top_k_index_NK.flatten(), stable=True)
        token_A, weight_A = order_A // k, top_k_weights_NK.flatten()[order_A]
        experts_E = torch.arange(num_experts, device=expert_A.device, dtype=expert_A.dtype)
        offsets_E = torch.searchsorted(expert_A, experts_E, right=True).to(torch.int32)
        row_A = token_A // tokens_per_row
        x_AH = hidden_NH[token_A]
        gate_up_AI = _with_delta(grouped_linear(x_AH, self.base.gate_up_proj, offsets_E), x_AH, gate_up, offsets_E,
                                 row_A)
        gate_AI, up_AI = gate_up_AI.chunk(2, dim=-1)
        h_AI = self.base.act_fn(gate_AI) * up_AI
        y_AH = _with_delta(grouped_linear(h_AI, self.base.down_proj, offsets_E), h_AI, down, offsets_E, row_A)
        return torch.zeros_like(hidden_NH).index_add_(0, token_A, (y_AH * weight_A[:, None]).to(hidden_NH.dtype))


def grouped_linear(x_TI: torch.Tensor, weight_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Each group of x's rows (group e ends at offsets_E[e]) times its own weight_EOI[e] transposed: [T, O]."""
    # grouped_mm (and its backward) reads rows of whole 16-byte units: zeros pad a dimension that is not
    # (tiny models, small ranks); real models' widths need none.
    unit = 16 // x_TI.element_size()
    out_features, in_features = weight_EOI.shape[1:]
    pad_in, pad_out = -in_features % unit, -out_features % unit
    if pad_in or pad_out:
        x_TI, weight_EOI = F.pad(x_TI, (0, pad_in)), F.pad(weight_EOI, (0, pad_in, 0, pad_out))
    y_TO = F.grouped_mm(x_TI.contiguous(), weight_EOI.contiguous().transpose(1, 2), offs=offsets_E)
    return y_TO[:, :out_features] if pad_out else y_TO


def _with_delta(y_AO: torch.Tensor, x_AI: torch.Tensor, factors, offsets_E: torch.Tensor,
                row_A: torch.Tensor) -> torch.Tensor:
    """y plus each pair's expert's LoRA delta of input x (per-row adapters scale their own columns)."""
    if factors is None:
        return y_AO
    lora_A_EJI, lora_B_EOJ, row_scale_BJ = factors
    mid_AJ = grouped_linear(x_AI, lora_A_EJI, offsets_E)
    if row_scale_BJ is not None:
        mid_AJ = mid_AJ * row_scale_BJ[row_A]
    return y_AO + grouped_linear(mid_AJ, lora_B_EOJ, offsets_E)
