"""What every route needs: the server's services, the caller's tenant, bounded body reading, ids, the
lookups of the caller's sessions, runs and samplers (404 where they are not the caller's), and the hand-off
of a training request to the scheduler (with `sequenced`, which marks the routes that run in seq_id order).

Routes stay thin: they validate, look things up here, and call named functions (server/runs.py,
server/checkpoints/) or the scheduler. Route modules import this module, never each other.
"""

import asyncio
import hashlib
import json
import logging
import multiprocessing
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Protocol

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader
from pydantic import BaseModel

from server.checkpoints.lifecycle import Checkpoints
from server.config import ServerConfig
from server.errors import (Conflict, Forbidden, InvalidRequest, NotFound, PayloadTooLarge, TinkerServerError,
                           Unauthorized)
from server.metrics import ServerMetrics
from server.models.builtin import spellings
from server.models.loading import LoadedModel
from server.rendering.chunks import RenderContext
from server.rendering.sampling import VLLMRenderer
from server.runs import storable_id
from server.sampling.adapters import SamplerAdapters
from server.sampling.types import SamplingEngine
from server.scheduler.requests import Respond
from server.scheduler.sampling import SamplingFutures
from server.scheduler.scheduler import Scheduler
from server.store.api_keys import BOOTSTRAP_TENANT, KnownKeys, hash_api_key
from server.store.exports import Signer
from server.store.ownership import Ownership
from server.store.retention import CheckpointPins
from server.store.store import SamplingSessionRecord, SessionRecord, Store, TrainingRunRecord
from server.training.operations import Operation
from server.training.trainer import Trainer
from server.wire import JSON
from server.wire.base import MAX_SEQ_ID
from server.wire.models import OptimizerConfig
from server.wire.proto import read_forward_backward_slot

logger = logging.getLogger(__name__)



@dataclass
class Services:
    config: ServerConfig
    store: Store
    scheduler: Scheduler
    """Training-side requests: journaled futures in each run's seq_id order."""
    sampling: SamplingFutures
    """Sampling requests: futures in memory, fed to `sampler`."""
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
    checkpoints: Checkpoints
    """What the checkpoint lifecycle (server/checkpoints) works with."""
    signer: Signer
    """Signs download URLs and weights access tokens."""
    metrics: ServerMetrics
    keys: KnownKeys
    """API keys found valid lately (each request's key is checked against it before the journal)."""
    ownership: Ownership
    """This server's hold on its data directory and database, released at shutdown."""


def services_of(request: Request) -> Services:
    return request.app.state.services


# The dependencies are `async def` although they never wait: FastAPI runs a plain `def` dependency on a
# worker thread, a thread hop per dependency per request.
async def get_services(request: Request) -> Services:
    return services_of(request)


@dataclass(frozen=True)
class Tenant:
    """Whose a request is: every session, run, checkpoint and future belongs to one tenant."""

    name: str
    admin: bool = False
    """May read server-wide data (/metrics)."""


API_KEY_HEADER = APIKeyHeader(name="X-API-Key", auto_error=False,
                              description="an API key issued by `python -m server keys create --tenant NAME`")
MAX_API_KEY_LENGTH = 512


async def authenticate(request: Request, x_api_key: Annotated[str | None, Depends(API_KEY_HEADER)]) -> Tenant:
    """The caller's tenant from its API key (X-API-Key, or `Authorization: Bearer` for scrapers); 401 otherwise."""
    return await tenant_of(request)


async def tenant_of(request: Request) -> Tenant:
    """What `authenticate` does, kept on the request (for `journal_refusal`)."""
    request.state.tenant = await tenant_from(services_of(request), request.headers)
    return request.state.tenant


async def tenant_from(services: Services, headers: Mapping[str, str]) -> Tenant:
    """The tenant of a request's headers (lowercase names); the routes of the sampling hot path call it themselves
    (resolving FastAPI dependencies cost them more than their own work)."""
    if services.config.auth == "none":
        return Tenant(BOOTSTRAP_TENANT, admin=True)
    key = headers.get("x-api-key") or _bearer_token(headers.get("authorization"))
    if not key:
        raise Unauthorized("missing X-API-Key header (an operator issues keys with "
                           "`python -m server keys create --tenant NAME`)")
    record = None
    if len(key) <= MAX_API_KEY_LENGTH:
        key_hash = hash_api_key(key)
        record = services.keys.known(key_hash) or await asyncio.to_thread(services.keys.find, key_hash)
    if record is None:
        raise Unauthorized("unknown or revoked API key")
    return Tenant(record.tenant, record.admin)


def _bearer_token(authorization: str | None) -> str | None:
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


TenantDep = Annotated[Tenant, Depends(authenticate)]


async def get_owner(tenant: TenantDep) -> str:
    """The name of the caller's tenant, which owns what the caller creates."""
    return tenant.name


async def require_admin(tenant: TenantDep) -> Tenant:
    if not tenant.admin:
        raise Forbidden("this needs an admin key (`python -m server keys create --tenant NAME --admin`)")
    return tenant


ServicesDep = Annotated[Services, Depends(get_services)]
OwnerDep = Annotated[str, Depends(get_owner)]


def new_request_id() -> str:
    return uuid.uuid4().hex


def payload_hash(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing to buffer more than `limit` bytes (kept on the request for `journal_refusal`)."""
    refuse_large_body(request.headers.get("content-length"), 0, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        refuse_large_body(None, size, limit)
        chunks.append(chunk)
    request.state.body = b"".join(chunks)
    return request.state.body


def refuse_large_body(declared: str | None, received: int, limit: int) -> None:
    """413 for a body over `limit` bytes, by the content-length it declares or by the bytes that arrived."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes is over the limit of {limit}")
    if received > limit:
        raise PayloadTooLarge(f"request body is over the limit of {limit} bytes")


class HotCall(Protocol):
    """A request of the sampling hot path as its routes read it: from Starlette's Request (`RequestCall`), or
    straight from the HTTP protocol (server/direct_routes.py)."""

    headers: Mapping[str, str]
    """Looked up by lowercase name."""

    async def body(self) -> bytes:
        """The raw body; 413 when it is over max_request_bytes."""


@dataclass(frozen=True)
class RequestCall:
    """A hot request that came through ASGI."""

    request: Request

    @property
    def headers(self) -> Mapping[str, str]:
        return self.request.headers

    async def body(self) -> bytes:
        return await read_body(self.request, services_of(self.request).config.limits.max_request_bytes)


async def session_of(store: Store, session_id: str, owner: str) -> SessionRecord:
    """The caller's session, or 404 (another tenant's session is not found either); read off the event loop."""
    session = await asyncio.to_thread(store.get_session, session_id) if storable_id(session_id) else None
    if session is None or session.owner != owner:
        raise NotFound(f"no session {session_id}")
    return session


async def run_of(store: Store, model_id: str, owner: str) -> TrainingRunRecord:
    """The caller's training run, or 404; read off the event loop."""
    run = await asyncio.to_thread(store.get_training_run, model_id) if storable_id(model_id) else None
    if run is None or run.owner != owner:
        raise NotFound(f"no model {model_id}")
    return run


async def sampler_of(services: Services, sampling_session_id: str, owner: str) -> SamplingSessionRecord:
    """The caller's sampling session, or 404: from memory when it was read lately (every sample request of an
    RL loop names the same one), else read off the event loop."""
    record = None
    if storable_id(sampling_session_id):
        store = services.store
        record = (store.remembered_sampling_session(sampling_session_id)
                  or await asyncio.to_thread(store.get_sampling_session, sampling_session_id))
    if record is None or record.owner != owner:
        raise NotFound(f"no sampling session {sampling_session_id}")
    return record


def serves(services: Services, model: str) -> bool:
    """Whether `model` names the served base model (a built-in by either of its spellings)."""
    return model in spellings(services.base.name)


def check_base_model(services: Services, base_model: str | None) -> None:
    if base_model is not None and not serves(services, base_model):
        raise InvalidRequest(f"base_model {base_model!r} is not served here; this server serves "
                             f"{services.base.name!r}")


def check_optimizer(config: OptimizerConfig | None) -> None:
    if config is not None and config.type != "adamw":
        raise InvalidRequest(f"optimizer {config.type!r} is not supported; use adamw")


@dataclass(frozen=True)
class TrainingSubmission:
    """What a training route hands the scheduler: the typed operation, and how its result becomes the response."""

    operation: Operation
    respond: Respond
    """The result -> the future's payload (recording what the route records: rows, checkpoint files)."""
    release: Callable[[], None] | None = None
    """Let go of what the request holds (a load's pin on its checkpoint), once it is over."""


async def submit_training_op(services: Services, *, owner: str, model_id: str, seq_id: int | None,
                             request_type: str, body: bytes, prepare: Callable[[], TrainingSubmission]) -> str:
    """Validate (via `prepare`) and submit one training-side request in its model's seq_id order.

    `prepare` runs on a worker thread, since rendering decodes images. If it refuses the request,
    the error handler's `journal_refusal` gives the refused request its seq_id.
    """
    submission = await asyncio.to_thread(prepare)
    return await services.scheduler.submit_training(request_id=new_request_id(), request_type=request_type,
                                                    owner=owner, model_id=model_id, seq_id=seq_id,
                                                    payload_hash=payload_hash(body), operation=submission.operation,
                                                    respond=submission.respond, release=submission.release)


def sequenced(request_type: str):
    """Mark a route whose requests run in their model's seq_id order and journal as `request_type`: a refusal
    of one still takes its seq_id (`journal_refusal`)."""
    def mark(endpoint):
        endpoint.request_type = request_type
        return endpoint

    return mark


async def journal_refusal(request: Request, error: TinkerServerError) -> None:
    """Give a refused training-side request its (model_id, seq_id) slot, as a failed future.

    Called by the error handler for every refusal (body validation, decoding, limits, rendering), so
    the run's later requests, which wait for that seq_id, go on. Only the caller's own runs are
    touched; a body whose model_id and seq_id cannot be read leaves a gap that the scheduler's gap
    timeout closes.
    """
    request_type = getattr(getattr(request.scope.get("route"), "endpoint", None), "request_type", None)
    tenant, body = getattr(request.state, "tenant", None), getattr(request.state, "body", None)
    if request_type is None or tenant is None or body is None or isinstance(error, Conflict):
        return
    services = services_of(request)
    if request_type == "ForwardBackward":
        inflated = getattr(request.state, "inflated", False)
        slot = read_forward_backward_slot(body, None if inflated else request.headers.get("content-encoding"),
                                          services.config.limits.max_decompressed_bytes)
        if slot is not None and slot[2]:
            request_type = "Forward"
    else:
        slot = _read_json_slot(body)
    if slot is None:
        return
    model_id, seq_id = slot[0], slot[1]
    try:
        run = await asyncio.to_thread(services.store.get_training_run, model_id)
        if run is None or run.owner != tenant.name:
            return
        await services.scheduler.refuse_training(request_id=new_request_id(), request_type=request_type,
                                                 owner=tenant.name, model_id=model_id, seq_id=seq_id,
                                                 payload_hash=payload_hash(body),
                                                 error=error)
    except TinkerServerError:  # the slot holds another request already, or the server is stopping
        pass
    except Exception:  # the client gets its refusal regardless; a gap is closed by the gap timeout
        logger.exception("could not journal the refusal of %s seq_id %s", model_id, seq_id)


def _read_json_slot(body: bytes) -> tuple[str, int] | None:
    try:
        fields = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: JSON nested thousands deep
        return None
    if not isinstance(fields, dict):
        return None
    model_id, seq_id = fields.get("model_id"), fields.get("seq_id")
    if not isinstance(model_id, str) or type(seq_id) is not int or not 1 <= seq_id <= MAX_SEQ_ID:
        return None
    return model_id, seq_id


def check_sampled_tokens(services: Services, num_samples: int, max_tokens: int) -> None:
    limit = services.config.limits.max_sampled_tokens_per_request
    if num_samples * max_tokens > limit:
        raise InvalidRequest(f"num_samples ({num_samples}) x max_tokens ({max_tokens}) is over this server's limit "
                             f"of {limit} tokens per request (--max-sampled-tokens-per-request); split the request")


def check_loss_config(config: dict[str, float]) -> None:
    """Loss settings that make no sense are refused by name (their magnitude is bounded by the wire)."""
    low, high = config.get("clip_low_threshold"), config.get("clip_high_threshold")
    if low is not None and high is not None and not 0 <= low <= high:
        raise InvalidRequest(f"loss_fn_config clip thresholds must satisfy 0 <= clip_low_threshold ({low:g}) <= "
                             f"clip_high_threshold ({high:g})")
    for key in ("beta", "kl_coeff"):
        if config.get(key, 0.0) < 0:
            raise InvalidRequest(f"loss_fn_config {key} must be >= 0, got {config[key]:g}")
    if config.get("ratio_cap", 1.0) <= 0:
        raise InvalidRequest(f"loss_fn_config ratio_cap must be > 0, got {config['ratio_cap']:g}")


def json_result(response: BaseModel) -> tuple[bytes, str]:
    """A pydantic response as a future's stored result."""
    return response.model_dump_json().encode(), JSON
