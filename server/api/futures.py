"""retrieve_future: the long poll every asynchronous request is answered through."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.api.deps import HotCall, RequestCall, Services, services_of, tenant_from
from server.scheduler.sampling import is_sampling_request_id
from server.wire.futures import FutureRetrieveRequest, RequestFailedResponse, TryAgainResponse

# Every sample request is polled here: the route authenticates and reads its body itself (see tenant_from).
hot_router = APIRouter(prefix="/api/v1")

# The SDK re-polls at once on 408, with a 45 s read timeout: hold a poll well inside it.
LONG_POLL_SECONDS = 30.0


@hot_router.post("/retrieve_future", openapi_extra={"requestBody": {"required": True, "content": {
    "application/json": {"schema": FutureRetrieveRequest.model_json_schema()}}}})
async def retrieve_future(request: Request) -> Response:
    """The result of one of the caller's requests; 408 + try_again while it is still running."""
    return await retrieve_one(services_of(request), RequestCall(request))


async def retrieve_one(services: Services, call: HotCall) -> Response:
    """What retrieve_future does, from whichever front served the call (server/direct_routes.py serves it
    without ASGI)."""
    owner = (await tenant_from(services, call.headers)).name
    body = FutureRetrieveRequest.model_validate_json(await call.body())
    read_timeout = call.headers.get("x-stainless-read-timeout")
    timeout = LONG_POLL_SECONDS
    if read_timeout is not None:
        try:
            timeout = max(0.0, min(timeout, float(read_timeout) - 5))
        except ValueError:
            pass
    futures = services.sampling if is_sampling_request_id(body.request_id) else services.scheduler
    outcome = await futures.retrieve(body.request_id, timeout, owner=owner)
    if outcome is None:
        return JSONResponse(TryAgainResponse(request_id=body.request_id).model_dump(), status_code=408)
    if outcome.status == "failed":
        failed = RequestFailedResponse(error=outcome.error or "failed", category=outcome.error_category or "unknown")
        return JSONResponse(failed.model_dump())
    return Response(outcome.result, media_type=outcome.content_type)
