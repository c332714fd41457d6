"""The REST listing surface: training runs and their checkpoints (changing a checkpoint is checkpoints.py)."""

import asyncio

from fastapi import APIRouter, Query

from server.api.deps import OwnerDep, Services, ServicesDep, run_of
from server.store.store import CheckpointRecord, TrainingRunRecord
from server.wire.base import MAX_INT32
from server.wire.rest import Checkpoint, CheckpointsListResponse, Cursor, TrainingRun, TrainingRunsResponse

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
                             offset: int = Query(0, ge=0, le=MAX_INT32), project_id: str | None = None) -> TrainingRunsResponse:
    """The caller's training runs (of one project, or all), newest first."""
    def listing():
        runs, total = services.store.list_training_runs(owner=owner, limit=limit, offset=offset,
                                                        project_id=project_id)
        return TrainingRunsResponse(training_runs=[training_run_view(services, run) for run in runs],
                                    cursor=Cursor(offset=offset, limit=limit, total_count=total))

    return await asyncio.to_thread(listing)


@router.get("/training_runs/{model_id}")
async def get_training_run(model_id: str, services: ServicesDep, owner: OwnerDep) -> TrainingRun:
    """One training run."""
    return await asyncio.to_thread(training_run_view, services, await run_of(services.store, model_id, owner))


@router.get("/training_runs/{model_id}/checkpoints")
async def list_run_checkpoints(model_id: str, services: ServicesDep, owner: OwnerDep) -> CheckpointsListResponse:
    """A run's checkpoints, newest first."""
    await run_of(services.store, model_id, owner)
    records, _ = await asyncio.to_thread(services.store.list_checkpoints, model_id=model_id, owner=owner,
                                         limit=10_000, offset=0)
    return CheckpointsListResponse(checkpoints=[checkpoint_view(r) for r in records])


@router.get("/checkpoints")
async def list_checkpoints(services: ServicesDep, owner: OwnerDep, limit: int = Query(100, ge=1, le=1000),
                           offset: int = Query(0, ge=0, le=MAX_INT32)) -> CheckpointsListResponse:
    """All of the caller's checkpoints, newest first."""
    records, total = await asyncio.to_thread(services.store.list_checkpoints, model_id=None, owner=owner,
                                             limit=limit, offset=offset)
    return CheckpointsListResponse(checkpoints=[checkpoint_view(r) for r in records],
                                   cursor=Cursor(offset=offset, limit=limit, total_count=total))
