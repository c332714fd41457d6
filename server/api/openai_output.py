"""Sampled sequences -> the OpenAI-compatible API's responses: whole bodies, or server-sent events.

A completion's text is its tokens decoded without special tokens (the end-of-turn token that stopped
it is not shown), cut before the first stop string it contains, as OpenAI returns it; its logprobs
cover every sampled token. A stream sends each token's share of that text as a chunk of its own, so
concatenating the chunks gives the text of the whole response. Knows nothing about engines or HTTP.
"""

from collections.abc import Iterator
from dataclasses import dataclass

from pydantic import BaseModel
from transformers import PreTrainedTokenizerBase

from server.sampling.types import SampledSequence
from server.wire.openai import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                                ChatDelta, ChatLogprobs, Completion, CompletionChoice, CompletionLogprobs,
                                TokenLogprob, TopLogprob, Usage)


@dataclass(frozen=True)
class Choice:
    """One returned completion, its text already cut at a stop string."""

    index: int
    sequence: SampledSequence
    text: str
    finish_reason: str


@dataclass(frozen=True)
class Answer:
    """What every response is made of: who asked for what, and the choices."""

    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    top_logprobs: int | None
    """None: no logprobs asked for; else each token's logprob and this many alternatives."""


def choice_of(tokenizer: PreTrainedTokenizerBase, index: int, sequence: SampledSequence,
              stop_strings: list[str]) -> Choice:
    text = tokenizer.decode(sequence.tokens, skip_special_tokens=True)
    cut = min((at for at in (text.find(stop) for stop in stop_strings) if at >= 0), default=-1)
    if cut >= 0:
        return Choice(index, sequence, text[:cut], "stop")
    return Choice(index, sequence, text, sequence.stop_reason)


def chat_completion(answer: Answer, tokenizer: PreTrainedTokenizerBase) -> ChatCompletion:
    return ChatCompletion(id=answer.id, created=answer.created, model=answer.model, usage=answer.usage, choices=[
        ChatChoice(index=choice.index, message=AssistantMessage(content=choice.text),
                   finish_reason=choice.finish_reason,
                   logprobs=_chat_logprobs(tokenizer, choice.sequence, range(len(choice.sequence.tokens)),
                                           answer.top_logprobs))
        for choice in answer.choices])


def chat_stream(answer: Answer, tokenizer: PreTrainedTokenizerBase, include_usage: bool) -> Iterator[bytes]:
    def chunk(index: int, delta: ChatDelta, finish_reason: str | None = None,
              logprobs: ChatLogprobs | None = None) -> bytes:
        return _event(ChatCompletionChunk(id=answer.id, created=answer.created, model=answer.model, choices=[
            ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)]))

    for choice in answer.choices:
        yield chunk(choice.index, ChatDelta(role="assistant", content=""))
        for k, piece in enumerate(token_pieces(tokenizer, choice.sequence.tokens, choice.text)):
            logprobs = _chat_logprobs(tokenizer, choice.sequence, [k], answer.top_logprobs)
            if piece or logprobs is not None:
                yield chunk(choice.index, ChatDelta(content=piece), logprobs=logprobs)
        yield chunk(choice.index, ChatDelta(), finish_reason=choice.finish_reason)
    if include_usage:
        yield _event(ChatCompletionChunk(id=answer.id, created=answer.created, model=answer.model, choices=[],
                                         usage=answer.usage))
    yield b"data: [DONE]\n\n"


def completion(answer: Answer, tokenizer: PreTrainedTokenizerBase) -> Completion:
    return Completion(id=answer.id, created=answer.created, model=answer.model, usage=answer.usage, choices=[
        CompletionChoice(index=choice.index, text=choice.text, finish_reason=choice.finish_reason,
                         logprobs=_completion_logprobs(tokenizer, choice.sequence, range(len(choice.sequence.tokens)),
                                                       answer.top_logprobs, 0))
        for choice in answer.choices])


def completion_stream(answer: Answer, tokenizer: PreTrainedTokenizerBase, include_usage: bool) -> Iterator[bytes]:
    def chunk(choice: CompletionChoice) -> bytes:
        return _event(Completion(id=answer.id, created=answer.created, model=answer.model, choices=[choice]))

    for choice in answer.choices:
        offset = 0
        for k, piece in enumerate(token_pieces(tokenizer, choice.sequence.tokens, choice.text)):
            logprobs = _completion_logprobs(tokenizer, choice.sequence, [k], answer.top_logprobs, offset)
            offset += len(piece)
            if piece or logprobs is not None:
                yield chunk(CompletionChoice(index=choice.index, text=piece, finish_reason=None, logprobs=logprobs))
        yield chunk(CompletionChoice(index=choice.index, text="", finish_reason=choice.finish_reason))
    if include_usage:
        yield _event(Completion(id=answer.id, created=answer.created, model=answer.model, choices=[],
                                usage=answer.usage))
    yield b"data: [DONE]\n\n"


def token_pieces(tokenizer: PreTrainedTokenizerBase, tokens: list[int], text: str) -> list[str]:
    """Per token, the part of `text` it adds. A token that ends inside a character adds nothing until the
    character is complete (decoded a few tokens at a time, as vLLM does); text past a stop string is dropped."""
    pieces: list[str] = []
    length = prefix = read = 0
    for end in range(1, len(tokens) + 1):
        before = tokenizer.decode(tokens[prefix:read], skip_special_tokens=True)
        after = tokenizer.decode(tokens[prefix:end], skip_special_tokens=True)
        added = 0
        if len(after) > len(before) and not after.endswith("\ufffd"):
            added, prefix, read = len(after) - len(before), read, end
        pieces.append(text[length:length + added])
        length += len(pieces[-1])
    if pieces:
        pieces[-1] += text[length:]
    return pieces


def _token(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _chat_logprobs(tokenizer: PreTrainedTokenizerBase, sequence: SampledSequence, positions,
                   top_logprobs: int | None) -> ChatLogprobs | None:
    if top_logprobs is None:
        return None
    content = []
    for k in positions:
        token = _token(tokenizer, sequence.tokens[k])
        alternatives = (sequence.topk_logprobs[k] or [])[:top_logprobs] if top_logprobs else []
        content.append(TokenLogprob(
            token=token, logprob=sequence.logprobs[k], bytes=list(token.encode()),
            top_logprobs=[TopLogprob(token=(alt := _token(tokenizer, t)), logprob=lp, bytes=list(alt.encode()))
                          for t, lp in alternatives]))
    return ChatLogprobs(content=content)


def _completion_logprobs(tokenizer: PreTrainedTokenizerBase, sequence: SampledSequence, positions,
                         top_logprobs: int | None, offset: int) -> CompletionLogprobs | None:
    if top_logprobs is None:
        return None
    tokens, offsets = [], []
    for k in positions:
        tokens.append(_token(tokenizer, sequence.tokens[k]))
        offsets.append(offset)
        offset += len(tokens[-1])
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=[sequence.logprobs[k] for k in positions], text_offset=offsets,
        top_logprobs=[{_token(tokenizer, t): lp for t, lp in (sequence.topk_logprobs[k] or [])[:top_logprobs]}
                      if top_logprobs else {} for k in positions])


def _event(body: BaseModel) -> bytes:
    return b"data: " + body.model_dump_json().encode() + b"\n\n"
