"""A tinker-cookbook `Env` over a message-level conversation, with the token-in/token-out `Episode` inside.

Write the task as a `Conversation` (the first messages, then a `Reply` to each assistant text with
the reward and only the *new* messages, images included) and hand `ConversationEnv` to the
cookbook's RL loop unchanged: every observation extends the previous observation and action token
for token, so the cookbook's `trajectory_to_data` keeps the episode in one datum (with provenance,
so `stable_reinforce` works). Per transition it reports `tito/fell_back` and
`tito/end_of_turn_repaired` (averaged by the cookbook into `env/all/...`).
"""

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from tinker import types
from tinker_cookbook.rl.types import (STOP_METRIC_PREFIX, ActionExtra, Env, InitialObservationOverflow, StepResult,
                                      StopReason)

from client_compat.chat import ChatRenderer, Message
from client_compat.rollout import Episode


@dataclass
class Reply:
    """The environment's answer to one assistant turn."""

    reward: float
    done: bool
    messages: list[Message] = field(default_factory=list)
    """The messages that follow the assistant's turn (user or tool), not the history."""
    metrics: dict[str, float] = field(default_factory=dict)


class Conversation(Protocol):
    """A task as messages: its first messages, then a Reply to each assistant text."""

    def start(self) -> list[Message]: ...

    def reply(self, text: str) -> Reply: ...


class ConversationEnv(Env):
    def __init__(self, conversation: Conversation, renderer: ChatRenderer, max_trajectory_tokens: int | None = None,
                 max_generation_tokens: int = 0, end_on_length: bool = False, length_reward: float = 0.0):
        """
        Args:
            max_trajectory_tokens: the episode ends (CONTEXT_OVERFLOW) when the next prompt plus
                max_generation_tokens would pass it; images count their expected_tokens.
            end_on_length: a turn cut by max_tokens ends the episode with `length_reward` (the
                cookbook's EnvFromMessageEnv default). Otherwise (the default) the turn is closed with
                the template's end-of-turn tokens and answered like any other.
        """
        self.conversation = conversation
        self.renderer = renderer
        self.max_trajectory_tokens = max_trajectory_tokens
        self.max_generation_tokens = max_generation_tokens
        self.end_on_length = end_on_length
        self.length_reward = length_reward
        self.episode: Episode | None = None

    async def initial_observation(self) -> tuple[types.ModelInput, list[int]] | InitialObservationOverflow:
        self.episode = await asyncio.to_thread(Episode, self.renderer, self.conversation.start())
        if self._over_budget():
            return InitialObservationOverflow(reward=self.length_reward,
                                              metrics={f"{STOP_METRIC_PREFIX}{StopReason.MAX_TOKENS}": 1.0})
        return self.episode.observation, self.renderer.stop_tokens

    async def step(self, action: list[int], *, extra: ActionExtra | None = None) -> StepResult:
        stop_reason = (extra or {}).get("stop_reason", "stop")
        self.episode.act(action, stop_reason=stop_reason)
        before = dict(self.episode.metrics)
        if stop_reason == "length" and self.end_on_length:
            return self._end(self.length_reward, {f"{STOP_METRIC_PREFIX}{StopReason.MAX_TOKENS}": 1.0}, before)
        reply = self.conversation.reply(self.renderer.decode(action))
        if reply.done:
            return self._end(reply.reward, {**reply.metrics, f"{STOP_METRIC_PREFIX}{StopReason.COMPLETED}": 1.0},
                             before)
        observation = await asyncio.to_thread(self.episode.observe, reply.messages)
        metrics = {**reply.metrics, **self._turn_metrics(before)}
        if self._over_budget():
            return self._end(reply.reward, {**metrics, f"{STOP_METRIC_PREFIX}{StopReason.CONTEXT_OVERFLOW}": 1.0},
                             before)
        return StepResult(reward=reply.reward, episode_done=False, next_observation=observation,
                          next_stop_condition=self.renderer.stop_tokens, metrics=metrics)

    def _end(self, reward: float, metrics: dict[str, float], before: dict[str, int]) -> StepResult:
        return StepResult(reward=reward, episode_done=True, next_observation=types.ModelInput.empty(),
                          next_stop_condition=self.renderer.stop_tokens,
                          metrics={**self._turn_metrics(before), **metrics})

    def _turn_metrics(self, before: dict[str, int]) -> dict[str, float]:
        """What this turn's observe() did: fell back to a full re-render, repaired an end of turn."""
        return {key: float(self.episode.metrics[key] - before[key])
                for key in ("tito/fell_back", "tito/end_of_turn_repaired")}

    def _over_budget(self) -> bool:
        return (self.max_trajectory_tokens is not None
                and self.episode.num_tokens + self.max_generation_tokens > self.max_trajectory_tokens)
