"""Training the same run with one and with two training ranks, through the SDK, for comparison."""

from safetensors.torch import load_file
from tinker import types

from support.live_server import start_server
from support.sdk import forward_logprobs
from support.vision_sdk import ImagePrompts, noise

BASE_MODEL = "builtin:tiny-qwen2-vl"
ADAM = types.AdamParams(learning_rate=3e-3, weight_decay=0.01, grad_clip_norm=1.0)


def mixed_batch(prompts: ImagePrompts) -> list[types.Datum]:
    """Datums of different lengths, with none, one and two images."""
    return [prompts.datum(prompts.user_turn([noise(90, 60, seed=1)], "What is it?"), "noise"),
            prompts.datum(prompts.user_turn([], "Say something long enough to be the longest datum here."),
                          "Something long."),
            prompts.datum(prompts.user_turn([noise(64, 64, seed=2), noise(40, 120, seed=3)], "Two?"), "yes"),
            prompts.datum(prompts.user_turn([], "Hi."), "Hello."),
            prompts.datum(prompts.user_turn([noise(100, 100, seed=4)], "And this?"), "more noise")]


def train(server) -> dict:
    """Three steps on a mixed batch, one on a single datum (one rank idles), then what the run holds."""
    service = server.service_client()
    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=5).result()
    prompts = ImagePrompts(tc)
    data = mixed_batch(prompts)
    losses = []
    for _ in range(3):
        losses.append(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(ADAM).result()
    single = tc.forward_backward(data[:1], "cross_entropy").result()
    metrics = tc.optim_step(ADAM).result().metrics
    path = tc.save_state("after").result().path
    run_id, _, name = path.removeprefix("tinker://").split("/")
    (version,) = (server.data_dir / "checkpoints" / run_id / "weights" / name).glob("v-*")
    adapter = load_file(version / "adapter_model.safetensors")
    return {"losses": losses + [single.metrics["loss:sum"]], "grad_norm": metrics["grad_norm:mean"],
            "logprobs": forward_logprobs(tc, data), "adapter": adapter}


def train_with_one_and_two_ranks(models_dir, tmp_path_factory, *extra_args: str) -> dict[int, dict]:
    results = {}
    for world_size in (1, 2):
        data_dir = tmp_path_factory.mktemp(f"world-{world_size}")
        server = start_server(data_dir, f"sqlite:///{data_dir}/server.db", models_dir, "--gpus", str(world_size),
                              *extra_args, base_model=BASE_MODEL)
        try:
            results[world_size] = train(server)
        finally:
            server.stop()
    return results
