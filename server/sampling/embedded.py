"""The embedded sampling engine: HF transformers with a KV cache, on CPU or GPU.

It serves `sample` and `compute_logprobs` when vLLM is absent: prefill the prompt once, copy the
cache into one row per sample, decode all rows together. Like vLLM it takes the sampling
renderer's collapsed prompt (one image pad per image, plus the images) and expands the pads
itself, with image features from its vision cache and the family's rope positions, and the LoRA
adapter each request names. It knows nothing about HTTP, the wire format or checkpoints.
"""

import threading

import torch
from transformers import DynamicCache

from server.config import ModelConfig
from server.errors import InvalidRequest
from server.models.loading import LoadedVision, load_base_model
from server.models.vision_features import VisionEncoder
from server.rendering.chunks import RenderedInput, position_ids
from server.training.lora import AdapterSlot, LoraAdapter, apply_lora_wrappers, use_adapter
from server.sampling.types import SampledSequence, SampleOutput, SamplingOptions

# Tensor shape suffixes:
#   L  prompt positions            N  samples asked for (num_samples)
#   R  rows still decoding         V  vocabulary
#   C  a chunk of prompt positions K  top-k alternatives

# Prompt logprobs are computed this many fp32 elements at a time (256 MiB), whatever the vocabulary.
_PROMPT_LOGPROB_CHUNK_ELEMENTS = 1 << 26
# Extra tail tokens decoded for stop strings, so that a token whose text depends on its left
# context (a leading space, half of a UTF-8 character) never sits inside a stop string.
_STOP_WINDOW_MARGIN = 8




class EmbeddedSampler:
    """Samples from an HF causal LM with a DynamicCache; one instance may serve many threads."""

    def __init__(self, model, tokenizer, *, device: torch.device | str = "cpu", vision: LoadedVision | None = None,
                 vision_encoder: VisionEncoder | None = None, lora_slot: AdapterSlot | None = None):
        # Per-call state lives in locals and the call's own cache, never here or on the model.
        self.model = model
        self.lora_slot = lora_slot
        """Where the model's LoRA wrappers read the adapter to add; None if the model has no wrappers."""
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.vision = vision
        self.vision_encoder = vision_encoder

    @torch.no_grad()
    def sample(
        self,
        prompt: RenderedInput,
        options: SamplingOptions,
        *,
        num_samples: int = 1,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        adapter: LoraAdapter | None = None,
    ) -> SampleOutput:
        """Sample `num_samples` completions of one prompt with `adapter` (None: the base model)."""
        if num_samples < 1:
            raise InvalidRequest(f"num_samples must be at least 1, got {num_samples}")
        if adapter is None:
            return self._sample(prompt, options, num_samples, include_prompt_logprobs, topk_prompt_logprobs)
        with use_adapter(self.lora_slot, adapter):
            return self._sample(prompt, options, num_samples, include_prompt_logprobs, topk_prompt_logprobs)

    def _sample(self, prompt: RenderedInput, options: SamplingOptions, num_samples: int,
                include_prompt_logprobs: bool, topk_prompt_logprobs: int) -> SampleOutput:
        score_prompt = include_prompt_logprobs or topk_prompt_logprobs > 0
        prefill_kwargs = {}
        if prompt.images:
            # M-RoPE positions also steer decoding: every step continues from their maximum + 1.
            prefill_kwargs["mm_encoder_outputs"] = self.vision_encoder.encoder_outputs(prompt.images)
            prefill_kwargs["position_ids"] = position_ids(prompt, self.vision)[:, None, :].to(self.device)
        input_ids_1L = torch.tensor([prompt.expanded_token_ids()], dtype=torch.long, device=self.device)
        cache = DynamicCache(config=self.model.config)
        logits_1LV = self.model(
            input_ids=input_ids_1L,
            past_key_values=cache,
            use_cache=True,
            # Full-vocabulary logits for every position only when the prompt is scored.
            logits_to_keep=0 if score_prompt else 1,
            **prefill_kwargs,
        ).logits

        prompt_logprobs = topk = None
        if score_prompt:
            prompt_logprobs, topk = _score_prompt(logits_1LV[0], input_ids_1L[0], topk_prompt_logprobs)
        next_logits_1V = logits_1LV[:, -1].float()
        del logits_1LV

        sequences = self._decode(cache, next_logits_1V, options, num_samples, prefill_kwargs.get("position_ids"))
        return SampleOutput(
            sequences=sequences,
            prompt_logprobs=prompt_logprobs if include_prompt_logprobs else None,
            topk_prompt_logprobs=topk if topk_prompt_logprobs > 0 else None,
        )

    def _decode(
        self,
        cache: DynamicCache,
        next_logits_1V: torch.Tensor,
        options: SamplingOptions,
        num_samples: int,
        prefill_position_ids: torch.Tensor | None,
    ) -> list[SampledSequence]:
        """Decode all samples together from the prefilled cache, dropping rows as they stop."""
        sequences = [
            SampledSequence(tokens=[], logprobs=[], stop_reason="length") for _ in range(num_samples)
        ]
        generator = torch.Generator(device=next_logits_1V.device)
        if options.seed is None:
            generator.seed()
        else:
            generator.manual_seed(options.seed)
        stop_token_ids = set(options.stop_token_ids)
        stop_window = max((len(s.encode()) for s in options.stop_strings), default=0) + _STOP_WINDOW_MARGIN

        cache.batch_repeat_interleave(num_samples)
        logits_RV = next_logits_1V.expand(num_samples, -1)
        rows_R = torch.arange(num_samples, device=next_logits_1V.device)  # the sequence each cache row feeds
        for step in range(options.max_tokens):
            tokens_R, logprobs_R = _sample_tokens(logits_RV, rows_R, num_samples, options, generator)
            keep = []
            step_rows = zip(rows_R.tolist(), tokens_R.tolist(), logprobs_R.tolist())
            for index, (row, token, logprob) in enumerate(step_rows):
                sequence = sequences[row]
                sequence.tokens.append(token)
                sequence.logprobs.append(logprob)
                stopped = token in stop_token_ids
                if stopped or self._has_stop_string(sequence.tokens, options.stop_strings, stop_window):
                    sequence.stop_reason = "stop"
                else:
                    keep.append(index)
            if not keep or step == options.max_tokens - 1:
                break
            if len(keep) < len(rows_R):
                keep_R = torch.tensor(keep, device=rows_R.device)
                cache.batch_select_indices(keep_R)
                rows_R, tokens_R = rows_R[keep_R], tokens_R[keep_R]

            step_kwargs = {}
            if prefill_position_ids is not None:
                # Explicit positions, because M-RoPE models would otherwise read rope_deltas that
                # they keep on the model itself, which another thread's forward may overwrite.
                shape = (*prefill_position_ids.shape[:-2], len(rows_R), 1)
                position = int(prefill_position_ids.max()) + 1 + step
                step_kwargs["position_ids"] = torch.full(
                    shape, position, dtype=prefill_position_ids.dtype, device=self.device
                )
            logits_RV = self.model(
                input_ids=tokens_R[:, None],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
                **step_kwargs,
            ).logits[:, -1].float()
        return sequences

    def _has_stop_string(self, tokens: list[int], stop_strings: tuple[str, ...], window: int) -> bool:
        """Whether the decoded tail of a completion contains a stop string."""
        # Checked after every token, so a match in the tail was completed by the newest token.
        if not stop_strings:
            return False
        text = self.tokenizer.decode(tokens[-window:], skip_special_tokens=False)
        return any(stop in text for stop in stop_strings)


class OnDemandSampler:
    """The embedded engine over its own copy of the base model, loaded on the first request.

    Training shards its copy across ranks, so sampling cannot share it; a server whose clients never
    sample through the embedded engine never spends the memory.
    """

    def __init__(self, config: ModelConfig, feature_cache_bytes: int):
        self.config = config
        self.feature_cache_bytes = feature_cache_bytes
        self._engine: EmbeddedSampler | None = None
        self._lock = threading.Lock()

    def sample(self, *args, **kwargs) -> SampleOutput:
        """EmbeddedSampler.sample, once the model is loaded."""
        return self._loaded().sample(*args, **kwargs)

    def _loaded(self) -> EmbeddedSampler:
        with self._lock:
            if self._engine is None:
                base = load_base_model(self.config)
                _, slot = apply_lora_wrappers(base.model, base.family)
                encoder = VisionEncoder(base.model, self.feature_cache_bytes) if base.vision is not None else None
                self._engine = EmbeddedSampler(base.model, base.tokenizer, device=self.config.device,
                                               vision=base.vision, vision_encoder=encoder, lora_slot=slot)
            return self._engine


def _sample_tokens(
    logits_RV: torch.Tensor,
    rows_R: torch.Tensor,
    num_samples: int,
    options: SamplingOptions,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return it with its logprob under the raw distribution."""
    if options.temperature == 0:
        tokens_R = logits_RV.argmax(dim=-1)
    else:
        probs_RV = _filtered_probs(logits_RV, options)
        # Exponential race (argmax of p / q, q ~ Exp(1)) draws from probs_RV, as vLLM does. Noise is
        # drawn for all N samples in one call and indexed by row, so a sample's draws do not depend
        # on which other samples have stopped; the clamp keeps q = 0 from producing inf or nan.
        noise_NV = torch.empty(num_samples, probs_RV.shape[-1], device=probs_RV.device)
        noise_NV.exponential_(generator=generator)
        noise_RV = noise_NV[rows_R].clamp_min(torch.finfo(noise_NV.dtype).tiny)
        tokens_R = (probs_RV / noise_RV).argmax(dim=-1)
    logprobs_R = logits_RV.log_softmax(dim=-1).gather(-1, tokens_R[:, None])[:, 0]
    return tokens_R, logprobs_R


def _filtered_probs(logits_RV: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """Apply temperature, then top-k, then top-p, and return the sampling distribution."""
    scaled_RV = logits_RV / options.temperature
    if 0 < options.top_k < scaled_RV.shape[-1]:
        kth_R1 = scaled_RV.topk(options.top_k, dim=-1).values[:, -1:]
        scaled_RV = scaled_RV.masked_fill(scaled_RV < kth_R1, float("-inf"))
    if options.top_p < 1:
        sorted_RV, order_RV = scaled_RV.sort(dim=-1, descending=True)
        sorted_probs_RV = sorted_RV.softmax(dim=-1)
        # Drop a token once the better tokens already hold top_p of the mass; the best always stays.
        drop_RV = sorted_probs_RV.cumsum(dim=-1) - sorted_probs_RV >= options.top_p
        scaled_RV = scaled_RV.scatter(-1, order_RV, sorted_RV.masked_fill(drop_RV, float("-inf")))
    return scaled_RV.softmax(dim=-1)


def _score_prompt(
    logits_LV: torch.Tensor, input_ids_L: torch.Tensor, k: int
) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """Logprob of each prompt token, and its k best alternatives, given the tokens before it."""
    logprobs: list[float | None] = [None]
    topk: list[list[tuple[int, float]] | None] = [None]
    num_positions, vocab_size = logits_LV.shape
    chunk = max(1, _PROMPT_LOGPROB_CHUNK_ELEMENTS // vocab_size)
    # Position i's logits predict token i + 1; the last position's logits only feed sampling.
    for start in range(0, num_positions - 1, chunk):
        end = min(start + chunk, num_positions - 1)
        logprobs_CV = logits_LV[start:end].float().log_softmax(dim=-1)
        logprobs.extend(logprobs_CV.gather(-1, input_ids_L[start + 1 : end + 1, None])[:, 0].tolist())
        if k > 0:
            values_CK, tokens_CK = logprobs_CV.topk(min(k, vocab_size), dim=-1)
            topk.extend(list(zip(t, v)) for t, v in zip(tokens_CK.tolist(), values_CK.tolist()))
    return logprobs, topk
