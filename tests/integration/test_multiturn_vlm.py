"""Multi-turn vision-language RL against a live server on the built-in tiny Qwen2-VL: the grid-walk example
trained by the cookbook's RL loop (as its README section runs it) and by the bare SDK, a long episode
with many images, and an image token count the server disagrees with; and the grid walk on the tiny
Qwen3.5-MoE (hybrid linear attention, routed experts). The CI-sized runs of benchmarks/visual_rl.py:
the grid walk without hints and the geometry task, each a warm start then the cookbook's loop from its
saved state (the plumbing, not the curve)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from client_compat.chat import ChatRenderer
from client_compat.examples import geometry, grid_walk
from client_compat.examples.grid_walk import GridWalk, sdk_loop
from client_compat.rollout import Episode, ImageTokensMismatch
from server.models.builtin import ensure_builtin_model
from support.live_server import REPO_ROOT, LiveServer, start_server

MODEL = "builtin:tiny-qwen2-vl"
HYBRID_MODEL = "builtin:tiny-qwen3.5-moe"


@pytest.fixture(scope="module")
def vlm_server(models_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    live = start_server(tmp_path_factory.mktemp("multiturn-vlm"), None, models_dir, base_model=MODEL)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(vlm_server: LiveServer):
    with vlm_server.service_client() as service_client:
        yield service_client


def run_grid_walk(server: LiveServer, model: str, models_dir: Path, log: Path, steps: int = 2) -> list[dict]:
    """The grid-walk example through the cookbook's RL loop, as its README section runs it; its RL steps' metrics."""
    env = dict(os.environ, TINKER_API_KEY=server.api_key, TINKER_TELEMETRY="0", PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "client_compat.examples.grid_walk", f"model_name={model}",
         f"model_dir={ensure_builtin_model(model.removeprefix('builtin:'), models_dir)}", f"base_url={server.url}",
         f"log_path={log}", "batch_size=2", "group_size=2", "max_turns=3", "max_tokens=6", f"max_steps={steps}",
         "learning_rate=1e-3"],
        cwd=log.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 0, f"{done.stdout[-6000:]}\n--- server log ---\n{server.log()}"
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    measured = [row for row in rows if "env/all/turns_per_episode" in row]
    assert len(measured) == steps
    for row in measured:
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
        assert row["env/all/total_episodes"] == 4 and row["env/all/turns_per_episode"] > 1
    return measured


def test_the_grid_walk_example_trains_with_the_cookbooks_rl_loop(vlm_server, models_dir, tmp_path):
    steps = run_grid_walk(vlm_server, MODEL, models_dir, tmp_path / "grid_walk")
    for row in steps:
        assert row["env/all/tito/fell_back"] == 0.0
        # One datum per episode trains fewer tokens than the prompts of all turns hold together; a datum
        # per turn (the cookbook's fallback when an observation does not extend the last one) trains more.
        assert row["tokens/trained"] < row["env/all/total_ob_tokens"]
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-3  # stable_reinforce on sampler-recorded sequences
    # A turn's prompt is the last one, its completion and a new observation: the engine ran only what was new.
    cached = vlm_server.metric("tinker_tokens_total", kind="prompt_cached")
    computed = vlm_server.metric("tinker_tokens_total", kind="prompt_computed")
    assert cached > 0, (cached, computed)


def test_the_grid_walk_example_trains_on_the_bare_sdk_one_datum_per_episode(client):
    history = sdk_loop(client, MODEL, steps=2, group_size=2, max_turns=3, max_tokens=6, learning_rate=1e-3)
    for metrics in history:
        assert metrics["datums_per_episode"] == 1.0 and metrics["turns_per_episode"] > 1
        assert metrics["tito/fell_back"] == 0 and metrics["tito/bridged"] > 0
        assert all(math.isfinite(v) for v in metrics.values())
        assert metrics["sampled_tokens:sum"] == metrics["logprob_gap/after_image/tokens"] > 0
        assert metrics["sampler_logprobs_mismatched:sum"] == 0
        # Sampled from these weights: the trainer scores the actions as the sampler did.
        assert metrics["logprob_gap/after_image/max"] < 1e-3


def test_a_long_episode_with_eleven_images_samples_and_trains_as_one_datum(client):
    training = client.create_lora_training_client(base_model=MODEL, rank=4).result()
    renderer = ChatRenderer.from_model_dir(training.get_info().model_data.tokenizer_id)
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    game = GridWalk(seed=3, max_turns=11)
    episode = Episode(renderer, game.start())
    for turn in range(11):
        sampled = episode.sample(sampler, max_tokens=3)
        reply = game.reply("sideways")  # never a move: the feedback and a new picture every turn
        if turn < 10:
            episode.observe(reply.messages)
    images = [c for c in episode.observation.chunks if c.type == "image"]
    assert len(images) == 11 and episode.metrics["tito/fell_back"] == 0
    assert sampled.sequence_id

    (rollout,) = episode.training_data(1.0, "stable_reinforce")
    out = training.forward_backward([rollout.datum], "stable_reinforce").result()
    assert out.metrics["sampled_tokens:sum"] == rollout.action_mask.sum()
    assert out.metrics["importance_ratio:max"] == pytest.approx(1.0, abs=1e-3)


def test_an_image_token_count_the_server_disagrees_with_is_surfaced_clearly(client, models_dir):
    training = client.create_lora_training_client(base_model=MODEL, rank=4).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    # Qwen3-VL's processor (patch 16, at least 64 tokens) instead of the served Qwen2-VL's.
    wrong = ChatRenderer.from_model_dir(ensure_builtin_model("tiny-qwen3-vl", models_dir))
    episode = Episode(wrong, [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (56, 56))},
                                                           {"type": "text", "text": "What is it?"}]}])
    with pytest.raises(ImageTokensMismatch, match=r"Expected 64 tokens, got 4 from image.*tokenizer_id"):
        episode.sample(sampler, max_tokens=2)


def test_the_grid_walk_trains_a_hybrid_moe_vlm_with_pictures_in_later_turns(models_dir, tmp_path):
    # Qwen3.5 / Qwen3.6's layout: linear-attention layers, routed experts. Its template writes an earlier
    # turn without the think block its prompt opened, so most turns become datums of their own.
    live = start_server(tmp_path / "server", None, models_dir, base_model=HYBRID_MODEL)
    try:
        steps = run_grid_walk(live, HYBRID_MODEL, models_dir, tmp_path / "grid_walk", steps=1)
    finally:
        live.stop()
    for row in steps:
        assert row["tokens/trained"] > 0 and row["env/all/total_turns"] > row["env/all/total_episodes"]
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-3  # the sampler's and the trainer's logprobs agree


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_grid_walk_without_hints_warm_starts_then_trains_from_the_saved_state(vlm_server, models_dir, tmp_path,
                                                                                  monkeypatch):
    model_dir = str(ensure_builtin_model("tiny-qwen2-vl", models_dir))
    # The curriculum: a 2 x 2 grid (56 x 56 pixels, 4 image tokens) first, then 3 x 3 (9 tokens).
    renderer = grid_walk.chat_renderer(model_dir)
    for step, tokens in [(0, 4), (1, 9)]:
        (datum,) = grid_walk.warm_start_batch(renderer, step, 1, hints=False, small_grids=1)
        assert datum.model_input.chunks[1].expected_tokens == tokens

    monkeypatch.setenv("TINKER_API_KEY", vlm_server.api_key)
    log = tmp_path / "walk"
    grid_walk.main(grid_walk.CLIConfig(
        model_name=MODEL, model_dir=model_dir, base_url=vlm_server.url, log_path=str(log), hints=False,
        small_grids=1, warm_start_steps=2, warm_start_batch_size=2, batch_size=2, group_size=2, max_turns=3,
        max_tokens=4, max_steps=1))
    warm = read_rows(log / "warm_start.jsonl")
    assert len(warm) == 2 and all(math.isfinite(row["nll"]) and row["nll"] > 0 for row in warm)
    (row,) = [row for row in read_rows(log / "metrics.jsonl") if "env/all/total_episodes" in row]
    assert row["env/all/total_episodes"] == 4 and row["env/all/tito/fell_back"] == 0.0
    assert "Loaded weights from tinker://" in (log / "logs.log").read_text()


def test_the_geometry_task_warm_starts_on_tool_calls_then_trains_with_the_cookbooks_loop(
        vlm_server, client, models_dir, tmp_path, monkeypatch):
    model_dir = str(ensure_builtin_model("tiny-qwen2-vl", models_dir))
    # A turn after the calculator's answer is sampled on the same token sequence (one datum per episode).
    training = client.create_lora_training_client(base_model=MODEL, rank=4).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    renderer = geometry.chat_renderer(model_dir)
    problem = geometry.GeometryProblem(seed=2, image_size=56, system_prompt=geometry.system_prompt(model_dir))
    call, _ = problem.correct_turns()
    episode = Episode(renderer, problem.start())
    episode.act(renderer.tokenizer.encode(call, add_special_tokens=False) + renderer.stop_tokens)
    episode.observe(problem.reply(call).messages)
    episode.sample(sampler, max_tokens=3)
    assert episode.metrics["tito/bridged"] == 1 and episode.metrics["tito/fell_back"] == 0
    assert len(episode.training_data(1.0, "cross_entropy")) == 1

    monkeypatch.setenv("TINKER_API_KEY", vlm_server.api_key)
    log = tmp_path / "geometry"
    geometry.main(geometry.CLIConfig(
        model_name=MODEL, model_dir=model_dir, base_url=vlm_server.url, log_path=str(log), image_size=56,
        warm_start_steps=1, warm_start_batch_size=2, batch_size=2, group_size=2, max_tokens=8, max_steps=1))
    (warm,) = read_rows(log / "warm_start.jsonl")
    assert math.isfinite(warm["nll"]) and warm["nll"] > 0
    (row,) = [row for row in read_rows(log / "metrics.jsonl") if "env/all/total_episodes" in row]
    assert row["env/all/total_episodes"] == 4 and math.isfinite(row["optim/kl_sample_train_v1"])
