"""Operations: liveness and the docs page (the routes that need no key), Prometheus metrics (admin keys) and
the API's schema."""

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from server.api.deps import ServicesDep, require_admin
from server.store.db import has_no_room, sqlite_journal_file
from server.wire.sessions import HealthResponse

_SWAGGER_JS = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"
_SWAGGER_CSS = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"

public_router = APIRouter()
router = APIRouter()


@public_router.get("/api/v1/healthz")
async def healthz(services: ServicesDep) -> HealthResponse:
    """Liveness: the app only serves once the model is loaded; "degraded" while a disk it writes to is full (the
    server stays up, and what needs the disk fails with 507 until space is freed)."""
    journal = sqlite_journal_file(services.store.engine.url)
    full = [what for what, directory in (("checkpoints", services.config.store.checkpoint_dir),
                                         ("journal", journal.parent if journal else None))
            if directory is not None and await asyncio.to_thread(has_no_room, directory)]
    if services.scheduler.num_unjournaled and "journal" not in full:
        full.append("journal")
    if full:
        return HealthResponse(status="degraded", detail=f"the disk of the {' and the '.join(full)} is full")
    return HealthResponse()


@router.get("/metrics", dependencies=[Depends(require_admin)], response_class=Response)
async def metrics(services: ServicesDep) -> Response:
    """Prometheus metrics (an admin key, as X-API-Key or `Authorization: Bearer`)."""
    return Response(services.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


# The docs page itself holds nothing: it asks for the API key once per browser tab and sends it (as
# X-API-Key) with every request it makes, the schema's included, which stays behind the key.
_DOCS_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<link rel="stylesheet" href="{css}"></head>
<body><div id="swagger-ui"></div>
<script src="{js}"></script>
<script>
function apiKey(ask) {{
  let key = sessionStorage.getItem("tinker-api-key");
  if (ask || !key) {{
    key = prompt("API key of this server (X-API-Key; the server's banner shows the first one):", key || "");
    if (key) sessionStorage.setItem("tinker-api-key", key);
  }}
  return key || "";
}}
apiKey(false);
SwaggerUIBundle({{
  url: "/openapi.json", dom_id: "#swagger-ui",
  requestInterceptor: (request) => {{ request.headers["X-API-Key"] = apiKey(false); return request; }},
  responseInterceptor: (response) => {{
    if (response.status === 401 && response.url.endsWith("/openapi.json")) {{ apiKey(true); location.reload(); }}
    return response;
  }},
}});
</script></body></html>
"""


@public_router.get("/docs", include_in_schema=False)
async def docs(request: Request) -> HTMLResponse:
    """The API's interactive docs (Swagger UI): a page that asks for the key and sends it with every call."""
    return HTMLResponse(_DOCS_PAGE.format(title=request.app.title, css=_SWAGGER_CSS, js=_SWAGGER_JS))
