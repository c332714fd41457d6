"""What the examples' command lines share: the cookbook RL loop's flags, a supervised warm start through
the same server (its state saved, RL starting from it), and the run. Knows nothing about any task:
each example gives its dataset and a function that builds a warm-start batch of correct episodes.
"""

import asyncio
import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import chz
import tinker
from tinker import types
from tinker_cookbook.rl import train
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import register_tokenizer

from client_compat.chat import ChatRenderer
from client_compat.env import Conversation, ConversationEnv


@functools.cache
def chat_renderer(model_dir: str) -> ChatRenderer:
    return ChatRenderer.from_model_dir(model_dir)


@dataclass(frozen=True)
class ConversationGroup(EnvGroupBuilder):
    """`group_size` attempts at the same task (rewards are centred within the group)."""

    conversation: Callable[[], Conversation]
    """Makes one attempt, e.g. functools.partial(GridWalk, seed)."""
    group_size: int
    model_dir: str
    tags: tuple[str, ...]
    max_trajectory_tokens: int = 4096

    async def make_envs(self) -> Sequence[ConversationEnv]:
        return [ConversationEnv(self.conversation(), chat_renderer(self.model_dir),
                                max_trajectory_tokens=self.max_trajectory_tokens)
                for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return list(self.tags)


class BatchDataset(RLDataset):
    """Batch `index` from a function of the index (the same groups for the same index: a control run sees
    the problems of the run it controls)."""

    def __init__(self, batch: Callable[[int], Sequence[EnvGroupBuilder]], num_batches: int):
        self.batch, self.num_batches = batch, num_batches

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return self.batch(index)

    def __len__(self) -> int:
        return self.num_batches


@chz.chz
class RecipeConfig:
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
    warm_start_steps: int = 0
    """Supervised steps on correct episodes before RL (through the same server); RL starts from their
    saved state. Their NLL per trained token goes to log_path/warm_start.jsonl."""
    warm_start_batch_size: int = 64
    warm_start_learning_rate: float = 1e-3
    load_checkpoint_path: str | None = None
    """RL starts from these weights (a saved state, e.g. another run's warm start)."""


def supervised_steps(training: tinker.TrainingClient, batch: Callable[[int], list[types.Datum]], steps: int,
                     learning_rate: float) -> list[dict[str, float]]:
    """cross_entropy steps on batch(step) for each step; each step's NLL per trained token."""
    history = []
    for step in range(steps):
        data = batch(step)
        backward = training.forward_backward(data, "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=learning_rate))
        out = backward.result()
        optim.result()
        trained = sum(float(d.loss_fn_inputs["weights"].to_numpy().sum()) for d in data)
        history.append({"step": step, "nll": out.metrics["loss:sum"] / trained})
        print("warm start", history[-1], flush=True)
    return history


def run(cli: RecipeConfig, renderer: ChatRenderer, recipe_name: str, dataset: RLDatasetBuilder,
        warm_start_batch: Callable[[int], list[types.Datum]]) -> None:
    """The warm start if asked (its state saved), then the cookbook's RL loop from it."""
    # The cookbook loads the tokenizer by model name; a self-hosted model's lives in its directory.
    register_tokenizer(cli.model_name, lambda: renderer.tokenizer)
    load_checkpoint_path = cli.load_checkpoint_path
    if cli.warm_start_steps:
        training = tinker.ServiceClient(base_url=cli.base_url).create_lora_training_client(
            base_model=cli.model_name, rank=cli.lora_rank).result()
        history = supervised_steps(training, warm_start_batch, cli.warm_start_steps, cli.warm_start_learning_rate)
        Path(cli.log_path).mkdir(parents=True, exist_ok=True)
        (Path(cli.log_path) / "warm_start.jsonl").write_text("".join(json.dumps(row) + "\n" for row in history))
        load_checkpoint_path = training.save_state("warm_start").result().path
    config = train.Config(learning_rate=cli.learning_rate, dataset_builder=dataset, model_name=cli.model_name,
                          recipe_name=recipe_name, max_tokens=cli.max_tokens, log_path=cli.log_path,
                          base_url=cli.base_url, lora_rank=cli.lora_rank, loss_fn=cli.loss_fn,
                          max_steps=cli.max_steps, eval_every=0, save_every=0,
                          load_checkpoint_path=load_checkpoint_path)
    asyncio.run(train.main(config))
