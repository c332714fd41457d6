"""retrieve_future: the long poll every asynchronous request is answered through."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.api.deps import OwnerDep, ServicesDep
from server.wire.types import FutureRetrieveRequest, RequestFailedResponse, TryAgainResponse

router = APIRouter(prefix="/api/v1")

# The SDK re-polls at once on 408, with a 45 s read timeout: hold a poll well inside it.
LONG_POLL_SECONDS = 30.0


@router.post("/retrieve_future")
async def retrieve_future(body: FutureRetrieveRequest, request: Request, services: ServicesDep,
                          owner: OwnerDep) -> Response:
    """The result of one of the caller's requests; 408 + try_again while it is still running."""
    read_timeout = request.headers.get("x-stainless-read-timeout")
    timeout = LONG_POLL_SECONDS
    if read_timeout is not None:
        try:
            timeout = max(0.0, min(timeout, float(read_timeout) - 5))
        except ValueError:
            pass
    record = await services.scheduler.retrieve(body.request_id, timeout, owner=owner)
    if record is None:
        return JSONResponse(TryAgainResponse(request_id=body.request_id).model_dump(), status_code=408)
    if record.status == "failed":
        failed = RequestFailedResponse(error=record.error or "failed", category=record.error_category or "unknown")
        return JSONResponse(failed.model_dump())
    return Response(record.result, media_type=record.content_type)
