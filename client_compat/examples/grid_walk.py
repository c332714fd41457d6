"""Grid walk: a small multi-turn vision-language RL task, trained with the cookbook's RL loop or the bare SDK.

The model is the blue dot on a grid picture and must reach the red square, one move per turn. After
every move it gets a picture of the new state and feedback ("Closer.", or "Not closer. Try again.");
an answer that is not a move gets "That is not a move..." and the same picture again. Reward 1 when
it gets there within `max_turns` turns, else 0.

Cookbook loop (sampling records stability info for its default loss, stable_reinforce):

    python -m client_compat.examples.grid_walk model_name=Qwen/Qwen2.5-VL-3B-Instruct \\
        model_dir=/models/Qwen2.5-VL-3B-Instruct base_url=http://127.0.0.1:8000 log_path=/tmp/grid_walk

`sdk_loop` is the same training as a flat loop on the bare SDK, with the rollout helper's own
datums and its trainer/sampler logprob diagnostics.
"""

import asyncio
import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass

import chz
import tinker
from PIL import Image, ImageDraw
from tinker import types
from tinker_cookbook.rl import train
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import register_tokenizer

from client_compat.chat import ChatRenderer, Message
from client_compat.env import ConversationEnv, Reply
from client_compat.rollout import Episode, logprob_gap

MOVES = {"up": (0, -1), "down": (0, 1), "left": (-1, 0), "right": (1, 0)}
CELL_PIXELS = 28
QUESTION = "You are the blue dot. Which way is the red square? Answer with one word: up, down, left or right."


class GridWalk:
    """One episode of the task, as a Conversation (client_compat.env)."""

    def __init__(self, seed: int, size: int = 3, max_turns: int = 4):
        rng = random.Random(seed)
        cells = [(x, y) for x in range(size) for y in range(size)]
        self.agent, self.goal = rng.sample(cells, 2)
        self.size, self.max_turns, self.turns = size, max_turns, 0

    def start(self) -> list[Message]:
        return [_user(self.picture(), QUESTION)]

    def reply(self, text: str) -> Reply:
        self.turns += 1
        words = text.strip().lower().split()
        move = MOVES.get(words[0].strip(".!,")) if words else None
        if move is None:
            feedback = "That is not a move. Answer with one word: up, down, left or right."
        else:
            before = self._distance()
            self.agent = tuple(min(self.size - 1, max(0, a + d)) for a, d in zip(self.agent, move))
            if self.agent == self.goal:
                return Reply(reward=1.0, done=True, metrics={"reached": 1.0, "valid_move": 1.0})
            feedback = "Closer." if self._distance() < before else "Not closer. Try again."
        if self.turns >= self.max_turns:
            return Reply(reward=0.0, done=True, metrics={"reached": 0.0, "valid_move": float(move is not None)})
        return Reply(reward=0.0, done=False, messages=[_user(self.picture(), f"{feedback} Which way now?")],
                     metrics={"valid_move": float(move is not None)})

    def picture(self) -> Image.Image:
        image = Image.new("RGB", (self.size * CELL_PIXELS,) * 2, "white")
        draw = ImageDraw.Draw(image)
        for x, y, colour, shape in [(*self.goal, "red", draw.rectangle), (*self.agent, "blue", draw.ellipse)]:
            shape([x * CELL_PIXELS + 4, y * CELL_PIXELS + 4, (x + 1) * CELL_PIXELS - 5, (y + 1) * CELL_PIXELS - 5],
                  fill=colour)
        return image

    def _distance(self) -> int:
        return abs(self.agent[0] - self.goal[0]) + abs(self.agent[1] - self.goal[1])


def _user(image: Image.Image, text: str) -> Message:
    return {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}


@functools.cache
def chat_renderer(model_dir: str) -> ChatRenderer:
    return ChatRenderer.from_model_dir(model_dir)


# -- the cookbook's RL loop --------------------------------------------------------------------------


@dataclass(frozen=True)
class GridWalkGroup(EnvGroupBuilder):
    """`group_size` attempts at the same grid (rewards are centred within the group)."""

    seed: int
    group_size: int
    model_dir: str
    max_turns: int
    max_trajectory_tokens: int

    async def make_envs(self) -> Sequence[ConversationEnv]:
        return [ConversationEnv(GridWalk(self.seed, max_turns=self.max_turns), chat_renderer(self.model_dir),
                                max_trajectory_tokens=self.max_trajectory_tokens)
                for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return ["grid_walk"]


class GridWalkDataset(RLDataset):
    def __init__(self, builder: "GridWalkDatasetBuilder"):
        self.builder = builder

    def get_batch(self, index: int) -> Sequence[GridWalkGroup]:
        b = self.builder
        return [GridWalkGroup(seed=b.seed * 1_000_003 + index * b.batch_size + i, group_size=b.group_size,
                              model_dir=b.model_dir, max_turns=b.max_turns,
                              max_trajectory_tokens=b.max_trajectory_tokens) for i in range(b.batch_size)]

    def __len__(self) -> int:
        return self.builder.num_batches


@chz.chz
class GridWalkDatasetBuilder(RLDatasetBuilder):
    model_dir: str
    batch_size: int = 8
    group_size: int = 4
    num_batches: int = 100
    max_turns: int = 4
    max_trajectory_tokens: int = 4096
    seed: int = 0

    async def __call__(self) -> tuple[GridWalkDataset, None]:
        return GridWalkDataset(self), None


@chz.chz
class CLIConfig:
    model_name: str
    """The base model the server serves."""
    log_path: str
    model_dir: str | None = None
    """Tokenizer, chat template and image processor (get_info().model_data.tokenizer_id); default model_name."""
    base_url: str | None = None
    batch_size: int = 8
    group_size: int = 4
    num_batches: int = 100
    max_turns: int = 4
    max_tokens: int = 16
    learning_rate: float = 1e-4
    lora_rank: int = 16
    loss_fn: str = "stable_reinforce"
    max_steps: int | None = None


def main(cli: CLIConfig) -> None:
    model_dir = cli.model_dir or cli.model_name
    # The cookbook loads the tokenizer by model name; a self-hosted model's lives in its directory.
    register_tokenizer(cli.model_name, lambda: chat_renderer(model_dir).tokenizer)
    dataset = GridWalkDatasetBuilder(model_dir=model_dir, batch_size=cli.batch_size, group_size=cli.group_size,
                                     num_batches=cli.num_batches, max_turns=cli.max_turns)
    config = train.Config(learning_rate=cli.learning_rate, dataset_builder=dataset, model_name=cli.model_name,
                          recipe_name="grid_walk", max_tokens=cli.max_tokens, log_path=cli.log_path,
                          base_url=cli.base_url, lora_rank=cli.lora_rank, loss_fn=cli.loss_fn,
                          max_steps=cli.max_steps, eval_every=0, save_every=0)
    asyncio.run(train.main(config))


# -- the same training on the bare SDK ------------------------------------------------------------


def sdk_loop(service_client: tinker.ServiceClient, model_name: str, steps: int, group_size: int = 4,
             max_turns: int = 4, max_tokens: int = 16, learning_rate: float = 1e-4) -> list[dict[str, float]]:
    """Sample a group of episodes per step, train on them with stable_reinforce; each step's metrics."""
    training = service_client.create_lora_training_client(base_model=model_name, rank=8).result()
    renderer = chat_renderer(training.get_info().model_data.tokenizer_id)
    history = []
    for step in range(steps):
        sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
        episodes, rewards = [], []
        for _ in range(group_size):
            game = GridWalk(seed=step, max_turns=max_turns)
            episode, total = Episode(renderer, game.start()), 0.0
            while True:
                sampled = episode.sample(sampler, max_tokens)
                reply = game.reply(renderer.decode(sampled.tokens))
                total += reply.reward
                if reply.done:
                    break
                episode.observe(reply.messages)
            episodes.append(episode)
            rewards.append(total)
        baseline = sum(rewards) / len(rewards)
        data = [d for episode, reward in zip(episodes, rewards)
                for d in episode.training_data(reward - baseline, "stable_reinforce")]
        out = training.forward_backward([d.datum for d in data], "stable_reinforce").result()
        training.optim_step(types.AdamParams(learning_rate=learning_rate)).result()
        metrics = {"step": step, "reward": baseline, "datums_per_episode": len(data) / len(episodes),
                   "turns_per_episode": sum(len(e.turns) for e in episodes) / len(episodes),
                   **{key: float(sum(e.metrics[key] for e in episodes)) for key in episodes[0].metrics},
                   **out.metrics, **logprob_gap(data, [o["logprobs"].tolist() for o in out.loss_fn_outputs])}
        print(metrics)
        history.append(metrics)
    return history


if __name__ == "__main__":
    main(chz.entrypoint(CLIConfig))
