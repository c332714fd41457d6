"""Client bootstrap and session lifecycle: client/config, sessions, heartbeats, finish, telemetry, projects and
sessions/search."""

import asyncio
import uuid
from functools import partial

from fastapi import APIRouter, Query

from server.api.deps import OwnerDep, Services, ServicesDep, session_of
from server.errors import Conflict, Gone
from server.runs import check_storage_quota, string_map
from server.store.store import SessionQuery, SessionSearchHit
from server.wire.base import MAX_INT32
from server.wire.lifecycle import (
    AssignSessionProjectRequest,
    ClientFinishedStatusQuery,
    ClientSessionFinished,
    FinishReasonBody,
    SessionActive,
    SessionSearchCursor,
    SessionSearchRequest,
    SessionSearchResponse,
    SessionSummary,
    StatusQuery,
    UserSearchOwner,
)
from server.wire.sessions import (ClientConfigRequest, ClientConfigResponse, CreateSessionRequest,
                                  CreateSessionResponse, FinishSessionRequest, GetSessionResponse, ListSessionsResponse,
                                  SessionHeartbeatRequest, SessionHeartbeatResponse, TelemetryBatch, TelemetryResponse)

router = APIRouter(prefix="/api/v1")


@router.post("/client/config")
async def client_config(body: ClientConfigRequest, services: ServicesDep) -> ClientConfigResponse:
    """Feature flags the SDK reads before anything else."""
    flags = services.config.client
    return ClientConfigResponse(proto_compress_fwdbwd=flags.proto_compress_fwdbwd,
                                fwdbwd_max_chunk_len=flags.fwdbwd_max_chunk_len)


@router.post("/create_session")
async def create_session(body: CreateSessionRequest, services: ServicesDep, owner: OwnerDep) -> CreateSessionResponse:
    """Open an SDK session."""
    await asyncio.to_thread(check_storage_quota, services.store, services.config.limits, owner)
    session_id = str(uuid.uuid4())

    def create():
        services.store.create_session(session_id, tags=body.tags, user_metadata=string_map(body.user_metadata),
                                      sdk_version=body.sdk_version, display_name=body.display_name, owner=owner)
        if body.project_id:
            services.store.set_session_project(session_id, body.project_id)

    await asyncio.to_thread(create)
    return CreateSessionResponse(session_id=session_id)


@router.post("/session_heartbeat")
async def session_heartbeat(body: SessionHeartbeatRequest, services: ServicesDep,
                            owner: OwnerDep) -> SessionHeartbeatResponse:
    """Keep a session alive; a finished session answers 410, which stops the SDK's heartbeat loop."""
    await session_of(services.store, body.session_id, owner)
    if not await asyncio.to_thread(services.store.heartbeat_session, body.session_id):
        raise Gone(f"session {body.session_id} is finished")
    return SessionHeartbeatResponse()


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, body: FinishSessionRequest, services: ServicesDep,
                         owner: OwnerDep) -> dict:
    """Close a session (ServiceClient.close): its runs leave memory; runs and checkpoints stay listed."""
    await session_of(services.store, session_id, owner)
    await asyncio.to_thread(services.store.finish_session, session_id, body.reason.type)
    _retire_runs(services, await asyncio.to_thread(services.store.list_training_run_ids, session_id))
    return {}


async def expire_silent_sessions(services: Services) -> list[str]:
    """Finish the sessions whose client stopped heartbeating without closing them (it exited, as the
    cookbook's DPO recipe does, or crashed); their runs leave memory as on finish. Returns their ids."""
    store = services.store
    silent = await asyncio.to_thread(store.silent_session_ids, services.config.limits.session_timeout_seconds)
    expired = [session_id for session_id in silent
               if await asyncio.to_thread(store.finish_session, session_id, "expired")]
    for session_id in expired:
        _retire_runs(services, await asyncio.to_thread(store.list_training_run_ids, session_id))
    return expired


def _retire_runs(services: Services, model_ids: list[str]) -> None:
    for model_id in model_ids:
        # Unloaded after its queued requests; then its ephemeral sampling adapters go too.
        services.scheduler.retire_model(model_id, partial(services.adapters.forget_run, model_id))


@router.get("/sessions")
async def list_sessions(services: ServicesDep, owner: OwnerDep, limit: int = Query(20, ge=1, le=1000),
                        offset: int = Query(0, ge=0, le=MAX_INT32)) -> ListSessionsResponse:
    """The caller's sessions, newest first."""
    sessions = await asyncio.to_thread(services.store.list_sessions, owner=owner, limit=limit, offset=offset)
    return ListSessionsResponse(sessions=[s.session_id for s in sessions])


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, services: ServicesDep, owner: OwnerDep) -> GetSessionResponse:
    """A session's training runs and samplers."""
    session = await session_of(services.store, session_id, owner)
    store = services.store
    return GetSessionResponse(training_run_ids=await asyncio.to_thread(store.list_training_run_ids, session_id),
                              sampler_ids=await asyncio.to_thread(store.list_sampling_session_ids, session_id),
                              user_metadata=session.user_metadata or None, display_name=session.display_name)


@router.delete("/sessions/{session_id}")
async def delete_session(session_id: str, services: ServicesDep, owner: OwnerDep) -> dict:
    """Delete a finished session with its runs, their results and curves, and its samplers (not an SDK call). A
    session that still has checkpoints, or requests queued or running, is a 409 that says what to do first."""
    session = await session_of(services.store, session_id, owner)
    if session.finished_at is None:
        raise Conflict(f"session {session_id} is still open: finish it first (ServiceClient.close(), or "
                       f"POST /api/v1/sessions/{session_id}/finish)")
    run_ids = await asyncio.to_thread(services.store.list_training_run_ids, session_id)
    busy = [model_id for model_id in run_ids
            if services.metrics.queue_depth_of(model_id) or model_id in services.trainer.models]
    if busy:
        raise Conflict(f"run {busy[0]} of session {session_id} still has requests queued or running; try again "
                       f"once they are done")
    for model_id in run_ids:
        checkpoints, _ = await asyncio.to_thread(services.store.list_checkpoints, model_id=model_id, owner=owner,
                                                 limit=1, offset=0)
        if checkpoints:
            raise Conflict(f"session {session_id} still has checkpoints (such as {checkpoints[0].tinker_path}): "
                           f"delete them first (DELETE /api/v1/training_runs/{{run}}/checkpoints/{{id}})")
    await asyncio.to_thread(services.store.delete_session, session_id)
    return {}


@router.put("/sessions/{session_id}/project")
async def assign_session_project(session_id: str, body: AssignSessionProjectRequest, services: ServicesDep,
                                 owner: OwnerDep) -> dict:
    """Move a session, with its runs and samplers, into a project (a label within the tenant)."""
    await session_of(services.store, session_id, owner)
    await asyncio.to_thread(services.store.set_session_project, session_id, body.project_id)
    return {}


_FINISH_REASONS = ("success", "errored", "interrupted")


def _status_keys(query: StatusQuery) -> tuple[str, ...]:
    # Nothing here is ever failed or cancelled by the server, so those queries match no session.
    if query.type == "active":
        return ("active",)
    if isinstance(query, ClientFinishedStatusQuery):
        return tuple(query.reasons or _FINISH_REASONS)
    return ()


def _summary(hit: SessionSearchHit) -> SessionSummary:
    session = hit.session
    status = None
    if session.finished_at is None:
        status = SessionActive()
    elif session.finish_reason in _FINISH_REASONS:
        status = ClientSessionFinished(reason=FinishReasonBody(type=session.finish_reason))
    return SessionSummary(session_id=session.session_id, created_at=session.created_at, owner=session.owner,
                          project_id=session.project_id, status=status, checkpoints_count=hit.num_checkpoints,
                          display_name=session.display_name, user_metadata=session.user_metadata or None,
                          checkpoint_storage_bytes=hit.checkpoint_bytes)


@router.post("/sessions/search")
async def search_sessions(body: SessionSearchRequest, services: ServicesDep, owner: OwnerDep) -> SessionSearchResponse:
    """The caller's sessions matching every filter, newest first, one page at a time (a tenant sees only its own,
    whatever `owner` asks for)."""
    if isinstance(body.owner, UserSearchOwner) and owner not in body.owner.owner_urns:
        return SessionSearchResponse(sessions=[])
    query = SessionQuery(
        owner=owner, session_id=body.session_id,
        display_name_words=tuple(body.display_name.split()) if body.display_name else (),
        project_ids=None if body.project_ids is None else tuple(body.project_ids),
        user_metadata=body.user_metadata,
        statuses=None if body.statuses is None else tuple(key for q in body.statuses for key in _status_keys(q)),
        after=body.cursor and (body.cursor.last_created_at, body.cursor.last_session_id),
        limit=body.limit + 1)  # one more tells whether another page follows
    hits = await asyncio.to_thread(services.store.search_sessions, query)
    page = hits[:body.limit]
    next_cursor = None
    if len(hits) > body.limit:
        next_cursor = SessionSearchCursor(last_created_at=page[-1].session.created_at,
                                          last_session_id=page[-1].session.session_id)
    return SessionSearchResponse(sessions=[_summary(hit) for hit in page], next_cursor=next_cursor)


@router.post("/telemetry")
async def telemetry(body: TelemetryBatch) -> TelemetryResponse:
    """Accept and drop client telemetry."""
    return TelemetryResponse()
