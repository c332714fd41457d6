"""retrieve_future: the long poll every asynchronous request is answered through."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.api.deps import read_body, services_of, tenant_of
from server.scheduler.sampling import is_sampling_request_id
from server.wire.futures import FutureRetrieveRequest, RequestFailedResponse, TryAgainResponse

# Every sample request is polled here: the route authenticates and reads its body itself (see tenant_of).
hot_router = APIRouter(prefix="/api/v1")

# The SDK re-polls at once on 408, with a 45 s read timeout: hold a poll well inside it.
LONG_POLL_SECONDS = 30.0


@hot_router.post("/retrieve_future", openapi_extra={"requestBody": {"required": True, "content": {
    "application/json": {"schema": FutureRetrieveRequest.model_json_schema()}}}})
async def retrieve_future(request: Request) -> Response:
    """The result of one of the caller's requests; 408 + try_again while it is still running."""
    owner = (await tenant_of(request)).name
    services = services_of(request)
    body = FutureRetrieveRequest.model_validate_json(await read_body(request, services.config.limits.max_request_bytes))
    read_timeout = request.headers.get("x-stainless-read-timeout")
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
