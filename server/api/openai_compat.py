"""The OpenAI-compatible inference API under /oai/api/v1: chat/completions, completions and models.

Same keys, tenants and sampling engine as asample: a request is rendered (chat messages through the
model's chat template, images from data: URLs), given the server's sampling limits, pinned to its
checkpoint, and handed to the same sampling futures as every Tinker sample. A streamed response sends
each token as the engine samples it (the request's `on_token`; vLLM returns whole results only, and
its tokens are sent once it is done). `model` names the base model, a tinker:// checkpoint path, or
`<base model>;<tinker:// path>`.
"""

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from server.api import openai_output
from server.api.deps import JSON, OwnerDep, Services, ServicesDep, check_sampled_tokens, read_body, serves
from server.api.sampling_inputs import check_num_samples, pin_adapter, sampling_options
from server.errors import InvalidRequest, NotFound, TinkerServerError
from server.rendering.chat import render_chat, render_text_prompt
from server.rendering.chunks import RenderedInput
from server.sampling.types import LogprobOptions, SampleOutput, SamplingRequest, TokenHook
from server.scheduler.outcomes import Outcome
from server.store.checkpoints import SCHEME
from server.wire.openai import (ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, SamplingFields,
                                Usage)
from server.wire.sampling import SamplingParams

router = APIRouter(prefix="/oai/api/v1")
EVENT_STREAM = "text/event-stream"
MAX_LISTED_CHECKPOINTS = 1000
WAIT_SECONDS = 60.0
"""How long one wait on the sampling futures lasts before it waits again (a request has no deadline)."""


@router.get("/models")
async def list_models(services: ServicesDep, owner: OwnerDep) -> ModelList:
    """The base model, and the caller's sampler checkpoints (newest first) by their tinker:// paths."""
    records, _ = await asyncio.to_thread(services.store.list_checkpoints, model_id=None, owner=owner,
                                         limit=MAX_LISTED_CHECKPOINTS, offset=0)
    base = ModelCard(id=services.base.name, created=0, owned_by="system")
    return ModelList(data=[base, *(ModelCard(id=r.tinker_path, created=int(r.created_at.timestamp()), owned_by=owner)
                                   for r in records if r.checkpoint_type == "sampler")])


@router.post("/chat/completions", openapi_extra={"requestBody": {"required": True, "content": {
    "application/json": {"schema": ChatCompletionRequest.model_json_schema()}}}})
async def chat_completions(request: Request, services: ServicesDep, owner: OwnerDep) -> Response:
    """Complete a conversation rendered with the model's chat template."""
    body = ChatCompletionRequest.model_validate_json(await read_body(request, services.config.limits.max_request_bytes))
    prompt = await asyncio.to_thread(render_chat, body.messages, services.base.tokenizer, services.render_context)
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    reply = _reply(body, top_logprobs, "chatcmpl-")
    if body.stream:
        return await _stream(services, owner, body, [prompt], body.max_new_tokens, openai_output.ChatStream(
            reply, services.base.tokenizer, body.n))
    return await _answer(services, owner, body, [prompt], body.max_new_tokens, reply, openai_output.chat_completion)


@router.post("/completions", openapi_extra={"requestBody": {"required": True, "content": {
    "application/json": {"schema": CompletionRequest.model_json_schema()}}}})
async def completions(request: Request, services: ServicesDep, owner: OwnerDep) -> Response:
    """Continue text prompts (or token ids) as they are, without a chat template."""
    body = CompletionRequest.model_validate_json(await read_body(request, services.config.limits.max_request_bytes))
    tokenizer = services.base.tokenizer
    many = len(body.prompts) > 1
    prompts = await asyncio.to_thread(lambda: [
        render_text_prompt(prompt, tokenizer, services.render_context, f"prompt[{i}]" if many else "prompt")
        for i, prompt in enumerate(body.prompts)])
    reply = _reply(body, body.logprobs, "cmpl-")
    if body.stream:
        return await _stream(services, owner, body, prompts, body.max_tokens, openai_output.CompletionStream(
            reply, tokenizer, body.n * len(prompts)))
    return await _answer(services, owner, body, prompts, body.max_tokens, reply, openai_output.completion)


def model_path_of(services: Services, model: str) -> str | None:
    """The checkpoint `model` names (None: the base model); a 404 for a model this server does not serve."""
    base, separator, path = model.partition(";")
    if separator:
        if not serves(services, base):
            raise NotFound(f"model {base!r} is not served here; this server serves {services.base.name!r}")
        return path
    if serves(services, model):
        return None
    if model.startswith(SCHEME):
        return model
    raise NotFound(f"model {model!r} is not served here: name the base model {services.base.name!r}, a "
                         f"tinker:// checkpoint path, or '{services.base.name};tinker://...'")


def _reply(body: SamplingFields, top_logprobs: int | None, id_prefix: str) -> openai_output.Reply:
    return openai_output.Reply(id=id_prefix + uuid.uuid4().hex, created=int(time.time()), model=body.model,
                               top_logprobs=top_logprobs, stop_strings=tuple(body.stop_strings))


async def _submit(services: Services, owner: str, body: SamplingFields, prompts: list[RenderedInput],
                  max_tokens: int | None, top_logprobs: int | None,
                  on_token: Callable[[int], TokenHook] | None = None) -> list[tuple[str, list[SampleOutput]]]:
    """Hand `body.n` completions of every prompt to the sampling engine, as asample does: per prompt, its
    request id and where its output will be. `on_token(i)` streams prompt i's tokens."""
    check_num_samples(services, body.n, "n")
    check_num_samples(services, body.n * len(prompts), "n x the number of prompts")
    model_path = model_path_of(services, body.model)
    params = SamplingParams(max_tokens=max_tokens, seed=body.seed, stop=body.stop_strings or None,
                            temperature=body.temperature, top_k=body.top_k, top_p=body.top_p)
    requests = []
    for prompt in prompts:
        options = sampling_options(services, params, prompt)
        check_sampled_tokens(services, body.n, options.max_tokens)
        requests.append(SamplingRequest(prompt=prompt, options=options, num_samples=body.n,
                                        logprobs=LogprobOptions(topk_sample_logprobs=top_logprobs or 0)))
    submitted = []
    for i, request in enumerate(requests):
        # Pinned last, once nothing is left to refuse: the pin is let go of when the request is over.
        adapter, release = await pin_adapter(services, None, model_path, owner)
        output: list[SampleOutput] = []
        request_id = services.sampling.submit(
            owner=owner, sampling_session_id=f"oai:{owner}", seq_id=None, payload_hash="",
            request=dataclasses.replace(request, adapter=adapter, on_token=on_token and on_token(i)),
            respond=_keep(output), release=release)
        submitted.append((request_id, output))
    return submitted


async def _answer(services: Services, owner: str, body: SamplingFields, prompts: list[RenderedInput],
                  max_tokens: int | None, reply: openai_output.Reply, whole: Callable[..., BaseModel]) -> Response:
    """The completions in one body."""
    outputs = []
    for request_id, output in await _submit(services, owner, body, prompts, max_tokens, reply.top_logprobs):
        _raise_failure(await _wait(services, request_id, owner))
        outputs.append(output[0])
    tokenizer = services.base.tokenizer

    def respond() -> bytes:
        choices = [openai_output.choice_of(tokenizer, i * body.n + j, sequence, reply.stop_strings)
                   for i, sampled in enumerate(outputs) for j, sequence in enumerate(sampled.sequences)]
        return whole(reply, choices, _usage(services, owner, prompts, outputs), tokenizer).model_dump_json()
    return Response(await asyncio.to_thread(respond), media_type=JSON)


async def _stream(services: Services, owner: str, body: SamplingFields, prompts: list[RenderedInput],
                  max_tokens: int | None, stream: openai_output.Stream) -> StreamingResponse:
    """The completions as server-sent events, each token sent as the engine samples it."""
    loop = asyncio.get_running_loop()
    arrivals: asyncio.Queue = asyncio.Queue()

    def on_token(prompt: int) -> TokenHook:
        def hand_over(sample: int, *token) -> None:  # on an engine thread
            with contextlib.suppress(RuntimeError):  # the event loop is closed: the server is stopping
                loop.call_soon_threadsafe(arrivals.put_nowait, (prompt * body.n + sample, token))
        return hand_over

    submitted = await _submit(services, owner, body, prompts, max_tokens, stream.reply.top_logprobs, on_token)

    async def done(prompt: int, request_id: str) -> None:
        # Queued after the prompt's last token: the engine hands every token over before its future completes.
        arrivals.put_nowait((prompt, await _wait(services, request_id, owner)))
    waits = [asyncio.create_task(done(i, request_id)) for i, (request_id, _) in enumerate(submitted)]

    async def events() -> AsyncIterator[bytes]:
        try:
            yield stream.start()
            for _ in submitted:
                while not isinstance((arrival := await arrivals.get())[1], Outcome):
                    yield stream.token(arrival[0], *arrival[1])
                prompt, outcome = arrival
                if outcome.status == "failed":
                    yield _error_event(outcome)
                    return
                yield await asyncio.to_thread(lambda: b"".join(
                    stream.finish(prompt * body.n + j, sequence)
                    for j, sequence in enumerate(submitted[prompt][1][0].sequences)))
            usage = _usage(services, owner, prompts, [output[0] for _, output in submitted])
            yield stream.end(usage if body.include_usage else None)
        finally:
            for wait in waits:
                wait.cancel()
    return StreamingResponse(events(), media_type=EVENT_STREAM)


def _usage(services: Services, owner: str, prompts: list[RenderedInput], outputs: list[SampleOutput]) -> Usage:
    """The request's token counts, also counted in the server's metrics."""
    completion_tokens = sum(len(sequence.tokens) for output in outputs for sequence in output.sequences)
    prompt_tokens = sum(prompt.num_positions for prompt in prompts)
    cached = sum(output.prompt_cache_hit_tokens for output in outputs)
    services.metrics.count_sample(owner, completion_tokens, cached, prompt_tokens - cached)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


def _keep(output: list[SampleOutput]) -> Callable[[SampleOutput], tuple[bytes, str]]:
    """A `respond` that keeps the engine's output for the route (which answers in OpenAI's format itself)."""
    def respond(sampled: SampleOutput) -> tuple[bytes, str]:
        output.append(sampled)
        return b"", JSON
    return respond


async def _wait(services: Services, request_id: str, owner: str) -> Outcome:
    while (outcome := await services.sampling.retrieve(request_id, WAIT_SECONDS, owner=owner)) is None:
        pass
    return outcome


def _raise_failure(outcome: Outcome) -> None:
    if outcome.status == "failed":
        error = outcome.error or "sampling failed"
        raise InvalidRequest(error) if outcome.error_category == "user" else TinkerServerError(error)


def _error_event(outcome: Outcome) -> bytes:
    """A failure after the stream began (its status line is sent): an event the `openai` client raises."""
    kind = "invalid_request_error" if outcome.error_category == "user" else "server_error"
    return b"data: " + json.dumps({"error": {"message": outcome.error or "sampling failed", "type": kind}}).encode() \
        + b"\n\n"
