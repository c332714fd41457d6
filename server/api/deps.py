"""What every route needs: the server's services, the caller's tenant, bounded body reading, ids.

Routes stay thin: they validate, look things up here, and hand work to the scheduler.
"""

import asyncio
import hashlib
import multiprocessing
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Header, Request
from pydantic import BaseModel

from server.config import ServerConfig
from server.errors import NotFound, PayloadTooLarge, TinkerServerError
from server.models.loading import LoadedModel
from server.rendering.chunks import RenderContext
from server.rendering.sampling import VLLMRenderer
from server.sampling.adapters import SamplerAdapters
from server.sampling.engine import EmbeddedEngine, VLLMEngine, checkpoint_adapter_name
from server.scheduler.scheduler import Scheduler, Work
from server.store.store import CheckpointRecord, SessionRecord, Store, TrainingRunRecord
from server.training.trainer import Trainer

JSON = "application/json"
PROTOBUF = "application/x-protobuf"


class Unauthorized(TinkerServerError, PermissionError):
    status_code = 401
    category = "user"


@dataclass
class Services:
    config: ServerConfig
    store: Store
    scheduler: Scheduler
    base: LoadedModel
    trainer: Trainer
    training_ranks: list[multiprocessing.Process]
    """Training ranks 1.. of this node (the server's process is rank 0)."""
    sampler: EmbeddedEngine | VLLMEngine
    adapters: SamplerAdapters
    render_context: RenderContext
    sampling_renderer: VLLMRenderer


def get_services(request: Request) -> Services:
    return request.app.state.services


def get_owner(x_api_key: Annotated[str | None, Header()] = None) -> str:
    """The tenant of the caller: a stable digest of its API key (the key itself is never stored)."""
    if not x_api_key:
        raise Unauthorized("missing X-API-Key header")
    return "tenant-" + hashlib.sha256(x_api_key.encode()).hexdigest()[:16]


ServicesDep = Annotated[Services, Depends(get_services)]
OwnerDep = Annotated[str, Depends(get_owner)]


def new_request_id() -> str:
    return uuid.uuid4().hex


def payload_hash(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing to buffer more than `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes is over the limit of {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def string_map(metadata: dict | None) -> dict[str, str]:
    """user_metadata as stored: the wire allows any JSON values, the journal keeps strings."""
    return {str(key): str(value) for key, value in (metadata or {}).items()}


def session_of(store: Store, session_id: str, owner: str) -> SessionRecord:
    """The caller's session, or 404 (another tenant's session is not found either)."""
    session = store.get_session(session_id)
    if session is None or session.owner != owner:
        raise NotFound(f"no session {session_id}")
    return session


def run_of(store: Store, model_id: str, owner: str) -> TrainingRunRecord:
    """The caller's training run, or 404."""
    run = store.get_training_run(model_id)
    if run is None or run.owner != owner:
        raise NotFound(f"no model {model_id}")
    return run


async def submit_training_op(services: Services, *, model_id: str, seq_id: int | None, request_type: str,
                             body: bytes, prepare: Callable[[], Work]) -> str:
    """Validate (via `prepare`) and submit one training-side request in its model's seq_id order.

    `prepare` runs on a worker thread, since rendering decodes images. An invalid request still
    uses up its seq_id (as a failed future), so the model's later requests are not left waiting
    for it; the caller then gets the 4xx at once.
    """
    digest = payload_hash(body)
    try:
        work = await asyncio.to_thread(prepare)
    except TinkerServerError as error:
        if seq_id is not None:
            await services.scheduler.submit_training(request_id=new_request_id(), request_type=request_type,
                                                     model_id=model_id, seq_id=seq_id, payload_hash=digest,
                                                     work=failing_work(error))
        raise
    return await services.scheduler.submit_training(request_id=new_request_id(), request_type=request_type,
                                                    model_id=model_id, seq_id=seq_id, payload_hash=digest,
                                                    work=work)


def forget_checkpoint(services: Services, record: CheckpointRecord) -> None:
    """Release every cached copy of a deleted or overwritten checkpoint's adapter."""
    services.adapters.forget(Path(record.directory))
    services.sampler.forget(checkpoint_adapter_name(record.tinker_path, record.created_at))


def failing_work(error: TinkerServerError) -> Work:
    def work() -> tuple[bytes, str]:
        raise error

    return work


def json_result(response: BaseModel) -> tuple[bytes, str]:
    """A pydantic response as a future's stored result."""
    return response.model_dump_json().encode(), JSON
