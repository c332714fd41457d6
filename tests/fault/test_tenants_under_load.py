"""Sustained load: several tenants, each with a key of its own, train and sample at once for a bounded number of
rounds, with bad calls mixed in. Every good call succeeds, every bad one is a 4xx that wedges nothing, no tenant
reaches another's runs or checkpoints, and the server's memory (its process tree, measured as
benchmarks/server_memory.py measures it) stays flat over the second half."""

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import tinker
from tinker import types

from benchmarks.process_memory import process_tree, rss_mib
from support.live_server import BASE_MODEL, LiveServer
from support.sdk import SENTENCES, supervised_datum

TENANTS = 3
ROUNDS = 6
BARRIER_SECONDS = 300  # a hang guard: a tenant that failed aborts the barriers, so the others stop at once


class Load:
    """What the tenants share: their keys, what each published for the others to try, and the counts."""

    def __init__(self, server: LiveServer, keys: list[str]):
        self.server = server
        self.keys = keys
        self.published: dict[int, tuple[str, str]] = {}
        """Tenant -> (its run's model_id, one of its sampler checkpoints)."""
        self.ready = threading.Barrier(TENANTS, timeout=BARRIER_SECONDS)
        self.rss_mib: list[float] = []
        self.halfway = threading.Barrier(TENANTS, action=self.measure, timeout=BARRIER_SECONDS)
        self.counts = {"good": 0, "refused": 0, "not found": 0}
        self._lock = threading.Lock()

    def measure(self) -> None:
        """The server's RSS while no tenant has a request in flight."""
        self.rss_mib.append(rss_mib(process_tree(self.server.process.pid)))

    def count(self, what: str, number: int = 1) -> None:
        with self._lock:
            self.counts[what] += number


def _tenant(load: Load, index: int) -> list[float]:
    """One tenant's rounds; returns its losses."""
    try:
        return _rounds(load, index)
    except BaseException:
        load.ready.abort()
        load.halfway.abort()
        raise


def _rounds(load: Load, index: int) -> list[float]:
    server, key = load.server, load.keys[index]
    training = server.service_client(api_key=key).create_lora_training_client(base_model=BASE_MODEL, rank=4,
                                                                                seed=index).result()
    datum = supervised_datum(training.get_tokenizer(), SENTENCES[index])
    prompt = types.ModelInput.from_ints(datum.model_input.to_ints()[:4])
    out_of_vocab = types.Datum(model_input=types.ModelInput.from_ints([5, 10_000_000]),
                               loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0, 1.0]})
    load.published[index] = (training.model_id, training.save_weights_for_sampler("mine").result().path)
    load.ready.wait()
    others = [load.published[other] for other in range(TENANTS) if other != index]
    losses = []
    with httpx.Client(base_url=server.url, headers=server.headers(key), timeout=120) as http:
        for round_index in range(ROUNDS):
            forward_backward = training.forward_backward([datum], "cross_entropy")
            optim = training.optim_step(types.AdamParams(learning_rate=1e-3))
            losses.append(forward_backward.result().metrics["loss:sum"])
            optim.result()
            sampler = training.save_weights_and_get_sampling_client().result()
            assert len(sampler.sample(prompt, 2, types.SamplingParams(max_tokens=8)).result().sequences) == 2
            load.count("good", 4)
            # Bad calls: each a 400 that takes its seq_id, so the run's next call goes on.
            with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
                training.forward_backward([out_of_vocab], "cross_entropy").result()
            with pytest.raises(tinker.BadRequestError, match="eps"):
                training.optim_step(types.AdamParams(eps=0.0)).result()
            with pytest.raises(tinker.BadRequestError, match="max_tokens"):
                sampler.sample(prompt, 1, types.SamplingParams(max_tokens=10_000_000)).result()
            assert http.get("/api/v1/training_runs", headers={"X-API-Key": "tml-not-a-key"}).status_code == 401
            load.count("refused", 4)
            # Another tenant's run and checkpoint are not found, by name or by path.
            model_id, sampler_path = others[round_index % len(others)]
            assert http.get(f"/api/v1/training_runs/{model_id}").status_code == 404
            assert http.post("/api/v1/asample", json={
                "base_model": BASE_MODEL, "model_path": sampler_path, "sampling_params": {"max_tokens": 1},
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]}}).status_code == 404
            listed = http.get("/api/v1/training_runs", params={"limit": 1000}).text
            assert not any(other_model in listed for other_model, _ in others)
            load.count("not found", 3)
            if round_index == ROUNDS // 2 - 1:
                load.halfway.wait()
    return losses


def test_tenants_training_and_sampling_at_once_with_bad_calls_mixed_in_lose_no_good_call_and_see_no_other(
        fault_server):
    keys = [fault_server.api_key] + [fault_server.create_key(f"under-load-{index}") for index in range(1, TENANTS)]
    load = Load(fault_server, keys)
    with ThreadPoolExecutor(TENANTS) as pool:
        tenants = [pool.submit(_tenant, load, index) for index in range(TENANTS)]
        losses = [tenant.result() for tenant in tenants]
    load.measure()
    print(f"{TENANTS} tenants x {ROUNDS} rounds at once: {load.counts}, server RSS at halfway and at the end "
          f"{load.rss_mib} MiB, first and last losses {[(run[0], run[-1]) for run in losses]}")
    for run in losses:
        assert run[-1] < run[0]  # the good calls trained
    assert 'status="500"' not in httpx.get(f"{fault_server.url}/metrics", headers=fault_server.headers()).text
    # The first half fills what is bounded (the tenants' snapshots, the sampler's batch shapes); over the second,
    # some 100 requests, the process tree must not grow: 20 MiB is 200 KiB a request, a leak of a snapshot or a
    # step's activations each. Slower leaks (KiBs a request) take benchmarks/server_memory.py's thousands.
    assert load.rss_mib[-1] - load.rss_mib[0] < 20, load.rss_mib
