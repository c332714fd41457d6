"""A conformance checker any Tinker-compatible server can be held to.

`python -m client_compat.conformance --base-url URL [--api-key KEY]` drives every public method of the
pinned `tinker` SDK's ServiceClient, TrainingClient, SamplingClient and RestClient (and their `_async`
twins) against the server and prints one row per call: pass, fail, unsupported (with the server's
reason) or unchecked (a method this checker does not know). It trains a small LoRA run there and
deletes what it saved at the end.
"""

from client_compat.conformance.checks import Conformance
from client_compat.conformance.outcomes import Outcome, render_json, render_markdown, render_text


def run_conformance(base_url: str, api_key: str, *, base_model: str | None = None,
                    project_id: str = "default") -> list[Outcome]:
    """Run every check against `base_url`; one Outcome per call, in the order they ran."""
    return Conformance(base_url, api_key, base_model=base_model, project_id=project_id).run()


__all__ = ["Outcome", "run_conformance", "render_json", "render_markdown", "render_text"]
