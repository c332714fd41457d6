"""The embedded engine's requests from arrival to last sample: what each one carries (`_Active`), its prompt
as the batch prefills it (`_PromptView`), and the line that hands out rows in the running batch (`_Line`).
Used on the engine thread only; knows nothing about the model or the batch's tensors.
"""

import random
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from server.lora.layers import LoraAdapter
from server.sampling.draws import seeded_generator
from server.sampling.types import SampledSequence, SampleOutput, SamplingRequest

if TYPE_CHECKING:
    from server.sampling.embedded_batch import _Batch

# prompt_alt_tokens_k draws with a generator of its own, seeded from the request's seed mixed with this
# (2**64 / golden ratio), so that a request's samples are the same with or without the draws.
_ALT_TOKENS_SEED_MIX = 0x9E3779B97F4A7C15
# Extra tail tokens decoded for stop strings, so that a token whose text depends on its left
# context (a leading space, half of a UTF-8 character) never sits inside a stop string.
_STOP_WINDOW_MARGIN = 8


@dataclass
class _Waiting:
    request: SamplingRequest
    adapter: LoraAdapter | None
    future: Future = field(default_factory=Future)


class _Active:
    """One request, from its arrival in the line to its last sample: its samples so far, one
    generator per sample, and where its results go.

    Each sample draws with its own generator, so its tokens do not depend on what else is in the batch
    or on when it joined; the request's `on_token` gets each token as it is sampled.
    """

    def __init__(self, waiting: _Waiting, device: torch.device):
        self.request = waiting.request
        self.adapter = waiting.adapter
        self.future = waiting.future
        options = self.request.options
        # Sample i draws with seed s + i (vLLM seeds child i of a request so), so a sample's tokens
        # are the same whether it joined the batch with its siblings or later; 64 bits, wrapping. Each
        # token takes one uniform number of the sample's own stream (server/sampling/draws.py).
        seed = random.getrandbits(64) if options.seed is None else options.seed
        self.streams = [random.Random((seed + sample) % (1 << 64)) for sample in range(self.request.num_samples)]
        wanted = self.request.logprobs
        self.alt_tokens_generator = None
        if wanted.prompt_alt_tokens_k:
            self.alt_tokens_generator = seeded_generator(device, None if options.seed is None
                                                         else options.seed ^ _ALT_TOKENS_SEED_MIX)
        self.sequences = [SampledSequence(tokens=[], logprobs=[], stop_reason="length",
                                          topk_logprobs=[] if wanted.topk_sample_logprobs else None)
                          for _ in range(self.request.num_samples)]
        self.rows_left = self.request.num_samples
        """Samples not stopped yet, in the batch or still waiting."""
        self.num_admitted = 0
        """Samples that joined the batch: samples 0 .. num_admitted - 1."""
        self.stop_token_ids = set(options.stop_token_ids)
        self.stop_window = max((len(s.encode()) for s in options.stop_strings), default=0) + _STOP_WINDOW_MARGIN
        self.output = SampleOutput(sequences=self.sequences)
        """The result: the first prefill fills in what the request asks of its prompt, decoding the sequences."""
        self.view: _PromptView | None = None
        """Its prompt as the batch prefills it, worked out at its first prefill."""

    @property
    def rows_waiting(self) -> int:
        return self.request.num_samples - self.num_admitted

    @property
    def rows_running(self) -> int:
        return self.rows_left - self.rows_waiting

    def share_rows(self, max_batch_tokens: int) -> int:
        """The rows it may hold while others wait: half the budget, at least one."""
        row_tokens = self.request.prompt.num_positions + self.request.options.max_tokens
        return max(1, max_batch_tokens // 2 // row_tokens)

    def waits_below_share(self, max_batch_tokens: int) -> bool:
        return self.rows_waiting > 0 and self.rows_running < self.share_rows(max_batch_tokens)


@dataclass
class _PromptView:
    """What prefilling a request's prompt takes, worked out once, on the engine thread."""

    sequence: list[int]
    """The expanded token ids (one pad per image token)."""
    positions: torch.Tensor
    """int64 [3, L] (M-RoPE models) or [L]: rope positions."""
    image_spans: list[tuple[int, int]]
    """(first position, number of positions) of each image, in order."""
    content: np.ndarray
    """int64 [L]: the prefix cache's view of each position (prefix_cache.content_ids)."""
    block_keys: list[bytes]
    """The prefix cache's keys of its full blocks."""
    salt: str
    """What sets its keys apart beside the content: the adapter's name."""

    def outside_images(self, length: int) -> int:
        """The longest prefix of at most `length` positions that ends outside every image."""
        for start, count in self.image_spans:
            if start < length < start + count:
                return start
        return length


@dataclass
class _Part:
    """Samples first .. first + count - 1 of a request, joining the batch together."""

    active: _Active
    first: int
    count: int


@dataclass
class _Joining:
    """What the parts admitted so far in one admission add up to."""

    tokens_left: int
    """The most tokens a running or joining row may still generate."""
    num_parts: int = 0
    num_rows: int = 0
    longest: int = 0
    """The longest joining prompt."""

    def add(self, part: _Part) -> None:
        self.num_parts += 1
        self.num_rows += part.count
        self.longest = max(self.longest, part.active.request.prompt.num_positions)
        self.tokens_left = max(self.tokens_left, part.active.request.options.max_tokens)


class _Line:
    """The requests with samples not yet in the batch, in the order they get rows: those not started
    yet first, in arrival order, then the partly admitted ones, least recently admitted first.

    A request's samples join a few at a time when they do not all fit, and one request holds at most half
    the budget while others wait; a request with no row yet may take one beyond the budget (such rows add
    at most an eighth, at least one: `_Batch.rows_that_fit`), so a request that arrives while long rows
    fill the batch starts at the next step.
    """

    def __init__(self):
        self.fresh: list[_Active] = []
        self.partial: list[_Active] = []

    def __bool__(self) -> bool:
        return bool(self.fresh or self.partial)

    def arrive(self, active: _Active) -> None:
        self.fresh.append(active)

    def admit(self, batch: "_Batch") -> list[_Part]:
        """The samples that join the batch now, a few of a request where not all fit."""
        order = [active for active in [*self.fresh, *self.partial] if not active.future.done()]
        # A request holds at most half the budget (at least one row) while another waits below its
        # own share: the simplest share that leaves room for a newcomer as the big one's rows stop,
        # whatever the number of tenants. When all that wait have their share (or one is alone), rows
        # go round in line order, so none stay idle.
        below_share = sum(active.waits_below_share(batch.max_batch_tokens) for active in order)
        joining = _Joining(tokens_left=batch.tokens_left())
        parts: list[_Part] = []
        for active in order:
            counted = active.waits_below_share(batch.max_batch_tokens)
            limit = active.rows_waiting
            if below_share > counted:
                room = active.share_rows(batch.max_batch_tokens) - active.rows_running
                if room <= 0:
                    continue  # over its share: those behind it go first
                limit = min(limit, room)
            count = min(limit, batch.rows_that_fit(active, joining))
            if not batch.rows and not parts:
                count = max(count, 1)  # alone, a request runs even if one row is over the budget
            if count == 0:
                break  # first come, first served: nobody overtakes a request that does not fit
            parts.append(_Part(active, active.num_admitted, count))
            joining.add(parts[-1])
            active.num_admitted += count
            below_share += active.waits_below_share(batch.max_batch_tokens) - counted
        # Partly admitted requests go to the back, behind everyone who got no rows this time.
        joined = {id(part.active) for part in parts}
        self.fresh = [a for a in self.fresh if id(a) not in joined and not a.future.done()]
        self.partial = ([a for a in self.partial if id(a) not in joined and not a.future.done()]
                        + [part.active for part in parts if part.active.rows_waiting])
        return parts

    def fail_all(self, error: Exception) -> None:
        for active in [*self.fresh, *self.partial]:
            if not active.future.done():
                active.future.set_exception(error)
        self.fresh, self.partial = [], []
