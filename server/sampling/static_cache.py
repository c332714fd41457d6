"""The running batch's keys and values in buffers allocated ahead, for models of full attention only: a decode
step writes one column in place instead of growing every layer's tensors, so its forward has the same shapes
and the same addresses step after step (what a CUDA graph needs, decode_graphs.py).

Per layer, keys and values are [row capacity, heads, column capacity, dim]. Rows [0, rows) are used, in the
batch's order; columns [0, width) hold the rows left-padded (a row's positions end at `width`, its mask hides
its padding), and every row writes its next position at column `width`. The capacities grow (doubling) only
between steps, and with them `generation`, which tells the graphs captured over the old buffers to go.

Shapes: R rows (or row capacity)  N rows joining  L columns  P the joining rows' width
"""

from collections import Counter

import torch
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin, DynamicCache

from server.sampling.host_copies import to_device

# Growth doubles a capacity; past this many times the batch's own budget of positions, a growing buffer is
# sized to what the batch holds now instead (rows and columns rarely peak at the same time).
_MAX_POSITIONS_OVER_BUDGET = 4


class _ColumnLayer(CacheLayerMixin):
    """One layer's keys and values over a bucket of the buffers: `update` writes the step's column in place
    (at a position held on the device, so a replayed graph writes wherever the batch is) and returns the bucket."""

    is_sliding = False
    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, column_1: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.column_1 = keys, values, column_1
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise AssertionError("the buffers exist before the first step")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.column_1, key_states)
        self.values.index_copy_(2, self.column_1, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2], 0

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


class StaticBatchCache:
    """The batch's keys, values, attention mask and decode inputs, in buffers that keep their addresses.

    Rows join right-aligned at the write column (the columns shift right when a newcomer is wider than what is
    used) and leave by compaction; left padding no row needs is reclaimed by a shift as soon as it spans a
    bucket's step of columns (the steps' attention then covers fewer), or when the columns run out.
    """

    def __init__(self, device: torch.device, vision: bool, max_positions: int, *, rows: int = 8,
                 columns: int = 256, column_step: int = 256):
        """
        Args:
            max_positions: the batch's budget of positions (rows x columns); bounds how far growth may overshoot.
            rows, columns: the first capacities (rounded up to a power of two, and to a power of two times
                `column_step`).
            column_step: the columns of a decode bucket are a multiple of it.
        """
        self.device = device
        self.vision = vision
        self.max_positions = max_positions
        self.column_step = column_step
        self.row_capacity = 1 << (rows - 1).bit_length()  # a bucket's rows are a power of two
        self.column_capacity = self._columns_for(columns)
        self.rows = 0
        self.width = 0
        """Columns in use; every row's next position goes to this column."""
        self.starts: list[int] = []
        """The first column each row uses (its positions and the holes its mask hides are to the right)."""
        self.generation = 0
        self.moves: Counter[str] = Counter()
        """How often the buffers grew, rows were compacted, and columns shifted right (for a wider newcomer)
        or left (to reclaim padding no row needs)."""
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._allocate_inputs()

    def _allocate_inputs(self) -> None:
        rows, columns, device = self.row_capacity, self.column_capacity, self.device
        self.mask_RL = torch.zeros(rows, columns, dtype=torch.bool, device=device)
        self.token_R1 = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.position_R = torch.zeros(rows, dtype=torch.long, device=device)
        self.adapter_R = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.column_1 = torch.zeros(1, dtype=torch.long, device=device)

    @property
    def used_width(self) -> int:
        """Columns the rows need (the width without the left padding no row needs)."""
        return self.width - min(self.starts) if self.rows else 0

    # -- rows joining and leaving ----------------------------------------------------------------------

    def join(self, prefilled: DynamicCache, mask_NP: torch.Tensor) -> None:
        """Append the prefilled rows (their positions the last ones of `prefilled`, `mask_NP` on the host)."""
        joining, width = mask_NP.shape
        if not self.keys:
            self._allocate_layers(prefilled)
        needed = max(self.used_width, width)
        self._reserve(self.rows + joining, needed + 1)
        if self.width < width:
            self._shift(needed - self.width)  # what is there moves right, to end where the newcomers do
        end = self.width
        start, stop = end - width, self.rows + joining
        for buffers, layers in ((self.keys, [layer.keys for layer in prefilled.layers]),
                                (self.values, [layer.values for layer in prefilled.layers])):
            for buffer, new in zip(buffers, layers):
                buffer[self.rows:stop, :, start:end] = new
        self.mask_RL[self.rows:stop] = False
        self.mask_RL[self.rows:stop, start:end] = to_device(mask_NP != 0, self.device)
        self.starts += [start + int(first) for first in (mask_NP != 0).int().argmax(dim=1)]
        self.rows = stop

    def keep(self, kept: list[int]) -> None:
        """Keep these rows, in this order (the others leave)."""
        if kept == list(range(len(kept))):  # only rows at the end left
            self.rows, self.starts = len(kept), self.starts[:len(kept)]
        elif not kept:
            self.clear()
            return
        else:
            index_N = to_device(kept, self.device)
            low = min(self.starts[row] for row in kept)
            for buffer in self.keys + self.values:
                buffer[:len(kept), :, low:self.width] = buffer[index_N, :, low:self.width]
            self.mask_RL[:len(kept)] = self.mask_RL[index_N]
            self.moves["compact"] += 1
            self.rows, self.starts = len(kept), [self.starts[row] for row in kept]
        if self._bucket_columns(self.used_width + 1) < self._bucket_columns(self.width + 1):
            self._shift(self.used_width - self.width)  # the steps' attention covers fewer columns from now on

    def clear(self) -> None:
        self.rows, self.width, self.starts = 0, 0, []

    def positions(self, row: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of a row's last `length` positions, per layer: keys and values [heads, length, dim]."""
        span = slice(self.width - length, self.width)
        return ([buffer[row, :, span].clone() for buffer in self.keys],
                [buffer[row, :, span].clone() for buffer in self.values])

    # -- a decode step -----------------------------------------------------------------------------

    def bucket(self) -> tuple[int, int]:
        """Rows and columns the next step's forward covers: rows up to a power of two, columns up to a multiple
        of the step, past the write column."""
        return 1 << (self.rows - 1).bit_length(), self._bucket_columns(self.width + 1)

    def _bucket_columns(self, columns: int) -> int:
        return -(-columns // self.column_step) * self.column_step

    def prepare_step(self, token_R: torch.Tensor, position_R: torch.Tensor, adapter_R: torch.Tensor) -> tuple[int, int]:
        """Make room for the step's column and put its inputs in place; returns its bucket. Padding rows get
        token 0 at position 0 and no adapter, and see at least their own column (no row is all masked); what
        they compute is dropped."""
        if self.width + 1 > self.column_capacity:  # no room for the step's column
            if self.used_width < self.width:
                self._shift(self.used_width - self.width)
            else:
                self._reserve(self.rows, self.width + 1)
        rows, columns = self.bucket()
        used = self.rows
        self.mask_RL[:rows, self.width] = True
        self.column_1.fill_(self.width)
        self.token_R1[:used, 0] = token_R
        self.position_R[:used] = position_R
        self.adapter_R[:used] = adapter_R
        if used < rows:  # each write is a launch on a GPU, even of nothing
            self.token_R1[used:rows] = 0
            self.position_R[used:rows] = 0
            self.adapter_R[used:rows] = -1
        return rows, columns

    def finish_step(self) -> None:
        self.width += 1

    def inputs(self, rows: int, columns: int) -> dict:
        """The language model's keyword arguments for a step over this bucket (views of the buffers)."""
        position = self.position_R[:rows, None]
        if self.vision:
            position = position.expand(3, -1, -1)  # generated text advances every rope axis
        cache = Cache(layers=[_ColumnLayer(keys[:rows, :, :columns], values[:rows, :, :columns], self.column_1)
                              for keys, values in zip(self.keys, self.values)])
        return {"input_ids": self.token_R1[:rows], "attention_mask": self.mask_RL[:rows, None, None, :columns],
                "position_ids": position, "past_key_values": cache, "use_cache": True}

    # -- capacity --------------------------------------------------------------------------------------

    def _allocate_layers(self, prefilled: DynamicCache) -> None:
        for layer in prefilled.layers:
            rows, heads, _, dim = layer.keys.shape
            shape = (self.row_capacity, heads, self.column_capacity, dim)
            self.keys.append(layer.keys.new_zeros(shape))
            self.values.append(layer.values.new_zeros(shape[:3] + layer.values.shape[3:]))

    def _reserve(self, rows: int, columns: int) -> None:
        """Grow the buffers to hold `rows` rows and `columns` columns; what is used moves to the left edge."""
        if rows <= self.row_capacity and columns <= self.column_capacity:
            return
        new_rows = max(self.row_capacity, 1 << (rows - 1).bit_length())
        new_columns = max(self.column_capacity, self._columns_for(columns))
        if new_rows * new_columns > _MAX_POSITIONS_OVER_BUDGET * self.max_positions:
            new_rows, new_columns = 1 << (rows - 1).bit_length(), self._columns_for(columns)
        low = self.width - self.used_width
        used = slice(low, self.width)
        moved = slice(0, self.width - low)
        for buffers in (self.keys, self.values):
            for index, old in enumerate(buffers):
                new = old.new_zeros((new_rows, old.shape[1], new_columns, old.shape[3]))
                new[:self.rows, :, moved] = old[:self.rows, :, used]
                buffers[index] = new
        mask_RL = self.mask_RL
        self.row_capacity, self.column_capacity = new_rows, new_columns
        self._allocate_inputs()
        self.mask_RL[:self.rows, moved] = mask_RL[:self.rows, used]
        self.width -= low
        self.starts = [start - low for start in self.starts]
        self.generation += 1
        self.moves["grow"] += 1

    def _columns_for(self, columns: int) -> int:
        """The fewest columns, a power of two times the step, that hold `columns`."""
        steps = -(-columns // self.column_step)
        return (1 << (steps - 1).bit_length()) * self.column_step

    def _shift(self, by: int) -> None:
        """Move every row's columns `by` to the right (left when negative), within the buffers."""
        low = self.width - self.used_width
        source, target = slice(low, self.width), slice(low + by, self.width + by)
        if not self.rows or not by:
            self.width += by
            return
        for buffer in self.keys + self.values:
            buffer[:self.rows, :, target] = buffer[:self.rows, :, source].clone()
        mask_RL = self.mask_RL[:self.rows, source].clone()
        self.mask_RL[:self.rows] = False
        self.mask_RL[:self.rows, target] = mask_RL
        self.moves["shift right" if by > 0 else "reclaim"] += 1
        self.width += by
        self.starts = [start + by for start in self.starts]
