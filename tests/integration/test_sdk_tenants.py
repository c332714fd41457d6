"""Several tenants training at once through the real SDK, each with its own API key: every run gets
exactly what it gets alone, and a tenant's small steps are not held behind another tenant's long queue.

The server's pass budget is small (40 tokens, about three datums), so the long job spans many passes
and the small steps must share them. Order is read from the server's own metrics (a run's queue
depth), never from wall-clock margins.
"""

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tinker import types

from support.live_server import BASE_MODEL, LiveServer, start_server
from support.sdk import SENTENCES, forward_logprobs, supervised_datum

ADAM = types.AdamParams(learning_rate=5e-3)
PASS_TOKENS = 40
# About 100 passes: the small tenants' few round trips end long before the long job does.
LONG_REQUESTS, LONG_DATUMS = 12, 24
JOURNAL_DEADLINE_SECONDS = 120  # a hang guard, not a margin: on an idle machine it takes well under a second


@pytest.fixture(scope="module")
def server(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_server(tmp_path_factory.mktemp("tenants"), None, models_dir,
                        "--max-tokens-per-pass", str(PASS_TOKENS))
    yield live
    live.stop()


def queue_depth(server: LiveServer, model_id: str) -> float:
    return server.metric("tinker_run_queue_depth", model_id=model_id)


def completed_forward_backwards(server: LiveServer) -> float:
    return server.metric("tinker_request_seconds_count", request_type="ForwardBackward", outcome="complete")


def single_run_passes(server: LiveServer) -> float:
    return server.metric("tinker_training_pass_runs_bucket", le="1.0")


def test_tenants_training_at_once_each_get_what_they_get_alone_and_small_steps_pass_a_long_queue(server):
    keys = {"long": server.api_key, "alice": server.create_key("alice"), "bob": server.create_key("bob")}
    clients = {tenant: server.service_client(key) for tenant, key in keys.items()}
    tokenizer = clients["long"].create_lora_training_client(base_model=BASE_MODEL, rank=4).result().get_tokenizer()
    long_data = [supervised_datum(tokenizer, SENTENCES[i % len(SENTENCES)], weight=1 + i % 3)
                 for i in range(LONG_DATUMS)]
    small_data = {"alice": [supervised_datum(tokenizer, s) for s in SENTENCES[:2]],
                  "bob": [supervised_datum(tokenizer, s, weight=0.5) for s in SENTENCES[3:5]]}
    ranks = {"long": 8, "alice": 4, "bob": 16}

    def new_run(tenant: str):
        return clients[tenant].create_lora_training_client(base_model=BASE_MODEL, rank=ranks[tenant], seed=7)

    def submit_long(run):
        return [run.forward_backward(long_data, "cross_entropy") for _ in range(LONG_REQUESTS)]

    def small_steps(tenant: str, run) -> list[float]:
        futures = []
        for _ in range(2):
            futures += [run.forward_backward(small_data[tenant], "cross_entropy"), run.optim_step(ADAM)]
        return [future.result().metrics["loss:sum"] for future in futures[::2]]

    def check_long(run, futures) -> list[float]:
        losses = [future.result().metrics["loss:sum"] for future in futures]
        run.optim_step(ADAM).result()
        return losses

    # Alone: one run at a time.
    alone = {}
    long_run = new_run("long").result()
    alone["long"] = check_long(long_run, submit_long(long_run)), forward_logprobs(long_run, small_data["alice"])
    for tenant in ("alice", "bob"):
        run = new_run(tenant).result()
        alone[tenant] = small_steps(tenant, run), forward_logprobs(run, small_data[tenant])

    # Together: the long job's whole queue is in before the small tenants start.
    passes_before = server.metric("tinker_training_pass_runs_count")
    single_run_passes_before = single_run_passes(server)
    runs = {tenant: new_run(tenant).result() for tenant in keys}
    completed_before = completed_forward_backwards(server)
    long_futures = submit_long(runs["long"])
    deadline = time.monotonic() + JOURNAL_DEADLINE_SECONDS
    while (queue_depth(server, runs["long"].model_id) + completed_forward_backwards(server) - completed_before
           < LONG_REQUESTS):  # until every request of the long job is journaled (queued, running or done)
        assert time.monotonic() < deadline, "the long job's requests were never all journaled"
        time.sleep(0.05)
    together = {}

    def small_tenant(tenant: str) -> None:
        together[tenant] = small_steps(tenant, runs[tenant]), forward_logprobs(runs[tenant], small_data[tenant])

    threads = [threading.Thread(target=small_tenant, args=(tenant,)) for tenant in ("alice", "bob")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert together.keys() == {"alice", "bob"}
    # Both small tenants finished their steps while the long job was still queued or running.
    assert queue_depth(server, runs["long"].model_id) >= 1
    together["long"] = check_long(runs["long"], long_futures), forward_logprobs(runs["long"], small_data["alice"])
    # ... so their datums shared passes with the long job's.
    shared = (server.metric("tinker_training_pass_runs_count") - passes_before
              - single_run_passes(server) + single_run_passes_before)
    assert shared >= 2

    for tenant in keys:
        (alone_losses, alone_logprobs), (losses, logprobs) = alone[tenant], together[tenant]
        np.testing.assert_allclose(losses, alone_losses, rtol=1e-5, atol=1e-4, err_msg=tenant)
        for x, y in zip(logprobs, alone_logprobs, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-5, err_msg=tenant)
