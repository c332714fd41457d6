"""The dashboard: one static page (no key needed to load it) and the two calls it makes with the key.

The page asks for the API key once, keeps it in the tab's sessionStorage and sends it as X-API-Key,
never in a URL. `dashboard/overview` gives the caller's runs (with live queue depth and steps),
checkpoints (sizes, TTLs) and sessions; `dashboard/runs/{id}/curves` a run's metrics per step
(server/store/run_metrics.py). A tenant sees only its own.
"""

import asyncio
from datetime import timedelta
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from server.api.deps import OwnerDep, Services, ServicesDep, run_of
from server.store.store import utcnow
from server.metrics import gpu_memory
from server.wire.dashboard import (DashboardCheckpoint, DashboardCurve, DashboardCurves, DashboardGpu,
                                   DashboardOverview, DashboardRun, DashboardSampling, DashboardSession)

STATIC = Path(__file__).parent / "static"
MAX_RUNS, MAX_CHECKPOINTS, MAX_SESSIONS = 500, 1000, 200
"""The newest this many are shown."""
SILENT_AFTER = timedelta(seconds=30)
"""A session without a heartbeat this long (the SDK sends one every 10 s) shows as silent."""
# The page holds a secret: it runs only its own script and talks only to this server.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
}

public_router = APIRouter()
router = APIRouter(prefix="/api/v1/dashboard")


@public_router.get("/dashboard", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(STATIC / "dashboard.html", media_type="text/html", headers=PAGE_HEADERS)


@public_router.get("/dashboard/dashboard.js", include_in_schema=False)
async def script() -> FileResponse:
    return FileResponse(STATIC / "dashboard.js", media_type="text/javascript", headers=PAGE_HEADERS)


@router.get("/overview")
async def overview(services: ServicesDep, owner: OwnerDep) -> DashboardOverview:
    """The caller's runs, checkpoints and sessions, newest first."""
    return await asyncio.to_thread(_overview, services, owner)


@router.get("/runs/{model_id}/curves")
async def curves(model_id: str, services: ServicesDep, owner: OwnerDep) -> DashboardCurves:
    """A run's metrics per step: loss:sum and the loss's own metrics, KL where known, the optimizer's."""
    await run_of(services.store, model_id, owner)
    recorded = await asyncio.to_thread(services.store.run_metrics.curves, model_id)
    steps = await asyncio.to_thread(services.store.run_metrics.num_steps, [model_id])
    return DashboardCurves(model_id=model_id, num_steps=steps[model_id],
                           curves=[DashboardCurve(kind=c.kind, name=c.name, points=c.points) for c in recorded])


def _overview(services: Services, owner: str) -> DashboardOverview:
    store, now = services.store, utcnow()
    runs, _ = store.list_training_runs(owner=owner, limit=MAX_RUNS, offset=0)
    checkpoints, _ = store.list_checkpoints(model_id=None, owner=owner, limit=MAX_CHECKPOINTS, offset=0)
    sessions = store.list_sessions(owner=owner, limit=MAX_SESSIONS, offset=0)
    steps = store.run_metrics.num_steps([run.model_id for run in runs])
    depths = {run.model_id: services.metrics.queue_depth_of(run.model_id) for run in runs}
    tally = services.metrics.sampling_of(owner)
    runs_per_session: dict[str, int] = {}
    for run in runs:
        runs_per_session[run.session_id] = runs_per_session.get(run.session_id, 0) + 1
    return DashboardOverview(
        tenant=owner, base_model=services.base.name, sampler=services.config.sampler.engine, now=now,
        queue_depth=sum(depths.values()), stored_bytes=store.stored_checkpoint_bytes(owner),
        sampling=DashboardSampling(requests=tally.requests, in_flight=services.sampling.pending_of(owner),
                                   sampled_tokens=tally.sampled_tokens, prompt_cached_tokens=tally.prompt_cached_tokens,
                                   prompt_computed_tokens=tally.prompt_computed_tokens),
        gpus=[DashboardGpu(device=device, allocated_bytes=allocated, reserved_bytes=reserved, total_bytes=total)
              for device, allocated, reserved, total in gpu_memory()],
        runs=[DashboardRun(model_id=run.model_id, session_id=run.session_id, base_model=run.base_model,
                           lora_rank=run.lora_rank, created_at=run.created_at, last_request_time=run.last_request_time,
                           loaded=run.model_id in services.trainer.models, queue_depth=depths[run.model_id],
                           num_steps=steps[run.model_id]) for run in runs],
        checkpoints=[DashboardCheckpoint(
            tinker_path=c.tinker_path, model_id=c.model_id, checkpoint_type=c.checkpoint_type, size_bytes=c.size_bytes,
            public=c.public, created_at=c.created_at, expires_at=c.expires_at,
            expires_in_seconds=(c.expires_at - now).total_seconds() if c.expires_at else None) for c in checkpoints],
        sessions=[DashboardSession(
            session_id=s.session_id, project_id=s.project_id, display_name=s.display_name, created_at=s.created_at,
            last_heartbeat_at=s.last_heartbeat_at, num_runs=runs_per_session.get(s.session_id, 0),
            status=(s.finish_reason or "finished") if s.finished_at else
            ("silent" if now - s.last_heartbeat_at > SILENT_AFTER else "active")) for s in sessions])
