"""The running batch's cache, row by row: the operations continuous batching needs from HF's DynamicCache.

A layer of full attention holds keys and values [rows, heads, positions, dim], left-padded to a common
width; a layer of linear attention (Qwen3.5's Gated DeltaNet) holds, per row, its convolution's last
inputs and its recurrent state, whatever the row's length. Rows join, leave and lose left padding
the same way in both; transformers' own batch helpers cover only the first kind. `DynamicBatchCache` is the
running batch's cache on these operations, for the models a static cache (static_cache.py) cannot hold.
"""

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from server.lora.layers import AdapterSlot, AdapterStack, use_adapter_rows
from server.sampling.host_copies import to_device


def new_cache(text_config, hybrid: bool) -> DynamicCache:
    """An empty cache; for a hybrid model, with the linear-attention layers where the config puts them."""
    return DynamicCache(config=text_config) if hybrid else DynamicCache()


def _is_linear(layer) -> bool:
    return hasattr(layer, "recurrent_states")


def select_rows(cache: DynamicCache, index_R: torch.Tensor) -> None:
    """Keep (or repeat) the rows `index_R`, in that order."""
    for layer in cache.layers:
        if _is_linear(layer):
            layer.conv_states[0] = layer.conv_states[0][index_R]
            layer.recurrent_states[0] = layer.recurrent_states[0][index_R]
        else:
            layer.keys, layer.values = layer.keys[index_R], layer.values[index_R]


def append_rows(kept: DynamicCache, joining: DynamicCache, kept_width: int, joining_width: int) -> None:
    """Put `joining`'s rows after `kept`'s; keys and values of the shorter side are left-padded with zeros
    (the caller's attention mask hides them)."""
    width = max(kept_width, joining_width)
    for old, new in zip(kept.layers, joining.layers):
        if _is_linear(old):
            old.conv_states[0] = torch.cat([old.conv_states[0], new.conv_states[0]])
            old.recurrent_states[0] = torch.cat([old.recurrent_states[0], new.recurrent_states[0]])
            continue
        old.keys = torch.cat([F.pad(old.keys, (0, 0, width - kept_width, 0)),
                              F.pad(new.keys, (0, 0, width - joining_width, 0))])
        old.values = torch.cat([F.pad(old.values, (0, 0, width - kept_width, 0)),
                                F.pad(new.values, (0, 0, width - joining_width, 0))])


def drop_left(cache: DynamicCache, positions: int) -> None:
    """Forget the first `positions` (padding no row needs any more) of every layer that has positions."""
    for layer in cache.layers:
        if not _is_linear(layer):
            layer.keys, layer.values = layer.keys[..., positions:, :], layer.values[..., positions:, :]


def row_positions(cache: DynamicCache, row: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copies of a row's last `length` positions, per layer: keys and values [heads, length, dim]."""
    return ([layer.keys[row, :, -length:].clone() for layer in cache.layers],
            [layer.values[row, :, -length:].clone() for layer in cache.layers])


class DynamicBatchCache:
    """The running batch's cache as a DynamicCache that grows a position every step, left-padded to a common
    width, with its attention mask: the path of models with linear-attention layers, whose state has no
    positions to preallocate. Has StaticBatchCache's interface (static_cache.py) and decodes itself."""

    def __init__(self, model: torch.nn.Module, slot: AdapterSlot, vision: bool, device: torch.device):
        self.model, self.slot, self.vision, self.device = model, slot, vision, device
        self.cache: DynamicCache | None = None
        self.mask_RL = torch.zeros(0, 0, dtype=torch.long, device=device)

    @property
    def used_width(self) -> int:
        return self.mask_RL.shape[1]

    def join(self, prefilled: DynamicCache, mask_NP: torch.Tensor) -> None:
        """Append the prefilled rows; the shorter side is left-padded (masked-out zero keys)."""
        mask_NP = to_device(mask_NP, self.device)
        if self.cache is None:
            self.cache, self.mask_RL = prefilled, mask_NP
            return
        old, new = self.mask_RL.shape[1], mask_NP.shape[1]
        width = max(old, new)
        append_rows(self.cache, prefilled, old, new)
        self.mask_RL = torch.cat([F.pad(self.mask_RL, (width - old, 0)), F.pad(mask_NP, (width - new, 0))])

    def keep(self, kept: list[int]) -> None:
        """Keep these rows, in this order, and drop the left padding no remaining row needs."""
        if not kept:
            self.clear()
            return
        keep_R = to_device(kept, self.device)
        select_rows(self.cache, keep_R)
        self.mask_RL = self.mask_RL[keep_R]
        first_used = int(self.mask_RL.any(dim=0).nonzero()[0])
        if first_used > 0:
            drop_left(self.cache, first_used)
            self.mask_RL = self.mask_RL[:, first_used:]

    def clear(self) -> None:
        self.cache = None
        self.mask_RL = self.mask_RL[:0, :0]

    def positions(self, row: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return row_positions(self.cache, row, length)

    def logits(self, token_R: torch.Tensor, position_R: torch.Tensor, adapter_R: torch.Tensor,
               stack: AdapterStack | None) -> torch.Tensor:
        """Feed every row its token and return its next-token logits [R, V] (fp32)."""
        self.mask_RL = F.pad(self.mask_RL, (0, 1), value=1)
        position = position_R[:, None]
        if self.vision:
            position = position.expand(3, -1, -1)  # generated text advances every rope axis
        with torch.no_grad(), use_adapter_rows(self.slot, stack, adapter_R):
            hidden_R1D = self.model.model(input_ids=token_R[:, None], attention_mask=self.mask_RL,
                                          position_ids=position, past_key_values=self.cache,
                                          use_cache=True).last_hidden_state
            return self.model.lm_head(hidden_R1D).float()[:, -1]
