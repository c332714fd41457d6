"""Sampled sequences -> the OpenAI-compatible API's responses: whole bodies, or server-sent events.

A completion's text is its tokens decoded without special tokens (the end-of-turn token that stopped
it is not shown), cut before the first stop string it contains, as OpenAI returns it; its logprobs
cover every sampled token. A stream sends each token as it is sampled, with the text it completes
(decoded a few tokens at a time, as vLLM does, so a token that ends inside a character waits for the
rest); text that may begin a stop string is held back until the next tokens tell, and none past a
stop string is sent, so concatenating the chunks gives the text of the whole response. Knows nothing
about engines or HTTP.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

from pydantic import BaseModel
from transformers import PreTrainedTokenizerBase

from server.sampling.types import SampledSequence
from server.wire.openai import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                                ChatDelta, ChatLogprobs, Completion, CompletionChoice, CompletionLogprobs,
                                TokenLogprob, TopLogprob, Usage)

DONE = b"data: [DONE]\n\n"
Alternatives = list[tuple[int, float]] | None
"""A sampled token's best (token id, logprob) alternatives, when asked for."""


@dataclass(frozen=True)
class Reply:
    """Who asked for what: the envelope of every response and chunk."""

    id: str
    created: int
    model: str
    top_logprobs: int | None
    """None: no logprobs asked for; else each token's logprob and this many alternatives."""
    stop_strings: tuple[str, ...]


@dataclass(frozen=True)
class Choice:
    """One returned completion, its text already cut at a stop string."""

    index: int
    sequence: SampledSequence
    text: str
    finish_reason: str


def choice_of(tokenizer: PreTrainedTokenizerBase, index: int, sequence: SampledSequence,
              stop_strings: tuple[str, ...]) -> Choice:
    text = tokenizer.decode(sequence.tokens, skip_special_tokens=True)
    cut = min((at for at in (text.find(stop) for stop in stop_strings) if at >= 0), default=-1)
    if cut >= 0:
        return Choice(index, sequence, text[:cut], "stop")
    return Choice(index, sequence, text, sequence.stop_reason)


def chat_completion(reply: Reply, choices: list[Choice], usage: Usage,
                    tokenizer: PreTrainedTokenizerBase) -> ChatCompletion:
    return ChatCompletion(id=reply.id, created=reply.created, model=reply.model, usage=usage, choices=[
        ChatChoice(index=choice.index, message=AssistantMessage(content=choice.text),
                   finish_reason=choice.finish_reason,
                   logprobs=None if reply.top_logprobs is None else ChatLogprobs(content=[
                       _token_logprob(tokenizer, *token, reply.top_logprobs) for token in _tokens(choice.sequence)]))
        for choice in choices])


def completion(reply: Reply, choices: list[Choice], usage: Usage, tokenizer: PreTrainedTokenizerBase) -> Completion:
    return Completion(id=reply.id, created=reply.created, model=reply.model, usage=usage, choices=[
        CompletionChoice(index=choice.index, text=choice.text, finish_reason=choice.finish_reason,
                         logprobs=_completion_logprobs(tokenizer, list(_tokens(choice.sequence)),
                                                       reply.top_logprobs, 0))
        for choice in choices])


class Stream(ABC):
    """The events of one streamed response, made as its tokens arrive (any order of choices)."""

    def __init__(self, reply: Reply, tokenizer: PreTrainedTokenizerBase, num_choices: int):
        self.reply, self.tokenizer = reply, tokenizer
        self.texts = [_StreamedText(tokenizer, reply.stop_strings) for _ in range(num_choices)]

    def start(self) -> bytes:
        return b""

    def token(self, index: int, token: int, logprob: float, best: Alternatives) -> bytes:
        """The chunk of one sampled token of choice `index` (none when it adds no text and no logprobs are sent)."""
        text = self.texts[index]
        offset = text.sent
        return self._chunk(index, text.add(token), (token, logprob, best), offset)

    def finish(self, index: int, sequence: SampledSequence) -> bytes:
        """Choice `index` is done: its tokens not streamed yet, the text held back, its finish_reason."""
        text = self.texts[index]
        events = [self.token(index, *token) for token in list(_tokens(sequence))[len(text.tokens):]]
        choice = choice_of(self.tokenizer, index, sequence, self.reply.stop_strings)
        offset = text.sent
        events.append(self._chunk(index, text.rest(choice.text), None, offset, choice.finish_reason))
        return b"".join(events)

    def end(self, usage: Usage | None) -> bytes:
        """The usage chunk (when asked for), then the end of the stream."""
        return (b"" if usage is None else self._usage_chunk(usage)) + DONE

    @abstractmethod
    def _chunk(self, index: int, text: str, token: tuple[int, float, Alternatives] | None, offset: int,
               finish_reason: str | None = None) -> bytes:
        """One event of choice `index`: its new text (and the token that brought it), in the route's format."""

    @abstractmethod
    def _usage_chunk(self, usage: Usage) -> bytes:
        """The event that carries the token counts, in the route's format."""


class ChatStream(Stream):
    def start(self) -> bytes:
        return b"".join(self._event(index, ChatDelta(role="assistant", content="")) for index in range(len(self.texts)))

    def _chunk(self, index, text, token, offset, finish_reason=None) -> bytes:
        logprobs = None
        if token is not None and self.reply.top_logprobs is not None:
            logprobs = ChatLogprobs(content=[_token_logprob(self.tokenizer, *token, self.reply.top_logprobs)])
        if not text and logprobs is None and finish_reason is None:
            return b""
        return self._event(index, ChatDelta(content=text) if text or logprobs else ChatDelta(), finish_reason,
                           logprobs)

    def _event(self, index: int, delta: ChatDelta, finish_reason: str | None = None,
               logprobs: ChatLogprobs | None = None) -> bytes:
        reply = self.reply
        return _event(ChatCompletionChunk(id=reply.id, created=reply.created, model=reply.model, choices=[
            ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)]))

    def _usage_chunk(self, usage: Usage) -> bytes:
        reply = self.reply
        return _event(ChatCompletionChunk(id=reply.id, created=reply.created, model=reply.model, choices=[],
                                          usage=usage))


class CompletionStream(Stream):
    def _chunk(self, index, text, token, offset, finish_reason=None) -> bytes:
        logprobs = None
        if token is not None:
            logprobs = _completion_logprobs(self.tokenizer, [token], self.reply.top_logprobs, offset)
        if not text and logprobs is None and finish_reason is None:
            return b""
        reply = self.reply
        return _event(Completion(id=reply.id, created=reply.created, model=reply.model, choices=[
            CompletionChoice(index=index, text=text, finish_reason=finish_reason, logprobs=logprobs)]))

    def _usage_chunk(self, usage: Usage) -> bytes:
        reply = self.reply
        return _event(Completion(id=reply.id, created=reply.created, model=reply.model, choices=[], usage=usage))


class _StreamedText:
    """One choice's text as its tokens arrive: what may be sent so far, and what was."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_strings: tuple[str, ...]):
        self.tokenizer, self.stop_strings = tokenizer, stop_strings
        self.tokens: list[int] = []
        self.text = ""
        """The text decoded so far (up to the last token that completed a character)."""
        self.sent = 0
        """Characters of `text` sent."""
        self._prefix = self._read = 0
        """Tokens [prefix, read) are decoded again beside the new ones, for the context their text depends on."""

    def add(self, token: int) -> str:
        """The text that may be sent now that `token` was sampled."""
        self.tokens.append(token)
        decode = self.tokenizer.decode
        before = decode(self.tokens[self._prefix:self._read], skip_special_tokens=True)
        after = decode(self.tokens[self._prefix:], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.tokens)
        end = max(self.sent, self._sendable())
        piece, self.sent = self.text[self.sent:end], end
        return piece

    def rest(self, final_text: str) -> str:
        """What is left to send of the choice's final text."""
        piece, self.sent = final_text[self.sent:], max(self.sent, len(final_text))
        return piece

    def _sendable(self) -> int:
        """How much of the text is sure to be sent: up to a stop string, or to a tail that may begin one."""
        text = self.text
        found = [at for at in (text.find(stop) for stop in self.stop_strings) if at >= 0]
        if found:
            return min(found)
        for length in range(min(len(text), max((len(s) for s in self.stop_strings), default=1) - 1), 0, -1):
            if any(stop.startswith(text[-length:]) for stop in self.stop_strings):
                return len(text) - length
        return len(text)


def _tokens(sequence: SampledSequence):
    """(token, logprob, alternatives) of each sampled token."""
    best = sequence.topk_logprobs or [None] * len(sequence.tokens)
    return zip(sequence.tokens, sequence.logprobs, best)


def _token(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _token_logprob(tokenizer: PreTrainedTokenizerBase, token_id: int, logprob: float, best: Alternatives,
                   top_logprobs: int) -> TokenLogprob:
    token = _token(tokenizer, token_id)
    return TokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()), top_logprobs=[
        TopLogprob(token=(alt := _token(tokenizer, t)), logprob=lp, bytes=list(alt.encode()))
        for t, lp in (best or [])[:top_logprobs]])


def _completion_logprobs(tokenizer: PreTrainedTokenizerBase, tokens: list[tuple[int, float, Alternatives]],
                         top_logprobs: int | None, offset: int) -> CompletionLogprobs | None:
    if top_logprobs is None:
        return None
    names, offsets = [], []
    for token_id, _, _ in tokens:
        names.append(_token(tokenizer, token_id))
        offsets.append(offset)
        offset += len(names[-1])
    return CompletionLogprobs(
        tokens=names, token_logprobs=[logprob for _, logprob, _ in tokens], text_offset=offsets,
        top_logprobs=[{_token(tokenizer, t): lp for t, lp in (best or [])[:top_logprobs]} for _, _, best in tokens])


def _event(body: BaseModel) -> bytes:
    return b"data: " + body.model_dump_json().encode() + b"\n\n"
