"""Grid walk: a small multi-turn vision-language RL task, trained with the cookbook's RL loop or the bare SDK.

The model is the blue dot on a grid picture and must reach the red square, one move per turn. After
every move it gets a picture of the new state and feedback ("Closer.", or "Not closer. Try again.";
with `hints=False` only "Not there yet.", so that where to go is in the picture alone); an answer
that is not a move gets "That is not a move..." and the same picture again. Reward 1 when it gets
there within `max_turns` turns, else 0. `text_only_ceiling` is the best success of any policy that
ignores the picture (exact, by dynamic programming over what the text has told it); a policy that
reads the picture reaches 1.0 when `max_turns >= 2 * (size - 1)`.

Cookbook loop (sampling records stability info for its default loss, stable_reinforce):

    python -m client_compat.examples.grid_walk model_name=Qwen/Qwen2.5-VL-3B-Instruct \\
        model_dir=/models/Qwen2.5-VL-3B-Instruct base_url=http://127.0.0.1:8000 log_path=/tmp/grid_walk

With a supervised warm start (correct moves read off the picture, through the same server) and a
curriculum (2 x 2 grids for the first batches), on the task only the picture solves:

    python -m client_compat.examples.grid_walk ... hints=False warm_start_steps=100 small_grids=20

`sdk_loop` is the same training as a flat loop on the bare SDK, with the rollout helper's own
datums and its trainer/sampler logprob diagnostics.
"""

import functools
import random
from fractions import Fraction

import chz
import tinker
from PIL import Image, ImageDraw
from tinker import types
from tinker_cookbook.rl.types import RLDatasetBuilder

from client_compat.chat import ChatRenderer, Message
from client_compat.env import Reply
from client_compat.examples import recipe
from client_compat.examples.recipe import BatchDataset, ConversationGroup, RecipeConfig, chat_renderer
from client_compat.rollout import Episode, logprob_gap

MOVES = {"up": (0, -1), "down": (0, 1), "left": (-1, 0), "right": (1, 0)}
CELL_PIXELS = 28
QUESTION = "You are the blue dot. Which way is the red square? Answer with one word: up, down, left or right."


class GridWalk:
    """One episode of the task, as a Conversation (client_compat.env)."""

    def __init__(self, seed: int, size: int = 3, max_turns: int = 4, hints: bool = True):
        rng = random.Random(seed)
        cells = [(x, y) for x in range(size) for y in range(size)]
        self.agent, self.goal = rng.sample(cells, 2)
        self.size, self.max_turns, self.hints, self.turns = size, max_turns, hints, 0

    def start(self) -> list[Message]:
        return [_user(self.picture(), QUESTION)]

    def reply(self, text: str) -> Reply:
        self.turns += 1
        words = text.strip().lower().split()
        move = MOVES.get(words[0].strip(".!,")) if words else None
        if move is None:
            feedback = "That is not a move. Answer with one word: up, down, left or right."
        else:
            before = _distance(self.agent, self.goal)
            self.agent = _moved(self.agent, move, self.size)
            if self.agent == self.goal:
                return Reply(reward=1.0, done=True, metrics={"reached": 1.0, "valid_move": 1.0})
            closer = _distance(self.agent, self.goal) < before
            feedback = ("Closer." if closer else "Not closer. Try again.") if self.hints else "Not there yet."
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

    def best_moves(self) -> list[str]:
        """The moves that bring the dot closer to the square: what the picture says."""
        return [name for name, move in MOVES.items()
                if _distance(_moved(self.agent, move, self.size), self.goal) < _distance(self.agent, self.goal)]


def _moved(cell: tuple[int, int], move: tuple[int, int], size: int) -> tuple[int, int]:
    return tuple(min(size - 1, max(0, a + d)) for a, d in zip(cell, move))


def _distance(a: tuple[int, int], b: tuple[int, int]) -> int:
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


def _pairs(size: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Every (dot, square) start a seed can draw, each equally likely."""
    cells = [(x, y) for x in range(size) for y in range(size)]
    return [(a, g) for a in cells for g in cells if a != g]


def text_only_ceiling(size: int, max_turns: int, hints: bool) -> Fraction:
    """The best success of any policy that never looks at the picture, exactly.

    Such a policy knows only its own answers and the feedback, so it acts on the set of starts that
    agree with them; dynamic programming over those sets (every move and "not a move", every
    feedback) finds the best. Without hints the feedback says nothing: the best fixed sequence of moves.
    """

    @functools.cache
    def successes(states: tuple, turns_left: int) -> int:
        """States: the sorted (dot, square) positions of the starts the text agrees with, with repeats
        (two starts the walls bring to the same place count twice)."""
        if turns_left == 0 or not states:
            return 0
        best = 0
        for move in [*MOVES.values(), (0, 0)]:  # (0, 0): an answer that is not a move
            reached, told = 0, {}
            for agent, goal in states:
                moved = _moved(agent, move, size)
                if moved == goal:
                    reached += 1
                    continue
                feedback = (move, _distance(moved, goal) < _distance(agent, goal)) if hints else move == (0, 0)
                told.setdefault(feedback, []).append((moved, goal))
            best = max(best, reached + sum(successes(tuple(sorted(s)), turns_left - 1) for s in told.values()))
        return best

    pairs = _pairs(size)
    return Fraction(successes(tuple(pairs), max_turns), len(pairs))


def random_policy_success(size: int, max_turns: int) -> Fraction:
    """The success of a policy that always makes a valid move, uniformly at random, exactly."""

    @functools.cache
    def success(agent: tuple[int, int], goal: tuple[int, int], turns_left: int) -> Fraction:
        if agent == goal:
            return Fraction(1)
        if turns_left == 0:
            return Fraction(0)
        return sum(success(_moved(agent, move, size), goal, turns_left - 1) for move in MOVES.values()) / len(MOVES)

    pairs = _pairs(size)
    return sum(success(a, g, max_turns) for a, g in pairs) / len(pairs)


def _user(image: Image.Image, text: str) -> Message:
    return {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}


def grid_size(index: int, size: int, small_grids: int) -> int:
    """The curriculum: batch `index` is on 2 x 2 grids while index < small_grids, then size x size."""
    return 2 if index < small_grids else size


# -- supervised warm start: correct moves, read off the picture --------------------------------------


def correct_episode(game: GridWalk, renderer: ChatRenderer, rng: random.Random) -> Episode:
    """An episode that takes a shortest way, every move written as the sampler would write it."""
    episode = Episode(renderer, game.start())
    while True:
        move = rng.choice(game.best_moves())
        episode.act(renderer.tokenizer.encode(move, add_special_tokens=False) + renderer.stop_tokens)
        reply = game.reply(move)
        if reply.done:
            return episode
        episode.observe(reply.messages)


def warm_start_batch(renderer: ChatRenderer, step: int, batch_size: int, size: int = 3, max_turns: int = 4,
                     hints: bool = True, small_grids: int = 0, seed: int = 0) -> list[types.Datum]:
    """Step `step`'s batch of correct episodes (the curriculum's grid size), cross_entropy on the moves only."""
    rng = random.Random(f"warm-start-{seed}-{step}")
    size_now = grid_size(step, size, small_grids)
    return [d.datum for _ in range(batch_size)
            for d in correct_episode(GridWalk(rng.randrange(2**31), size_now, max_turns, hints), renderer,
                                     rng).training_data(1.0, "cross_entropy")]


# -- the cookbook's RL loop --------------------------------------------------------------------------


@chz.chz
class GridWalkDatasetBuilder(RLDatasetBuilder):
    model_dir: str
    batch_size: int = 8
    group_size: int = 4
    num_batches: int = 100
    max_turns: int = 4
    max_trajectory_tokens: int = 4096
    seed: int = 0
    size: int = 3
    hints: bool = True
    small_grids: int = 0
    """The first small_grids batches are 2 x 2 grids (a curriculum)."""

    async def __call__(self) -> tuple[BatchDataset, None]:
        return BatchDataset(self.batch, self.num_batches), None

    def batch(self, index: int) -> list[ConversationGroup]:
        size = grid_size(index, self.size, self.small_grids)
        return [ConversationGroup(functools.partial(GridWalk, self.seed * 1_000_003 + index * self.batch_size + i,
                                                    size, self.max_turns, self.hints),
                                  self.group_size, self.model_dir, ("grid_walk", f"size_{size}"),
                                  self.max_trajectory_tokens)
                for i in range(self.batch_size)]


@chz.chz
class CLIConfig(RecipeConfig):
    size: int = 3
    hints: bool = True
    """False: the feedback never says whether a move got closer; only the picture shows the way."""
    small_grids: int = 0
    """Curriculum: the first small_grids batches (of the warm start, then of RL) are 2 x 2 grids."""


def main(cli: CLIConfig) -> None:
    model_dir = cli.model_dir or cli.model_name
    renderer = chat_renderer(model_dir)
    dataset = GridWalkDatasetBuilder(model_dir=model_dir, batch_size=cli.batch_size, group_size=cli.group_size,
                                     num_batches=cli.num_batches, max_turns=cli.max_turns, size=cli.size,
                                     hints=cli.hints, small_grids=max(0, cli.small_grids - cli.warm_start_steps))
    recipe.run(cli, renderer, "grid_walk", dataset,
               lambda step: warm_start_batch(renderer, step, cli.warm_start_batch_size, cli.size, cli.max_turns,
                                             cli.hints, cli.small_grids))


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
