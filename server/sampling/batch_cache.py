"""The running batch's cache, row by row: the operations continuous batching needs from HF's DynamicCache.

A layer of full attention holds keys and values [rows, heads, positions, dim], left-padded to a common
width; a layer of linear attention (Qwen3.5's Gated DeltaNet) holds, per row, its convolution's last
inputs and its recurrent state, whatever the row's length. Rows join, leave and lose left padding
the same way in both; transformers' own batch helpers cover only the first kind.
"""

import torch
import torch.nn.functional as F
from transformers import DynamicCache


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
