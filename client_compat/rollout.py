"""A multi-turn (vision-language) RL episode as one growing token sequence, and its training datums.

Token in, token out: sampled tokens are kept verbatim, never decoded and re-encoded; each new turn
renders only its new messages (`ChatRenderer.bridge`) and appends them after the template's
end-of-turn tokens, which are completed where generation stopped without them (a stop string, or
`length`). So every prompt extends the previous prompt and action, and an episode stays one datum
at linear cost. A template that rewrites history there (the bridge check fails) falls back to a
full re-render, which starts a new datum; `metrics` counts both. `training_data` is the one place
that builds every loss input; `logprob_gap` compares trainer and sampler logprobs after training.

Positions are the expanded view: an image chunk takes `expected_tokens` positions in every length.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import tinker
from tinker import types

from client_compat.chat import Chunk, ChatRenderer, Message

Element = int | types.ImageChunk
"""One sampled or rendered token, or one image (which takes its expected_tokens positions)."""

LOSS_INPUTS = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages", "sequence_ratio_mask"),
    "stable_reinforce": ("logprobs", "advantages"),
}
"""loss_fn_inputs each loss takes besides target_tokens (a server may refuse others)."""


class ImageTokensMismatch(ValueError):
    """The server counts an image's tokens differently from the client's ImageChunker."""


@dataclass
class Turn:
    observation: list[Element]
    """What this turn's prompt added: the whole first prompt, then end-of-turn repair + new messages."""
    action: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sequence_id: str | None = None
    stop_reason: str = "stop"
    acted: bool = False


@dataclass
class RolloutDatum:
    """A datum and, per target position, whether it is a sampled token and whether an image precedes it."""

    datum: types.Datum
    action_mask: np.ndarray
    after_image: np.ndarray


class Episode:
    """One conversation: `Episode(renderer, messages)`, then `act` (or `sample`) and `observe` turn by turn."""

    def __init__(self, renderer: ChatRenderer, messages: list[Message]):
        self.renderer = renderer
        self.messages = list(messages)
        """The conversation as messages (assistant turns decoded): used only for a full re-render."""
        self.segments: list[list[Turn]] = [[Turn(observation=_flatten(renderer.render(messages)))]]
        """Turns sharing one token sequence; a fallback re-render starts a new segment (a new datum)."""
        self.metrics = {"tito/bridged": 0, "tito/fell_back": 0, "tito/end_of_turn_repaired": 0}

    @property
    def observation(self) -> types.ModelInput:
        """The prompt of the next sampling request: the current segment so far."""
        return _model_input([element for turn in self.segments[-1]
                             for element in (*turn.observation, *turn.action)])

    @property
    def num_tokens(self) -> int:
        """Positions of the current prompt, images counted by their expected_tokens."""
        return self.observation.length

    @property
    def turns(self) -> list[Turn]:
        return [turn for segment in self.segments for turn in segment]

    def act(self, tokens: Sequence[int], logprobs: Sequence[float] | None = None, stop_reason: str = "stop",
            sequence_id: str | None = None) -> None:
        """Record the sampled tokens of the current turn, verbatim (with the sampler's logprobs and sequence id)."""
        turn = self.segments[-1][-1]
        if turn.acted:
            raise ValueError("this turn already has its action; call observe() with the next messages first")
        if logprobs is not None and len(logprobs) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {len(logprobs)} logprobs")
        turn.action, turn.logprobs = list(tokens), list(logprobs) if logprobs is not None else [0.0] * len(tokens)
        turn.sequence_id, turn.stop_reason, turn.acted = sequence_id, stop_reason, True

    def sample(self, sampling_client: tinker.SamplingClient, max_tokens: int, temperature: float = 1.0,
               seed: int | None = None) -> types.SampledSequence:
        """Sample the current turn with the bare SDK (stopping at the end-of-turn token) and `act` on it."""
        params = types.SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                      stop=self.renderer.stop_tokens)
        try:
            sequence = sampling_client.sample(self.observation, num_samples=1, sampling_params=params).result()
        except tinker.BadRequestError as error:
            if "tokens, got" in str(error) and "from image" in str(error):
                raise ImageTokensMismatch(
                    f"the server counts an image's tokens differently from this client: {error}. Build the "
                    f"ChatRenderer (its ImageChunker) from the directory the server reports as "
                    f"get_info().model_data.tokenizer_id, so both use the same preprocessor_config.json") from error
            raise
        (sampled,) = sequence.sequences
        self.act(sampled.tokens, sampled.logprobs, sampled.stop_reason, sampled.sequence_id)
        return sampled

    def observe(self, messages: list[Message]) -> types.ModelInput:
        """Append the next messages (with their images) after the last action; the next prompt."""
        turn = self.segments[-1][-1]
        if not turn.acted:
            raise ValueError("observe() follows act(): the current turn has no action yet")
        self.messages += [{"role": "assistant", "content": self.renderer.decode(turn.action)}, *messages]
        delta = self.renderer.bridge(messages)
        if delta is None:
            self.metrics["tito/fell_back"] += 1
            self.segments.append([Turn(observation=_flatten(self.renderer.render(self.messages)))])
            return self.observation
        self.metrics["tito/bridged"] += 1
        end_of_turn = self.renderer.end_of_turn
        done = _overlap(turn.action, end_of_turn)
        if done == 0:  # stopped on a stop string, or on length: the turn never got its end-of-turn token
            self.metrics["tito/end_of_turn_repaired"] += 1
        self.segments[-1].append(Turn(observation=[*end_of_turn[done:], *_flatten(delta)]))
        return self.observation

    def training_data(self, advantages: float | Sequence[float], loss_fn: str) -> list[RolloutDatum]:
        """One datum per segment with the inputs `loss_fn` takes, and provenance spans where every turn has
        a sequence id.

        Args:
            advantages: one for the whole episode, or one per acted turn (e.g. `discounted_returns`
                minus a baseline); it goes on that turn's sampled tokens only.
        """
        acted = [turn for turn in self.turns if turn.acted]
        per_turn = [float(advantages)] * len(acted) if np.ndim(advantages) == 0 else [float(a) for a in advantages]
        if len(per_turn) != len(acted):
            raise ValueError(f"{len(per_turn)} advantages for {len(acted)} turns")
        by_turn = dict(zip(map(id, acted), per_turn))
        data = []
        for segment in self.segments:
            turns = segment[:-1] if not segment[-1].acted else segment  # a last prompt never sampled adds nothing
            if any(turn.action for turn in turns):
                data.append(_segment_datum(turns, [by_turn[id(turn)] for turn in turns], loss_fn))
        return data


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """Per turn: its reward plus the later ones, discounted by gamma per turn."""
    returns, running = [], 0.0
    for reward in reversed(rewards):
        running = reward + gamma * running
        returns.append(running)
    return returns[::-1]


def logprob_gap(data: Sequence[RolloutDatum], training_logprobs: Sequence[Sequence[float]]) -> dict[str, float]:
    """Mean and max |trainer - sampler| logprob over sampled tokens, after an image and in text-only context.

    `training_logprobs` are forward_backward's `loss_fn_outputs[i]["logprobs"]`, in datum order.
    """
    gaps = {"after_image": [], "text_only": []}
    for rollout, trainer in zip(data, training_logprobs, strict=True):
        sampler = rollout.datum.loss_fn_inputs["logprobs"].to_numpy()
        gap = np.abs(np.asarray(trainer, dtype=np.float64) - sampler)
        gaps["after_image"].append(gap[rollout.action_mask & rollout.after_image])
        gaps["text_only"].append(gap[rollout.action_mask & ~rollout.after_image])
    metrics = {}
    for context, pieces in gaps.items():
        values = np.concatenate(pieces) if pieces else np.zeros(0)
        metrics[f"logprob_gap/{context}/mean"] = float(values.mean()) if values.size else 0.0
        metrics[f"logprob_gap/{context}/max"] = float(values.max()) if values.size else 0.0
        metrics[f"logprob_gap/{context}/tokens"] = float(values.size)
    return metrics


def _segment_datum(turns: list[Turn], advantages: list[float], loss_fn: str) -> RolloutDatum:
    """The cookbook's layout: inputs drop the last position, targets the first (0 at image positions)."""
    if loss_fn not in LOSS_INPUTS:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; known: {sorted(LOSS_INPUTS)}")
    elements: list[Element] = []
    # Per position of the whole sequence:
    tokens, action, logprobs, advantage, after_image = [], [], [], [], []
    spans: list[types.PromptProvenanceSpan | types.SampledProvenanceSpan] | None = []
    seen_image = False
    for turn, turn_advantage in zip(turns, advantages, strict=True):
        start = len(tokens)
        for element in turn.observation:
            is_text = isinstance(element, int)
            width = 1 if is_text else element.expected_tokens
            tokens += [element] if is_text else [0] * width
            after_image += [seen_image] * width
            seen_image = seen_image or not is_text
        observed = len(tokens) - start
        elements += [*turn.observation, *turn.action]
        tokens += turn.action
        action += [False] * observed + [True] * len(turn.action)
        logprobs += [0.0] * observed + turn.logprobs
        advantage += [0.0] * observed + [turn_advantage] * len(turn.action)
        after_image += [seen_image] * len(turn.action)
        if turn.sequence_id is None:
            spans = None  # provenance needs a sequence id for every turn (the cookbook's rule too)
        elif spans is not None:
            if observed:
                spans.append(types.PromptProvenanceSpan(sequence_id=turn.sequence_id, offset=start, length=observed))
            if turn.action:
                spans.append(types.SampledProvenanceSpan(sequence_id=turn.sequence_id, length=len(turn.action)))
    # Target t is position t + 1 of the sequence; its context is positions 0..t.
    mask = np.asarray(action[1:], dtype=bool)
    columns = {"target_tokens": np.asarray(tokens[1:], dtype=np.int64), "weights": mask.astype(np.float32),
               "logprobs": np.asarray(logprobs[1:], dtype=np.float32),
               "advantages": np.asarray(advantage[1:], dtype=np.float32),
               "sequence_ratio_mask": mask.astype(np.float32)}
    datum = types.Datum(model_input=_model_input(elements[:-1]),
                        loss_fn_inputs={name: columns[name] for name in ("target_tokens", *LOSS_INPUTS[loss_fn])})
    if spans:
        datum = datum.with_provenance(model_input=_without_last(spans), loss_fn_inputs=_without_first(spans))
    return RolloutDatum(datum, mask, np.asarray(after_image[1:], dtype=bool))


def _without_first(spans: list) -> list:
    """The spans of the same tokens without the first position (no zero-length run left behind)."""
    first, rest = spans[0], spans[1:]
    return rest if first.length == 1 else [replace(first, offset=first.offset + 1, length=first.length - 1), *rest]


def _without_last(spans: list) -> list:
    last, rest = spans[-1], spans[:-1]
    return rest if last.length == 1 else [*rest, replace(last, length=last.length - 1)]


def _overlap(action: list[int], end_of_turn: list[int]) -> int:
    """How many leading end-of-turn tokens the action already ends with."""
    for count in range(min(len(action), len(end_of_turn)), 0, -1):
        if action[len(action) - count:] == end_of_turn[:count]:
            return count
    return 0


def _flatten(chunks: list[Chunk]) -> list[Element]:
    return [element for chunk in chunks
            for element in (chunk.tokens if isinstance(chunk, types.EncodedTextChunk) else [chunk])]


def _model_input(elements: list[Element]) -> types.ModelInput:
    chunks: list[Chunk] = []
    text: list[int] = []
    for element in elements:
        if isinstance(element, int):
            text.append(element)
            continue
        if text:
            chunks.append(types.EncodedTextChunk(tokens=text))
            text = []
        chunks.append(element)
    if text:
        chunks.append(types.EncodedTextChunk(tokens=text))
    return types.ModelInput(chunks=chunks)
