"""What one check found (pass, fail, unsupported, unchecked), how an SDK error is read, and the report tables.

A server says "not supported" with its own words (a 4xx or a failed future naming it) or with a 404 of
the endpoint itself; anything else that goes wrong is a failure. Knows nothing of the checks themselves.
"""

import json
from dataclasses import asdict, dataclass
from typing import Literal

import tinker

Status = Literal["pass", "fail", "unsupported", "unchecked"]
CLIENTS = ("ServiceClient", "TrainingClient", "SamplingClient", "RestClient")
_REFUSAL_WORDS = ("not supported", "unsupported", "not implemented")
# FastAPI's body for a path or method the app does not serve (another server may say it otherwise).
_NO_ROUTE = {404: "Not Found", 405: "Method Not Allowed"}
_CLIENT_ONLY = "client-only: the SDK answered without a request"


@dataclass(frozen=True)
class Outcome:
    client: str
    call: str
    """The method's name, with the option it exercises in brackets where one method has several rows."""
    status: Status
    detail: str = ""
    client_only: bool = False
    """The SDK answered it without a request (a pass that says nothing about the server)."""

    @property
    def method(self) -> str:
        return self.call.split("[")[0]


def error_detail(error: BaseException) -> str:
    """The server's own words for an SDK error: the body's detail, else the exception's message."""
    body = getattr(error, "body", None)
    if isinstance(body, dict):
        for key in ("detail", "error", "message"):
            if isinstance(body.get(key), str):
                return body[key]
    return str(error)


def classify(error: BaseException) -> tuple[Status, str]:
    """unsupported (with the server's reason) or fail (with the error) for an exception a check raised."""
    detail = error_detail(error)
    if isinstance(error, tinker.APIStatusError):
        if _NO_ROUTE.get(error.status_code) == detail:
            return "unsupported", f"the server has no such endpoint (HTTP {error.status_code})"
        if error.status_code == 501:
            return "unsupported", detail
    if any(word in detail.lower() for word in _REFUSAL_WORDS):
        return "unsupported", detail
    return "fail", f"{type(error).__name__}: {detail}"[:500]


def render_text(outcomes: list[Outcome]) -> str:
    """An aligned table for a terminal: one line per check."""
    width = max(len(f"{o.client}.{o.call}") for o in outcomes)
    lines = [f"{'call'.ljust(width)}  {'status':<11}  detail", "-" * (width + 30)]
    lines += [f"{f'{o.client}.{o.call}'.ljust(width)}  {o.status:<11}  {o.detail or _CLIENT_ONLY * o.client_only}"
              for o in outcomes]
    return "\n".join(lines)


def render_markdown(outcomes: list[Outcome]) -> str:
    """Two tables for a README: what passes, per client (marking what the SDK answers without a request),
    then every other row with its reason."""
    lines = ["| SDK class | methods passing | calls that pass (* client-only: answered by the SDK, no request) |",
             "|---|---|---|"]
    for client in CLIENTS:
        rows = [o for o in outcomes if o.client == client]
        methods = [o for o in rows if "[" not in o.call]
        passing = [f"`{o.call}`" + "*" * o.client_only for o in rows if o.status == "pass"]
        num_passing = sum(o.status == "pass" for o in methods)
        num_client_only = sum(o.client_only for o in methods)
        lines.append(f"| `{client}` | {num_passing} of {len(methods)} ({num_client_only} client-only) | "
                     f"{', '.join(passing)} |")
    others = [o for o in outcomes if o.status != "pass"]
    lines += ["", "| call | status | reason |", "|---|---|---|"]
    lines += [f"| `{o.client}.{o.call}` | {o.status} | {o.detail.replace('|', '/')} |" for o in others]
    return "\n".join(lines)


def render_json(outcomes: list[Outcome]) -> str:
    return json.dumps([asdict(o) for o in outcomes], indent=2)
