"""Position ids of the Qwen-VL families' multimodal rotary embedding (M-RoPE) for text and still images.

Text advances one position per token on all three axes (temporal, height, width). An image's merged
patch grid takes (0, row, column) offsets from the running position, after which text continues
from there + max(rows, columns). This is transformers' `get_rope_index` of Qwen2-VL, Qwen2.5-VL and
Qwen3-VL for still images, computed per image so that two adjacent images stay distinct. Knows
nothing about token ids or chunks: the caller says which runs are text and which are images.
"""

from functools import lru_cache

import numpy as np
import torch

Segment = int | tuple[int, int, int]
"""A run of text tokens (its length), or an image (its patch grid t, h, w before merging)."""


def mrope_position_ids(segments: list[Segment], merge_size: int) -> torch.Tensor:
    """int64 [3, L] positions of a sequence made of the given text runs and images, in order."""
    pieces = []
    start = 0
    for segment in segments:
        if isinstance(segment, int):
            pieces.append(np.broadcast_to(np.arange(start, start + segment), (3, segment)))
            start += segment
            continue
        grid_h, grid_w = segment[1] // merge_size, segment[2] // merge_size
        pieces.append(_grid_offsets(segment[0], grid_h, grid_w) + start)
        start += max(grid_h, grid_w)
    # numpy, not torch: a training request renders tens of datums on rank 0 while the other ranks wait, and
    # torch's per-op overhead was most of this function's time.
    return torch.from_numpy(np.concatenate(pieces, axis=1)) if pieces else torch.zeros(3, 0, dtype=torch.long)


@lru_cache(maxsize=256)
def _grid_offsets(grid_t: int, grid_h: int, grid_w: int) -> np.ndarray:
    """int64 [3, t*h*w] (t, row, column) of each merged patch, row-major; read-only (shared by every caller)."""
    axes = np.meshgrid(np.arange(grid_t), np.arange(grid_h), np.arange(grid_w), indexing="ij")
    offsets = np.stack(axes).reshape(3, -1)
    offsets.flags.writeable = False
    return offsets
