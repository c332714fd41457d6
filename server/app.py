"""The FastAPI app: builds the services (store, model, trainer, sampler, scheduler) and maps errors.

`create_app(config)` is all a caller needs; the lifespan loads the model before the first request
is served and closes everything on shutdown. The one error handler turns `TinkerServerError` (and
request validation errors) into a 4xx/5xx with a body that says what is wrong.
"""

import asyncio
import contextlib
import dataclasses
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from server.api import checkpoints, futures, models, rest, sampling, sessions, training, weights
from server.api.deps import Services
from server.config import ServerConfig
from server.errors import Conflict, TinkerServerError
from server.rendering.chunks import RenderContext
from server.rendering.images import ImagePreparer
from server.rendering.sampling import VLLMRenderer
from server.sampling.engine import build_sampling_engine
from server.scheduler.scheduler import Scheduler
from server.store.exports import Signer
from server.store.retention import CheckpointPins
from server.store.store import Store
from server.training.parallel import free_port, init_training_group
from server.training.trainer import build_trainer
from server.training.workers import start_local_ranks

logger = logging.getLogger(__name__)

RETENTION_INTERVAL_SECONDS = 600.0


def build_services(config: ServerConfig) -> Services:
    """Open the journal, load the base model and wire the engines together."""
    config.data_dir.mkdir(parents=True, exist_ok=True)
    store = Store(config.store.database_url)
    abandoned = store.fail_pending_futures("the server restarted before this request finished; send it again")
    if abandoned:
        logger.warning("%d requests were pending at the last shutdown and are marked failed", abandoned)
    # Training ranks 1.. are processes of their own; this process is rank 0. The trainer's copy of the
    # base model is sharded (FSDP2) and driven by the training thread alone, so sampling gets its own.
    if config.trainer.master_port == 0:
        config = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, master_port=free_port()))
    training_ranks = start_local_ranks(config)
    trainer_config = config.trainer
    group = init_training_group(0, trainer_config.world_size, config.model.device_type, trainer_config.master_addr,
                                trainer_config.master_port)
    trainer = build_trainer(config, group)
    base = trainer.base  # what requests need to know of the model: name, tokenizer, vocabulary, vision
    images = ImagePreparer(base.vision.processor, config.images) if base.vision is not None else None
    render_context = RenderContext.build(base, config.limits.max_sequence_length, images)
    sampler, adapters = build_sampling_engine(config.sampler, config.model, config.images.feature_cache_bytes, base,
                                              config.data_dir)
    return Services(config=config, store=store,
                    scheduler=Scheduler(store, sampling_workers=sampler.max_concurrent_requests),
                    base=base, trainer=trainer, training_ranks=training_ranks, sampler=sampler, adapters=adapters,
                    render_context=render_context, sampling_renderer=VLLMRenderer(render_context),
                    checkpoint_pins=CheckpointPins(), signer=Signer.from_data_dir(config.data_dir))


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
            await checkpoints.sweep_expired(services)
        except Exception:
            logger.exception("could not delete expired checkpoints")


def _error_body(message: str, category: str) -> dict:
    # `detail` is what FastAPI clients expect; `error`/`category` mirror a failed future.
    return {"detail": message, "error": message, "category": category}


def create_app(config: ServerConfig) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        services = await asyncio.to_thread(build_services, config)
        app.state.services = services
        housekeeping = [asyncio.create_task(_retention_loop(services)),
                        asyncio.create_task(_session_expiry_loop(services)),
                        asyncio.create_task(_checkpoint_sweep_loop(services))]
        logger.info("serving %s from %s", services.base.name, services.base.path)
        try:
            yield
        finally:
            for task in housekeeping:
                task.cancel()
            services.scheduler.close()
            services.sampler.close()
            services.trainer.stop_followers()
            for process in services.training_ranks:
                process.join(timeout=30)
            services.store.close()

    app = FastAPI(title="Tinker-compatible training service", lifespan=lifespan)
    for module in (sessions, models, training, weights, sampling, futures, rest, checkpoints):
        app.include_router(module.router)

    @app.exception_handler(TinkerServerError)
    async def server_error(request: Request, error: TinkerServerError) -> JSONResponse:
        # The SDK retries 409s for minutes; a conflicting seq_id never succeeds, so say so.
        headers = {"x-should-retry": "false"} if isinstance(error, Conflict) else None
        return JSONResponse(_error_body(str(error), error.category), status_code=error.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    @app.exception_handler(ValidationError)
    async def invalid_body(request: Request, error: ValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors())
        return JSONResponse(_error_body(f"invalid request: {problems}", "user"), status_code=400)

    return app
