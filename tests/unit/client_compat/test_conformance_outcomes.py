"""How the conformance checker reads an error (unsupported, with the server's reason, or a failure) and the
README table it renders."""

import httpx
import pytest
import tinker
from tinker.types.request_error_category import RequestErrorCategory

from client_compat.conformance.outcomes import Outcome, classify, render_markdown


def status_error(kind: type, status: int, body: object) -> tinker.APIStatusError:
    response = httpx.Response(status, request=httpx.Request("GET", "http://server/api/v1/x"), json=body)
    return kind(f"Error code: {status} - {body}", response=response, body=body)


@pytest.mark.parametrize("error, expected", [
    (status_error(tinker.NotFoundError, 404, {"detail": "Not Found"}),
     ("unsupported", "the server has no such endpoint (HTTP 404)")),
    (status_error(tinker.BadRequestError, 400, {"detail": "optimizer 'dimuon' is not supported; use adamw"}),
     ("unsupported", "optimizer 'dimuon' is not supported; use adamw")),
    (tinker.RequestFailedError("unsupported loss_fn 'gspo'", request_id="r", category=RequestErrorCategory.User),
     ("unsupported", "unsupported loss_fn 'gspo'")),
    (status_error(tinker.NotFoundError, 404, {"detail": "no checkpoint tinker://r/weights/x"}),
     ("fail", "NotFoundError: no checkpoint tinker://r/weights/x")),
    (AssertionError("2 logprobs for 3 targets"), ("fail", "AssertionError: 2 logprobs for 3 targets")),
])  # fmt: skip
def test_errors_read_as_unsupported_only_when_the_server_says_so(error, expected):
    assert classify(error) == expected


def test_the_markdown_lists_what_passes_per_class_marking_client_only_then_every_other_call_with_its_reason():
    outcomes = [Outcome("SamplingClient", "sample", "pass"), Outcome("SamplingClient", "sample_async", "pass"),
                Outcome("SamplingClient", "get_tokenizer", "pass", client_only=True),
                Outcome("SamplingClient", "sample[topk_sample_logprobs]", "unsupported", "not supported | yet"),
                Outcome("RestClient", "whoami", "fail", "RuntimeError: boom")]
    lines = render_markdown(outcomes).splitlines()
    assert "| `SamplingClient` | 3 of 3 (1 client-only) | `sample`, `sample_async`, `get_tokenizer`* |" in lines
    assert "| `RestClient` | 0 of 1 (0 client-only) |  |" in lines
    assert lines[-2:] == ["| `SamplingClient.sample[topk_sample_logprobs]` | unsupported | not supported / yet |",
                          "| `RestClient.whoami` | fail | RuntimeError: boom |"]
