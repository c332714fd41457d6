"""The checkpoint lifecycle: delete, TTL, publish/unpublish, weights access tokens, copy_weights, PEFT adapter
imports, and external weights' signed download URLs (served here, without an API key: the signature is the
permission).

Publishing makes a checkpoint readable by every tenant (load, sample from, copy, weights_info), as a weights
access token does for its holder; only the owner changes or deletes it. The TTL sweeper that deletes
expired checkpoints is `sweep_expired_checkpoints`, run by the app's housekeeping.
"""

import asyncio
import dataclasses
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse

from server.adapter_imports import write_imported_adapter
from server.api.deps import (
    JSON,
    OwnerDep,
    Services,
    ServicesDep,
    check_storage_quota,
    checkpoint_of,
    forget_checkpoint,
    model_id_for,
    new_request_id,
    owned_checkpoint_of,
    payload_hash,
    read_body,
    session_of,
    training_run_record,
)
from server.errors import Conflict, EngineUnavailable, Forbidden, InvalidRequest, NotFound, TinkerServerError
from server.models.builtin import spellings
from server.store.checkpoints import SCHEME, TinkerPath, parse_tinker_path, remove_checkpoint_files
from server.store.retention import sweep_expired_checkpoints
from server.store.store import CheckpointRecord, utcnow
from server.lora.peft_import import read_peft_adapter
from server.wire.lifecycle import (
    CheckpointTtlRequest,
    CopyWeightsRequest,
    CopyWeightsResponse,
    ExternalWeightsUrlsResponse,
    ImportAdapterRequest,
    ImportAdapterResponse,
    WeightsAccessTokenResponse,
)
from server.wire.types import LoraConfig

router = APIRouter(prefix="/api/v1")
public_router = APIRouter(prefix="/api/v1")
"""Signed download URLs: the SDK fetches them with no API key, and the signature is the permission."""

DOWNLOAD_URL_SECONDS = 3600
"""How long a signed download URL works (the SDK's downloaders sign again when one is about to expire)."""
_READ_BYTES = 1 << 20


def _tinker_path(model_id: str, checkpoint_id: str) -> str:
    return f"{SCHEME}{model_id}/{checkpoint_id}"


@router.delete("/training_runs/{model_id}/checkpoints/{checkpoint_path:path}")
async def delete_or_unpublish_checkpoint(model_id: str, checkpoint_path: str, services: ServicesDep,
                                         owner: OwnerDep) -> dict:
    """Delete a checkpoint (`.../checkpoints/SEGMENT/NAME`) or unpublish it (`.../SEGMENT/NAME/publish`)."""
    # One route for both: a checkpoint id holds a '/', so `{id:path}/publish` would also match a checkpoint named
    # "publish". Names never hold '/', which makes the two forms tell apart by their number of parts.
    parts = checkpoint_path.split("/")
    if len(parts) == 3 and parts[2] == "publish":
        return _set_public(services, _tinker_path(model_id, "/".join(parts[:2])), owner, public=False)
    record = owned_checkpoint_of(services, _tinker_path(model_id, checkpoint_path), owner)
    services.store.delete_checkpoint(record.tinker_path)
    forget_checkpoint(services, record)
    remove_checkpoint_files(Path(record.directory), services.config.store.checkpoint_dir)
    return {}


@router.post("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish")
async def publish_checkpoint(model_id: str, checkpoint_id: str, services: ServicesDep, owner: OwnerDep) -> dict:
    """Make a checkpoint readable by every tenant; 409 if it already is."""
    return _set_public(services, _tinker_path(model_id, checkpoint_id), owner, public=True)


def _set_public(services: Services, path: str, owner: str, public: bool) -> dict:
    record = owned_checkpoint_of(services, path, owner)
    if record.public == public:
        raise Conflict(f"checkpoint {path} is already {'public' if public else 'private'}")
    services.store.set_checkpoint_public(record.tinker_path, public)
    return {}


@router.put("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/ttl")
async def set_checkpoint_ttl(model_id: str, checkpoint_id: str, body: CheckpointTtlRequest, services: ServicesDep,
                             owner: OwnerDep) -> dict:
    """Set a checkpoint's expiry to ttl_seconds from now, or remove it; expired checkpoints are deleted."""
    record = owned_checkpoint_of(services, _tinker_path(model_id, checkpoint_id), owner)
    expires_at = utcnow() + timedelta(seconds=body.ttl_seconds) if body.ttl_seconds is not None else None
    services.store.set_checkpoint_expires_at(record.tinker_path, expires_at)
    return {}


@router.post("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/access_token")
async def create_weights_access_token(model_id: str, checkpoint_id: str, services: ServicesDep,
                                      owner: OwnerDep) -> WeightsAccessTokenResponse:
    """A token to hand to another tenant, who passes it as `weights_access_token` to load or copy the checkpoint
    (not part of the SDK: Tinker issues these in its console)."""
    record = owned_checkpoint_of(services, _tinker_path(model_id, checkpoint_id), owner)
    return WeightsAccessTokenResponse(weights_access_token=services.signer.weights_access_token(
        record.tinker_path, record.created_at.isoformat()))


@router.get("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
async def external_weights_urls(model_id: str, checkpoint_id: str, request: Request, services: ServicesDep,
                                owner: OwnerDep) -> ExternalWeightsUrlsResponse:
    """Signed, expiring URLs of an external weights checkpoint's files (fetched without an API key)."""
    record = checkpoint_of(services, _tinker_path(model_id, checkpoint_id), owner)
    if record.checkpoint_type != "external":
        raise InvalidRequest(f"{record.tinker_path} is not an external weights checkpoint "
                             f"(tinker://RUN/external_weights/NAME, from save_weights_external)")
    expires = int(time.time()) + DOWNLOAD_URL_SECONDS
    name = parse_tinker_path(record.tinker_path).name
    urls = {}
    for file_name in sorted(p.name for p in Path(record.directory).iterdir() if p.is_file()):
        signature = services.signer.download_signature(f"{record.tinker_path}/{file_name}", expires)
        url = request.url_for("download_external_weights", model_id=record.model_id, name=name, file_name=file_name)
        urls[file_name] = f"{url}?{urlencode({'expires': expires, 'signature': signature})}"
    return ExternalWeightsUrlsResponse(urls=urls, expires=datetime.fromtimestamp(expires, UTC))


@public_router.get("/external_weights/{model_id}/{name}/{file_name}", name="download_external_weights")
async def download_external_weights(model_id: str, name: str, file_name: str, services: ServicesDep,
                                    expires: Annotated[int, Query()], signature: Annotated[str, Query()]):
    """One file of an external weights checkpoint, for the holder of a signed URL (no API key)."""
    tinker_path = str(TinkerPath(model_id, "external_weights", name))
    if not services.signer.valid_download(f"{tinker_path}/{file_name}", expires, signature, time.time()):
        raise Forbidden("this download URL is invalid or has expired; ask for new ones (external_weights_urls)")
    record = services.store.get_checkpoint(tinker_path)
    path = Path(record.directory) / file_name if record is not None else None
    try:
        # Opened here, so that deleting the checkpoint meanwhile cannot cut the download short.
        handle = open(path, "rb") if path is not None else None
    except FileNotFoundError:
        handle = None
    if handle is None:
        raise NotFound(f"{tinker_path} has no file {file_name} (deleted or expired)")
    size = os.fstat(handle.fileno()).st_size
    return StreamingResponse(_read_chunks(handle), media_type="application/octet-stream",
                             headers={"content-length": str(size)})


def _read_chunks(handle) -> Iterator[bytes]:
    with handle:
        while chunk := handle.read(_READ_BYTES):
            yield chunk


@router.post("/copy_weights")
async def copy_weights(body: CopyWeightsRequest, services: ServicesDep, owner: OwnerDep,
                       x_idempotency_key: Annotated[str | None, Header()] = None,
                       x_tinker_weights_access_token: Annotated[str | None, Header()] = None) -> CopyWeightsResponse:
    """Copy a readable checkpoint into a new run of the caller's (files hard-linked, not duplicated).

    The SDK sends one X-Idempotency-Key for all retries of a call: a retry gets the first copy's answer.
    """
    source = checkpoint_of(services, body.source_path, owner,
                           access_token=x_tinker_weights_access_token or body.weights_access_token)
    if body.session_id is not None:
        session_of(services.store, body.session_id, owner)
        if services.store.get_training_run(model_id_for(body.session_id, body.model_seq_id)) is not None:
            raise Conflict(f"session {body.session_id} already has a run {body.model_seq_id}")
    if x_idempotency_key is None:
        return await asyncio.to_thread(_copy, services, source, body, owner)
    return await _copy_once(services, body, owner, x_idempotency_key, source)


async def _copy_once(services: Services, body: CopyWeightsRequest, owner: str, key: str,
                     source: CheckpointRecord) -> CopyWeightsResponse:
    """Journal the copy under its idempotency key (per tenant), so it happens once whatever the retries."""
    store, request_id = services.store, new_request_id()
    record = await asyncio.to_thread(store.insert_future, request_id=request_id, request_type="CopyWeights",
                                     model_id=f"copy_weights:{owner}:{key}", seq_id=0,
                                     payload_hash=payload_hash(body.model_dump_json().encode()))
    if record.request_id != request_id:
        if record.payload_hash != payload_hash(body.model_dump_json().encode()):
            raise Conflict(f"X-Idempotency-Key {key} was already used for a different copy_weights")
        if record.status == "pending":
            raise EngineUnavailable("a copy_weights with this X-Idempotency-Key is still running; try again")
        if record.status == "failed":
            raise (InvalidRequest if record.error_category == "user" else TinkerServerError)(record.error)
        return CopyWeightsResponse.model_validate_json(record.result)
    try:
        response = await asyncio.to_thread(_copy, services, source, body, owner)
    except TinkerServerError as error:
        await asyncio.to_thread(store.fail_future, request_id, error=str(error), category=error.category)
        raise
    await asyncio.to_thread(store.complete_future, request_id, result=response.model_dump_json().encode(),
                            content_type=JSON)
    return response


def _copy(services: Services, source: CheckpointRecord, body: CopyWeightsRequest, owner: str) -> CopyWeightsResponse:
    store = services.store
    # A new session holds the copy's run, unless the caller names one; it is finished at once, so the run is
    # never trained.
    new_session = body.destination_project_id is not None
    session_id, model_seq_id = (str(uuid.uuid4()), 0) if new_session else (body.session_id, body.model_seq_id)
    source_path = parse_tinker_path(source.tinker_path)
    target = TinkerPath(model_id_for(session_id, model_seq_id), source_path.segment, source_path.name)
    directory = target.new_version_directory(services.config.store.checkpoint_dir)
    with services.checkpoint_pins.hold(source.tinker_path):
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
    store.create_training_run(training_run_record(services, session_id=session_id, model_seq_id=model_seq_id,
                                                  owner=owner, lora=lora, user_metadata=source_run.user_metadata))
    now = utcnow()
    store.add_checkpoint(CheckpointRecord(
        tinker_path=str(target), model_id=target.model_id, checkpoint_id=target.checkpoint_id,
        checkpoint_type=source.checkpoint_type, directory=str(directory), size_bytes=source.size_bytes, owner=owner,
        user_metadata=source.user_metadata, created_at=now,
        expires_at=now + timedelta(seconds=body.ttl_seconds) if body.ttl_seconds is not None else None))
    return CopyWeightsResponse(tinker_path=str(target))


@router.post("/adapters/import", openapi_extra={"requestBody": {"required": True, "content": {
    "application/json": {"schema": ImportAdapterRequest.model_json_schema()}}}})
async def import_adapter(request: Request, services: ServicesDep, owner: OwnerDep) -> ImportAdapterResponse:
    """Import a PEFT LoRA adapter made elsewhere for the served base model, as a new run's checkpoints (this
    server's own route; `python -m server adapters import` does the same from the server's machine)."""
    body = ImportAdapterRequest.model_validate_json(await read_body(request, services.config.limits.max_request_bytes))

    def work():
        check_storage_quota(services, owner)
        adapter, lora_config = read_peft_adapter(
            body.adapter_config, body.adapter_model, services.trainer.targets,
            spellings(services.base.name) | {str(services.base.path)}, services.config.limits.max_lora_rank)
        return write_imported_adapter(services.store, services.config.store.checkpoint_dir,
                                      base_model=services.base.name, owner=owner, name=body.name, adapter=adapter,
                                      lora_config=lora_config)

    return ImportAdapterResponse(**dataclasses.asdict(await asyncio.to_thread(work)))


def _link_or_copy(source: str, destination: str) -> None:
    # A hard link shares the bytes, and each copy still deletes on its own; another filesystem needs a copy.
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


async def sweep_expired(services: Services) -> list[str]:
    """Delete expired checkpoints that are not in use (the housekeeping loop's job); returns their paths."""
    return await asyncio.to_thread(sweep_expired_checkpoints, services.store, services.checkpoint_pins, utcnow(),
                                   services.config.store.checkpoint_dir, lambda record: forget_checkpoint(services, record))
