"""Several vLLM replicas behind one VLLMEngine: requests spread over them, an adapter loaded on each, and a
replica killed mid-burst (its requests go to the other one; it is restarted, loads the adapter again and
serves again), and a request with no replica up fails saying so.

The replicas are the package's qwen2-vl, which the engine's test kills, and a second qwen2-vl reached by its
URL (conftest's QWEN2_VL_REPLICA, as a vLLM run by someone else); greedy, so both sample the same tokens.
"""

import logging
import os
import signal
import time

import httpx
import pytest
from conftest import QWEN2_VL_REPLICA
from hf_reference import write_adapter

from server.errors import EngineUnavailable
from server.sampling.types import AdapterRef, SampleOutput, SamplingOptions, SamplingRequest
from server.sampling.vllm import VLLMEngine
from server.sampling.vllm_process import VLLMEndpoint


@pytest.fixture(scope="module")
def replicas(qwen2_vl, vllm_servers):
    """An engine over the package's qwen2-vl and a second one reached by its URL."""
    second = vllm_servers[QWEN2_VL_REPLICA]
    second.wait_until_ready()
    yield VLLMEngine([qwen2_vl.server, VLLMEndpoint(second.url, second.config)])  # not closed: the package's
    second.close()


@pytest.fixture(scope="module")
def burst(qwen2_vl, tmp_path_factory) -> list[SamplingRequest]:
    """12 greedy prompts, every other one with an adapter."""
    adapter = AdapterRef(name="qwen2-vl-replicas",
                         directory=write_adapter(qwen2_vl.model_dir, tmp_path_factory.mktemp("adapter"), seed=9))
    options = SamplingOptions(max_tokens=8, temperature=0.0)
    return [SamplingRequest(prompt=qwen2_vl.prompt(qwen2_vl.encode(f"<|im_start|>user\nItem {i}<|im_end|>\n")),
                            options=options, adapter=adapter if i % 2 else None) for i in range(12)]


@pytest.fixture(scope="module")
def expected(qwen2_vl, burst) -> list[SampleOutput]:
    """What one replica alone samples."""
    return [qwen2_vl.sampler.sample(request) for request in burst]


def served_requests(url: str) -> float:
    """Requests the vLLM at `url` finished, from its own counter."""
    return sum(float(line.rpartition(" ")[2]) for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines()
               if line.startswith("vllm:request_success_total"))


def adapters_loaded(url: str) -> set[str]:
    return {card["id"] for card in httpx.get(f"{url}/v1/models", timeout=60).json()["data"] if card.get("parent")}


def test_concurrent_requests_are_spread_over_both_replicas_and_adapters_load_on_each(replicas, burst, expected):
    urls = [replica.endpoint.url for replica in replicas.replicas.all]
    before = [served_requests(url) for url in urls]

    got = [future.result() for future in [replicas.submit(request) for request in burst]]

    assert got == expected
    served = [served_requests(url) - previous for url, previous in zip(urls, before)]
    assert all(count >= 2 for count in served) and sum(served) == len(burst), served
    assert all(burst[1].adapter.name in adapters_loaded(url) for url in urls)


def test_a_replica_killed_mid_burst_drops_no_request_and_comes_back(qwen2_vl, replicas, burst, expected, caplog):
    killed = replicas.replicas.all[0]
    old_url, restarts = killed.endpoint.url, killed.endpoint.num_restarts
    caplog.set_level(logging.WARNING, logger="server.sampling.vllm")

    futures = [replicas.submit(request) for request in burst]
    while killed.in_flight == 0 and not all(future.done() for future in futures):  # half go to it
        time.sleep(0.01)
    os.kill(killed.endpoint.pid, signal.SIGKILL)  # the API server; the engine core follows it

    # Each completes on the other replica: none is lost or left pending.
    assert [future.result() for future in futures] == expected
    assert any("event=vllm_request_dropped replica=0" in record.getMessage() for record in caplog.records)
    # The supervisor restarts it. An engine with no other replica waits for that, then loads the adapter again.
    assert qwen2_vl.sampler.sample(burst[1]) == expected[1]
    assert killed.endpoint.num_restarts == restarts + 1 and killed.endpoint.url != old_url
    # Back in the turn: requests one at a time take turns.
    before = served_requests(killed.endpoint.url)
    with_adapter = [(request, output) for request, output in zip(burst, expected) if request.adapter][:4]
    assert [replicas.sample(request) for request, _ in with_adapter] == [output for _, output in with_adapter]
    assert served_requests(killed.endpoint.url) - before == 2
    assert burst[1].adapter.name in adapters_loaded(killed.endpoint.url)


def test_a_request_with_no_replica_up_fails_saying_so(qwen2_vl, burst):
    engine = VLLMEngine([VLLMEndpoint("http://127.0.0.1:9", qwen2_vl.server.config, recovery_s=1.0)])
    try:
        with pytest.raises(EngineUnavailable, match="no vLLM replica answered within 1 s"):
            engine.sample(burst[0])
    finally:
        engine.close()
