"""The embedded engine's prefix cache: the keys and values of sequences it has prefilled or sampled, so that a
prompt that starts like an earlier one (the next turn of a conversation: the last prompt, its completion, a new
observation) is prefilled only from where the two part. Knows nothing about requests, batches or models
beyond the tensors it is handed.

Tensor shape suffixes: H  key/value heads   L  positions   D  head dimension
"""

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

BLOCK_TOKENS = 16


@dataclass(eq=False)
class Segment:
    """The keys and values of one cached sequence, every layer."""

    keys_HLD: list[torch.Tensor]
    values_HLD: list[torch.Tensor]
    length: int
    block_keys: set[bytes] = field(default_factory=set)
    """The keys that name a prefix of it (it is dropped when none is left)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys_HLD, *self.values_HLD))


def content_ids(token_ids: list[int], images: list[tuple[str, int, int]]) -> np.ndarray:
    """What a sequence's positions hold, as int64: the token id, or for an image's position a negative number
    derived from the image's hash and the position within it.

    Args:
        images: (sha256 hex, first position, number of positions) of each image.
    """
    content = np.asarray(token_ids, dtype=np.int64).copy()
    for sha256, start, count in images:
        base = int(sha256[:15], 16)  # 60 bits of the image's hash
        content[start:start + count] = -1 - (base + np.arange(count, dtype=np.int64))
    return content


def block_keys(content: np.ndarray, salt: str, block_tokens: int = BLOCK_TOKENS, previous: bytes | None = None,
               first_block: int = 0) -> list[bytes]:
    """The key of each full block of `content`, from `first_block` on (`previous`: the key of the block before).

    Block i's key is a hash of block i-1's key and block i's content (token ids, and at image positions the
    image's hash and the position within it); block 0's also covers `salt` (the adapter), so requests of
    different adapters (different runs, different tenants) never share an entry. A key names its whole
    prefix, so the longest run of known keys is the longest cached prefix.
    """
    keys = []
    key = previous if previous is not None else hashlib.blake2b(salt.encode(), digest_size=16).digest()
    for start in range(first_block * block_tokens, len(content) - block_tokens + 1, block_tokens):
        key = hashlib.blake2b(key + content[start:start + block_tokens].tobytes(), digest_size=16).digest()
        keys.append(key)
    return keys


class PrefixCache:
    """Segments by the keys of their blocks, bounded in bytes; owned by the engine thread.

    A sequence is cut into blocks of `block_tokens` positions (`block_keys`). Each stored sequence (a
    `Segment`: its keys and values, every layer) serves every prefix of itself; a longer sequence that
    starts the same takes its keys over, and a segment no key names any more is dropped. At most
    `max_bytes` are kept, least recently used first out.
    """

    def __init__(self, max_bytes: int, block_tokens: int = BLOCK_TOKENS):
        self.max_bytes = max_bytes
        self.block_tokens = block_tokens
        self._by_key: dict[bytes, Segment] = {}
        self._segments: OrderedDict[int, Segment] = OrderedDict()
        """Every kept segment by id, least recently used first."""
        self.nbytes = 0

    def longest(self, keys: list[bytes]) -> tuple[Segment | None, int]:
        """The segment holding the longest known prefix named by `keys`, and that prefix's length."""
        found, matched = None, 0
        for index, key in enumerate(keys):
            segment = self._by_key.get(key)
            if segment is None:
                break
            found, matched = segment, index + 1
        if found is not None:
            self._segments.move_to_end(id(found))
        return found, matched * self.block_tokens

    def insert(self, keys: list[bytes], keys_HLD: list[torch.Tensor], values_HLD: list[torch.Tensor]) -> None:
        """Keep a sequence's keys and values (their own copies, `length` >= its full blocks) under its block keys."""
        if not keys:
            return
        segment = Segment(keys_HLD, values_HLD, keys_HLD[0].shape[1])
        if segment.nbytes > self.max_bytes:
            return
        for key in keys:
            replaced = self._by_key.get(key)
            if replaced is not None and replaced.length > segment.length:
                continue  # a longer sequence already serves this prefix
            self._by_key[key] = segment
            segment.block_keys.add(key)
            if replaced is not None:
                replaced.block_keys.discard(key)
                if not replaced.block_keys:
                    self._drop(replaced)
        if not segment.block_keys:
            return
        self._segments[id(segment)] = segment
        self.nbytes += segment.nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self._segments.values())))

    def _drop(self, segment: Segment) -> None:
        for key in segment.block_keys:
            if self._by_key.get(key) is segment:
                del self._by_key[key]
        segment.block_keys.clear()
        if self._segments.pop(id(segment), None) is not None:
            self.nbytes -= segment.nbytes
