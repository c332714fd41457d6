"""Schemathesis fuzzes every operation of the OpenAPI schema: no input may get a 5xx.

Its two phases, as its pytest integration runs them: the coverage cases (each parameter and body field
at its boundaries, wrong types, missing fields, unexpected methods) and then Hypothesis's fuzzing, valid
and invalid. They run inside one plain test: the schema comes from the live server at run time, which
schemathesis's pytest integration (`from_fixture`) does by rewriting pytest's private node ids, and
pytest 9.2 removed those.
"""

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from support.live_server import LiveServer

EXAMPLES_PER_OPERATION = 25


def test_no_generated_request_gets_a_server_error(fault_server: LiveServer):
    schema = schemathesis.openapi.from_url(f"{fault_server.url}/openapi.json", headers=fault_server.headers())
    operations = [result.ok() for result in schema.get_all_operations()]
    answers: dict[int, int] = {}
    failures: dict[str, str] = {}

    def call(case) -> None:
        # Authenticated, so that the cases reach past the key check (schemathesis still drops the key from
        # some on purpose, to test the check: those get 401s).
        headers = {name: value for name, value in (case.headers or {}).items() if name.lower() != "x-api-key"}
        response = case.call(headers={**headers, **fault_server.headers()}, timeout=60)
        answers[response.status_code] = answers.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.method, case.formatted_path, response.text[:500])
        assert str(fault_server.data_dir) not in response.text  # no server paths in any answer

    for operation in operations:
        fuzz = given(case=operation.as_strategy(GenerationMode.POSITIVE) | operation.as_strategy(GenerationMode.NEGATIVE))
        fuzz = settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck),
                        database=None)(fuzz(call))
        coverage = schema.iter_coverage_cases(operation, generation_modes=list(GenerationMode),
                                              generation_config=schema.config.generation_for(operation=operation))
        try:
            for case in coverage:
                call(case)
            fuzz()
        except AssertionError as failure:  # the first failing case; the next operation runs all the same
            failures[operation.label] = str(failure)[:2000]

    print(f"schemathesis answers by status over {len(operations)} operations: {dict(sorted(answers.items()))}")
    assert len(operations) > 30 and sum(answers.values()) >= len(operations) * EXAMPLES_PER_OPERATION
    assert not failures, failures
    assert httpx.get(f"{fault_server.url}/api/v1/healthz").status_code == 200
    assert fault_server.process.poll() is None
