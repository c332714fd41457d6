"""The examples' tasks without a server: the text-only ceilings, the calculator and the tool-call turns."""

import itertools
import json
from fractions import Fraction

import pytest

from client_compat.examples import geometry
from client_compat.examples.geometry import Calculator, GeometryProblem
from client_compat.examples.grid_walk import (MOVES, GridWalk, _moved, _pairs, random_policy_success,
                                              text_only_ceiling)


def test_the_grid_walks_ceilings_with_hints_are_the_ones_measured_before():
    # 0.53 by dynamic programming over the 72 start/goal pairs, 0.25 at random: the numbers.
    assert text_only_ceiling(3, 4, hints=True) == Fraction(38, 72)
    assert random_policy_success(3, 4) == Fraction(581, 2304)


@pytest.mark.parametrize("size, max_turns", [(2, 2), (3, 3), (3, 4)])
def test_without_hints_the_ceiling_is_the_best_fixed_sequence_of_moves_and_random_is_their_mean(size, max_turns):
    def successes(sequence) -> int:
        count = 0
        for agent, goal in _pairs(size):
            for move in sequence:
                agent = _moved(agent, move, size)
                if agent == goal:
                    count += 1
                    break
        return count

    sequences = list(itertools.product([*MOVES.values(), (0, 0)], repeat=max_turns))
    pairs = len(_pairs(size))
    assert text_only_ceiling(size, max_turns, hints=False) == Fraction(max(map(successes, sequences)), pairs)
    moves_only = [s for s in sequences if (0, 0) not in s]
    assert random_policy_success(size, max_turns) == Fraction(sum(map(successes, moves_only)),
                                                              pairs * len(moves_only))


def test_the_task_without_hints_leaves_text_only_policies_at_a_third():
    assert text_only_ceiling(3, 4, hints=False) == Fraction(25, 72)


def test_following_the_best_moves_always_reaches_the_square_and_the_feedback_tells_nothing():
    for seed in range(40):
        game = GridWalk(seed, hints=False)
        for _ in range(4):
            reply = game.reply(game.best_moves()[0])
            if reply.done:
                break
            assert reply.messages[0]["content"][1]["text"] == "Not there yet. Which way now?"
        assert reply.reward == 1.0


def test_the_calculator_does_arithmetic_and_refuses_anything_else():
    assert Calculator()("sqrt(3**2 + 4**2) * 2 - -1") == 11.0
    assert Calculator()("pi * 2**2") == pytest.approx(12.566370614)
    for expression in ["__import__('os')", "2 ** 1000", "open('x')", "[1]"]:
        with pytest.raises(ValueError):
            Calculator()(expression)


def test_a_tool_call_gets_the_result_and_the_answer_gets_the_reward():
    problem = GeometryProblem(seed=1, max_turns=3)
    call, answer = problem.correct_turns()
    reply = problem.reply(call)
    assert not reply.done and reply.metrics == {"tool_call": 1.0, "tool_error": 0.0}
    result = float(reply.messages[0]["content"].removeprefix("<tool_response>\n").removesuffix("\n</tool_response>"))
    assert result == pytest.approx(problem.truth, abs=1e-4)
    assert problem.reply(f"So x is 12. {answer}").reward == 1.0


def test_a_bad_tool_call_gets_an_error_and_the_last_turn_ends_the_episode():
    problem = GeometryProblem(seed=1, max_turns=2)
    reply = problem.reply('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1/0"}}\n</tool_call>')
    assert json.loads(reply.messages[0]["content"].split("\n")[1])["error"].startswith("ZeroDivisionError")
    assert problem.reply("<tool_call>\nnot json\n</tool_call>").done


def test_an_answer_is_right_within_a_percent():
    problem = GeometryProblem(seed=0)  # a circle of radius 7: area 153.938
    assert problem.truth == pytest.approx(153.938, abs=1e-3)
    assert problem.reply("Answer: 154").reward == 1.0
    assert GeometryProblem(seed=0).reply("Answer: 156").reward == 0.0
    assert GeometryProblem(seed=0).reply("I think 154").metrics["answered"] == 0.0


def test_the_geometry_text_only_ceiling_is_the_best_single_guess_per_kind():
    # Third angle: 180 - a - b over a, b in 30..80 by 5; the most common value is 90 (11 of 121 pairs).
    assert geometry.text_only_ceiling(["third_angle"]) == Fraction(11, 121)
    # Circle areas pi r^2, r = 1..12, are all more than 1 % apart: any guess is right for one radius.
    assert geometry.text_only_ceiling(["circle_area"]) == Fraction(1, 12)
    assert geometry.text_only_ceiling() < Fraction(1, 10)
