"""The embedded engine in a process of its own, so that its Python (the model's forwards, the batching) never
holds the interpreter lock that the server's HTTP front needs: on a GPU, where the model's work is launched
rather than done, the two each keep a core busy, and in one process they took turns (benchmarks/RESULTS.md).
Knows nothing about HTTP, the store or the wire format.
"""

import dataclasses
import functools
import itertools
import logging
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection

import torch.multiprocessing as multiprocessing

from server.config import ModelConfig, SamplerConfig
from server.errors import EngineUnavailable
from server.heap import freeze_startup_objects
from server.lora.layers import LoraAdapter
from server.sampling.adapters import SamplerAdapters
from server.sampling.embedded import EmbeddedEngine
from server.sampling.types import SampleOutput, SamplingRequest, TokenHook

logger = logging.getLogger(__name__)

_START_SECONDS = 600.0
# In place of an output, marks a message of the child as one streamed token: (request id, _TOKEN, token).
_TOKEN = "token"


class EngineProcess:
    """An `EmbeddedEngine` in a child process, behind the same interface.

    `submit` sends the request down a pipe and returns a future, which a reader thread completes when the
    child answers (a request's `on_token` stays here: the child sends each token it samples, and the reader
    thread hands it over). An in-memory adapter (a snapshot) crosses once, as a CPU copy, the first time
    its name is used; later requests name it, and `forget` drops it in the child too. Saved checkpoints are
    loaded by the child from their directory. The child starts on the first request (a server whose
    clients never sample never starts it); if it dies, every request in flight fails with a 503 and the
    next request starts a new one.
    """

    def __init__(self, model: ModelConfig, feature_cache_bytes: int, sampler: SamplerConfig):
        self.model, self.feature_cache_bytes, self.sampler = model, feature_cache_bytes, sampler
        self._lock = threading.Lock()
        """Held while the child is started or a message is queued for it."""
        self._child: _Child | None = None
        self._closed = False

    def submit(self, request: SamplingRequest) -> Future:
        """Send one request to the child; its future completes when the child answers."""
        with self._lock:
            if self._closed:
                raise EngineUnavailable("the embedded sampling engine is shut down")
            if self._child is None or not self._child.alive:
                self._child = _Child(self)
            return self._child.submit(request)

    def sample(self, request: SamplingRequest) -> SampleOutput:
        return self.submit(request).result()

    def forget(self, adapter_name: str) -> None:
        """Drop a snapshot's weights in the child (a later request with the name would send them again)."""
        with self._lock:
            if self._child is not None and self._child.alive:
                self._child.forget(adapter_name)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            child, self._child = self._child, None
        if child is not None:
            child.close()


class _Child:
    """One child process and what the parent knows of it: requests in flight, adapters it holds. Its methods
    are called under the EngineProcess's lock (but the reader's and the writer's threads).

    Messages cross the pipe in batches: the writer thread sends whatever was queued since its last send as one
    message, so that the caller (the event loop) never waits on the pipe while the child is busy with a step,
    and a burst's requests reach the child (and take its interpreter lock) together; the child answers each
    engine step's finished requests (and streamed tokens) in one message too.
    """

    def __init__(self, owner: EngineProcess):
        context = multiprocessing.get_context("spawn")
        self._connection, child_end = context.Pipe()
        self.process = context.Process(target=_serve, name="embedded-sampler",
                                       args=(child_end, owner.model, owner.feature_cache_bytes, owner.sampler),
                                       daemon=True)
        self.process.start()
        child_end.close()
        self.alive = True
        """False once the reader saw the child end (under `_pending_lock`): nothing more is taken."""
        self._ids = itertools.count()
        self._pending: dict[int, Future] = {}
        self._streams: dict[int, TokenHook] = {}
        """The `on_token` of each pending request that streams."""
        self._pending_lock = threading.Lock()
        self._outbox: list[tuple | None] = []
        """Messages not sent yet, in order (None: stop)."""
        self._queued = threading.Condition(threading.Lock())
        self._adapters: set[str] = set()
        """Names of the snapshots whose weights the child holds."""
        self._reader = threading.Thread(target=self._read, name="embedded-sampler-reader", daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name="embedded-sampler-writer", daemon=True)
        self._writer.start()

    def submit(self, request: SamplingRequest) -> Future:
        future, request_id = Future(), next(self._ids)
        weights = None
        on_token = request.on_token  # stays here: the child sends the tokens, the reader hands them over
        if on_token is not None:
            request = dataclasses.replace(request, on_token=None)
        adapter = request.adapter
        if adapter is not None and adapter.weights is not None:
            if adapter.name not in self._adapters:
                weights = _cpu_copy(adapter.weights)
                self._adapters.add(adapter.name)
            request = dataclasses.replace(request, adapter=dataclasses.replace(adapter, weights=None))
        with self._pending_lock:
            if not self.alive:
                raise EngineUnavailable("the embedded sampling engine's process is gone; send the request again")
            self._pending[request_id] = future
            if on_token is not None:
                self._streams[request_id] = on_token
        self._send(("sample", request_id, request, weights, on_token is not None))
        return future

    def forget(self, adapter_name: str) -> None:
        if adapter_name in self._adapters:
            self._adapters.discard(adapter_name)
            self._send(("forget", adapter_name))

    def close(self) -> None:
        self._send(None)
        self._writer.join(timeout=60)
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._reader.join(timeout=10)

    def _send(self, message: tuple | None) -> None:
        with self._queued:
            self._outbox.append(message)
            self._queued.notify()

    def _write(self) -> None:
        """Writer thread: send the messages queued since the last send as one; fail the requests it could not send."""
        while True:
            with self._queued:
                while not self._outbox:
                    self._queued.wait()
                messages, self._outbox = self._outbox, []
            stopping = messages[-1] is None
            messages = [message for message in messages if message is not None]
            try:
                if messages:
                    self._connection.send(messages)
            except Exception:  # the child is gone, or a request did not pickle (nothing was written): one by one,
                for message in messages:  # so that only what cannot be sent fails
                    self._send_alone(message)
            if stopping:
                try:
                    self._connection.send(None)
                except (OSError, ValueError):  # the child is gone already
                    pass
                return

    def _send_alone(self, message: tuple) -> None:
        try:
            self._connection.send([message])
        except Exception as error:  # the reader fails the rest if the child is gone
            if message[0] == "sample":
                self._fail(message[1], EngineUnavailable(
                    f"the request could not be sent to the embedded sampling engine's process: {error}"))

    def _fail(self, request_id: int, error: Exception) -> None:
        with self._pending_lock:
            future = self._pending.pop(request_id, None)
            self._streams.pop(request_id, None)
        if future is not None:
            future.set_exception(error)

    def _read(self) -> None:
        """Reader thread: complete each future with what the child answers, stream the tokens it sends; fail the
        rest if it dies."""
        try:
            while True:
                for request_id, output, error in self._connection.recv():
                    if output == _TOKEN:
                        with self._pending_lock:
                            on_token = self._streams[request_id]
                        on_token(*error)
                        continue
                    with self._pending_lock:
                        future = self._pending.pop(request_id)
                        self._streams.pop(request_id, None)
                    if error is None:
                        future.set_result(output)
                    else:
                        future.set_exception(error)
        except (EOFError, OSError):
            pass
        code = self.process.exitcode
        if code not in (0, None):
            logger.error("event=sampler_process_died exitcode=%s", code)
        failure = EngineUnavailable(f"the embedded sampling engine's process ended (exit code {code}); send the "
                                    f"request again")
        with self._pending_lock:
            self.alive = False
            pending, self._pending, self._streams = self._pending, {}, {}
        for future in pending.values():
            future.set_exception(failure)


def _cpu_copy(adapter: LoraAdapter) -> LoraAdapter:
    return adapter.frozen_copy(device="cpu")


def _serve(connection: Connection, model: ModelConfig, feature_cache_bytes: int, sampler: SamplerConfig) -> None:
    """The child: an EmbeddedEngine fed from the pipe. Its answers, (request id, output, error) each, go back in
    one message per engine step; an answer made off the engine thread (a request it refused) goes at once."""
    outbox: list[tuple] = []
    sending = threading.Lock()
    """Held while the outbox is added to or sent, so that messages keep their order."""

    def send_answers() -> None:
        with sending:
            if not outbox:
                return
            try:
                connection.send(outbox)
            except (OSError, ValueError):  # the parent is gone
                pass
            outbox.clear()

    # This process lives for its model: what it holds once the model is loaded is never garbage.
    engine = EmbeddedEngine.on_demand(model, feature_cache_bytes, SamplerAdapters(sampler, model.device), sampler,
                                      after_step=send_answers, after_load=freeze_startup_objects)
    snapshots: dict[str, LoraAdapter] = {}

    def send_token(request_id: int, *token) -> None:  # on the engine thread: goes with its step's answers
        with sending:
            outbox.append((request_id, _TOKEN, token))

    def answer(request_id: int, done: Future) -> None:
        error = done.exception()
        with sending:
            outbox.append((request_id, None if error else done.result(), _picklable(error)))
        if not engine.on_engine_thread():
            send_answers()

    while (messages := connection.recv()) is not None:
        for message in messages:
            if message[0] == "forget":
                snapshots.pop(message[1], None)
                continue
            _, request_id, request, weights, streams = message
            if streams:
                request = dataclasses.replace(request, on_token=functools.partial(send_token, request_id))
            adapter = request.adapter
            if weights is not None:
                snapshots[adapter.name] = weights.frozen_copy(device=model.device)
            if adapter is not None and adapter.name in snapshots:
                request = dataclasses.replace(request, adapter=dataclasses.replace(adapter,
                                                                                   weights=snapshots[adapter.name]))
            try:
                future = engine.submit(request)
            except Exception as error:
                future = Future()
                future.set_exception(error)
            future.add_done_callback(functools.partial(answer, request_id))
    engine.close()
    send_answers()


def _picklable(error: BaseException | None) -> BaseException | None:
    """The error as the parent can receive it (the engine's own errors pickle; anything else becomes a 503)."""
    if error is None or isinstance(error, EngineUnavailable) or type(error).__module__.startswith("server."):
        return error
    return EngineUnavailable(f"the embedded sampling engine failed: {type(error).__name__}: {error}")
