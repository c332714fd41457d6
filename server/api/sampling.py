"""Sampling: create_sampling_session, GET samplers/{id}, asample (which also serves compute_logprobs)."""

import asyncio
import dataclasses
import uuid

import numpy as np
from fastapi import APIRouter, Request

from server.api.deps import (
    HotCall,
    OwnerDep,
    RequestCall,
    Services,
    ServicesDep,
    check_base_model,
    check_sampled_tokens,
    payload_hash,
    sampler_of,
    services_of,
    session_of,
    tenant_from,
)
from server.api.sampling_inputs import check_num_samples, pin_adapter, sampling_options
from server.checkpoints.access import checkpoint_of
from server.errors import InvalidRequest
from server.recorded_sequences import record_sampled_sequences
from server.rendering.chunks import RenderedInput
from server.runs import ensure_sampling_session
from server.sampling.types import LogprobOptions, PromptTargets, SampleOutput, SamplingRequest
from server.wire import PROTOBUF
from server.wire.futures import UntypedAPIFuture
from server.wire.model_input import TensorData
from server.wire.proto import encode_sample_response
from server.wire.sampling import (CreateSamplingSessionRequest, CreateSamplingSessionResponse, GetSamplerResponse,
                                  SampleRequest)

router = APIRouter(prefix="/api/v1")
# asample authenticates itself (see tenant_from): it is half of every sample request's HTTP calls.
hot_router = APIRouter(prefix="/api/v1")


@router.post("/create_sampling_session")
async def create_sampling_session(body: CreateSamplingSessionRequest, services: ServicesDep,
                                  owner: OwnerDep) -> CreateSamplingSessionResponse:
    """A sampler over the base model or over a saved checkpoint."""
    await session_of(services.store, body.session_id, owner)
    check_base_model(services, body.base_model)

    def create() -> str:
        if body.model_path is not None:
            checkpoint_of(services.store, services.signer, body.model_path, owner)
        return ensure_sampling_session(services.store, base_model=services.base.name, session_id=body.session_id,
                                       sampling_session_seq_id=body.sampling_session_seq_id, owner=owner,
                                       model_path=body.model_path)

    sampling_session_id = await asyncio.to_thread(create)
    return CreateSamplingSessionResponse(sampling_session_id=sampling_session_id)


@router.get("/samplers/{sampling_session_id}")
async def get_sampler(sampling_session_id: str, services: ServicesDep, owner: OwnerDep) -> GetSamplerResponse:
    """Which model a sampler samples (the SDK asks when it only knows a model_path)."""
    record = await sampler_of(services, sampling_session_id, owner)
    return GetSamplerResponse(sampler_id=record.sampling_session_id, base_model=record.base_model,
                              model_path=record.model_path)


def prompt_targets(services: Services, ids: TensorData, prompt: RenderedInput) -> tuple[PromptTargets, np.ndarray]:
    """The cells target_prompt_logprobs asks for, and which of the tensor's cells those are (-1 asks
    for nothing, and gets 0)."""
    num_rows = prompt.num_positions - 1
    if ids.shape[0] != num_rows:
        raise InvalidRequest(f"target_prompt_logprobs has {ids.shape[0]} rows; a prompt of {prompt.num_positions} "
                             f"tokens needs len(prompt) - 1 = {num_rows} (row i scores position i + 1)")
    rows, token_ids = ids.cells()
    vocab_size = services.base.vocab_size
    wrong = (token_ids < -1) | (token_ids >= vocab_size)
    if wrong.any():
        raise InvalidRequest(f"target_prompt_logprobs names token id {token_ids[wrong][0]}; ids must lie in "
                             f"[0, {vocab_size}), or be -1 to ask for nothing")
    asked = token_ids >= 0
    if not asked.any():
        raise InvalidRequest("target_prompt_logprobs names no token id (every cell is -1)")
    return PromptTargets(positions=rows[asked] + 1, token_ids=token_ids[asked]), asked


@hot_router.post("/asample", openapi_extra={"requestBody": {"required": True, "content": {
    "application/json": {"schema": SampleRequest.model_json_schema()}}}})
async def asample(request: Request) -> UntypedAPIFuture:
    """Sample completions (and prompt logprobs) for one prompt."""
    return await sample_one(services_of(request), RequestCall(request))


async def sample_one(services: Services, call: HotCall) -> UntypedAPIFuture:
    """What asample does, from whichever front served the call (server/direct_routes.py serves it without ASGI)."""
    owner = (await tenant_from(services, call.headers)).name
    body = await call.body()
    sample = SampleRequest.model_validate_json(body)
    record = None
    if sample.sampling_session_id is not None:
        record = await sampler_of(services, sample.sampling_session_id, owner)
    else:
        check_base_model(services, sample.base_model)
    check_num_samples(services, sample.num_samples, "num_samples")
    if sample.record_stability_info and record is None:
        raise InvalidRequest("record_stability_info needs a sampling session: recorded sequences belong to its session")
    if all(chunk.type == "encoded_text" for chunk in sample.prompt.chunks):
        prompt = services.sampling_renderer.render(sample.prompt)  # token ids only: cheap
    else:  # images are decoded (or found in the cache by their hash) on a worker thread
        prompt = await asyncio.to_thread(services.sampling_renderer.render, sample.prompt)
    targets = asked = None
    if sample.target_prompt_logprobs is not None:
        targets, asked = prompt_targets(services, sample.target_prompt_logprobs, prompt)
    logprobs = LogprobOptions(prompt_logprobs=bool(sample.prompt_logprobs),
                              topk_prompt_logprobs=sample.topk_prompt_logprobs,
                              topk_sample_logprobs=sample.topk_sample_logprobs, target_prompt_logprobs=targets,
                              prompt_alt_tokens_k=sample.prompt_alt_tokens_k)
    options = sampling_options(services, sample.sampling_params, prompt)
    check_sampled_tokens(services, sample.num_samples, options.max_tokens)
    sampling = SamplingRequest(prompt=prompt, options=options, num_samples=sample.num_samples, logprobs=logprobs)
    # Last, once nothing is left to refuse: the pin is let go of when the request is over.
    adapter, release = await pin_adapter(services, record, sample.model_path, owner)
    sampling = dataclasses.replace(sampling, adapter=adapter)
    sampler_id = sample.sampling_session_id or f"direct:{owner}"
    seq_id = sample.seq_id
    # Without a seq_id (plain REST callers) the ids are numbered by the request itself.
    numbered = uuid.uuid4().hex if seq_id is None else seq_id
    sequence_ids = [f"{sampler_id}:seq:{numbered}:{i}" for i in range(sample.num_samples)]

    def respond(output: SampleOutput) -> tuple[bytes, str]:
        prompt_logprobs, topk = output.prompt_logprobs, output.topk_prompt_logprobs
        if sample.prompt_logprobs_last_n is not None:
            # Positions before the last n are reported as "no value" (NaN on the wire).
            first = max(0, prompt.num_positions - sample.prompt_logprobs_last_n)
            prompt_logprobs = prompt_logprobs and [None] * first + prompt_logprobs[first:]
            topk = topk and [None] * first + topk[first:]
        if sample.record_stability_info:
            record_sampled_sequences(services.store, record, prompt, adapter and adapter.name, sequence_ids,
                                     output.sequences)
        target_logprobs = None
        if targets is not None:
            values = np.zeros(len(asked), dtype=np.float32)
            values[asked] = output.target_prompt_logprobs
            target_logprobs = (values, sample.target_prompt_logprobs)
        alt = output.prompt_alt_tokens
        num_tokens = sum(len(sequence.tokens) for sequence in output.sequences)
        services.metrics.count_sample(owner, num_tokens, output.prompt_cache_hit_tokens,
                                      prompt.num_positions - output.prompt_cache_hit_tokens)
        return encode_sample_response(output.sequences, prompt_logprobs=prompt_logprobs, topk_prompt_logprobs=topk,
                                      target_prompt_logprobs=target_logprobs,
                                      prompt_alt_tokens=alt and (alt.tokens, alt.logprobs),
                                      prompt_cache_hit_tokens=output.prompt_cache_hit_tokens), PROTOBUF

    # Recording writes to the journal, and prompt logprobs make large payloads: both off the event loop.
    respond_in_thread = sample.record_stability_info or logprobs.scores_prompt or bool(logprobs.topk_sample_logprobs)
    request_id = services.sampling.submit(owner=owner, sampling_session_id=sampler_id, seq_id=seq_id,
                                          payload_hash=payload_hash(body), request=sampling, respond=respond,
                                          respond_in_thread=respond_in_thread, release=release)
    return UntypedAPIFuture(request_id=request_id, sample_sequence_ids=sequence_ids)
