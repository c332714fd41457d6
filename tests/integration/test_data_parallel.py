"""Data-parallel training (`--gpus 2`, here two CPU processes over gloo) gives the same losses, logprobs
and adapter as one training process: the FSDP2 path is the same code at every world size."""

import numpy as np
import pytest
from safetensors.torch import load_file
from tinker import types

from live_server import start_server
from sdk_helpers import forward_logprobs
from vision_sdk_helpers import ImagePrompts, noise

BASE_MODEL = "builtin:tiny-qwen2-vl"
ADAM = types.AdamParams(learning_rate=3e-3, weight_decay=0.01, grad_clip_norm=1.0)


def _train(server, data_of) -> dict:
    """Three steps on a mixed batch, one on a single datum (one rank idles), then what the run holds."""
    service = server.service_client()
    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=5).result()
    prompts = ImagePrompts(tc)
    data = data_of(prompts)
    losses = []
    for _ in range(3):
        losses.append(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(ADAM).result()
    single = tc.forward_backward(data[:1], "cross_entropy").result()
    metrics = tc.optim_step(ADAM).result().metrics
    path = tc.save_state("after").result().path
    run_id, _, name = path.removeprefix("tinker://").split("/")
    adapter = load_file(server.data_dir / "checkpoints" / run_id / "weights" / name / "adapter_model.safetensors")
    return {"losses": losses + [single.metrics["loss:sum"]], "grad_norm": metrics["grad_norm:mean"],
            "logprobs": forward_logprobs(tc, data), "adapter": adapter}


@pytest.fixture(scope="module")
def runs(models_dir, tmp_path_factory):
    def data_of(prompts: ImagePrompts) -> list[types.Datum]:
        return [prompts.datum(prompts.user_turn([noise(90, 60, seed=1)], "What is it?"), "noise"),
                prompts.datum(prompts.user_turn([], "Say something long enough to be the longest datum here."),
                              "Something long."),
                prompts.datum(prompts.user_turn([noise(64, 64, seed=2), noise(40, 120, seed=3)], "Two?"), "yes"),
                prompts.datum(prompts.user_turn([], "Hi."), "Hello."),
                prompts.datum(prompts.user_turn([noise(100, 100, seed=4)], "And this?"), "more noise")]

    results = {}
    for world_size in (1, 2):
        data_dir = tmp_path_factory.mktemp(f"world-{world_size}")
        server = start_server(data_dir, f"sqlite:///{data_dir}/server.db", models_dir, "--gpus", str(world_size),
                              base_model=BASE_MODEL)
        try:
            results[world_size] = _train(server, data_of)
        finally:
            server.stop()
    return results


def test_two_ranks_give_the_same_losses_and_logprobs_as_one(runs):
    one, two = runs[1], runs[2]
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    for a, b in zip(two["logprobs"], one["logprobs"]):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert one["losses"][2] < one["losses"][0]


def test_two_ranks_train_the_same_adapter_as_one(runs):
    one, two = runs[1]["adapter"], runs[2]["adapter"]
    assert one.keys() == two.keys()
    for name in one:
        np.testing.assert_allclose(two[name].numpy(), one[name].numpy(), atol=1e-6, rtol=1e-4, err_msg=name)
    assert max(float(t.abs().max()) for name, t in one.items() if "lora_B" in name) > 1e-3
