"""What every sample request settles before it goes to the engine, whichever API it came by (Tinker's
asample or the OpenAI-compatible routes): its sampling options (the server's defaults, limits and EOS
rule) and the adapter it samples with, pinned while it runs.
"""

import asyncio
from collections.abc import Callable
from pathlib import Path

from server.api.deps import Services
from server.checkpoints.access import checkpoint_of, readable_checkpoint
from server.errors import InvalidRequest, NotFound, PayloadTooLarge
from server.rendering.chunks import RenderedInput
from server.sampling.engine import checkpoint_adapter_name
from server.sampling.types import AdapterRef, SamplingOptions
from server.store.checkpoints import parse_tinker_path
from server.store.store import CheckpointRecord, SamplingSessionRecord
from server.wire.sampling import SamplingParams


def check_num_samples(services: Services, num_samples: int, field: str) -> None:
    limit = services.config.limits.max_num_samples
    if num_samples > limit:
        raise InvalidRequest(f"{field} {num_samples} is over the limit of {limit} (the server's --max-num-samples)")


async def pin_adapter(services: Services, record: SamplingSessionRecord | None, model_path: str | None,
                      owner: str) -> tuple[AdapterRef | None, Callable[[], None] | None]:
    """The adapter a request samples with, fixed when the request is accepted (None: the base model), and
    what lets go of it once the request is over.

    Pinned here, so that a save_weights_for_sampler issued after this request never changes it, and a
    saved checkpoint stays on disk (never swept as expired) while the request runs.
    """
    if record is not None and record.source_model_id is not None:
        # An inflight session gets its run's newest inflight weights, as they are now.
        snapshot = services.adapters.ephemeral(record.sampling_session_id)
        return AdapterRef(name=snapshot.name, directory=snapshot.directory, weights=snapshot.adapter,
                          checked_finite=True), None
    path = record.model_path if record is not None else model_path
    if path is None:
        return None, None

    def hold() -> CheckpointRecord:
        checkpoint = checkpoint_of(services.store, services.signer, path, owner)
        services.checkpoint_pins.acquire(checkpoint.tinker_path)
        return checkpoint

    # An RL loop names the same checkpoint in every request: once read, it is pinned here on the event loop,
    # without a database read or a thread (the store forgets a checkpoint whose row changes).
    remembered = services.store.remembered_checkpoint(str(parse_tinker_path(path)))
    if remembered is not None and services.checkpoint_pins.try_acquire(remembered.tinker_path):
        try:
            checkpoint = readable_checkpoint(services.signer, remembered, path, owner)
        except NotFound:
            services.checkpoint_pins.release(remembered.tinker_path)
            raise
    else:
        checkpoint = await asyncio.to_thread(hold)
    adapter = AdapterRef(name=checkpoint_adapter_name(checkpoint.tinker_path, checkpoint.created_at),
                         directory=Path(checkpoint.directory))
    return adapter, lambda: services.checkpoint_pins.release(checkpoint.tinker_path)


def sampling_options(services: Services, params: SamplingParams, prompt: RenderedInput) -> SamplingOptions:
    """A request's SamplingParams with the server's defaults, limits and EOS rule applied."""
    limits = services.config.limits
    # Checked here, so that every engine refuses the same prompts with the same words.
    max_images = services.config.sampler.max_images_per_prompt
    if len(prompt.images) > max_images:
        raise InvalidRequest(f"the prompt holds {len(prompt.images)} images; at most {max_images} images per prompt "
                             f"are accepted (the server's --max-images-per-prompt)")
    prompt_length = prompt.num_positions
    max_tokens = params.max_tokens or services.config.sampler.max_new_tokens_default
    if max_tokens > limits.max_sample_tokens:
        raise InvalidRequest(f"max_tokens {max_tokens} is over the limit of {limits.max_sample_tokens} (the server's "
                             f"--max-sample-tokens)")
    if prompt_length + max_tokens > limits.max_sequence_length:
        raise PayloadTooLarge(f"prompt ({prompt_length} tokens) + max_tokens ({max_tokens}) is over the "
                              f"context limit of {limits.max_sequence_length}")
    stops = params.stop_conditions()
    # stop=None keeps EOS stopping and stop=[] disables every stop; explicit stops come on top of EOS.
    eos = () if stops.ignore_eos else services.base.eos_token_ids
    return SamplingOptions(max_tokens=max_tokens, temperature=params.temperature, top_k=params.top_k,
                           top_p=params.top_p, seed=params.seed,
                           stop_token_ids=tuple(dict.fromkeys([*eos, *stops.stop_token_ids])),
                           stop_strings=tuple(stops.stop_strings))
