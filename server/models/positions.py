"""Position ids of the Qwen-VL families' multimodal rotary embedding (M-RoPE) for text and still images.

Text advances one position per token on all three axes (temporal, height, width). An image's merged
patch grid takes (0, row, column) offsets from the running position, after which text continues
from there + max(rows, columns). This is transformers' `get_rope_index` of Qwen2-VL, Qwen2.5-VL and
Qwen3-VL for still images, computed per image so that two adjacent images stay distinct. Knows
nothing about token ids or chunks: the caller says which runs are text and which are images.
"""

import torch

Segment = int | tuple[int, int, int]
"""A run of text tokens (its length), or an image (its patch grid t, h, w before merging)."""


def mrope_position_ids(segments: list[Segment], merge_size: int) -> torch.Tensor:
    """int64 [3, L] positions of a sequence made of the given text runs and images, in order."""
    pieces = []
    start = 0
    for segment in segments:
        if isinstance(segment, int):
            pieces.append(torch.arange(start, start + segment).expand(3, -1))
            start += segment
            continue
        grid_t, grid_h, grid_w = segment[0], segment[1] // merge_size, segment[2] // merge_size
        t, h, w = torch.meshgrid(torch.arange(grid_t), torch.arange(grid_h), torch.arange(grid_w), indexing="ij")
        pieces.append(torch.stack([t, h, w]).reshape(3, -1) + start)
        start += max(grid_h, grid_w)
    return torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
