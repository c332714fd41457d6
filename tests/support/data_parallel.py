"""Training the same run with one and with two training ranks (two processes of one node, or two nodes
joined by torchrun on this host), through the SDK, for comparison."""

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.torch import load_file
from tinker import types

from support.live_server import REPO_ROOT, LiveServer, free_port, start_server
from support.sdk import forward_logprobs
from support.vision_sdk import ImagePrompts, noise

BASE_MODEL = "builtin:tiny-qwen2-vl"
CUDA_BF16 = ("--device", "cuda", "--dtype", "bfloat16")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast off, as benchmarks/README.md asks on a machine of several GPUs."""
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
    # A run started from the checkpoint (on every rank) has its weights, and steps with its AdamW moments.
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    reloaded = forward_logprobs(resumed, data)
    resumed.forward_backward(data, "cross_entropy").result()
    resumed.optim_step(ADAM).result()
    return {"losses": losses + [single.metrics["loss:sum"]], "grad_norm": metrics["grad_norm:mean"],
            "logprobs": forward_logprobs(tc, data), "reloaded": reloaded, "resumed": forward_logprobs(resumed, data),
            "adapter": adapter}


def assert_trained_alike_in_bf16(got: dict, want: dict) -> None:
    """`train`'s results of the same run on GPUs within bf16 rounding (test_data_parallel_gpu.py's tolerances)."""
    print("losses", want["losses"], got["losses"])
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=2e-2)
    for name in ("logprobs", "reloaded", "resumed"):
        for a, b in zip(got[name], want[name]):
            np.testing.assert_allclose(a, b, atol=0.1)


def start_ranks(models_dir: Path, tmp_path_factory, world_size: int, *extra_args: str) -> LiveServer:
    """A server with `world_size` training ranks on this node."""
    data_dir = tmp_path_factory.mktemp(f"world-{world_size}")
    return start_server(data_dir, f"sqlite:///{data_dir}/server.db", models_dir, "--gpus", str(world_size),
                        *extra_args, base_model=BASE_MODEL)


def train_with_one_and_two_ranks(models_dir, tmp_path_factory, *extra_args: str) -> dict[int, dict]:
    results = {}
    for world_size in (1, 2):
        server = start_ranks(models_dir, tmp_path_factory, world_size, *extra_args)
        try:
            results[world_size] = train(server)
        finally:
            server.stop()
    return results


@dataclass
class TwoNodes:
    """The server as node 0 (its local ranks first) and torchrun starting node 1's ranks after them."""

    server: LiveServer
    node: subprocess.Popen
    """torchrun on node 1."""
    node_log: Path


def start_two_nodes(data_dir: Path, models_dir: Path, *model_args: str,
                    environments: tuple[dict[str, str], dict[str, str]] = ({}, {}),
                    ranks_per_node: int = 1) -> TwoNodes:
    """Two "nodes" on this host with the README's commands; node 1 has a data directory of its own, sharing
    only the built-in models (the ranks of both nodes find or build them in turn).

    Args:
        model_args: the model flags both nodes get (`--device cuda --dtype bfloat16`).
        environments: more variables for node 0 and node 1 (each its own GPUs).
        ranks_per_node: training ranks of each node (`--gpus` of the server, torchrun's `--nproc-per-node`).
    """
    port = free_port()
    node_dir = data_dir.with_name(f"{data_dir.name}-node-1")
    node_dir.mkdir(parents=True)
    (node_dir / "models").symlink_to(models_dir, target_is_directory=True)
    node_log = node_dir / "torchrun.log"
    node = subprocess.Popen(
        [str(Path(sys.executable).with_name("torchrun")), "--nnodes", "2", "--node-rank", "1",
         "--nproc-per-node", str(ranks_per_node), "--master-addr", "127.0.0.1", "--master-port", str(port),
         "-m", "server.training.workers",
         "--base-model", BASE_MODEL, "--data-dir", str(node_dir), *model_args],
        cwd=REPO_ROOT, env=dict(os.environ, TORCH_ELASTIC_WORKER_IDENTICAL="1", OMP_NUM_THREADS="2",
                                **environments[1]),
        stdout=node_log.open("w"), stderr=subprocess.STDOUT)
    try:
        server = start_server(data_dir, f"sqlite:///{data_dir}/server.db", models_dir, "--gpus", str(ranks_per_node),
                              *model_args, base_model=BASE_MODEL,
                              environment={"WORLD_SIZE": str(2 * ranks_per_node), "MASTER_ADDR": "127.0.0.1",
                                           "MASTER_PORT": str(port), **environments[0]})
    except BaseException:
        node.kill()
        raise
    return TwoNodes(server, node, node_log)


def rank_pid(log: str, rank: int) -> int:
    """The process id of a training rank, from the line it logs once ready."""
    return int(re.search(rf"training rank {rank} of \d+ ready on \S+ \(pid (\d+)\)", log).group(1))
