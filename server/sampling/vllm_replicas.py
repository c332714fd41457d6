"""The vLLM replicas one VLLMEngine samples through: which one takes the next request, and what each has loaded.

A request goes to the replica with the fewest requests in flight among those up (ties: the one that
waited longest, so that requests one at a time take turns); the retries of a request that a replica
dropped (killed, restarting) go to the others first. When none is up, a request waits for one to come
back (the supervisor restarts those it started) and fails with the reasons when none can. Knows nothing about request bodies or adapter files: vllm.py speaks HTTP to the replica.
"""

import itertools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from server.errors import EngineUnavailable
from server.sampling.vllm_process import VLLMEndpoint

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Replica:
    """One vLLM server and this engine's bookkeeping of it."""

    index: int
    endpoint: VLLMEndpoint
    in_flight: int = 0
    last_chosen: int = 0
    """When it last got a request (a ticket number): ties go to the one that waited longest."""
    adapters: dict[str, Path] = field(default_factory=dict)
    """Adapters this engine has loaded into it: name -> path (a restarted replica forgets them)."""
    load_locks: dict[str, threading.Lock] = field(default_factory=dict)
    """One per adapter name: concurrent first uses of an adapter load it once."""


class Replicas:
    """The replicas, and the choice of one per request; thread-safe."""

    def __init__(self, endpoints: Sequence[VLLMEndpoint]):
        assert endpoints, "a vLLM engine needs at least one replica"
        self.all = [Replica(index, endpoint) for index, endpoint in enumerate(endpoints)]
        self.lock = threading.Lock()
        """Guards every replica's in_flight, last_chosen, adapters and load_locks, and the tickets."""
        self._tickets = itertools.count(1)

    @contextmanager
    def take(self, avoid: set[int]) -> Iterator[Replica]:
        """The least busy replica that is up, counted in flight while the block runs; those in `avoid`
        (which failed this request) only when no other is up."""
        replica = self._choose(avoid)
        try:
            yield replica
        finally:
            with self.lock:
                replica.in_flight -= 1

    def _choose(self, avoid: set[int]) -> Replica:
        deadline = None
        while True:
            # Asked outside the lock: a replica that stopped answering is probed over HTTP.
            up = [replica for replica in self.all if replica.endpoint.is_up()]
            if up:
                with self.lock:
                    # Ties go to the one that waited longest: an idle engine's requests take turns.
                    chosen = min([r for r in up if r.index not in avoid] or up,
                                 key=lambda r: (r.in_flight, r.last_chosen))
                    chosen.in_flight += 1
                    chosen.last_chosen = next(self._tickets)
                return chosen
            failures = [replica.endpoint.failure for replica in self.all]
            if all(failures):
                raise EngineUnavailable("no vLLM replica can serve: " + " | ".join(failures))
            if deadline is None:
                wait_s = max(r.endpoint.recovery_s for r in self.all if r.endpoint.failure is None)
                deadline = time.monotonic() + wait_s
                logger.warning("event=vllm_none_up replicas=%d; waiting up to %.0f s for one", len(self.all), wait_s)
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"no vLLM replica answered within {wait_s:.0f} s "
                                        f"({', '.join(r.endpoint.url for r in self.all)})")
            time.sleep(0.2)

    def close(self) -> None:
        for replica in self.all:
            replica.endpoint.close()
