"""What every route needs: the server's services, the caller's tenant, bounded body reading, ids,
the lookups of the caller's resources (404 where they are not the caller's) and the record builders.

Routes stay thin: they validate, look things up here, and hand work to the scheduler. Route modules
import this module, never each other.
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
from server.errors import InvalidRequest, NotFound, PayloadTooLarge, TinkerServerError, Unauthorized
from server.models.loading import LoadedModel
from server.rendering.chunks import RenderContext, RenderedInput
from server.rendering.provenance import position_keys
from server.rendering.sampling import VLLMRenderer
from server.sampling.adapters import SamplerAdapters
from server.sampling.engine import SamplingEngine, checkpoint_adapter_name
from server.sampling.types import SampledSequence
from server.scheduler.scheduler import Scheduler, Work
from server.store.checkpoints import parse_tinker_path
from server.store.sampled_sequences import SampledSequenceRecord
from server.store.exports import Signer
from server.store.retention import CheckpointPins
from server.store.store import (CheckpointRecord, SamplingSessionRecord, SessionRecord, Store,
                                TrainingRunRecord)
from server.training.trainer import Trainer
from server.wire.types import MAX_TTL_SECONDS, MIN_TTL_SECONDS, LoraConfig, OptimizerConfig

JSON = "application/json"
PROTOBUF = "application/x-protobuf"


@dataclass
class Services:
    config: ServerConfig
    store: Store
    scheduler: Scheduler
    base: LoadedModel
    trainer: Trainer
    training_ranks: list[multiprocessing.Process]
    """Training ranks 1.. of this node (the server's process is rank 0)."""
    sampler: SamplingEngine
    adapters: SamplerAdapters
    render_context: RenderContext
    sampling_renderer: VLLMRenderer
    checkpoint_pins: CheckpointPins
    """Checkpoints that requests of this process are loading, writing or copying (never swept meanwhile)."""
    signer: Signer
    """Signs download URLs and weights access tokens."""


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


def checkpoint_of(services: Services, path: str, owner: str, access_token: str | None = None) -> CheckpointRecord:
    """The checkpoint behind a tinker:// path that the caller may read (load, sample, copy), or 404: its own,
    a published one, or one whose weights access token it holds."""
    record = services.store.get_checkpoint(str(parse_tinker_path(path)))
    if record is not None and (record.owner == owner or record.public or (
            access_token is not None and services.signer.valid_weights_access_token(
                access_token, record.tinker_path, record.created_at.isoformat()))):
        return record
    raise NotFound(f"no checkpoint {path}")


def owned_checkpoint_of(services: Services, path: str, owner: str) -> CheckpointRecord:
    """The caller's own checkpoint behind a tinker:// path (to publish, expire or delete it), or 404."""
    record = services.store.get_checkpoint(str(parse_tinker_path(path)))
    if record is None or record.owner != owner:
        raise NotFound(f"no checkpoint {path}")
    return record


def sampler_of(services: Services, sampling_session_id: str, owner: str) -> SamplingSessionRecord:
    """The caller's sampling session, or 404."""
    record = services.store.get_sampling_session(sampling_session_id)
    if record is None or record.owner != owner:
        raise NotFound(f"no sampling session {sampling_session_id}")
    return record


def check_base_model(services: Services, base_model: str | None) -> None:
    if base_model is not None and base_model != services.base.name:
        raise InvalidRequest(f"base_model {base_model!r} is not served here; this server serves "
                             f"{services.base.name!r}")


def check_ttl(ttl_seconds: int | None) -> None:
    """A save's ttl_seconds, in the SDK's documented range (None: the checkpoint never expires)."""
    if ttl_seconds is not None and not MIN_TTL_SECONDS <= ttl_seconds <= MAX_TTL_SECONDS:
        raise InvalidRequest(f"ttl_seconds must be between {MIN_TTL_SECONDS} (1 hour) and {MAX_TTL_SECONDS} "
                             f"(10 years), got {ttl_seconds}")


def check_optimizer(config: OptimizerConfig | None) -> None:
    if config is not None and config.type != "adamw":
        raise InvalidRequest(f"optimizer {config.type!r} is not supported; use adamw")


def model_id_for(session_id: str, model_seq_id: int) -> str:
    """The SDK builds this id on its own side for create-via-load, so it must be exactly this."""
    return f"{session_id}:train:{model_seq_id}"


def sampling_session_id_for(session_id: str, sampling_session_seq_id: int) -> str:
    return f"{session_id}:sample:{sampling_session_seq_id}"


def training_run_record(services: Services, *, session_id: str, model_seq_id: int, owner: str, lora: LoraConfig,
                        user_metadata: dict | None) -> TrainingRunRecord:
    """The journal's record of a new training run (create_model or create-via-load)."""
    return TrainingRunRecord(
        model_id=model_id_for(session_id, model_seq_id), session_id=session_id, owner=owner,
        base_model=services.base.name, model_seq_id=model_seq_id, lora_rank=lora.rank, seed=lora.seed,
        train_mlp=lora.train_mlp, train_attn=lora.train_attn, train_unembed=lora.train_unembed,
        user_metadata=string_map(user_metadata))


def ensure_sampling_session(services: Services, *, session_id: str, sampling_session_seq_id: int, owner: str,
                            model_path: str | None = None, source_model_id: str | None = None) -> str:
    """Journal a sampling session unless a retry already did; returns its id."""
    sampling_session_id = sampling_session_id_for(session_id, sampling_session_seq_id)
    if services.store.get_sampling_session(sampling_session_id) is None:
        services.store.create_sampling_session(SamplingSessionRecord(
            sampling_session_id=sampling_session_id, session_id=session_id, owner=owner,
            base_model=services.base.name, model_path=model_path, source_model_id=source_model_id))
    return sampling_session_id


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


# -- stable_reinforce: sequences recorded at sampling time, looked up at training time -----------------


def record_sampled_sequences(services: Services, sampler: SamplingSessionRecord, prompt: RenderedInput,
                             adapter: str | None, sequence_ids: list[str],
                             sequences: list[SampledSequence]) -> None:
    """Keep what a record_stability_info request sampled, per returned sequence, for its session.

    Args:
        adapter: the name of the adapter version that sampled them; None for the base model.
    """
    keys = position_keys(prompt.expanded_token_ids(), prompt.images, prompt.image_token_id)
    services.store.sampled_sequences.record([
        SampledSequenceRecord(sequence_id=sequence_id, owner=sampler.owner, session_id=sampler.session_id,
                              sampling_session_id=sampler.sampling_session_id,
                              adapter=adapter, prompt_keys=keys,
                              tokens=sequence.tokens, logprobs=sequence.logprobs)
        for sequence_id, sequence in zip(sequence_ids, sequences, strict=True)])


def recorded_sequences_of(services: Services, sequence_ids: set[str], owner: str,
                          session_id: str) -> dict[str, SampledSequenceRecord]:
    """The recorded sequences a training request names, each given another day; a 400 names the first
    one that is unknown (or another tenant's), expired, or sampled in another session."""
    found = services.store.sampled_sequences.use(sequence_ids, owner)
    for sequence_id in sorted(sequence_ids):
        record = found.get(sequence_id)
        if record is None:
            raise InvalidRequest(f"sequence {sequence_id} is unknown or expired: sample it with "
                                 f"record_stability_info=True; recorded sequences can be trained on for one day "
                                 f"after sampling or their last use")
        if record.session_id != session_id:
            raise InvalidRequest(f"sequence {sequence_id} was sampled in session {record.session_id}, not in this "
                                 f"run's session {session_id}: recorded sequences belong to the session that "
                                 f"sampled them")
    return found
