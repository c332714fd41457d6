"""Lifecycle and session-search wire types against the real SDK: its request bodies parse into ours, our
responses validate in its strict response models."""

from datetime import UTC, datetime

import pydantic
import pytest
from tinker import types as sdk
from tinker._compat import model_dump

from server.wire import lifecycle as wire

T0 = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


def sent_by_sdk(request: pydantic.BaseModel) -> dict:
    return model_dump(request, exclude_unset=False, exclude_none=True, mode="json")


def test_save_weights_external_body_parses_with_its_recipients():
    body = sent_by_sdk(sdk.SaveWeightsExternalRequest(model_id="S:train:0", path="final", seq_id=3, ttl_seconds=3600,
                                                      age_encryption_recipients=["age1xyz"]))
    request = wire.SaveWeightsExternalRequest.model_validate(body)
    assert (request.path, request.seq_id, request.ttl_seconds) == ("final", 3, 3600)
    assert request.age_encryption_recipients == ["age1xyz"]


@pytest.mark.parametrize("ttl", [60, 3599, 11 * 366 * 24 * 3600])
def test_a_ttl_outside_one_hour_to_ten_years_is_refused(ttl):
    for model in (wire.CheckpointTtlRequest, wire.CopyWeightsRequest):
        with pytest.raises(pydantic.ValidationError, match="ttl_seconds"):
            model.model_validate({"ttl_seconds": ttl, "source_path": "p", "destination_project_id": "d"})


def test_copy_weights_bodies_parse_in_both_destination_forms():
    to_project = wire.CopyWeightsRequest.model_validate(sent_by_sdk(sdk.CopyWeightsRequest(
        source_path="tinker://S:train:0/weights/a", destination_project_id="archive", ttl_seconds=7200)))
    assert (to_project.destination_project_id, to_project.ttl_seconds) == ("archive", 7200)
    into_session = wire.CopyWeightsRequest.model_validate(sent_by_sdk(sdk.CopyWeightsRequest(
        source_path="tinker://S:train:0/weights/a", session_id="S2", model_seq_id=4, weights_access_token="t")))
    assert (into_session.session_id, into_session.model_seq_id, into_session.weights_access_token) == ("S2", 4, "t")
    for body in ({}, {"destination_project_id": "p", "session_id": "S", "model_seq_id": 0}, {"session_id": "S"}):
        with pytest.raises(pydantic.ValidationError, match="destination_project_id, or session_id"):
            wire.CopyWeightsRequest.model_validate({"source_path": "tinker://S:train:0/weights/a", **body})


def test_every_session_search_request_the_sdk_can_send_parses():
    cursor = sdk.SessionSearchCursor(last_created_at=T0, last_session_id="s9")
    request = sdk.SessionSearchRequest(
        session_id="s1", project_ids=["p"], user_metadata={"k": "v"}, display_name="nightly run",
        owner=sdk.UserSearchOwner(owner_urns=["tenant-x"]), limit=7, cursor=cursor,
        statuses=[sdk.ActiveSessionStatusQuery(), sdk.CancelledSessionStatusQuery(), sdk.FailedSessionStatusQuery(),
                  sdk.ClientFinishedSessionStatusQuery(reasons=["errored"])])
    ours = wire.SessionSearchRequest.model_validate(sent_by_sdk(request))
    assert ours.owner == wire.UserSearchOwner(owner_urns=["tenant-x"])
    assert [s.type for s in ours.statuses] == ["active", "cancelled", "failed", "client_finished"]
    assert ours.statuses[3].reasons == ["errored"]
    assert (ours.cursor.last_created_at, ours.cursor.last_session_id, ours.limit) == (T0, "s9", 7)
    assert wire.SessionSearchRequest.model_validate(sent_by_sdk(sdk.SessionSearchRequest())).owner.type == "own"


@pytest.mark.parametrize("ours, theirs", [
    (wire.SaveWeightsExternalResponse(path="tinker://S:train:0/external_weights/x", size_bytes=10),
     sdk.SaveWeightsExternalResponseInternal),
    (wire.ExternalWeightsUrlsResponse(urls={"adapter_config.json": "http://h/x?sig=1"}, expires=T0),
     sdk.ExternalWeightsUrlsResponse),
    (wire.CopyWeightsResponse(tinker_path="tinker://S:train:0/weights/x"), sdk.CopyWeightsResponse),
    (wire.SessionSearchResponse(
        sessions=[wire.SessionSummary(session_id="a", created_at=T0, owner="o", project_id="default",
                                      status=wire.SessionActive(), checkpoints_count=2, checkpoint_storage_bytes=9),
                  wire.SessionSummary(session_id="b", created_at=T0, owner="o", project_id="p", checkpoints_count=0,
                                      status=wire.ClientSessionFinished(reason=wire.FinishReasonBody(type="errored"))),
                  wire.SessionSummary(session_id="c", created_at=T0, owner="o", project_id="p", checkpoints_count=0)],
        next_cursor=wire.SessionSearchCursor(last_created_at=T0, last_session_id="c")),
     sdk.SessionSearchResponse),
])  # fmt: skip
def test_every_response_validates_in_the_sdk_model(ours, theirs):
    parsed = theirs.model_validate_json(ours.model_dump_json())
    if isinstance(parsed, sdk.SessionSearchResponse):
        assert [type(s.status).__name__ for s in parsed.sessions] == ["SessionActive", "ClientSessionFinished",
                                                                      "NoneType"]
        assert parsed.sessions[1].status.reason.type == "errored"
        assert parsed.next_cursor.last_created_at == T0
