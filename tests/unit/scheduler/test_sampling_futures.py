"""Sampling futures in memory: a resent seq_id never samples twice, an outcome is answered once and then
forgotten, other tenants get 410 like an unknown id, the engine is fed without a thread per request, and
everything kept is bounded (pending requests, unretrieved outcomes) under a flood of unique requests.
A fake engine stands for the real one: the test decides when each of its requests finishes."""

import asyncio
import concurrent.futures
import threading

import pytest

from server.errors import Conflict, Gone, InvalidRequest, Overloaded
from server.metrics import ServerMetrics
from server.scheduler.sampling import SamplingFutures, is_sampling_request_id


class FakeEngine:
    """Records what it is given; each request's future stays pending until the test finishes it."""

    def __init__(self):
        self.submitted: list[tuple[str, concurrent.futures.Future]] = []
        self.threads: set[str] = set()

    def submit(self, request):
        future = concurrent.futures.Future()
        self.submitted.append((request, future))
        self.threads.add(threading.current_thread().name)
        return future

    def finish(self, index: int, output="out", error: Exception | None = None) -> None:
        """From another thread, as the engine's own thread does."""
        future = self.submitted[index][1]
        thread = threading.Thread(target=future.set_exception if error else future.set_result, args=(error or output,))
        thread.start()
        thread.join()


def respond(output) -> tuple[bytes, str]:
    return str(output).encode(), "text/plain"


def submit(futures: SamplingFutures, seq_id: int | None, request="prompt", owner: str = "o",
           payload_hash: str | None = None, release=None) -> str:
    return futures.submit(owner=owner, sampling_session_id="s:sample:0", seq_id=seq_id,
                          payload_hash=payload_hash or f"hash-{seq_id}", request=request, respond=respond,
                          release=release)


def run(scenario):
    return asyncio.run(scenario())


def test_a_resent_seq_id_gets_the_original_request_and_samples_once_while_a_changed_payload_conflicts():
    async def scenario():
        engine = FakeEngine()
        futures = SamplingFutures(engine, ServerMetrics())
        first = submit(futures, 1)
        assert submit(futures, 1) == first and is_sampling_request_id(first)
        with pytest.raises(Conflict):
            submit(futures, 1, payload_hash="another payload")
        engine.finish(0, "sampled")
        outcome = await futures.retrieve(first, timeout=10, owner="o")
        return engine, outcome

    engine, outcome = run(scenario)
    assert len(engine.submitted) == 1 and outcome.result == b"sampled"
    assert engine.threads == {threading.main_thread().name}  # handed over on the event loop, no thread of its own


def test_an_outcome_is_answered_once_and_then_is_gone():
    async def scenario():
        engine = FakeEngine()
        futures = SamplingFutures(engine, ServerMetrics())
        request_id = submit(futures, 1)
        pending = await futures.retrieve(request_id, timeout=0.01, owner="o")
        engine.finish(0)
        answered = await futures.retrieve(request_id, timeout=10, owner="o")
        with pytest.raises(Gone):
            await futures.retrieve(request_id, timeout=10, owner="o")
        again = submit(futures, 1)  # the seq_id is free again once its outcome is gone
        return pending, answered, request_id, again

    pending, answered, request_id, again = run(scenario)
    assert pending is None and answered.status == "complete" and again != request_id


def test_another_tenants_request_id_is_gone_like_an_unknown_one_and_the_owner_still_gets_it():
    async def scenario():
        engine = FakeEngine()
        futures = SamplingFutures(engine, ServerMetrics())
        request_id = submit(futures, 1, owner="alice")
        engine.finish(0, "alice's")
        with pytest.raises(Gone):
            await futures.retrieve(request_id, timeout=1, owner="bob")
        with pytest.raises(Gone):
            await futures.retrieve("sample-unknown", timeout=1, owner="bob")
        return await futures.retrieve(request_id, timeout=1, owner="alice")

    assert run(scenario).result == b"alice's"


def test_a_failed_sample_fails_only_its_own_future():
    async def scenario():
        engine = FakeEngine()
        futures = SamplingFutures(engine, ServerMetrics())
        bad, good = submit(futures, 1), submit(futures, 2)
        engine.finish(0, error=InvalidRequest("the prompt is wrong"))
        engine.finish(1, "fine")
        return await futures.retrieve(bad, timeout=10, owner="o"), await futures.retrieve(good, timeout=10, owner="o")

    bad, good = run(scenario)
    assert (bad.status, bad.error, bad.error_category) == ("failed", "the prompt is wrong", "user")
    assert good.result == b"fine"


def test_requests_over_the_pending_limit_get_backpressure_until_one_finishes():
    async def scenario():
        engine = FakeEngine()
        futures = SamplingFutures(engine, ServerMetrics(), max_pending=2)
        first = submit(futures, 1)
        submit(futures, 2)
        with pytest.raises(Overloaded):
            submit(futures, 3)
        engine.finish(0)
        await futures.retrieve(first, timeout=10, owner="o")
        return submit(futures, 3)

    assert is_sampling_request_id(run(scenario))


def test_a_flood_of_unretrieved_outcomes_keeps_only_the_newest_within_the_byte_budget():
    async def scenario():
        engine = FakeEngine()
        futures = SamplingFutures(engine, ServerMetrics(), max_kept_bytes=100)
        request_ids = [submit(futures, seq_id) for seq_id in range(1000)]
        for index in range(1000):
            engine.finish(index, "x" * 10)  # 10 bytes each: the newest 10 fit
        await asyncio.sleep(0)  # let the loop take the engine's callbacks
        while sum(future.outcome is not None for future in futures._futures.values()) < 10:
            await asyncio.sleep(0.01)
        kept = [await futures.retrieve(request_id, timeout=1, owner="o") for request_id in request_ids[-10:]]
        with pytest.raises(Gone):
            await futures.retrieve(request_ids[-11], timeout=1, owner="o")
        return kept, futures

    kept, futures = run(scenario)
    assert [outcome.result for outcome in kept] == [b"x" * 10] * 10
    assert not futures._futures and not futures._by_key and not futures._unretrieved and futures._kept_bytes == 0


def test_what_a_request_holds_is_released_once_it_is_over_or_at_once_when_it_is_resent_or_refused():
    released = []

    async def scenario():
        engine = FakeEngine()
        futures = SamplingFutures(engine, ServerMetrics(), max_pending=1)
        request_id = submit(futures, 1, release=lambda: released.append("running"))
        submit(futures, 1, release=lambda: released.append("resent"))
        with pytest.raises(Overloaded):
            submit(futures, 2, release=lambda: released.append("refused"))
        held_while_running = list(released)
        engine.finish(0)
        await futures.retrieve(request_id, timeout=10, owner="o")
        return held_while_running

    assert run(scenario) == ["resent", "refused"] and released == ["resent", "refused", "running"]


def test_each_tenants_requests_in_flight_are_counted_apart_and_forgotten_once_none_is_left():
    async def scenario():
        engine = FakeEngine()
        futures = SamplingFutures(engine, ServerMetrics())
        first = submit(futures, 1, owner="a")
        submit(futures, 2, owner="a")
        submit(futures, 3, owner="b")
        assert (futures.pending_of("a"), futures.pending_of("b"), futures.pending_of("c")) == (2, 1, 0)
        engine.finish(0)
        await futures.retrieve(first, timeout=10, owner="a")
        assert (futures.pending_of("a"), futures.pending_of("b")) == (1, 1)
        for index in (1, 2):
            engine.finish(index)
        for _ in range(3000):  # the engine's callbacks reach the event loop
            if not (futures.pending_of("a") or futures.pending_of("b")):
                break
            await asyncio.sleep(0.01)
        return futures._pending_by_owner

    assert run(scenario) == {}  # a tenant with nothing in flight holds no entry
