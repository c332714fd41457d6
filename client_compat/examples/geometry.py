"""Geometry problems shaped like Geometry3K: a diagram, a question, a calculator tool, up to 3 turns.

Each problem is a triangle or a circle drawn offline with Pillow, its given values written on the
diagram (an angle, a side, a height, a radius), and a question in the text ("Find the area of the
circle."); `values_in_text=True` also writes the values into the question, for a model that cannot
read them off the picture yet. The model may call a calculator in text, as the cookbook renders tool
calls for Qwen models (its `<tools>` system prompt, a `<tool_call>` JSON block, the result back in a
user turn inside `<tool_response>`), and ends with `Answer: <number>`. Reward 1 when the number is
within 1 % of the truth (at least 0.01), else 0; a turn budget of 3 by default.

`text_only_ceiling` is the best any policy can do from the question alone (values only in the
picture): per kind of problem, the one number that is right for most problems, exactly.

    python -m client_compat.examples.geometry model_name=... model_dir=... base_url=... log_path=/tmp/geo \\
        warm_start_steps=50
"""

import ast
import functools
import itertools
import json
import math
import operator
import random
from collections.abc import Sequence
from fractions import Fraction

import chz
from PIL import Image, ImageDraw, ImageFont
from tinker import types
from tinker_cookbook.renderers.base import ToolCall, ToolSpec, parse_content_blocks
from tinker_cookbook.renderers.qwen3 import Qwen3Renderer
from tinker_cookbook.rl.types import RLDatasetBuilder

from client_compat.chat import ChatRenderer, Message
from client_compat.env import Reply
from client_compat.examples import recipe
from client_compat.examples.recipe import BatchDataset, ConversationGroup, RecipeConfig, chat_renderer
from client_compat.rollout import Episode

CALCULATOR: ToolSpec = {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression: numbers, + - * / ** ( ), sqrt(x) and pi.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}
SYSTEM = ("Solve the geometry problem in the picture. You may call the calculator. "
          "End with 'Answer: <number>'.")

# Each kind: the values a problem draws from (every combination equally likely), its question, and
# the calculator expression of its answer.
KINDS = {
    "third_angle": (dict(a=range(30, 85, 5), b=range(30, 85, 5)), "Find the angle x, in degrees.", "180 - {a} - {b}"),
    "hypotenuse": (dict(a=range(3, 13), b=range(3, 13)), "Find the hypotenuse x.", "sqrt({a}**2 + {b}**2)"),
    "triangle_area": (dict(a=range(2, 13), b=range(2, 13)), "Find the area of the triangle.", "{a} * {b} / 2"),
    "circle_area": (dict(a=range(1, 13)), "Find the area of the circle.", "pi * {a}**2"),
    "circumference": (dict(a=range(1, 13)), "Find the circumference of the circle.", "2 * pi * {a}"),
}
GIVEN = {"third_angle": "angle A = {a} degrees, angle B = {b} degrees", "hypotenuse": "legs {a} and {b}",
         "triangle_area": "base {a}, height {b}", "circle_area": "radius {a}", "circumference": "radius {a}"}


class Calculator:
    """Arithmetic on a whitelist of syntax (no names but pi and sqrt, small powers): never eval."""

    OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
                 ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}

    def __call__(self, expression: str) -> float:
        return float(self._value(ast.parse(expression, mode="eval").body))

    def _value(self, node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.Name) and node.id == "pi":
            return math.pi
        if isinstance(node, ast.UnaryOp) and type(node.op) in self.OPERATORS:
            return self.OPERATORS[type(node.op)](self._value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in self.OPERATORS:
            left, right = self._value(node.left), self._value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 16:
                raise ValueError("exponent too large")
            return self.OPERATORS[type(node.op)](left, right)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "sqrt"
                and len(node.args) == 1 and not node.keywords):
            return math.sqrt(self._value(node.args[0]))
        raise ValueError(f"not allowed: {ast.unparse(node)}")


def number_text(value: float) -> str:
    return f"{value:.4f}".rstrip("0").rstrip(".")


def is_correct(answer: float, truth: float) -> bool:
    return abs(answer - truth) <= tolerance(truth)


def tolerance(truth: float) -> float:
    return 0.01 * max(1.0, abs(truth))


class GeometryProblem:
    """One episode, as a Conversation (client_compat.env)."""

    def __init__(self, seed: int, kinds: Sequence[str] = tuple(KINDS), max_turns: int = 3,
                 values_in_text: bool = False, image_size: int = 224, system_prompt: str = ""):
        rng = random.Random(seed)
        self.kind = rng.choice(list(kinds))
        ranges, self.question, expression = KINDS[self.kind]
        self.values = {name: rng.choice(values) for name, values in ranges.items()}
        self.expression = expression.format(**self.values)
        self.truth = Calculator()(self.expression)
        self.max_turns, self.values_in_text, self.image_size = max_turns, values_in_text, image_size
        self.system_prompt, self.turns = system_prompt, 0

    def start(self) -> list[Message]:
        text = self.question
        if self.values_in_text:
            text += " Given: " + GIVEN[self.kind].format(**self.values) + "."
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": [{"type": "image", "image": self.picture()},
                                                      {"type": "text", "text": text}]}]

    def reply(self, text: str) -> Reply:
        self.turns += 1
        parsed = parse_content_blocks(text)
        calls = parsed[1] if parsed else []
        if calls:
            response, ok = self._run(calls[0])
            metrics = {"tool_call": 1.0, "tool_error": float(not ok)}
            if self.turns >= self.max_turns:
                return Reply(reward=0.0, done=True, metrics={**metrics, "answered": 0.0, "correct": 0.0})
            # The cookbook's Qwen renderers write a tool message as a user turn wrapped in <tool_response>.
            return Reply(reward=0.0, done=False, metrics=metrics,
                         messages=[{"role": "user", "content": f"<tool_response>\n{response}\n</tool_response>"}])
        answer = _answer(text)
        correct = answer is not None and is_correct(answer, self.truth)
        return Reply(reward=float(correct), done=True,
                     metrics={"tool_call": 0.0, "answered": float(answer is not None), "correct": float(correct)})

    def _run(self, call) -> tuple[str, bool]:
        """The calculator's answer to a tool call, or the error the cookbook's error_tool_result would give."""
        if not isinstance(call, ToolCall) or call.function.name != CALCULATOR["name"]:
            return json.dumps({"error": getattr(call, "error", None) or "unknown tool"}), False
        try:
            return number_text(Calculator()(json.loads(call.function.arguments)["expression"])), True
        except (KeyError, TypeError, ValueError, SyntaxError, ZeroDivisionError, OverflowError) as error:
            return json.dumps({"error": f"{type(error).__name__}: {error}"}), False

    def correct_turns(self) -> list[str]:
        """What a correct solver writes: a calculator call, then the answer."""
        call = json.dumps({"name": CALCULATOR["name"], "arguments": {"expression": self.expression}})
        return [f"<tool_call>\n{call}\n</tool_call>", f"Answer: {number_text(self.truth)}"]

    def picture(self) -> Image.Image:
        size = self.image_size
        image = Image.new("RGB", (size, size), "white")
        draw = ImageDraw.Draw(image)
        font = ImageFont.load_default(size=max(10, size // 14))
        a, b = self.values.get("a"), self.values.get("b")
        if self.kind in ("circle_area", "circumference"):
            centre, radius = size / 2, size * 0.36
            draw.ellipse([centre - radius, centre - radius, centre + radius, centre + radius], outline="black", width=2)
            draw.line([centre, centre, centre + radius, centre], fill="black", width=2)
            draw.text((centre + radius / 2, centre - size / 24), str(a), fill="blue", font=font, anchor="md")
            return image
        if self.kind == "third_angle":
            angle_a, angle_b = math.radians(a), math.radians(b)
            # C where the rays from A (at angle_a) and from B (at pi - angle_b) meet, side AB = 1.
            t = math.sin(angle_b) / math.sin(angle_a + angle_b)
            corners = [(0.0, 0.0), (1.0, 0.0), (t * math.cos(angle_a), t * math.sin(angle_a))]
        else:  # a right angle at B: legs a (base) and b (height)
            corners = [(0.0, 0.0), (float(a), 0.0), (float(a), float(b))]
        points = _fit(corners, size)
        draw.polygon(points, outline="black", width=2)
        for name, (x, y) in zip("ABC", points):
            draw.text((x, y), name, fill="black", font=font, anchor="mm")
        (ax, ay), (bx, by), (cx, cy) = points
        if self.kind == "third_angle":
            draw.text((ax + size / 9, ay - size / 28), f"{a}°", fill="blue", font=font, anchor="mm")
            draw.text((bx - size / 9, by - size / 28), f"{b}°", fill="blue", font=font, anchor="mm")
            draw.text((cx, cy + size / 9), "x", fill="red", font=font, anchor="mm")
        else:
            draw.text(((ax + bx) / 2, ay + size / 24), str(a), fill="blue", font=font, anchor="mm")
            draw.text((bx + size / 24, (by + cy) / 2), str(b), fill="blue", font=font, anchor="mm")
            if self.kind == "hypotenuse":
                draw.text(((ax + cx) / 2 - size / 24, (ay + cy) / 2), "x", fill="red", font=font, anchor="mm")
        return image


def _fit(corners: list[tuple[float, float]], size: int) -> list[tuple[float, float]]:
    """Scale the corners into the picture with a margin, y pointing up."""
    xs, ys = [x for x, _ in corners], [y for _, y in corners]
    scale = 0.7 * size / max(max(xs) - min(xs), max(ys) - min(ys))
    return [(0.15 * size + (x - min(xs)) * scale, 0.85 * size - (y - min(ys)) * scale) for x, y in corners]


def _answer(text: str) -> float | None:
    """The number after the last 'Answer:'."""
    _, found, rest = text.rpartition("Answer:")
    words = rest.split()
    if not found or not words:
        return None
    try:
        return float(words[0].strip(".,;").replace(",", ""))
    except ValueError:
        return None


def text_only_ceiling(kinds: Sequence[str] = tuple(KINDS)) -> Fraction:
    """The best success from the question alone: per kind, the number right for the most problems.

    A guess g is right for truth t when |g - t| <= tolerance(t), so each truth is an interval of right
    guesses; the best guess is the point inside most intervals (a sweep over their ends).
    """
    best = Fraction(0)
    for kind in kinds:
        ranges, _, expression = KINDS[kind]
        names = list(ranges)
        truths = [Calculator()(expression.format(**dict(zip(names, combination))))
                  for combination in itertools.product(*ranges.values())]
        # Opening ends sort before closing ends at the same point: a guess on both is right for both.
        ends = sorted([(t - tolerance(t), 0) for t in truths] + [(t + tolerance(t), 1) for t in truths])
        inside = most = 0
        for _, closing in ends:
            inside += -1 if closing else 1
            most = max(most, inside)
        best += Fraction(most, len(truths)) / len(kinds)
    return best


@functools.cache
def system_prompt(model_dir: str) -> str:
    """SYSTEM followed by the calculator's signature, as the cookbook's Qwen3 renderer writes tools."""
    (message,) = Qwen3Renderer(chat_renderer(model_dir).tokenizer).create_conversation_prefix_with_tools(
        [CALCULATOR], SYSTEM)
    return message["content"]


# -- supervised warm start: correct tool calls and answers ---------------------------------------------


def correct_episode(problem: GeometryProblem, renderer: ChatRenderer) -> Episode:
    """The calculator called with the right expression, then its result as the answer."""
    episode, (call, answer) = Episode(renderer, problem.start()), problem.correct_turns()
    episode.act(renderer.tokenizer.encode(call, add_special_tokens=False) + renderer.stop_tokens)
    episode.observe(problem.reply(call).messages)
    episode.act(renderer.tokenizer.encode(answer, add_special_tokens=False) + renderer.stop_tokens)
    assert problem.reply(answer).reward == 1.0, problem.expression
    return episode


def warm_start_batch(model_dir: str, step: int, batch_size: int, values_in_text: bool = False,
                     image_size: int = 224, seed: int = 0) -> list[types.Datum]:
    """Step `step`'s batch of correct episodes, cross_entropy on the assistant turns only."""
    rng = random.Random(f"warm-start-{seed}-{step}")
    return [d.datum for _ in range(batch_size)
            for d in correct_episode(GeometryProblem(rng.randrange(2**31), values_in_text=values_in_text,
                                                     image_size=image_size, system_prompt=system_prompt(model_dir)),
                                     chat_renderer(model_dir)).training_data(1.0, "cross_entropy")]


# -- the cookbook's RL loop --------------------------------------------------------------------------


@chz.chz
class GeometryDatasetBuilder(RLDatasetBuilder):
    model_dir: str
    batch_size: int = 16
    group_size: int = 8
    num_batches: int = 100
    max_turns: int = 3
    values_in_text: bool = False
    image_size: int = 224
    seed: int = 0

    async def __call__(self) -> tuple[BatchDataset, None]:
        return BatchDataset(self.batch, self.num_batches), None

    def batch(self, index: int) -> list[ConversationGroup]:
        return [ConversationGroup(functools.partial(GeometryProblem, self.seed * 1_000_003 + index * self.batch_size + i,
                                                    max_turns=self.max_turns, values_in_text=self.values_in_text,
                                                    image_size=self.image_size,
                                                    system_prompt=system_prompt(self.model_dir)),
                                  self.group_size, self.model_dir, ("geometry",))
                for i in range(self.batch_size)]


@chz.chz
class CLIConfig(RecipeConfig):
    batch_size: int = 16
    group_size: int = 8
    max_turns: int = 3
    max_tokens: int = 48
    warm_start_batch_size: int = 32
    values_in_text: bool = False
    """Also write the given values into the question (the picture then only repeats them)."""
    image_size: int = 224


def main(cli: CLIConfig) -> None:
    model_dir = cli.model_dir or cli.model_name
    dataset = GeometryDatasetBuilder(model_dir=model_dir, batch_size=cli.batch_size, group_size=cli.group_size,
                                     num_batches=cli.num_batches, max_turns=cli.max_turns,
                                     values_in_text=cli.values_in_text, image_size=cli.image_size)
    recipe.run(cli, chat_renderer(model_dir), "geometry", dataset,
               lambda step: warm_start_batch(model_dir, step, cli.warm_start_batch_size, cli.values_in_text,
                                             cli.image_size))


if __name__ == "__main__":
    main(chz.entrypoint(CLIConfig))
