"""The multi-turn rollout helper, golden, with the real tokenizers and chat templates of the built-in families.

Expected token sequences are written out by hand from the templates' text (not by the helper's own
rendering), and checked against the template's full render where the template has the extension
property; the cookbook's own trajectory_to_data must build the same datum from the Env's transitions.
"""

import asyncio

import numpy as np
import pytest
from PIL import Image
from tinker import types
from tinker_cookbook.completers import TokensWithLogprobs
from tinker_cookbook.rl.data_processing import trajectory_to_data
from tinker_cookbook.rl.types import Trajectory, Transition

from client_compat.chat import ChatRenderer
from client_compat.env import ConversationEnv, Reply
from client_compat.rollout import Episode, discounted_returns
from server.models.builtin import ensure_builtin_model

VISION_FAMILIES = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe"]
DEFAULT_SYSTEM = {"tiny-qwen2-vl": True, "tiny-qwen2.5-vl": True, "tiny-qwen3-vl": False, "tiny-qwen3-vl-moe": False}
RED = Image.new("RGB", (84, 56), (220, 30, 30))
BLUE = Image.new("RGB", (40, 90), (30, 30, 220))


def renderer_for(models_dir, family: str, **kwargs) -> ChatRenderer:
    return ChatRenderer.from_model_dir(ensure_builtin_model(family, models_dir), **kwargs)


def user(*parts) -> dict:
    return {"role": "user", "content": [{"type": "image", "image": p} if isinstance(p, Image.Image)
                                        else {"type": "text", "text": p} for p in parts]}


def expected_chunks(renderer: ChatRenderer, pieces: list) -> list:
    """Text pieces tokenised on their own (every seam is at a special token) and image chunks in between."""
    chunks = []
    for piece in pieces:
        if isinstance(piece, str):
            chunks.append(types.EncodedTextChunk(tokens=renderer.tokenizer.encode(piece)))
        else:
            chunks.append(renderer.image_chunk(piece))
    return chunks


def flat(model_input: types.ModelInput) -> list:
    """Tokens, and ("image", bytes, expected_tokens) for image chunks: one comparable list."""
    return [element for chunk in model_input.chunks for element in (
        chunk.tokens if isinstance(chunk, types.EncodedTextChunk) else [("image", chunk.data, chunk.expected_tokens)])]


def three_turn_episode(renderer: ChatRenderer) -> tuple[Episode, list[list[int]]]:
    """Turn 1 sees RED, turn 2's observation brings BLUE, turn 3's is text only; every action ends on <|im_end|>."""
    encode, im_end = renderer.tokenizer.encode, renderer.stop_tokens[0]
    actions = [encode("left") + [im_end], encode("up up") + [im_end], encode("right") + [im_end]]
    episode = Episode(renderer, [user(RED, "Where is the red square?")])
    for turn, (action, observation) in enumerate(zip(actions, [[user("No. Look again:", BLUE)],
                                                               [user("Last try.")], None])):
        episode.act(action, [-0.5 - turn] * len(action), "stop", f"seq-{turn}")
        if observation is not None:
            episode.observe(observation)
    return episode, actions


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_a_three_turn_two_image_episode_has_the_templates_exact_tokens_and_masks(models_dir, family):
    renderer = renderer_for(models_dir, family)
    episode, actions = three_turn_episode(renderer)

    (rollout,) = episode.training_data(np.array([1.0, -2.0, 0.5]), "gspo")

    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" if DEFAULT_SYSTEM[family] else ""
    expected = flat(types.ModelInput(chunks=expected_chunks(renderer, [
        system + "<|im_start|>user\n<|vision_start|>", RED,
        "<|vision_end|>Where is the red square?<|im_end|>\n<|im_start|>assistant\nleft<|im_end|>"
        "\n<|im_start|>user\nNo. Look again:<|vision_start|>", BLUE,
        "<|vision_end|><|im_end|>\n<|im_start|>assistant\nup up<|im_end|>"
        "\n<|im_start|>user\nLast try.<|im_end|>\n<|im_start|>assistant\nright<|im_end|>"])))
    datum = rollout.datum
    assert flat(datum.model_input) == expected[:-1]
    assert episode.metrics == {"tito/bridged": 2, "tito/fell_back": 0, "tito/end_of_turn_repaired": 0}
    # These templates have the extension property: the full render of the conversation is the same.
    conversation = [user(RED, "Where is the red square?"), {"role": "assistant", "content": "left"},
                    user("No. Look again:", BLUE), {"role": "assistant", "content": "up up"}, user("Last try."),
                    {"role": "assistant", "content": "right"}]
    assert flat(types.ModelInput(chunks=renderer.render(conversation, generation_prompt=False))) == expected + \
        renderer.tokenizer.encode("\n")

    # Targets: the sequence shifted by one, 0 at image positions; the masks are exactly the actions.
    positions = [token for element in expected for token in
                 ([element] if isinstance(element, int) else [0] * element[2])]
    targets = datum.loss_fn_inputs["target_tokens"].to_numpy()
    np.testing.assert_array_equal(targets, positions[1:])
    mask = datum.loss_fn_inputs["sequence_ratio_mask"].to_numpy()
    advantages = datum.loss_fn_inputs["advantages"].to_numpy()
    logprobs = datum.loss_fn_inputs["logprobs"].to_numpy()
    sampled = np.flatnonzero(mask)
    assert len(sampled) == sum(map(len, actions))
    np.testing.assert_array_equal(targets[sampled], np.concatenate(actions))
    np.testing.assert_array_equal(advantages[sampled], np.repeat([1.0, -2.0, 0.5], list(map(len, actions))))
    np.testing.assert_array_equal(logprobs[sampled], np.repeat([-0.5, -1.5, -2.5], list(map(len, actions))))
    assert (advantages[mask == 0] == 0).all() and (logprobs[mask == 0] == 0).all()
    assert rollout.after_image[sampled].all()  # every action has an image in its context
    # Provenance: each observation is a prompt span of its turn's request at the running offset.
    starts = [0] + [int(i) + 1 for i in np.flatnonzero(np.diff(sampled) > 1)]
    first_action = [int(sampled[s]) + 1 for s in starts]  # sequence positions of each action's first token
    assert datum.loss_fn_input_spans == [
        types.PromptProvenanceSpan(sequence_id="seq-0", offset=1, length=first_action[0] - 1),
        types.SampledProvenanceSpan(sequence_id="seq-0", length=len(actions[0])),
        types.PromptProvenanceSpan(sequence_id="seq-1", offset=first_action[0] + len(actions[0]),
                                   length=first_action[1] - first_action[0] - len(actions[0])),
        types.SampledProvenanceSpan(sequence_id="seq-1", length=len(actions[1])),
        types.PromptProvenanceSpan(sequence_id="seq-2", offset=first_action[1] + len(actions[1]),
                                   length=first_action[2] - first_action[1] - len(actions[1])),
        types.SampledProvenanceSpan(sequence_id="seq-2", length=len(actions[2]))]
    assert datum.model_input_spans[-1] == types.SampledProvenanceSpan(sequence_id="seq-2", length=len(actions[2]) - 1)


class Scripted:
    """A Conversation that answers every turn with the next scripted reply."""

    def __init__(self, first: list, replies: list[Reply]):
        self.first, self.replies = first, list(replies)

    def start(self):
        return self.first

    def reply(self, text):
        return self.replies.pop(0)


def test_an_observation_whose_wording_came_before_is_not_tokenised_again(models_dir, monkeypatch):
    renderer = renderer_for(models_dir, "tiny-qwen2-vl")
    first = renderer.bridge([user("Closer.", RED)])
    calls = []
    original = renderer.tokenizer.encode
    monkeypatch.setattr(renderer.tokenizer, "encode", lambda *a, **k: calls.append(a) or original(*a, **k))
    again = renderer.bridge([user("Closer.", BLUE)])  # the same words, another picture
    assert calls == []
    assert flat(types.ModelInput(chunks=again)) == flat(types.ModelInput(chunks=first[:1] + [
        renderer.image_chunk(BLUE)] + first[2:]))
    renderer.bridge([user("Not closer.", RED)])
    assert calls  # new wording is tokenised


def test_the_remembered_wordings_are_bounded(models_dir, monkeypatch):
    monkeypatch.setattr("client_compat.chat.RECENT_TEXTS", 3)
    renderer = renderer_for(models_dir, "tiny-qwen2-vl")
    for index in range(10):
        assert renderer.bridge([user(f"Step {index}.")]) is not None
    assert len(renderer._bridges) == 3


def test_the_cookbooks_trajectory_to_data_builds_the_same_single_datum_from_the_env(models_dir):
    renderer = renderer_for(models_dir, "tiny-qwen2-vl")
    encode, im_end = renderer.tokenizer.encode, renderer.stop_tokens[0]
    env = ConversationEnv(Scripted([user(RED, "Where?")], [Reply(0.0, False, [user("Again:", BLUE)]),
                                                             Reply(1.0, True)]), renderer)
    actions = [encode("left") + [im_end], encode("up")]  # the second stopped on length: no <|im_end|>

    async def run() -> list[Transition]:
        observation, stop = await env.initial_observation()
        assert stop == renderer.stop_tokens
        transitions = []
        for turn, (action, reason) in enumerate(zip(actions, ["stop", "length"])):
            step = await env.step(action, extra={"stop_reason": reason})
            transitions.append(Transition(ob=observation, ac=TokensWithLogprobs(action, [-1.0] * len(action),
                                                                                reason, f"seq-{turn}"),
                                          reward=step.reward, episode_done=step.episode_done, metrics=step.metrics))
            observation = step.next_observation
        return transitions

    transitions = asyncio.run(run())
    assert transitions[0].metrics == {"tito/fell_back": 0.0, "tito/end_of_turn_repaired": 0.0}
    (cookbook,) = trajectory_to_data(Trajectory(transitions, types.ModelInput.empty()), 0.25)
    # The env's episode holds the same turns (with their sequence ids) as the trajectory.
    for turn, transition in zip(env.episode.turns, transitions):
        turn.logprobs, turn.sequence_id = transition.ac.logprobs, transition.ac.sequence_id
    (ours,) = env.episode.training_data(0.25, "importance_sampling")
    assert flat(ours.datum.model_input) == flat(cookbook.model_input)
    for name in ("target_tokens", "logprobs", "advantages"):
        np.testing.assert_array_equal(ours.datum.loss_fn_inputs[name].to_numpy(),
                                      cookbook.loss_fn_inputs[name].to_numpy(), err_msg=name)
    np.testing.assert_array_equal(ours.action_mask, cookbook.loss_fn_inputs["mask"].to_numpy() != 0)
    assert ours.datum.model_input_spans == cookbook.model_input_spans
    assert ours.datum.loss_fn_input_spans == cookbook.loss_fn_input_spans


def test_a_stop_string_gets_the_whole_end_of_turn_appended_a_stop_token_only_the_rest(models_dir):
    renderer = renderer_for(models_dir, "tiny-qwen3-vl")
    encode, (im_end, newline) = renderer.tokenizer.encode, renderer.end_of_turn
    next_turn = encode("<|im_start|>user\nAnd now?<|im_end|>\n<|im_start|>assistant\n")
    for action, reason, appended, repaired in [(encode("left") + [im_end], "stop", [newline], 0),
                                               (encode("left </answer>"), "stop", [im_end, newline], 1),
                                               (encode("left and then"), "length", [im_end, newline], 1)]:
        episode = Episode(renderer, [user(RED, "Where?")])
        before = flat(episode.observation)
        episode.act(action, stop_reason=reason)
        assert flat(episode.observe([user("And now?")])) == before + action + appended + next_turn
        assert episode.metrics["tito/end_of_turn_repaired"] == repaired
    assert renderer.stop_tokens == [im_end] and renderer.decode(encode("left") + [im_end]) == "left"


def test_a_template_that_strips_earlier_reasoning_keeps_the_episode_one_datum(models_dir):
    renderer = renderer_for(models_dir, "tiny-qwen3")
    encode, im_end = renderer.tokenizer.encode, renderer.stop_tokens[0]
    thought = encode("<think>\nTwo and two.\n</think>\n\nfour") + [im_end]
    episode = Episode(renderer, [{"role": "user", "content": "Two plus two?"}])
    first_prompt = flat(episode.observation)
    episode.act(thought, sequence_id="seq-0")
    second_prompt = flat(episode.observe([{"role": "user", "content": "Sure?"}]))
    episode.act(encode("yes") + [im_end], sequence_id="seq-1")

    # The template's own render of the history drops the reasoning: not an extension of what was sampled.
    rerendered = flat(types.ModelInput(chunks=renderer.render([
        {"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": renderer.decode(thought)},
        {"role": "user", "content": "Sure?"}])))
    assert rerendered[:len(first_prompt) + len(thought)] != first_prompt + thought
    # The episode appended instead: the reasoning stays, and the episode is one datum.
    assert second_prompt[:len(first_prompt) + len(thought)] == first_prompt + thought
    assert episode.metrics["tito/fell_back"] == 0
    assert len(episode.training_data(1.0, "stable_reinforce")) == 1


def test_a_template_that_rewrites_history_falls_back_to_a_new_datum_and_counts_it(models_dir):
    renderer = renderer_for(models_dir, "tiny-qwen3")
    # A template that numbers the conversation in its first line: every new message changes the start.
    renderer.tokenizer.chat_template = ("{{ 'Messages: ' + (messages | length | string) + '\\n' }}"
                                        + renderer.tokenizer.chat_template)
    encode, im_end = renderer.tokenizer.encode, renderer.stop_tokens[0]
    episode = Episode(renderer, [{"role": "user", "content": "Hi"}])
    episode.act(encode("hello") + [im_end], sequence_id="seq-0")
    observation = episode.observe([{"role": "user", "content": "Bye"}])
    episode.act(encode("bye") + [im_end], sequence_id="seq-1")

    assert episode.metrics == {"tito/bridged": 0, "tito/fell_back": 1, "tito/end_of_turn_repaired": 0}
    assert renderer.tokenizer.decode(flat(observation)).startswith("Messages: 3\n")
    first, second = episode.training_data(1.0, "stable_reinforce")
    assert {s.sequence_id for s in first.datum.loss_fn_input_spans} == {"seq-0"}
    assert {s.sequence_id for s in second.datum.loss_fn_input_spans} == {"seq-1"}


def test_an_empty_generation_trains_nothing_and_breaks_no_slice(models_dir):
    renderer = renderer_for(models_dir, "tiny-qwen2.5-vl")
    encode, im_end = renderer.tokenizer.encode, renderer.stop_tokens[0]
    only_empty = Episode(renderer, [user(RED, "Where?")])
    only_empty.act([], [], "length", "seq-0")
    assert only_empty.training_data(1.0, "stable_reinforce") == []

    episode = Episode(renderer, [user(RED, "Where?")])
    episode.act([], [], "length", "seq-0")
    episode.observe([user("Answer, please.")])
    episode.act(encode("left") + [im_end], [-1.0, -2.0], "stop", "seq-1")
    (rollout,) = episode.training_data([5.0, 1.0], "stable_reinforce")
    advantages = rollout.datum.loss_fn_inputs["advantages"].to_numpy()
    assert rollout.action_mask.sum() == 2 and (advantages[rollout.action_mask] == 1.0).all()
    assert (advantages[~rollout.action_mask] == 0).all()
    # The empty turn has a prompt span and no sampled span; the repaired end of turn is in seq-1's prompt.
    assert [type(s).__name__ for s in rollout.datum.loss_fn_input_spans] == [
        "PromptProvenanceSpan", "PromptProvenanceSpan", "SampledProvenanceSpan"]


def test_more_than_eight_images_with_a_repeated_one_count_in_every_length(models_dir):
    renderer = renderer_for(models_dir, "tiny-qwen2-vl")
    encode, im_end = renderer.tokenizer.encode, renderer.stop_tokens[0]
    pictures = [Image.new("RGB", (28 * (1 + i % 3), 56), (20 * i, 100, 50)) for i in range(9)] + [RED]
    episode = Episode(renderer, [user(RED, "Start.")])
    for index, picture in enumerate(pictures):
        episode.act(encode(f"move {index}") + [im_end], sequence_id=f"seq-{index}")
        episode.observe([user(f"Turn {index}:", picture)])
    episode.act(encode("done") + [im_end], sequence_id="seq-final")

    images = [c for c in episode.observation.chunks if isinstance(c, types.ImageChunk)]
    assert len(images) == 11
    assert images[0] is images[-1]  # the repeated picture is the very same chunk, so the same bytes
    text = sum(len(c.tokens) for c in episode.observation.chunks if isinstance(c, types.EncodedTextChunk))
    assert episode.num_tokens == text + sum(c.expected_tokens for c in images) == episode.observation.length
    assert all(c.expected_tokens == renderer.chunker.num_tokens(*p.size) for c, p in zip(images, [RED, *pictures]))
    (rollout,) = episode.training_data(discounted_returns([0.0] * 10 + [1.0], 0.9), "importance_sampling")
    assert rollout.datum.model_input.length == episode.num_tokens - 1
    advantages = rollout.datum.loss_fn_inputs["advantages"].to_numpy()
    assert advantages[rollout.action_mask][0] == pytest.approx(0.9 ** 10)
    assert advantages[rollout.action_mask][-1] == 1.0
    assert episode.metrics["tito/fell_back"] == 0 and episode.metrics["tito/bridged"] == 10


def test_the_helper_refuses_to_act_twice_or_observe_before_acting(models_dir):
    renderer = renderer_for(models_dir, "tiny-qwen3")
    episode = Episode(renderer, [{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="observe\\(\\) follows act\\(\\)"):
        episode.observe([{"role": "user", "content": "again"}])
    episode.act([1, 2])
    with pytest.raises(ValueError, match="already has its action"):
        episode.act([3])
    with pytest.raises(ValueError, match="2 advantages for 1 turns"):
        episode.training_data([1.0, 2.0], "ppo")
