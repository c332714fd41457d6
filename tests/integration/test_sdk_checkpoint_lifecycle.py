"""The checkpoint lifecycle through the real SDK: publishing (what it opens to other tenants), weights access
tokens, copy_weights, TTLs and the sweeper that enforces them (never on a checkpoint in use), session
projects and search."""

import time
import uuid

import httpx
import numpy as np
import pytest
import sqlalchemy as sa
import tinker
from tinker import types

from support.live_server import BASE_MODEL
from support.sdk import SENTENCES, forward_logprobs, supervised_datum

@pytest.fixture(scope="module")
def owner(lifecycle_server):
    service = lifecycle_server.service_client()
    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    data = [supervised_datum(tc.get_tokenizer(), SENTENCES[0])]
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    yield tc, data, tinker.RestClient(base_url=lifecycle_server.url, api_key=lifecycle_server.api_key)
    service.close("success").result()


@pytest.fixture(scope="module")
def stranger_key(lifecycle_server) -> str:
    return lifecycle_server.create_key("lifecycle-stranger")


@pytest.fixture(scope="module")
def stranger(lifecycle_server, stranger_key):
    service = lifecycle_server.service_client(api_key=stranger_key)
    yield service, tinker.RestClient(base_url=lifecycle_server.url, api_key=stranger_key)
    service.close("success").result()


def api(server, method: str, path: str, api_key: str | None = None, **kwargs) -> httpx.Response:
    """A plain HTTP call, where the SDK would retry a 409 for minutes or checks paths before sending."""
    return httpx.request(method, f"{server.url}/api/v1/{path}", headers={**server.headers(api_key), **kwargs.pop(
        "headers", {})}, timeout=60, **kwargs)


def checkpoint_route(tinker_path: str) -> str:
    run_id, checkpoint_id = tinker_path.removeprefix("tinker://").split("/", 1)
    return f"training_runs/{run_id}/checkpoints/{checkpoint_id}"


def test_publishing_lets_other_tenants_read_a_checkpoint_and_only_read_it(lifecycle_server, owner, stranger):
    tc, data, rest = owner
    stranger_service, stranger_rest = stranger
    sampler_path = tc.save_weights_for_sampler("shared").result().path
    state_path = tc.save_state("shared-state").result().path
    with pytest.raises(tinker.NotFoundError):
        stranger_service.create_sampling_client(model_path=sampler_path).result()

    for path in (sampler_path, state_path):
        rest.publish_checkpoint_from_tinker_path(path).result()
    assert api(lifecycle_server, "POST", checkpoint_route(sampler_path) + "/publish").status_code == 409
    sampler = stranger_service.create_sampling_client(model_path=sampler_path).result()
    prompt = types.ModelInput.from_ints(data[0].model_input.to_ints()[:4])
    assert sampler.sample(prompt, 1, types.SamplingParams(max_tokens=3)).result().sequences[0].tokens
    loaded = stranger_service.create_training_client_from_state(state_path).result()
    np.testing.assert_allclose(forward_logprobs(loaded, data)[0], forward_logprobs(tc, data)[0], atol=1e-6)
    assert stranger_rest.get_weights_info_by_tinker_path(state_path).result().lora_rank == 4
    # Reading is all: the stranger cannot unpublish, expire, delete or list the owner's checkpoints.
    for call in (lambda: stranger_rest.unpublish_checkpoint_from_tinker_path(sampler_path),
                 lambda: stranger_rest.set_checkpoint_ttl_from_tinker_path(sampler_path, 7200),
                 lambda: stranger_rest.delete_checkpoint_from_tinker_path(sampler_path),
                 lambda: stranger_rest.list_checkpoints(tc.model_id)):
        with pytest.raises(tinker.NotFoundError):
            call().result()

    rest.unpublish_checkpoint_from_tinker_path(sampler_path).result()
    assert api(lifecycle_server, "DELETE", checkpoint_route(sampler_path) + "/publish").status_code == 409
    assert not {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}[sampler_path].public
    with pytest.raises(tinker.NotFoundError):
        stranger_service.create_sampling_client(model_path=sampler_path).result()


def test_a_weights_access_token_opens_one_version_of_one_checkpoint(lifecycle_server, owner, stranger, stranger_key):
    tc, data, rest = owner
    stranger_service, stranger_rest = stranger
    path = tc.save_state("by-token").result().path
    assert api(lifecycle_server, "POST", checkpoint_route(path) + "/access_token",
               api_key=stranger_key).status_code == 404
    token = api(lifecycle_server, "POST", checkpoint_route(path) + "/access_token").json()["weights_access_token"]
    with pytest.raises(tinker.NotFoundError):
        stranger_service.create_training_client_from_state(path, weights_access_token="wat-wrong").result()
    loaded = stranger_service.create_training_client_from_state(path, weights_access_token=token).result()
    np.testing.assert_allclose(forward_logprobs(loaded, data)[0], forward_logprobs(tc, data)[0], atol=1e-6)
    copied = stranger_rest.copy_weights(path, "theirs", weights_access_token=token).result()  # the header form
    assert copied in [c.tinker_path for c in stranger_rest.list_user_checkpoints().result().checkpoints]
    tc.save_state("by-token", overwrite=True).result()  # a new version: the old token opens nothing
    with pytest.raises(tinker.NotFoundError):
        stranger_service.create_training_client_from_state(path, weights_access_token=token).result()


def test_copy_weights_makes_an_independent_copy_in_the_project(lifecycle_server, owner):
    tc, data, rest = owner
    path = tc.save_state("to-copy").result().path
    archive = lifecycle_server.service_client()
    copied = tinker.ServiceClient(project_id="archive", base_url=lifecycle_server.url, api_key=lifecycle_server.api_key) \
        .copy_weights(path, ttl_seconds=7200).result()
    copy_run = copied.removeprefix("tinker://").split("/")[0]
    assert copied == f"tinker://{copy_run}/weights/to-copy" and copy_run != tc.model_id
    runs = rest.list_training_runs(limit=100, project_id="archive").result().training_runs
    assert [run.training_run_id for run in runs] == [copy_run]
    listed = {c.tinker_path: c for c in rest.list_checkpoints(copy_run).result().checkpoints}
    assert listed[copied].expires_at is not None and not listed[copied].public
    rest.delete_checkpoint_from_tinker_path(path).result()  # the copy shares no fate with its source
    loaded = archive.create_training_client_from_state(copied).result()
    np.testing.assert_allclose(forward_logprobs(loaded, data)[0], forward_logprobs(tc, data)[0], atol=1e-6)
    archive.close("success").result()


def test_one_idempotency_key_makes_one_copy_whatever_the_retries(lifecycle_server, owner):
    tc, data, rest = owner
    path = tc.save_weights_for_sampler("copied-once").result().path
    body = {"source_path": path, "destination_project_id": "retries"}
    key = {"X-Idempotency-Key": str(uuid.uuid4())}
    first, retry = (api(lifecycle_server, "POST", "copy_weights", json=body, headers=key) for _ in range(2))
    assert first.status_code == retry.status_code == 200 and first.json() == retry.json()
    other = api(lifecycle_server, "POST", "copy_weights", json=body, headers={"X-Idempotency-Key": "another"})
    assert other.json()["tinker_path"] != first.json()["tinker_path"]
    reused = api(lifecycle_server, "POST", "copy_weights", json={**body, "ttl_seconds": 7200}, headers=key)
    assert reused.status_code == 409


def test_ttls_out_of_range_are_refused(owner):
    tc, data, rest = owner
    path = tc.save_state("ttl-range").result().path
    for ttl in (60, 11 * 366 * 24 * 3600):
        with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
            rest.set_checkpoint_ttl_from_tinker_path(path, ttl).result()
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        tc.save_state("too-short", ttl_seconds=60).result()
    assert tc.save_state("after-refusal").result().path.endswith("/after-refusal")


def test_the_sweeper_deletes_expired_checkpoints_but_not_one_a_live_sampler_uses(lifecycle_server, owner):
    tc, data, rest = owner
    in_use = tc.save_weights_for_sampler("expiring-in-use", ttl_seconds=3600).result().path
    unused = tc.save_weights_for_sampler("expiring-unused", ttl_seconds=3600).result().path
    sampler_service = lifecycle_server.service_client()
    sampler = sampler_service.create_sampling_client(model_path=in_use).result()
    engine = sa.create_engine(f"sqlite:///{lifecycle_server.data_dir / 'server.db'}")
    with engine.begin() as connection:  # as if their hour had passed; the in-use one expired first
        for path, hours_ago in ((in_use, 2), (unused, 1)):
            connection.execute(sa.text("UPDATE checkpoints SET expires_at = :at WHERE tinker_path = :path"),
                               {"at": (_utc_naive(hours_ago)), "path": path})
    engine.dispose()

    # One sweep looks at both, oldest expiry first: once the unused one is gone the other was spared.
    _wait_until(lambda: unused not in _paths(rest, tc.model_id))
    assert not _directory(lifecycle_server, unused).exists()
    assert in_use in _paths(rest, tc.model_id) and _directory(lifecycle_server, in_use).exists()
    prompt = types.ModelInput.from_ints(data[0].model_input.to_ints()[:4])
    assert sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result().sequences
    sampler_service.close("success").result()  # its session finished: nothing uses the checkpoint any more
    _wait_until(lambda: in_use not in _paths(rest, tc.model_id))
    assert not _directory(lifecycle_server, in_use).exists()


def test_sessions_are_found_by_name_metadata_project_and_status_a_page_at_a_time(lifecycle_server, stranger_key):
    token = uuid.uuid4().hex[:8]
    services = []
    for index in range(3):
        service = tinker.ServiceClient(user_metadata={"search": token}, display_name=f"Search Me {token} #{index}",
                                       base_url=lifecycle_server.url, api_key=lifecycle_server.api_key)
        service.create_sampling_client(base_model=BASE_MODEL).result()  # opens the session
        services.append(service)
    session_ids = [service.holder.get_session_id() for service in services]
    services[0].close("errored").result()
    rest = tinker.RestClient(base_url=lifecycle_server.url, api_key=lifecycle_server.api_key)
    rest.assign_session_project(session_ids[1], f"project-{token}").result()

    request = types.SessionSearchRequest(display_name=f"search me {token}", limit=1)
    pages = []
    while True:
        page = rest.search_sessions(request).result()
        pages.append([s.session_id for s in page.sessions])
        if page.next_cursor is None:
            break
        request = request.model_copy(update={"cursor": page.next_cursor})
    assert pages == [[session_ids[2]], [session_ids[1]], [session_ids[0]]]

    def search(**filters) -> list[str]:
        found = rest.search_sessions(types.SessionSearchRequest(user_metadata={"search": token}, **filters)).result()
        return [s.session_id for s in found.sessions]

    assert search() == session_ids[::-1]
    assert search(project_ids=[f"project-{token}"]) == [session_ids[1]]
    assert search(statuses=[types.ClientFinishedSessionStatusQuery(reasons=["errored"])]) == [session_ids[0]]
    assert search(statuses=[types.ActiveSessionStatusQuery()]) == session_ids[:0:-1]
    summary = rest.search_sessions(types.SessionSearchRequest(session_id=session_ids[0])).result().sessions[0]
    assert summary.status.type == "client_finished" and summary.status.reason.type == "errored"
    assert summary.display_name == f"Search Me {token} #0" and summary.project_id == "default"
    stranger = tinker.RestClient(base_url=lifecycle_server.url, api_key=stranger_key)
    assert stranger.search_sessions(types.SessionSearchRequest(user_metadata={"search": token})).result().sessions \
        == []
    for service in services[1:]:
        service.close("success").result()


def _utc_naive(hours_ago: float) -> str:
    # SQLite keeps the server's UTC datetimes naive.
    from datetime import UTC, datetime, timedelta
    return (datetime.now(UTC) - timedelta(hours=hours_ago)).replace(tzinfo=None).isoformat(sep=" ")


def _paths(rest: tinker.RestClient, model_id: str) -> list[str]:
    return [c.tinker_path for c in rest.list_checkpoints(model_id).result().checkpoints]


def _directory(server, tinker_path: str):
    run_id, segment, name = tinker_path.removeprefix("tinker://").split("/")
    return server.data_dir / "checkpoints" / run_id / segment / name


def _wait_until(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the sweeper did not get there"
        time.sleep(0.2)
