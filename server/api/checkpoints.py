"""The checkpoint lifecycle: delete, TTL, publish/unpublish, weights access tokens, copy_weights, PEFT adapter
imports, and external weights' signed download URLs (served here, without an API key: the signature is the
permission).

Publishing makes a checkpoint readable by every tenant (load, sample from, copy, weights_info), as a weights
access token does for its holder; only the owner changes or deletes it. The work is server/checkpoints'
(the TTL sweeper too, run by the app's housekeeping); these routes check the caller and call it.
"""

import asyncio
import dataclasses
import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse

from server.adapter_imports import write_imported_adapter
from server.api.deps import OwnerDep, Services, ServicesDep, new_request_id, payload_hash, read_body, session_of
from server.checkpoints.access import checkpoint_of, owned_checkpoint_of
from server.checkpoints.copying import copy_checkpoint, copy_checkpoint_once
from server.checkpoints.lifecycle import delete_checkpoint, set_public, set_ttl
from server.errors import Conflict, Forbidden, InvalidRequest, NotFound
from server.lora.peft_import import read_peft_adapter
from server.models.builtin import spellings
from server.runs import check_storage_quota, model_id_for
from server.store.checkpoints import SCHEME, TinkerPath, parse_tinker_path
from server.store.store import CheckpointRecord
from server.wire.lifecycle import (CheckpointTtlRequest, CopyWeightsRequest, CopyWeightsResponse,
                                   ExternalWeightsUrlsResponse, ImportAdapterRequest, ImportAdapterResponse,
                                   WeightsAccessTokenResponse)

router = APIRouter(prefix="/api/v1")
public_router = APIRouter(prefix="/api/v1")
"""Signed download URLs: the SDK fetches them with no API key, and the signature is the permission."""

DOWNLOAD_URL_SECONDS = 3600
"""How long a signed download URL works (the SDK's downloaders sign again when one is about to expire)."""
_READ_BYTES = 1 << 20


def _tinker_path(model_id: str, checkpoint_id: str) -> str:
    return f"{SCHEME}{model_id}/{checkpoint_id}"


async def _owned(services: Services, model_id: str, checkpoint_id: str, owner: str) -> CheckpointRecord:
    """The caller's own checkpoint, read off the event loop, or 404."""
    return await asyncio.to_thread(owned_checkpoint_of, services.store, _tinker_path(model_id, checkpoint_id), owner)


@router.delete("/training_runs/{model_id}/checkpoints/{checkpoint_path:path}")
async def delete_or_unpublish_checkpoint(model_id: str, checkpoint_path: str, services: ServicesDep,
                                         owner: OwnerDep) -> dict:
    """Delete a checkpoint (`.../checkpoints/SEGMENT/NAME`) or unpublish it (`.../SEGMENT/NAME/publish`)."""
    # One route for both: a checkpoint id holds a '/', so `{id:path}/publish` would also match a checkpoint named
    # "publish". Names never hold '/', which makes the two forms tell apart by their number of parts.
    parts = checkpoint_path.split("/")
    if len(parts) == 3 and parts[2] == "publish":
        record = await _owned(services, model_id, "/".join(parts[:2]), owner)
        await asyncio.to_thread(set_public, services.store, record, public=False)
        return {}
    record = await _owned(services, model_id, checkpoint_path, owner)
    await asyncio.to_thread(delete_checkpoint, services.checkpoints, record)
    return {}


@router.post("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish")
async def publish_checkpoint(model_id: str, checkpoint_id: str, services: ServicesDep, owner: OwnerDep) -> dict:
    """Make a checkpoint readable by every tenant; 409 if it already is."""
    record = await _owned(services, model_id, checkpoint_id, owner)
    await asyncio.to_thread(set_public, services.store, record, public=True)
    return {}


@router.put("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/ttl")
async def set_checkpoint_ttl(model_id: str, checkpoint_id: str, body: CheckpointTtlRequest, services: ServicesDep,
                             owner: OwnerDep) -> dict:
    """Set a checkpoint's expiry to ttl_seconds from now, or remove it; expired checkpoints are deleted."""
    record = await _owned(services, model_id, checkpoint_id, owner)
    await asyncio.to_thread(set_ttl, services.store, record, body.ttl_seconds)
    return {}


@router.post("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/access_token")
async def create_weights_access_token(model_id: str, checkpoint_id: str, services: ServicesDep,
                                      owner: OwnerDep) -> WeightsAccessTokenResponse:
    """A token to hand to another tenant, who passes it as `weights_access_token` to load or copy the checkpoint
    (not part of the SDK: Tinker issues these in its console)."""
    record = await _owned(services, model_id, checkpoint_id, owner)
    return WeightsAccessTokenResponse(weights_access_token=services.signer.weights_access_token(
        record.tinker_path, record.created_at.isoformat()))


@router.get("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
async def external_weights_urls(model_id: str, checkpoint_id: str, request: Request, services: ServicesDep,
                                owner: OwnerDep) -> ExternalWeightsUrlsResponse:
    """Signed, expiring URLs of an external weights checkpoint's files (fetched without an API key)."""
    def files():
        record = checkpoint_of(services.store, services.signer, _tinker_path(model_id, checkpoint_id), owner)
        if record.checkpoint_type != "external":
            raise InvalidRequest(f"{record.tinker_path} is not an external weights checkpoint "
                                 f"(tinker://RUN/external_weights/NAME, from save_weights_external)")
        return record, sorted(p.name for p in Path(record.directory).iterdir() if p.is_file())

    record, file_names = await asyncio.to_thread(files)
    expires = int(time.time()) + DOWNLOAD_URL_SECONDS
    name = parse_tinker_path(record.tinker_path).name
    urls = {}
    for file_name in file_names:
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

    def opened():
        record = services.store.get_checkpoint(tinker_path)
        path = Path(record.directory) / file_name if record is not None else None
        try:
            # Opened here, so that deleting the checkpoint meanwhile cannot cut the download short.
            return open(path, "rb") if path is not None else None
        except FileNotFoundError:
            return None

    handle = await asyncio.to_thread(opened)
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
    source = await asyncio.to_thread(checkpoint_of, services.store, services.signer, body.source_path, owner,
                                     x_tinker_weights_access_token or body.weights_access_token)
    if body.session_id is not None:
        await session_of(services.store, body.session_id, owner)
        target_run = model_id_for(body.session_id, body.model_seq_id)
        if await asyncio.to_thread(services.store.get_training_run, target_run) is not None:
            raise Conflict(f"session {body.session_id} already has a run {body.model_seq_id}")
    if x_idempotency_key is None:
        return await asyncio.to_thread(copy_checkpoint, services.checkpoints, services.base.name, source, body, owner)
    return await copy_checkpoint_once(services.checkpoints, services.base.name, source, body, owner, x_idempotency_key,
                                      new_request_id(), payload_hash(body.model_dump_json().encode()))


@router.post("/adapters/import", openapi_extra={"requestBody": {"required": True, "content": {
    "application/json": {"schema": ImportAdapterRequest.model_json_schema()}}}})
async def import_adapter(request: Request, services: ServicesDep, owner: OwnerDep) -> ImportAdapterResponse:
    """Import a PEFT LoRA adapter made elsewhere for the served base model, as a new run's checkpoints (this
    server's own route; `python -m server adapters import` does the same from the server's machine)."""
    body = ImportAdapterRequest.model_validate_json(await read_body(request, services.config.limits.max_request_bytes))

    def work():
        check_storage_quota(services.store, services.config.limits, owner)
        adapter, lora_config = read_peft_adapter(
            body.adapter_config, body.adapter_model, services.trainer.targets,
            spellings(services.base.name) | {str(services.base.path)}, services.config.limits.max_lora_rank)
        return write_imported_adapter(services.store, services.config.store.checkpoint_dir,
                                      base_model=services.base.name, owner=owner, name=body.name, adapter=adapter,
                                      lora_config=lora_config)

    return ImportAdapterResponse(**dataclasses.asdict(await asyncio.to_thread(work)))
