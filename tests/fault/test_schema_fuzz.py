"""Schemathesis fuzzes every operation of the OpenAPI schema: no input may get a 5xx."""

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from support.live_server import LiveServer

EXAMPLES_PER_OPERATION = 25
answers: dict[int, int] = {}


@pytest.fixture(scope="module")
def api_schema(fault_server: LiveServer):
    return schemathesis.openapi.from_url(f"{fault_server.url}/openapi.json", headers=fault_server.headers())


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_generated_request_gets_a_server_error(case, fault_server: LiveServer):
    # Authenticated, so the fuzzing reaches past the key check (schemathesis still drops the key from some
    # cases on purpose, to test the check: those get 401s).
    headers = {name: value for name, value in (case.headers or {}).items() if name.lower() != "x-api-key"}
    response = case.call(headers={**headers, **fault_server.headers()}, timeout=60)
    answers[response.status_code] = answers.get(response.status_code, 0) + 1
    assert response.status_code < 500, (case.method, case.formatted_path, response.text[:500])
    assert str(fault_server.data_dir) not in response.text  # no server paths in any answer


def test_the_server_is_healthy_after_the_fuzzing(fault_server: LiveServer):
    import httpx

    print(f"schemathesis answers by status: {dict(sorted(answers.items()))}")
    assert httpx.get(f"{fault_server.url}/api/v1/healthz").status_code == 200
    assert fault_server.process.poll() is None
