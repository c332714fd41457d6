"""What `use_adapter` / `use_adapter_rows` (lora/layers.py) put on a LoRA layer for one forward.

Shared by the layers that compute a LoRA delta (LoraLinear, a MoE's ExpertProjection), so that the adapter
machinery sets and clears them alike.
"""

import torch


class AdapterSettings:
    def clear_adapter(self) -> None:
        """Nothing in place: the layer is its base."""
        # One adapter for every row (use_adapter):
        self.lora_A: torch.Tensor | None = None
        self.lora_B: torch.Tensor | None = None
        self.scale = 1.0
        # One adapter per row (use_adapter_rows): the adapters' ranks side by side (A [J, in] and B [out, J],
        # per expert for a MoE's experts), and each row's scale on each column (its adapter's scale on its
        # adapter's columns, else 0).
        self.grouped_A: torch.Tensor | None = None
        self.grouped_B: torch.Tensor | None = None
        self.row_scale_BJ: torch.Tensor | None = None

    @property
    def adapted(self) -> bool:
        return self.lora_A is not None or self.grouped_A is not None
