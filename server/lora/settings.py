"""What `use_adapter` / `use_adapter_rows` (lora/layers.py) put on a LoRA layer for one forward.

Shared by the layers that compute a LoRA delta (LoraLinear, a MoE's ExpertProjection), so that the adapter
machinery sets and clears them alike.
"""

import torch


class AdapterSettings:
    def clear_adapter(self) -> None:
        """Nothing in place: the layer is its base."""
        self.put_adapter(
            # One adapter for every row (use_adapter):
            lora_A=None, lora_B=None, scale=1.0,
            # One adapter per row (use_adapter_rows): the adapters' ranks side by side (A [J, in] and B [out, J],
            # per expert for a MoE's experts), and each row's scale on each column (its adapter's scale on its
            # adapter's columns, else 0).
            grouped_A=None, grouped_B=None, row_scale_BJ=None)

    def put_adapter(self, **settings: torch.Tensor | float | None) -> None:
        """Set some of the fields above."""
        # Straight into the instance's dict: nn.Module.__setattr__ checks every name against the module's
        # parameters, buffers and submodules, which every layer paid twice per forward of the sampler.
        self.__dict__.update(settings)

    lora_A: torch.Tensor | None
    lora_B: torch.Tensor | None
    scale: float
    grouped_A: torch.Tensor | None
    grouped_B: torch.Tensor | None
    row_scale_BJ: torch.Tensor | None

    @property
    def adapted(self) -> bool:
        return self.lora_A is not None or self.grouped_A is not None
