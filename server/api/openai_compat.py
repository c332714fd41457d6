"""The OpenAI-compatible inference API under /oai/api/v1: chat/completions, completions and models.

Same keys, tenants and sampling engine as asample: a request is rendered (chat messages through the
model's chat template, images from data: URLs), given the server's sampling limits, pinned to its
checkpoint, and handed to the same sampling futures as every Tinker sample. The engine returns each
completion whole, so a streamed response starts once sampling is done and then sends every token as
an event of its own. `model` names the base model, a tinker:// checkpoint path, or
`<base model>;<tinker:// path>`.
"""

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from server.api import openai_output
from server.api.deps import JSON, OwnerDep, Services, ServicesDep, check_sampled_tokens, read_body, serves
from server.api.sampling_inputs import check_num_samples, pin_adapter, sampling_options
from server.errors import InvalidRequest, NotFound, TinkerServerError
from server.rendering.chat import render_chat, render_text_prompt
from server.rendering.chunks import RenderedInput
from server.sampling.types import LogprobOptions, SampleOutput, SamplingRequest
from server.scheduler.outcomes import Outcome
from server.store.checkpoints import SCHEME
from server.wire.openai import (ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, SamplingFields,
                                Usage)
from server.wire.types import SamplingParams

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
    answer = await _answer(services, owner, body, [prompt], body.max_new_tokens, top_logprobs, "chatcmpl-")
    return await _respond(services, body, answer, openai_output.chat_completion, openai_output.chat_stream)


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
    answer = await _answer(services, owner, body, prompts, body.max_tokens, body.logprobs, "cmpl-")
    return await _respond(services, body, answer, openai_output.completion, openai_output.completion_stream)


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


async def _answer(services: Services, owner: str, body: SamplingFields, prompts: list[RenderedInput],
                  max_tokens: int | None, top_logprobs: int | None, id_prefix: str) -> openai_output.Answer:
    """Sample `body.n` completions of every prompt with the sampling engine, as asample does."""
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
    waits = []
    for request in requests:
        # Pinned last, once nothing is left to refuse: the pin is let go of when the request is over.
        adapter, release = await pin_adapter(services, None, model_path, owner)
        output: list[SampleOutput] = []
        request_id = services.sampling.submit(
            owner=owner, sampling_session_id=f"oai:{owner}", seq_id=None, payload_hash="",
            request=SamplingRequest(prompt=request.prompt, options=request.options, adapter=adapter,
                                    num_samples=request.num_samples, logprobs=request.logprobs),
            respond=_keep(output), release=release)
        waits.append((request_id, output))
    outputs = []
    for request_id, output in waits:
        _raise_failure(await _wait(services, request_id, owner))
        outputs.append(output[0])
    tokenizer = services.base.tokenizer
    choices = [openai_output.choice_of(tokenizer, i * body.n + j, sequence, body.stop_strings)
               for i, sampled in enumerate(outputs) for j, sequence in enumerate(sampled.sequences)]
    completion_tokens = sum(len(choice.sequence.tokens) for choice in choices)
    prompt_tokens = sum(prompt.num_positions for prompt in prompts)
    services.metrics.count_sample(owner, completion_tokens, sum(o.prompt_cache_hit_tokens for o in outputs),
                                  prompt_tokens - sum(o.prompt_cache_hit_tokens for o in outputs))
    return openai_output.Answer(id=id_prefix + uuid.uuid4().hex, created=int(time.time()), model=body.model,
                                choices=choices, top_logprobs=top_logprobs,
                                usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                            total_tokens=prompt_tokens + completion_tokens))


async def _respond(services: Services, body: SamplingFields, answer: openai_output.Answer,
                   whole: Callable[..., BaseModel], stream: Callable[..., Iterator[bytes]]) -> Response:
    """The answer as one body, or as server-sent events (all of them at once: see the module's docstring)."""
    tokenizer = services.base.tokenizer
    if body.stream:
        events = await asyncio.to_thread(lambda: b"".join(stream(answer, tokenizer, body.include_usage)))
        return Response(events, media_type=EVENT_STREAM)
    response = await asyncio.to_thread(whole, answer, tokenizer)
    return Response(response.model_dump_json(), media_type=JSON)


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
