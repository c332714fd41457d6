"""Data-parallel training (`--gpus 2`, here two CPU processes over gloo, the frozen base sharded with FSDP2;
and two "nodes" on this host, the server and a torchrun, where `--base-sharding auto` replicates the tiny
base) gives the same losses, logprobs and adapter as one training process, so neither sharding the frozen
base nor replicating it changes anything. A rank that dies, of this node or another, stops the server: the
step it ran fails with the cause, nothing stays pending in the journal."""

import numpy as np
import pytest

from support.data_parallel import BASE_MODEL, mixed_batch, rank_pid, start_ranks, start_two_nodes, train
from support.fault import check_stopped_for_lost_rank, kill_rank_mid_step
from support.live_server import LiveServer
from support.vision_sdk import ImagePrompts


@pytest.fixture(scope="module")
def one_rank(models_dir, tmp_path_factory) -> dict:
    """What one training rank trains."""
    server = start_ranks(models_dir, tmp_path_factory, 1)
    try:
        return train(server)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def two_ranks(one_rank, tmp_path_factory):
    """A server with two training ranks sharing the base with FSDP2, kept for the test that kills one. Its model
    directory starts empty: the ranks find the built-in missing together, one builds it and the other loads it."""
    server = start_ranks(tmp_path_factory.mktemp("models-of-two-ranks"), tmp_path_factory, 2, "--base-sharding",
                         "shard")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def runs(one_rank, two_ranks) -> dict[int, dict]:
    return {1: one_rank, 2: train(two_ranks)}


@pytest.fixture(scope="module")
def two_nodes(one_rank, models_dir, tmp_path_factory):
    nodes = start_two_nodes(tmp_path_factory.mktemp("two-nodes") / "data", models_dir)
    yield nodes
    nodes.server.stop()
    nodes.node.kill()
    nodes.node.wait()


@pytest.fixture(scope="module")
def two_nodes_run(two_nodes) -> dict:
    return train(two_nodes.server)


def _check_same_training(one: dict, two: dict) -> None:
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    for name in ("logprobs", "reloaded", "resumed"):
        for a, b in zip(two[name], one[name]):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_two_ranks_give_the_same_losses_and_logprobs_as_one(runs):
    one, two = runs[1], runs[2]
    _check_same_training(one, two)
    assert one["losses"][2] < one["losses"][0]
    for a, b in zip(one["reloaded"], one["logprobs"]):  # the checkpoint holds the weights it was saved with
        np.testing.assert_allclose(a, b, atol=1e-5)


def _check_same_adapter(one: dict, two: dict) -> None:
    assert one.keys() == two.keys()
    for name in one:
        np.testing.assert_allclose(two[name].numpy(), one[name].numpy(), atol=1e-6, rtol=1e-4, err_msg=name)


def test_two_ranks_train_the_same_adapter_as_one(runs, two_ranks):
    log = two_ranks.log_path.read_text()
    assert "base_sharding=shard" in log
    # The server goes on (to start a sampler, which may be a vLLM colocated with rank 1) once every rank is ready.
    assert log.index("training rank 1 of 2 ready") < log.index("event=model_loaded")
    _check_same_adapter(runs[1]["adapter"], runs[2]["adapter"])
    assert max(float(t.abs().max()) for name, t in runs[1]["adapter"].items() if "lora_B" in name) > 1e-3


def test_two_nodes_joined_by_torchrun_train_as_one_rank_with_no_shared_checkpoint_directory(runs, two_nodes_run):
    """Node 1's data directory is its own: it loads checkpoints from the files rank 0 sends."""
    _check_same_training(runs[1], two_nodes_run)
    _check_same_adapter(runs[1]["adapter"], two_nodes_run["adapter"])


def test_a_replicated_base_trains_as_a_sharded_one_and_auto_replicates_a_base_that_fits(runs, two_nodes,
                                                                                         two_nodes_run):
    """The tiny base takes far less than 35 % of a rank's share of this host's memory: auto replicates it, on
    both nodes (the last step's single datum leaves one rank with no micro-batch at all)."""
    assert "base_sharding=replicate" in two_nodes.server.log_path.read_text()
    _check_same_training(runs[2], two_nodes_run)
    _check_same_adapter(runs[2]["adapter"], two_nodes_run["adapter"])


def _kill_rank_1_mid_step(server: LiveServer, log: str) -> str:
    """Returns the model_id of the run whose step the kill cut short."""
    training = server.service_client().create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=5).result()
    kill_rank_mid_step(server, rank_pid(log, 1), training, mixed_batch(ImagePrompts(training)))
    return training.model_id


def test_a_local_rank_that_dies_mid_step_stops_the_server_and_fails_the_step_with_the_cause(runs, two_ranks):
    model_id = _kill_rank_1_mid_step(two_ranks, two_ranks.log_path.read_text())
    check_stopped_for_lost_rank(two_ranks, 1, model_id)


def test_a_node_whose_rank_dies_mid_step_stops_the_server_and_fails_the_step_with_the_cause(two_nodes_run,
                                                                                           two_nodes):
    model_id = _kill_rank_1_mid_step(two_nodes.server, two_nodes.node_log.read_text())
    check_stopped_for_lost_rank(two_nodes.server, 1, model_id)
    assert two_nodes.node.wait(timeout=120) != 0  # torchrun saw its worker die
