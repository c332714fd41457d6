"""The FastAPI app: builds the services (store, model, trainer, sampler, scheduler) and maps errors.

`create_app(config)` is all a caller needs; the lifespan takes the data directory (one server per
data directory and database), loads the model before the first request is served, prints the
banner (with the first API key, once), and on shutdown stops taking work and ends every future
within a bounded time.
The error handler turns `TinkerServerError`, validation errors and anything unexpected into a
4xx/5xx with a body that says what is wrong (never a server path), and gives a refused training
request its seq_id so its run goes on. `HotRoutes` serves the sampling hot path ahead of FastAPI.
"""

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from sqlalchemy.exc import SQLAlchemyError
from starlette.requests import ClientDisconnect

from server.api import (checkpoints, dashboard, futures, models, openai_compat, operations, rest, sampling, sessions,
                        training, weights)
from server.api.deps import HotCall, RequestCall, Services, authenticate, journal_refusal
from server.banner import start_banner
from server.checkpoints.lifecycle import Checkpoints, sweep_expired
from server.config import ServerConfig
from server.errors import Conflict, InvalidRequest, TinkerServerError, rank_lost_cause, without_server_paths
from server.metrics import ServerMetrics
from server.rendering.chunks import RenderContext
from server.rendering.images import ImagePreparer
from server.rendering.sampling import VLLMRenderer
from server.sampling.engine import build_sampling_engine, checkpoint_adapter_name
from server.scheduler.sampling import SamplingFutures
from server.scheduler.scheduler import Scheduler
from server.store.api_keys import BOOTSTRAP_TENANT, KnownKeys, issue_api_key
from server.store.checkpoints import sweep_unlisted_versions
from server.store.db import storage_failure
from server.store.exports import Signer
from server.store.ownership import AlreadyServed, Ownership
from server.store.retention import CheckpointPins
from server.store.store import Store, utcnow
from server.training.executor import TrainingExecutor
from server.training.parallel import free_port, init_training_group
from server.training.trainer import build_trainer
from server.training.workers import start_local_ranks

logger = logging.getLogger(__name__)

RETENTION_INTERVAL_SECONDS = 600.0
OPENAI_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                      404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def build_services(config: ServerConfig, metrics: ServerMetrics) -> Services:
    """Take the data directory, open the journal, load the base model and wire the engines together."""
    config.data_dir.mkdir(parents=True, exist_ok=True)
    store = Store(config.store.database_url)
    try:
        ownership = Ownership(config.data_dir, store.engine)
    except AlreadyServed:
        store.close()
        raise
    # Only now, as the one owner: a second server must never fail the first one's running requests.
    abandoned = store.fail_pending_futures("the server restarted before this request finished; send it again")
    if abandoned:
        logger.warning("%d requests were pending at the last shutdown and are marked failed", abandoned)
    swept = sweep_unlisted_versions(config.store.checkpoint_dir, store.checkpoint_directories())
    if swept:
        logger.info("event=checkpoint_leftovers_removed count=%d (saves a stop cut short)", swept)
    # Training ranks 1.. are processes of their own; this process is rank 0. The trainer's copy of the base
    # model is sharded (FSDP2) or replicated and driven by the training thread alone, so sampling gets its own.
    if config.trainer.master_port == 0:
        config = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, master_port=free_port()))
    training_ranks = start_local_ranks(config)
    trainer_config = config.trainer
    group = init_training_group(0, trainer_config.world_size, config.model.device_type, trainer_config.master_addr,
                                trainer_config.master_port, trainer_config.training_devices, trainer_config.local_ranks)
    started = time.perf_counter()
    trainer = build_trainer(config.model, trainer_config, config.images.feature_cache_bytes, group)
    base = trainer.base  # what requests need to know of the model: name, tokenizer, vocabulary, vision
    logger.info("event=model_loaded base_model=%s device=%s dtype=%s ranks=%d base_sharding=%s seconds=%.1f",
                base.name, config.model.device, config.model.dtype, trainer_config.world_size, trainer.base_sharding,
                time.perf_counter() - started)
    images = (ImagePreparer(base.vision.processor, config.images, host_pixel_values=config.model.device_type == "cpu")
              if base.vision is not None else None)
    render_context = RenderContext.build(base, config.limits.max_sequence_length, images)
    sampler, adapters = build_sampling_engine(config.sampler, config.model, config.images.feature_cache_bytes, base,
                                              config.data_dir)
    scheduler = Scheduler(store, TrainingExecutor(trainer), pass_tokens=trainer_config.max_tokens_per_pass,
                          pass_runs=trainer_config.max_runs_per_pass,
                          seq_gap_timeout=config.limits.seq_gap_timeout_seconds, metrics=metrics,
                          hidden_paths=(str(config.data_dir),))
    sampling = SamplingFutures(sampler, metrics, hidden_paths=(str(config.data_dir),))
    pins = CheckpointPins()

    def forget(record):  # every cached copy of a deleted or overwritten checkpoint's adapter
        adapters.forget(Path(record.directory))
        sampler.forget(checkpoint_adapter_name(record.tinker_path, record.created_at))

    return Services(config=config, store=store, scheduler=scheduler, sampling=sampling, base=base, trainer=trainer,
                    training_ranks=training_ranks, sampler=sampler, adapters=adapters, render_context=render_context,
                    sampling_renderer=VLLMRenderer(render_context), metrics=metrics, keys=KnownKeys(store),
                    ownership=ownership,
                    checkpoint_pins=pins, signer=Signer.from_data_dir(config.data_dir),
                    checkpoints=Checkpoints(store, config.store.checkpoint_dir, pins, config.limits, forget))


def _stop_for_lost_rank(app: FastAPI, rank: int) -> None:
    """A training rank died: its group cannot go on, so the server stops as on SIGTERM, failing what it holds
    with the cause, and exits with a status that says it failed (`stop_serving` and the exit are __main__'s)."""
    app.state.lost_rank = rank
    app.state.exit_message = (f"{rank_lost_cause(rank)}: the server stopped. Start it again with the same command, "
                              f"and on every other node its torchrun; clients send their failed requests again and "
                              f"resume runs from their last checkpoint.")
    logger.error("event=training_rank_lost rank=%d %s", rank, app.state.exit_message)
    app.state.stop_serving()


async def _retention_loop(services: Services) -> None:
    """Keep the futures journal and the sequences recorded for stable_reinforce bounded."""
    while True:
        await asyncio.sleep(RETENTION_INTERVAL_SECONDS)
        seconds = services.config.store.future_retention_seconds
        await asyncio.to_thread(services.store.delete_finished_futures_older_than, seconds)
        await asyncio.to_thread(services.store.sampled_sequences.delete_expired)


async def _session_expiry_loop(services: Services) -> None:
    """Take the runs of abandoned sessions out of memory; looks every quarter timeout (at most every minute)."""
    timeout = services.config.limits.session_timeout_seconds
    while True:
        await asyncio.sleep(min(60.0, timeout / 4))
        try:
            expired = await sessions.expire_silent_sessions(services)
        except Exception:
            # A database hiccup must not end the loop: the next round tries again.
            logger.exception("could not expire silent sessions")
            continue
        if expired:
            logger.info("finished %d sessions silent for over %g s: %s", len(expired), timeout, ", ".join(expired))


async def _checkpoint_sweep_loop(services: Services) -> None:
    """Delete checkpoints past their TTL that are not in use (see server/store/retention.py)."""
    while True:
        await asyncio.sleep(services.config.store.checkpoint_sweep_seconds)
        try:
            await asyncio.to_thread(sweep_expired, services.checkpoints, utcnow())
        except Exception:
            logger.exception("could not delete expired checkpoints")


def _bootstrap_key(services: Services) -> str | None:
    """On a first start with keys on, issue an admin key for the default tenant (the banner shows it once)."""
    if services.config.auth != "keys" or services.store.has_api_keys():
        return None
    key, _ = issue_api_key(services.store, BOOTSTRAP_TENANT, admin=True, label="bootstrap")
    return key


class RequestMetrics:
    """ASGI middleware counting every HTTP request by route template, method and status."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.count_http(route, scope["method"], status[0])


class HotRoutes:
    """ASGI front of the two requests every sample takes (`asample`, then `retrieve_future`), served here before
    FastAPI's middleware, routing and dependency resolution, which cost more than their own work (a sample
    request is thousands a second in RL; benchmarks/RESULTS.md). They authenticate themselves, count in the
    metrics and refuse what they refuse exactly as the app does. Every other request goes to the app. Under
    `python -m server` the HTTP protocol serves them itself through `answer` (server/direct_routes.py)."""

    def __init__(self, app: FastAPI, metrics: ServerMetrics, data_dir: Path):
        self.app, self.metrics, self.data_dir = app, metrics, data_dir
        self.state = app.state
        self.routes = {"/api/v1/asample": sampling.sample_one, "/api/v1/retrieve_future": futures.retrieve_one}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, self._lifespan_send(send))
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.routes:
            return await self.app(scope, receive, send)
        scope["app"] = self.app  # what request.app finds: the services
        response = await self.answer(scope["path"], RequestCall(Request(scope, receive)))
        await response(scope, receive, send)

    async def answer(self, path: str, call: HotCall) -> Response:
        """The response to a call of one of the routes, a refusal included, counted in the metrics."""
        try:
            result = await self.routes[path](self.state.services, call)
            response = result if isinstance(result, Response) else Response(result.model_dump_json(),
                                                                             media_type="application/json")
        except Exception as error:
            response = refusal_response(error, path, self.data_dir)
        self.metrics.count_http(path, "POST", response.status_code)
        return response

    def _lifespan_send(self, send):
        """A start-up refused for what the operator gave fails with its reason, not the traceback (--debug)."""
        async def refused_in_one_line(message):
            reason = getattr(self.state, "start_refused", None)
            if message["type"] == "lifespan.startup.failed" and reason:
                message = {**message, "message": f"{reason} (--debug prints the traceback)"}
            await send(message)

        return refused_in_one_line


def refusal_of(error: Exception, path: str) -> TinkerServerError:
    """What a client is told of anything its request raised (an error that tells it nothing is logged in full)."""
    if isinstance(error, TinkerServerError):
        return error
    if isinstance(error, ClientDisconnect):  # it stalled (server/connections.py) or left; no one reads the answer
        return InvalidRequest("the connection closed before the request's body arrived")
    if isinstance(error, (RequestValidationError, ValidationError)):
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors())
        return InvalidRequest(f"invalid request: {problems}")
    if isinstance(error, (OSError, SQLAlchemyError)):
        failure = storage_failure(error, "handle this request")
        logger.warning("event=request_failed route=%s error=%r", path, str(failure))
        return failure
    logger.error("event=request_failed route=%s", path, exc_info=error)
    return TinkerServerError(f"internal error ({type(error).__name__}); the server log has the details")


def refusal_response(error: Exception, path: str, data_dir: Path) -> JSONResponse:
    """The response that refuses a request for `error`, in the Tinker error body's shape (OpenAI's on its routes)."""
    refusal = refusal_of(error, path)
    message = without_server_paths(str(refusal), data_dir)
    # The SDK retries 409s for minutes; a conflicting seq_id never succeeds, so say so.
    headers = {"x-should-retry": "false"} if isinstance(refusal, Conflict) else None
    body = {"detail": message, "error": message, "category": refusal.category}  # also a failed future's shape
    if path.startswith(openai_compat.router.prefix):  # OpenAI's shape, which its clients read
        body = {"error": {"message": message, "type": OPENAI_ERROR_TYPES.get(refusal.status_code, "server_error"),
                          "param": None, "code": None}}
    return JSONResponse(body, status_code=refusal.status_code, headers=headers)


def create_app(config: ServerConfig,
               build: Callable[[ServerConfig, ServerMetrics], Services] = build_services) -> HotRoutes:
    """The ASGI app: FastAPI behind the front of the sampling hot path (its `state` is the FastAPI app's).

    Args:
        build: what makes the services at start-up (route tests pass one with a fake trainer and engine).
    """
    metrics = ServerMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            services = await asyncio.to_thread(build, config, metrics)
        except (AlreadyServed, ValueError) as error:  # what the operator gave: a model, a directory, a device
            logger.error("event=start_refused reason=%r", str(error))
            if not config.debug:
                app.state.start_refused = str(error)
            raise
        app.state.services = services
        gap_check_seconds = max(0.2, min(5.0, config.limits.seq_gap_timeout_seconds / 4))
        housekeeping = [asyncio.create_task(_retention_loop(services)),
                        asyncio.create_task(_session_expiry_loop(services)),
                        asyncio.create_task(_checkpoint_sweep_loop(services)),
                        asyncio.create_task(services.scheduler.watch(gap_check_seconds))]
        lifelines = services.trainer.group.lifelines
        if lifelines is not None:
            lifelines.watch(functools.partial(_stop_for_lost_rank, app))
        key = await asyncio.to_thread(_bootstrap_key, services)
        print(start_banner(config, services.base.path, services.base.family.model_type, key, BOOTSTRAP_TENANT,
                           services.trainer.base_sharding), flush=True)
        logger.info("event=server_start base_model=%s model_path=%s host=%s port=%d auth=%s database=%s sampler=%s",
                    services.base.name, services.base.path, config.host, config.port, config.auth,
                    services.store.engine.url.get_backend_name(), config.sampler.engine)
        try:
            yield
        finally:
            logger.info("event=shutdown_started timeout_seconds=%g", config.shutdown_timeout_seconds)
            started = time.perf_counter()
            for task in housekeeping:
                task.cancel()
            lost_rank = getattr(app.state, "lost_rank", None)
            report = services.scheduler.close(config.shutdown_timeout_seconds,
                                              cause=rank_lost_cause(lost_rank) if lost_rank is not None else None)
            sampled, unsampled = services.sampling.close(config.shutdown_timeout_seconds)
            app.state.abandoned_threads = report.interrupted > 0
            services.sampler.close()
            # The training thread is free to tell the other ranks to stop (with one dead, they stop when this
            # process ends: see lifelines.py).
            if not report.interrupted and lost_rank is None:
                services.trainer.stop_followers()
                for process in services.training_ranks:
                    process.join(timeout=30)
            services.ownership.release()
            services.store.close()
            logger.info("event=shutdown finished_running=%d failed_queued=%d failed_running=%d seconds=%.1f",
                        report.finished + sampled, report.cancelled, report.interrupted + unsampled,
                        time.perf_counter() - started)

    # The server's own Prometheus metrics (RequestMetrics) count requests; FastAPI's OpenTelemetry hooks
    # would only add work to each request.
    app = FastAPI(title="Tinker-compatible training service", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, telemetry={"tracing": False, "metrics": False, "logs": False})
    app.add_middleware(RequestMetrics, metrics=metrics)
    # The two routes every sample request takes, which HotRoutes serves (and which authenticate themselves),
    # are in the app too: for the API's schema.
    app.include_router(sampling.hot_router)
    app.include_router(futures.hot_router)
    app.include_router(operations.public_router)
    app.include_router(checkpoints.public_router)
    app.include_router(dashboard.public_router)
    for module in (sessions, models, training, weights, sampling, rest, checkpoints, operations, dashboard,
                   openai_compat):
        app.include_router(module.router, dependencies=[Depends(authenticate)])

    async def refuse(request: Request, error: Exception) -> JSONResponse:
        """The error response, after giving a refused training request its seq_id (so its run goes on)."""
        refusal = refusal_of(error, request.url.path)
        await journal_refusal(request, refusal)
        return refusal_response(refusal, request.url.path, config.data_dir)

    # Exception is the last resort (Starlette answers it in its outermost middleware); the others are
    # answered where they are raised.
    for kind in (TinkerServerError, RequestValidationError, ValidationError, OSError, SQLAlchemyError, Exception):
        app.add_exception_handler(kind, refuse)
    return HotRoutes(app, metrics, config.data_dir)
