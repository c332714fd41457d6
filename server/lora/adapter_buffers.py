"""Several adapters side by side in buffers that keep their addresses: what `use_adapter_rows` reads in a forward
replayed as a CUDA graph (the embedded sampler's decode steps), where an `AdapterStack` built afresh for every
new set of adapters would leave the graph reading the old one's tensors.

Every adapted layer has the same columns (a capacity J): each adapter holds `rank` contiguous columns, the same
in every layer (zeros where it does not adapt one), and a column's owner and scale are tensors too, so the row
scales are one computation per forward. An adapter keeps its columns while it stays in the set; a new one takes
free columns. Only when the columns or the adapted layers run out are the buffers replaced (`generation`
counts it), so an RL loop that samples a new adapter every step copies that adapter in and replays the same
graphs. Knows nothing about batches or graphs.

Shapes: A [..., J, in] and B [..., out, J] (per expert first for a MoE's experts), as AdapterStack's.
"""

import torch

from server.lora.layers import AdapterSlot, LoraAdapter

_LAYOUT = ()
"""The one column layout every layer shares (AdapterStack's `columns` values)."""
_FREE = -2
"""Owner of a free column; a row without an adapter has index -1, so it matches no column."""


class AdapterBuffers:
    """Columns of adapters for one model copy; `use` puts a set of adapters in place and returns their indices.

    Has AdapterStack's interface for `use_adapter_rows`: `columns`, `lora_A`, `lora_B`, `row_scales`.
    """

    def __init__(self, slot: AdapterSlot, dtype: torch.dtype, device: torch.device):
        self.slot, self.dtype, self.device = slot, dtype, device
        self.capacity = 0
        self.generation = 0
        self.lora_A: dict[str, torch.Tensor] = {}
        self.lora_B: dict[str, torch.Tensor] = {}
        self.columns: dict[str, tuple] = {}
        self.spans: dict[int, tuple[LoraAdapter, int]] = {}
        """id(adapter) -> (adapter, its first column), for the adapters in place."""
        self.owner_J = torch.zeros(0, dtype=torch.long, device=device)
        self.scale_J = torch.zeros(0, dtype=dtype, device=device)

    def use(self, adapters: list[LoraAdapter]) -> dict[int, int]:
        """Put exactly these adapters in place (those already there stay put); returns id(adapter) -> the row
        index that selects it (its first column)."""
        wanted = {id(a): a for a in adapters}
        names = {name for a in adapters for name in a.lora_A}
        needed = sum(a.rank for a in wanted.values())
        if needed > self.capacity or not names <= self.lora_A.keys():
            self._allocate(list(wanted.values()), max(needed, self.capacity))
        self.spans = {key: span for key, span in self.spans.items() if key in wanted}
        for key, adapter in wanted.items():
            if key not in self.spans:
                start = self._free_columns(adapter.rank)
                if start is None:  # free columns exist, in pieces: place every adapter afresh
                    self.spans = {}
                    return self.use(adapters)
                self._write(adapter, start)  # first: an adapter that fails to load takes no columns
                self.spans[key] = (adapter, start)
        owner = torch.full((self.capacity,), _FREE, dtype=torch.long)
        scale = torch.zeros(self.capacity)
        for adapter, start in self.spans.values():
            owner[start:start + adapter.rank] = start
            scale[start:start + adapter.rank] = adapter.scale
        self.owner_J.copy_(owner)
        self.scale_J.copy_(scale)
        return {key: start for key, (_, start) in self.spans.items()}

    def row_scales(self, row_adapter_B: torch.Tensor) -> dict[tuple, torch.Tensor]:
        """Each row's scale on each column [B, J]: its adapter's scale on its adapter's columns, else 0."""
        return {_LAYOUT: (row_adapter_B[:, None] == self.owner_J[None, :]) * self.scale_J}

    def _free_columns(self, rank: int) -> int | None:
        taken = sorted((start, start + adapter.rank) for adapter, start in self.spans.values())
        position = 0
        for start, stop in taken + [(self.capacity, self.capacity)]:
            if start - position >= rank:
                return position
            position = stop
        return None

    def _write(self, adapter: LoraAdapter, start: int) -> None:
        columns = slice(start, start + adapter.rank)
        for layer in self.slot.layers:
            if layer.name not in self.lora_A:
                continue
            lora_A, lora_B = self.lora_A[layer.name], self.lora_B[layer.name]
            if layer.name in adapter.lora_A:
                own_A, own_B = layer.stacked([adapter.lora_A[layer.name]], [adapter.lora_B[layer.name]], self.dtype)
                lora_A[..., columns, :] = own_A
                lora_B[..., columns] = own_B
            else:
                lora_A[..., columns, :] = 0
                lora_B[..., columns] = 0

    def _allocate(self, adapters: list[LoraAdapter], needed: int) -> None:
        """New buffers of at least `needed` columns (a power of two), for the layers adapted so far and by these
        adapters; every adapter leaves."""
        capacity = 1 << (needed - 1).bit_length()
        # The columns are dimension -2 of A and -1 of B; one adapter's factors give the other dimensions.
        shapes = {name: (lora_A.shape[:-2] + (capacity, lora_A.shape[-1]), self.lora_B[name].shape[:-1] + (capacity,))
                  for name, lora_A in self.lora_A.items()}
        for layer in self.slot.layers:
            adapter = next((a for a in adapters if layer.name in a.lora_A), None)
            if layer.name not in shapes and adapter is not None:
                own_A, own_B = layer.stacked([adapter.lora_A[layer.name]], [adapter.lora_B[layer.name]], self.dtype)
                shapes[layer.name] = (own_A.shape[:-2] + (capacity, own_A.shape[-1]), own_B.shape[:-1] + (capacity,))
        self.capacity = capacity
        self.lora_A = {name: torch.zeros(a, dtype=self.dtype, device=self.device) for name, (a, _) in shapes.items()}
        self.lora_B = {name: torch.zeros(b, dtype=self.dtype, device=self.device) for name, (_, b) in shapes.items()}
        self.columns = {name: _LAYOUT for name in shapes}
        self.owner_J = torch.full((capacity,), _FREE, dtype=torch.long, device=self.device)
        self.scale_J = torch.zeros(capacity, dtype=self.dtype, device=self.device)
        self.spans = {}
        self.generation += 1
