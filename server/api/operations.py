"""Operations: liveness (the one route that needs no key), Prometheus metrics (admin keys) and the API docs."""

from fastapi import APIRouter, Depends, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from server.api.deps import ServicesDep, require_admin
from server.wire.types import HealthResponse

public_router = APIRouter()
router = APIRouter()


@public_router.get("/api/v1/healthz")
async def healthz() -> HealthResponse:
    """Liveness: the app only serves once the model is loaded."""
    return HealthResponse()


@router.get("/metrics", dependencies=[Depends(require_admin)], response_class=Response)
async def metrics(services: ServicesDep) -> Response:
    """Prometheus metrics (an admin key, as X-API-Key or `Authorization: Bearer`)."""
    return Response(services.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@router.get("/docs", include_in_schema=False)
async def docs(request: Request) -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title=request.app.title)
