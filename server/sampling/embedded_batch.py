"""The embedded engine's running batch (`_Batch`), owned by the engine thread: prefill (with the prefix
cache), merge, one decode step over every row, sampling and the rows' adapters. Knows nothing about
the queue, threads or the order in which requests get rows (embedded_requests.py).

Tensor shape suffixes:
  R  rows of the running batch (one per sample still decoding)   L  cache positions
  M  parts of requests prefilled together   P  their padded prompt length   N  samples of one request
  V  vocabulary   C  a chunk of prompt positions   K  top-k alternatives or draws
  X  cells of target_prompt_logprobs
"""

import logging
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache

from server.errors import EngineUnavailable, InvalidRequest
from server.lora.adapter_buffers import AdapterBuffers
from server.lora.layers import AdapterSlot, AdapterStack, LoraAdapter, use_adapter_rows
from server.models.attention import without_cudnn_attention
from server.models.loading import LoadedVision
from server.models.logprobs import (mask_refused, refused_ids_tensor, refused_mask, renormalised_logprobs,
                                    zero_refused_targets)
from server.models.vision_features import VisionEncoder
from server.rendering.chunks import position_ids
from server.sampling.batch_cache import DynamicBatchCache, new_cache, row_positions, select_rows
from server.sampling.decode_graphs import DecodeRunner, DecodeSettings
from server.sampling.draws import best_alternatives, draw, sample_tokens
from server.sampling.embedded_requests import _Active, _Joining, _Part, _PromptView
from server.sampling.host_copies import to_device
from server.sampling.prefix_cache import PrefixCache, Segment, block_keys, content_ids
from server.sampling.static_cache import StaticBatchCache
from server.sampling.types import PromptAltTokens

logger = logging.getLogger(__name__)

# Prompt logprobs are computed this many fp32 elements at a time (256 MiB), whatever the vocabulary.
_PROMPT_LOGPROB_CHUNK_ELEMENTS = 1 << 26
# Padded prompt tokens prefilled in one step: newcomers beyond it wait a step, so that the
# running rows are not held for long by a burst of long prompts.
_MAX_PREFILL_TOKENS = 8192
# A request with no row yet may take one beyond the budget, as long as such rows add at most one in this
# many of the rows that fit (at least one): another tenant's short request never waits for long rows to stop.
_NEWCOMER_HEADROOM = 8


@dataclass
class EngineModel:
    """The engine's own model copy and what it needs to know about it."""

    model: torch.nn.Module
    """HF *ForCausalLM / *ForConditionalGeneration with LoRA wrappers (`slot`)."""
    slot: AdapterSlot
    tokenizer: object
    vision: LoadedVision | None = None
    vision_encoder: VisionEncoder | None = None
    refused_token_ids: frozenset[int] = frozenset()
    """Never sampled: the media placeholders."""
    hybrid: bool = False
    """Some layers are linear attention (`ModelFamily.hybrid`): no prefix cache."""

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def static_decode(self) -> bool:
        """Whether every layer is full attention, whose positions a static cache can preallocate."""
        return not self.hybrid and "sliding_attention" not in (getattr(self.model.config.get_text_config(),
                                                                       "layer_types", None) or ())


@dataclass
class _Prefill:
    """How one part is prefilled: its prompt's last positions, after `cached` taken from a cached segment."""

    part: "_Part"
    view: _PromptView
    segment: Segment | None
    cached: int
    matched: int
    """The cached prefix found (whole blocks), before `cached` was cut back to what the forward takes."""


class _Batch:
    """The running batch, owned by the engine thread: row r of every tensor is sample `rows[r]`.

    A request joins it at the next decode step: it is prefilled (with the other newcomers) and its cache is
    merged into the batch's, left-padded, with an attention mask and explicit rope positions for every row;
    it leaves when its last sample stops, so a long request never holds a short one. Rows of any mix of
    adapters share every forward (one adapter per row, lora/layers.py), and the batch stays within a token
    budget (`rows_that_fit`).
    """

    def __init__(self, engine_model: EngineModel, max_batch_tokens: int, prefix_cache_bytes: int = 0,
                 decode: DecodeSettings = DecodeSettings()):
        self.m = engine_model
        self.max_batch_tokens = max_batch_tokens
        # A linear-attention layer's state covers a whole sequence: it cannot be cut at a shared prefix.
        self.prefix_cache = (PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 and not engine_model.hybrid
                             else None)
        self.device = engine_model.device
        self.dtype = next(engine_model.model.parameters()).dtype
        self.refused_M = refused_ids_tensor(engine_model.refused_token_ids, self.device)
        self.refused_V = refused_mask(self.refused_M, engine_model.model.lm_head.base.out_features)
        """Kept for the decode steps' sampling (built once rather than every step)."""
        self.rows: list[tuple[_Active, int]] = []
        """(request, sample index) of each cache row."""
        self.buffers: AdapterBuffers | None = None
        """Where the rows' adapters are put, with a static cache (graphs read them at fixed addresses)."""
        if decode.mode != "dynamic" and engine_model.static_decode:
            step = decode.column_step or (256 if self.device.type == "cuda" else 32)
            self.cache = StaticBatchCache(self.device, engine_model.vision is not None, max_batch_tokens,
                                          rows=decode.rows, columns=decode.columns, column_step=step)
            self.decoder = DecodeRunner(engine_model.model, engine_model.slot, self.cache, decode.mode == "graphs")
            self.buffers = AdapterBuffers(engine_model.slot, self.dtype, self.device)
        else:
            self.cache = self.decoder = DynamicBatchCache(engine_model.model, engine_model.slot,
                                                          engine_model.vision is not None, self.device)
        self.position_R = torch.zeros(0, dtype=torch.long, device=self.device)
        """The rope position of each row's next input token (every rope axis, for M-RoPE models)."""
        self.token_R = torch.zeros(0, dtype=torch.long, device=self.device)
        """Each row's last sampled token, the input of the next decode step."""
        self.temperature_R = torch.zeros(0, device=self.device)
        self.top_k_R = torch.zeros(0, dtype=torch.long, device=self.device)
        self.top_p_R = torch.zeros(0, device=self.device)
        """Each row's sampling settings (its request's), so that one pass draws every row."""
        self.adapters: list[LoraAdapter | None] = []
        self.stack: AdapterStack | AdapterBuffers | None = None
        self.adapter_index: dict[int, int] = {}
        """id(adapter) -> the row index that selects it in `stack` (rows of any other: the base model)."""
        self.row_adapter_R = torch.zeros(0, dtype=torch.long, device=self.device)

    # -- admission -----------------------------------------------------------------------------

    def tokens_left(self) -> int:
        """The most tokens a running row may still generate (0 for an empty batch)."""
        return max((a.request.options.max_tokens - len(a.sequences[sample].tokens) for a, sample in self.rows),
                   default=0)

    def rows_that_fit(self, active: _Active, joining: "_Joining") -> int:
        """How many rows of `active` may join now, beside the parts joining this step, within the budgets."""
        longest = max(joining.longest, active.request.prompt.num_positions)
        if joining.num_parts and (joining.num_parts + 1) * longest > _MAX_PREFILL_TOKENS:
            return 0
        # After the merge every row is left-padded to the same width, then grows until it stops.
        width = max(self.cache.used_width, longest)
        remaining = max(joining.tokens_left, active.request.options.max_tokens)
        capacity = self.max_batch_tokens // (width + remaining)
        free = capacity - len(self.rows) - joining.num_rows
        if free <= 0 and active.num_admitted == 0 and -free < max(1, capacity // _NEWCOMER_HEADROOM):
            return 1  # a request with no row yet gets one in the headroom over the budget
        return max(0, free)

    def prefill(self, parts: list[_Part]) -> None:
        """Prefill the newcomers' prompts, sample their first tokens and merge them into the batch: those that
        start like a cached sequence from where they part, together, and the others together."""
        plans = [self._plan(part) for part in parts]
        for group in ([plan for plan in plans if not plan.cached], [plan for plan in plans if plan.cached]):
            if group:
                self._prefill_group(group)

    def _plan(self, part: _Part) -> _Prefill:
        """How much of a part's prompt the prefix cache gives (none where the request scores its prompt)."""
        view = self._view(part.active)
        if self.prefix_cache is None or (part.active.request.logprobs.scores_prompt and part.first == 0):
            return _Prefill(part, view, None, 0, 0)
        segment, matched = self.prefix_cache.longest(view.block_keys)
        # The last position is always run: its logits give the first token.
        cached = view.outside_images(min(matched, len(view.sequence) - 1))
        return _Prefill(part, view, segment if cached else None, cached, matched)

    def _view(self, active: _Active) -> _PromptView:
        """The request's prompt as prefilled, worked out once: the image pads expanded to one per image token
        (as vLLM does), rope positions, image spans and the prefix cache's keys."""
        if active.view is None:
            prompt = active.request.prompt
            sequence = prompt.expanded_token_ids()
            vision = self.m.vision
            positions = position_ids(prompt, vision) if vision else torch.arange(len(sequence))
            spans, position, images = [], 0, iter(prompt.images)
            for segment in prompt.segments():
                count = segment if isinstance(segment, int) else next(images).num_tokens
                if not isinstance(segment, int):
                    spans.append((position, count))
                position += count
            content = content_ids(sequence, [(image.sha256, start, count)
                                             for image, (start, count) in zip(prompt.images, spans)])
            salt = active.request.adapter.name if active.request.adapter is not None else ""
            active.view = _PromptView(sequence, positions, spans, content,
                                      block_keys(content, salt) if self.prefix_cache is not None else [], salt)
        return active.view

    def _prefill_group(self, plans: list[_Prefill]) -> None:
        """Prefill these parts together, sample their first tokens and merge them into the batch."""
        parts = [plan.part for plan in plans]
        actives = [part.active for part in parts]
        try:
            self._use_adapters([a.adapter for a, _ in self.rows] + [a.adapter for a in actives])
            cache, mask_MP, next_position_M, last_logits_MV = self._prefill_forward(plans)
        except Exception as error:
            # The newcomers' own failure (bad input, out of memory): the running batch is untouched.
            # Alone, each one fails only for what is wrong with it (with its rows already running).
            self._use_adapters([a.adapter for a, _ in self.rows])
            if len(plans) > 1:
                for plan in plans:
                    self._prefill_group([plan])
                return
            logger.exception("prefill of a sampling request failed")
            actives[0].future.set_exception(_as_server_error(error))
            self._drop_finished()
            return
        for row, plan in enumerate(plans):
            if plan.part.first == 0:
                plan.part.active.output.prompt_cache_hit_tokens = plan.cached
            if self.prefix_cache is not None and len(plan.view.block_keys) * self.prefix_cache.block_tokens > plan.matched:
                self.prefix_cache.insert(plan.view.block_keys, *row_positions(cache, row, len(plan.view.sequence)))
        rows = [(part.active, part.first + index) for part in parts for index in range(part.count)]
        if len(rows) > len(parts):  # a part of several samples: its prefilled row is repeated for each
            expand = torch.repeat_interleave(torch.arange(len(parts)), torch.tensor([part.count for part in parts]))
            expand_R = to_device(expand, self.device)
            select_rows(cache, expand_R)
            mask_MP, next_position_M = mask_MP[expand], next_position_M[expand_R]
            last_logits_MV = last_logits_MV[expand_R]
        self._merge(cache, mask_MP, next_position_M, rows)
        self._sample(last_logits_MV, range(len(self.rows) - len(rows), len(self.rows)))
        self._drop_finished()

    def _prefill_forward(self, plans: list[_Prefill]):
        """One forward over the newcomers' prompts after their cached prefixes; returns their cache, mask (on the
        host), next positions and last logits, and fills in the prompt logprobs of requests starting now.

        Row m of the cache holds its prompt's positions as its last ones: first its cached prefix (from its
        segment, left-padded to the longest one), then the positions it runs (left-padded to the most any
        row runs). A row runs at least what it did not find cached, and more where another row of the group
        runs more (its cached prefix is cut back to keep the input rectangular, never inside an image).
        """
        width = max(len(plan.view.sequence) - plan.cached for plan in plans)
        while True:  # cutting a prefix back out of an image makes that row run more: widen until none does
            cached = [plan.view.outside_images(min(plan.cached, max(0, len(plan.view.sequence) - width)))
                      for plan in plans]
            widest = max(len(plan.view.sequence) - c for plan, c in zip(plans, cached))
            if widest == width:
                break
            width = widest
        past = max(cached)
        for plan, prefix in zip(plans, cached):
            plan.cached = prefix
        vision = self.m.vision
        input_ids_MN = torch.zeros(len(plans), width, dtype=torch.long)
        mask_MP = torch.zeros(len(plans), past + width, dtype=torch.long)
        positions = torch.zeros((3, len(plans), width) if vision else (len(plans), width), dtype=torch.long)
        images = []
        for row, (plan, prefix) in enumerate(zip(plans, cached)):
            run = len(plan.view.sequence) - prefix
            input_ids_MN[row, width - run:] = torch.tensor(plan.view.sequence[prefix:])
            mask_MP[row, past - prefix:past] = 1
            mask_MP[row, past + width - run:] = 1
            positions[..., row, width - run:] = plan.view.positions[..., prefix:]
            prompt_images = plan.part.active.request.prompt.images
            images += [image for image, (start, _) in zip(prompt_images, plan.view.image_spans) if start >= prefix]
        next_position_M = torch.tensor([int(plan.view.positions.max()) + 1 for plan in plans])
        # Each group of prompts prefilled together is a new shape (rows, lengths, images): off cuDNN, whose plan for
        # each new shape took 90 % of the engine's time under a burst of short requests on an H100.
        kwargs = {}
        if images:
            with without_cudnn_attention(self.device):
                kwargs["mm_encoder_outputs"] = self.m.vision_encoder.encoder_outputs(images)
        adapter_M = self._adapter_indices([plan.part.active.adapter for plan in plans])
        cache = new_cache(self.m.model.config.get_text_config(), self.m.hybrid)
        if past:
            layers = next(len(plan.segment.keys_HLD) for plan in plans if plan.cached)
            for layer in range(layers):
                cache.update(self._past(plans, past, layer, "keys_HLD"), self._past(plans, past, layer, "values_HLD"),
                             layer)
        # Rows without padding (one alone, always) need no mask: the model's causal one is implied, which spares
        # building a 4D mask and lets SDPA take its causal kernels (and spares the check for padding that waits
        # on the device).
        attention_mask = None if bool(mask_MP.all()) else to_device(mask_MP, self.device)
        with torch.no_grad(), self._rows(adapter_M), without_cudnn_attention(self.device):
            hidden_MND = self.m.model.model(
                input_ids=to_device(input_ids_MN, self.device), attention_mask=attention_mask,
                position_ids=to_device(positions, self.device), past_key_values=cache, use_cache=True, **kwargs,
            ).last_hidden_state
            last_logits_MV = self.m.model.lm_head(hidden_MND[:, -1:]).float()[:, 0]
        for row, plan in enumerate(plans):
            active, sequence = plan.part.active, plan.view.sequence
            if active.request.logprobs.scores_prompt and plan.part.first == 0:  # never cached: it runs whole
                self._score_prompt(active, hidden_MND[row, width - len(sequence):], sequence, adapter_M[row:row + 1])
        return cache, mask_MP, to_device(next_position_M, self.device), last_logits_MV

    @staticmethod
    def _past(plans: list[_Prefill], past: int, layer: int, kind: str) -> torch.Tensor:
        """[M, H, past, D]: each row's cached prefix of one layer's keys or values, left-padded with zeros."""
        reference = next(getattr(plan.segment, kind)[layer] for plan in plans if plan.cached)
        heads, _, dim = reference.shape
        tensor = reference.new_zeros(len(plans), heads, past, dim)
        for row, plan in enumerate(plans):
            if plan.cached:
                tensor[row, :, past - plan.cached:] = getattr(plan.segment, kind)[layer][:, :plan.cached]
        return tensor

    def _score_prompt(self, active: _Active, hidden_LD: torch.Tensor, sequence: list[int],
                      adapter_1: torch.Tensor) -> None:
        """What the request asks of its prompt, from the distribution at each position given the tokens
        before it: each token's logprob, the k best, chosen ids' logprobs, and draws."""
        wanted = active.request.logprobs
        targets = wanted.target_prompt_logprobs
        every_row = wanted.prompt_logprobs or wanted.topk_prompt_logprobs > 0 or wanted.prompt_alt_tokens_k > 0
        # Logit row r predicts prompt position r + 1; the last position's logits only feed sampling. Only
        # target_prompt_logprobs' rows are computed when nothing else needs every row.
        rows_R = (torch.arange(len(sequence) - 1, device=self.device) if every_row
                  else torch.unique(torch.from_numpy(targets.positions - 1).to(self.device)))
        next_L = torch.tensor(sequence[1:], device=self.device)
        k, num_draws = wanted.topk_prompt_logprobs, wanted.prompt_alt_tokens_k
        logprobs, topk = [], []
        draws = [torch.zeros(0, num_draws, dtype=torch.long, device=self.device)]
        draw_logprobs = [torch.zeros(0, num_draws, device=self.device)]
        if targets is not None:
            cell_rows_X = torch.from_numpy(targets.positions - 1).to(self.device)
            cell_ids_X = torch.from_numpy(targets.token_ids).to(self.device)
            target_X = torch.zeros(len(cell_rows_X), device=self.device)
        chunk = max(1, _PROMPT_LOGPROB_CHUNK_ELEMENTS // self.m.model.lm_head.base.out_features)
        for start in range(0, len(rows_R), chunk):
            rows_C = rows_R[start:start + chunk]
            with torch.no_grad(), self._rows(adapter_1):
                logits_CV = self.m.model.lm_head(hidden_LD[rows_C][None])[0]
            logprobs_CV = renormalised_logprobs(logits_CV, self.refused_M)
            if wanted.prompt_logprobs:
                next_C1 = next_L[rows_C, None]
                chosen_C1 = zero_refused_targets(logprobs_CV.gather(-1, next_C1), next_C1, self.refused_M)
                logprobs.extend(chosen_C1[:, 0].tolist())
            if k > 0:
                topk.extend(best_alternatives(logprobs_CV, k))
            if num_draws:
                tokens_CK = draw(logprobs_CV, active.request.options.temperature, num_draws,
                                 active.alt_tokens_generator)
                draws.append(tokens_CK)
                draw_logprobs.append(logprobs_CV.gather(-1, tokens_CK))
            if targets is not None:
                in_chunk_X = (cell_rows_X >= rows_C[0]) & (cell_rows_X <= rows_C[-1])
                ids_X = cell_ids_X[in_chunk_X]
                found = logprobs_CV[torch.searchsorted(rows_C, cell_rows_X[in_chunk_X]), ids_X]
                target_X[in_chunk_X] = zero_refused_targets(found, ids_X, self.refused_M)
        output = active.output
        if wanted.prompt_logprobs:
            output.prompt_logprobs = [None, *logprobs]
        if k > 0:
            output.topk_prompt_logprobs = [None, *topk]
        if num_draws:
            output.prompt_alt_tokens = PromptAltTokens(tokens=torch.cat(draws).cpu().numpy(),
                                                       logprobs=torch.cat(draw_logprobs).cpu().numpy())
        if targets is not None:
            output.target_prompt_logprobs = target_X.cpu().numpy()

    def _merge(self, cache: DynamicCache, mask_NP: torch.Tensor, next_position_N: torch.Tensor,
               rows: list[tuple[_Active, int]]) -> None:
        """Append new rows to the batch; the shorter side is left-padded (masked-out zero keys)."""
        adapter_N = self._adapter_indices([active.adapter for active, _ in rows])
        self.cache.join(cache, mask_NP)
        self.position_R = torch.cat([self.position_R, next_position_N])
        self.token_R = torch.cat([self.token_R, torch.zeros_like(next_position_N)])
        self.row_adapter_R = torch.cat([self.row_adapter_R, adapter_N])
        options = [active.request.options for active, _ in rows]
        self.temperature_R = torch.cat([self.temperature_R, to_device([o.temperature for o in options], self.device)])
        self.top_k_R = torch.cat([self.top_k_R, to_device([o.top_k for o in options], self.device)])
        self.top_p_R = torch.cat([self.top_p_R, to_device([o.top_p for o in options], self.device)])
        self.rows += rows

    # -- decoding ------------------------------------------------------------------------------

    def decode_step(self) -> None:
        """Feed every row its last token, sample the next one, and let finished requests go."""
        try:
            logits_RV = self.decoder.logits(self.token_R, self.position_R, self.row_adapter_R, self.stack)
            self.position_R = self.position_R + 1
            self._sample(logits_RV, range(len(self.rows)))
        except Exception as error:
            logger.exception("a decode step of %d rows failed", len(self.rows))
            self.fail_all(_as_server_error(error))
            return
        self._drop_finished()

    def _sample(self, logits_RV: torch.Tensor, rows: range) -> None:
        """Draw the next token of the given rows (logits_RV holds theirs, in order) and record it: every row
        in one pass, whatever its request."""
        logits_RV = mask_refused(logits_RV, self.refused_M, self.refused_V)
        logprobs_RV = logits_RV.log_softmax(dim=-1)
        at = slice(rows.start, rows.stop) if len(rows) < len(self.rows) else slice(None)  # no slicing ops for all
        drawn = self.rows[at]
        uniform_R = to_device([active.streams[sample].random() for active, sample in drawn], self.device)
        options = [active.request.options for active, _ in drawn]
        vocab = logits_RV.shape[-1]
        tokens_R = sample_tokens(logits_RV, self.temperature_R[at], self.top_k_R[at], self.top_p_R[at], uniform_R,
                                 widest_top_k=max((o.top_k for o in options if 0 < o.top_k < vocab), default=0),
                                 any_top_p=any(o.top_p < 1 for o in options))
        self.token_R[at] = tokens_R
        chosen_R = logprobs_RV.gather(-1, tokens_R[:, None])[:, 0]
        alternatives: list[list[tuple[int, float]] | None] = [None] * len(drawn)
        widths = [active.request.logprobs.topk_sample_logprobs for active, _ in drawn]
        if any(widths):
            best = best_alternatives(logprobs_RV, max(widths))
            alternatives = [row[:k] if k else None for row, k in zip(best, widths)]
        # One copy to the host per step: token ids and fp32 logprobs are exact in fp64.
        tokens, logprobs = torch.stack([tokens_R.double(), chosen_R.double()]).tolist()
        for (active, sample), token, logprob, row_best in zip(drawn, tokens, logprobs, alternatives):
            self._record(active, sample, int(token), logprob, row_best)

    def _record(self, active: _Active, sample: int, token: int, logprob: float,
                best: list[tuple[int, float]] | None) -> None:
        sequence = active.sequences[sample]
        sequence.tokens.append(token)
        sequence.logprobs.append(logprob)
        if best is not None:
            sequence.topk_logprobs.append(best)
        if active.request.on_token is not None:
            active.request.on_token(sample, token, logprob, best)
        options = active.request.options
        if token in active.stop_token_ids or self._has_stop_string(active, sequence.tokens):
            sequence.stop_reason = "stop"
        elif len(sequence.tokens) < options.max_tokens:
            return
        active.rows_left -= 1
        if active.rows_left == 0:
            active.future.set_result(active.output)

    def _has_stop_string(self, active: _Active, tokens: list[int]) -> bool:
        """Whether the decoded tail of a completion contains a stop string."""
        # Checked after every token, so a match in the tail was completed by the newest token.
        stop_strings = active.request.options.stop_strings
        if not stop_strings:
            return False
        text = self.m.tokenizer.decode(tokens[-active.stop_window:], skip_special_tokens=False)
        return any(stop in text for stop in stop_strings)

    def _drop_finished(self) -> None:
        """Remove the rows that stopped, and the left padding no remaining row needs."""
        keep = [row for row, (active, sample) in enumerate(self.rows) if not _stopped(active, sample)]
        if len(keep) == len(self.rows):
            return
        if self.prefix_cache is not None:
            kept = set(keep)
            for row, (active, _) in enumerate(self.rows):
                if row not in kept and active.request.num_samples == 1 and active.future.exception() is None:
                    self._keep_conversation(row, active)
        if not keep:
            self._empty()
            return
        self.rows = [self.rows[row] for row in keep]
        self.cache.keep(keep)
        keep_R = to_device(keep, self.device)
        (self.position_R, self.token_R, self.row_adapter_R, self.temperature_R, self.top_k_R,
         self.top_p_R) = (t[keep_R] for t in (self.position_R, self.token_R, self.row_adapter_R,
                                              self.temperature_R, self.top_k_R, self.top_p_R))

    def _keep_conversation(self, row: int, active: _Active) -> None:
        """Put a finished request's prompt and completion into the prefix cache: a conversation's next turn
        starts with them. The last token was sampled, never run, so its keys and values do not exist yet."""
        view, tokens = active.view, active.sequences[0].tokens
        content = np.concatenate([view.content, np.asarray(tokens[:-1], dtype=np.int64)])
        keys = view.block_keys + block_keys(content, view.salt, previous=view.block_keys[-1] if view.block_keys
                                            else None, first_block=len(view.block_keys))
        if len(keys) > len(view.block_keys):
            self.prefix_cache.insert(keys, *self.cache.positions(row, len(content)))

    def fail_all(self, error: Exception) -> None:
        """Fail every request in the batch (the engine itself goes on) and empty it."""
        for active, _ in self.rows:
            if not active.future.done():
                active.future.set_exception(error)
        self._empty()

    def _empty(self) -> None:
        self.rows = []
        self.cache.clear()
        (self.position_R, self.token_R, self.row_adapter_R, self.temperature_R, self.top_k_R,
         self.top_p_R) = (t[:0] for t in (self.position_R, self.token_R, self.row_adapter_R, self.temperature_R,
                                          self.top_k_R, self.top_p_R))
        self._use_adapters([])

    # -- adapters ------------------------------------------------------------------------------

    def _use_adapters(self, adapters: list[LoraAdapter | None]) -> None:
        """Stack exactly the adapters these rows use (a new stack only when that set changes)."""
        distinct = list({id(a): a for a in adapters}.values())
        if [id(a) for a in distinct] == [id(a) for a in self.adapters]:
            return
        self.adapters = distinct
        real = [a for a in distinct if a is not None]
        if not real:
            self.stack, self.adapter_index = None, {}
        elif self.buffers is not None:
            self.stack, self.adapter_index = self.buffers, self.buffers.use(real)
        else:
            self.stack = AdapterStack(self.m.slot, distinct, self.dtype)
            self.adapter_index = {id(a): index for index, a in enumerate(distinct)}
        self.row_adapter_R = self._adapter_indices([active.adapter for active, _ in self.rows])

    def _adapter_indices(self, adapters: list[LoraAdapter | None]) -> torch.Tensor:
        return to_device([self.adapter_index.get(id(a), -1) for a in adapters], self.device, torch.long)

    def _rows(self, adapter_R: torch.Tensor):
        """The context in which the model's forward gives row r the adapter `adapter_index` maps to adapter_R[r]."""
        return use_adapter_rows(self.m.slot, self.stack, adapter_R)


def _stopped(active: _Active, sample: int) -> bool:
    if active.future.done():
        return True  # failed, with rows still in the batch
    sequence = active.sequences[sample]
    return sequence.stop_reason == "stop" or len(sequence.tokens) >= active.request.options.max_tokens


def _as_server_error(error: Exception) -> Exception:
    if isinstance(error, (InvalidRequest, EngineUnavailable)):
        return error
    return EngineUnavailable(f"the embedded sampling engine failed: {type(error).__name__}: {error}")
