"""The REST listing surface: training runs, checkpoints (list, delete, publish, ttl)."""

from datetime import timedelta
from pathlib import Path

from fastapi import APIRouter, Query
from pydantic import BaseModel

from server.api.deps import OwnerDep, Services, ServicesDep, checkpoint_of, forget_checkpoint, run_of
from server.errors import InvalidRequest
from server.store.checkpoints import SCHEME, remove_checkpoint_files
from server.store.store import CheckpointRecord, TrainingRunRecord, utcnow
from server.wire.types import (MAX_INT32, Checkpoint, CheckpointsListResponse, Cursor, TrainingRun,
                               TrainingRunsResponse, TtlSeconds)

router = APIRouter(prefix="/api/v1")


def checkpoint_view(record: CheckpointRecord) -> Checkpoint:
    return Checkpoint(checkpoint_id=record.checkpoint_id, checkpoint_type=record.checkpoint_type,
                      time=record.created_at, tinker_path=record.tinker_path, size_bytes=record.size_bytes,
                      public=record.public, user_metadata=record.user_metadata or None,
                      expires_at=record.expires_at)


def training_run_view(services: Services, run: TrainingRunRecord) -> TrainingRun:
    checkpoints, _ = services.store.list_checkpoints(model_id=run.model_id, owner=run.owner, limit=1000, offset=0)
    newest = {}
    for record in checkpoints:  # newest first
        newest.setdefault(record.checkpoint_type, record)
    return TrainingRun(
        training_run_id=run.model_id, base_model=run.base_model, model_owner=run.owner, is_lora=True,
        lora_rank=run.lora_rank, last_request_time=run.last_request_time,
        last_checkpoint=checkpoint_view(newest["training"]) if "training" in newest else None,
        last_sampler_checkpoint=checkpoint_view(newest["sampler"]) if "sampler" in newest else None,
        user_metadata=run.user_metadata or None)


@router.get("/training_runs")
async def list_training_runs(services: ServicesDep, owner: OwnerDep, limit: int = Query(20, ge=1, le=1000),
                             offset: int = Query(0, ge=0, le=MAX_INT32)) -> TrainingRunsResponse:
    """The caller's training runs, newest first."""
    runs, total = services.store.list_training_runs(owner=owner, limit=limit, offset=offset)
    return TrainingRunsResponse(training_runs=[training_run_view(services, run) for run in runs],
                                cursor=Cursor(offset=offset, limit=limit, total_count=total))


@router.get("/training_runs/{model_id}")
async def get_training_run(model_id: str, services: ServicesDep, owner: OwnerDep) -> TrainingRun:
    """One training run."""
    return training_run_view(services, run_of(services.store, model_id, owner))


@router.get("/training_runs/{model_id}/checkpoints")
async def list_run_checkpoints(model_id: str, services: ServicesDep, owner: OwnerDep) -> CheckpointsListResponse:
    """A run's checkpoints, newest first."""
    run_of(services.store, model_id, owner)
    records, _ = services.store.list_checkpoints(model_id=model_id, owner=owner, limit=10_000, offset=0)
    return CheckpointsListResponse(checkpoints=[checkpoint_view(r) for r in records])


@router.get("/checkpoints")
async def list_checkpoints(services: ServicesDep, owner: OwnerDep, limit: int = Query(100, ge=1, le=1000),
                           offset: int = Query(0, ge=0, le=MAX_INT32)) -> CheckpointsListResponse:
    """All of the caller's checkpoints, newest first."""
    records, total = services.store.list_checkpoints(model_id=None, owner=owner, limit=limit, offset=offset)
    return CheckpointsListResponse(checkpoints=[checkpoint_view(r) for r in records],
                                   cursor=Cursor(offset=offset, limit=limit, total_count=total))


def _checkpoint_by_id(services: Services, model_id: str, checkpoint_id: str, owner: str) -> CheckpointRecord:
    if "/" not in checkpoint_id:
        raise InvalidRequest(f"checkpoint id {checkpoint_id!r} must look like weights/NAME or sampler_weights/NAME")
    return checkpoint_of(services, f"{SCHEME}{model_id}/{checkpoint_id}", owner)


@router.delete("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(model_id: str, checkpoint_id: str, services: ServicesDep, owner: OwnerDep) -> dict:
    """Delete a checkpoint's listing and files."""
    record = _checkpoint_by_id(services, model_id, checkpoint_id, owner)
    services.store.delete_checkpoint(record.tinker_path)
    forget_checkpoint(services, record)
    remove_checkpoint_files(Path(record.directory), services.config.store.checkpoint_dir)
    return {}


class TtlRequest(BaseModel):
    ttl_seconds: TtlSeconds | None = None


@router.put("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/ttl")
async def set_checkpoint_ttl(model_id: str, checkpoint_id: str, body: TtlRequest, services: ServicesDep,
                             owner: OwnerDep) -> dict:
    """Set or clear a checkpoint's expiry."""
    record = _checkpoint_by_id(services, model_id, checkpoint_id, owner)
    expires_at = utcnow() + timedelta(seconds=body.ttl_seconds) if body.ttl_seconds else None
    services.store.set_checkpoint_expires_at(record.tinker_path, expires_at)
    return {}
