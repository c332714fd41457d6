"""copy_weights: a readable checkpoint copied into a new run of the caller's (files hard-linked, not
duplicated), once per idempotency key whatever the retries."""

import asyncio
import os
import shutil
import uuid
from datetime import timedelta

from server.checkpoints.lifecycle import Checkpoints
from server.errors import Conflict, EngineUnavailable, InvalidRequest, NotFound, TinkerServerError
from server.runs import model_id_for, training_run_record
from server.store.checkpoints import TinkerPath, parse_tinker_path
from server.store.store import CheckpointRecord, utcnow
from server.wire import JSON
from server.wire.lifecycle import CopyWeightsRequest, CopyWeightsResponse
from server.wire.models import LoraConfig


async def copy_checkpoint_once(checkpoints: Checkpoints, base_model: str, source: CheckpointRecord,
                               body: CopyWeightsRequest, owner: str, key: str, request_id: str,
                               payload_hash: str) -> CopyWeightsResponse:
    """Journal the copy under its idempotency key (per tenant), so it happens once whatever the retries."""
    store = checkpoints.store
    record = await asyncio.to_thread(store.insert_future, request_id=request_id, request_type="CopyWeights",
                                     model_id=f"copy_weights:{owner}:{key}", seq_id=0, payload_hash=payload_hash)
    if record.request_id != request_id:
        if record.payload_hash != payload_hash:
            raise Conflict(f"X-Idempotency-Key {key} was already used for a different copy_weights")
        if record.status == "pending":
            raise EngineUnavailable("a copy_weights with this X-Idempotency-Key is still running; try again")
        if record.status == "failed":
            raise (InvalidRequest if record.error_category == "user" else TinkerServerError)(record.error)
        return CopyWeightsResponse.model_validate_json(record.result)
    try:
        response = await asyncio.to_thread(copy_checkpoint, checkpoints, base_model, source, body, owner)
    except TinkerServerError as error:
        await asyncio.to_thread(store.fail_future, request_id, error=str(error), category=error.category)
        raise
    await asyncio.to_thread(store.complete_future, request_id, result=response.model_dump_json().encode(),
                            content_type=JSON)
    return response


def copy_checkpoint(checkpoints: Checkpoints, base_model: str, source: CheckpointRecord, body: CopyWeightsRequest,
                    owner: str) -> CopyWeightsResponse:
    """Copy `source` into the run `body` names (or a new session's, finished at once so it is never trained)."""
    store = checkpoints.store
    new_session = body.destination_project_id is not None
    session_id, model_seq_id = (str(uuid.uuid4()), 0) if new_session else (body.session_id, body.model_seq_id)
    source_path = parse_tinker_path(source.tinker_path)
    target = TinkerPath(model_id_for(session_id, model_seq_id), source_path.segment, source_path.name)
    directory = target.new_version_directory(checkpoints.directory)
    with checkpoints.pins.hold(source.tinker_path):
        try:
            shutil.copytree(source.directory, directory, copy_function=_link_or_copy)
        except FileNotFoundError:
            raise NotFound(f"no checkpoint {source.tinker_path} (deleted meanwhile)") from None
    if new_session:
        store.create_session(session_id, tags=[], user_metadata={}, sdk_version=None,
                             display_name=f"copy of {source.tinker_path}", owner=owner)
        store.set_session_project(session_id, body.destination_project_id)
        store.finish_session(session_id, "copied")
    source_run = store.get_training_run(source.model_id)
    lora = LoraConfig(rank=source_run.lora_rank, seed=source_run.seed, train_mlp=source_run.train_mlp,
                      train_attn=source_run.train_attn, train_unembed=source_run.train_unembed)
    store.create_training_run(training_run_record(base_model=base_model, session_id=session_id,
                                                  model_seq_id=model_seq_id, owner=owner, lora=lora,
                                                  user_metadata=source_run.user_metadata))
    now = utcnow()
    store.add_checkpoint(CheckpointRecord(
        tinker_path=str(target), model_id=target.model_id, checkpoint_id=target.checkpoint_id,
        checkpoint_type=source.checkpoint_type, directory=str(directory), size_bytes=source.size_bytes, owner=owner,
        user_metadata=source.user_metadata, created_at=now,
        expires_at=now + timedelta(seconds=body.ttl_seconds) if body.ttl_seconds is not None else None))
    return CopyWeightsResponse(tinker_path=str(target))


def _link_or_copy(source: str, destination: str) -> None:
    # A hard link shares the bytes, and each copy still deletes on its own; another filesystem needs a copy.
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)
