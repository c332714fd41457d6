"""JSON wire types against the real SDK: request bodies the SDK sends parse into ours, and every
response we build validates in the SDK's own (strict) response models."""

import base64
from datetime import datetime, timezone

import pydantic
import pytest
import torch
from tinker import types as sdk
from tinker._compat import model_dump
from tinker.types._pydantic_types.tensor_data import TensorData as SdkTensorData
from tinker.types.optimizer import DimuonOptimizerConfig
from tinker.types.optimizer import DimuonParams as SdkDimuonParams
from tinker.types.try_again_response import TryAgainResponse as SdkTryAgainResponse

from server.wire.futures import FutureRetrieveRequest, RequestFailedResponse, TryAgainResponse, UntypedAPIFuture
from server.wire.model_input import EncodedTextChunk, ImageChunk, ModelInput, TensorData
from server.wire.models import (CreateModelRequest, CreateModelResponse, GetInfoRequest, GetInfoResponse,
                                GetServerCapabilitiesResponse, LoraConfig, ModelData, OptimizerConfig, SupportedModel)
from server.wire.rest import Checkpoint, CheckpointsListResponse, Cursor, TrainingRun, TrainingRunsResponse
from server.wire.sampling import (CreateSamplingSessionRequest, CreateSamplingSessionResponse, GetSamplerResponse,
                                  SampleRequest, SamplingParams, StopConditions)
from server.wire.sessions import (ClientConfigResponse, CreateSessionRequest, CreateSessionResponse,
                                  FinishSessionRequest, GetSessionResponse, HealthResponse, ListSessionsResponse,
                                  SessionHeartbeatRequest, SessionHeartbeatResponse, TelemetryBatch, TelemetryResponse)
from server.wire.training import AdamParams, DimuonParams, OptimStepRequest, OptimStepResponse
from server.wire.weights import (LoadWeightsRequest, LoadWeightsResponse, SaveWeightsForSamplerRequest,
                                 SaveWeightsForSamplerResponse, SaveWeightsRequest, SaveWeightsResponse,
                                 WeightsInfoResponse)

PNG_BYTES = b"\x89PNG\r\n\x1a\n" + bytes(range(200))


def sent_by_sdk(request: pydantic.BaseModel) -> dict:
    """The JSON body the SDK puts on the wire for `request` (tinker/resources/*.py)."""
    return model_dump(request, exclude_unset=False, exclude_none=True, mode="json")


# ---------------------------------------------------------------------------------------------
# Captured request bodies (tinker-wire-protocol.md, sections 5 and 7)


def test_captured_create_model_body_parses():
    body = {
        "session_id": "S", "model_seq_id": 0, "base_model": "Qwen/Qwen3-0.6B",
        "lora_config": {"rank": 8, "seed": 0, "train_unembed": True, "train_mlp": True, "train_attn": True},
        "optimizer_config": {"type": "adamw"}, "type": "create_model",
    }  # fmt: skip
    request = CreateModelRequest.model_validate(body)
    assert request.lora_config == LoraConfig(rank=8, seed=0)
    assert request.optimizer_config.type == "adamw"
    assert request.user_metadata is None


def test_create_model_without_lora_config_gets_rank_32():
    request = CreateModelRequest.model_validate({"session_id": "S", "model_seq_id": 1, "base_model": "m"})
    assert request.lora_config.rank == 32
    assert request.optimizer_config.type == "adamw"


def test_captured_optim_step_body_parses():
    body = {
        "model_id": "S:train:0", "seq_id": 4, "type": "optim_step",
        "adam_params": {"learning_rate": 0.0001, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12,
                        "weight_decay": 0.0, "grad_clip_norm": 1.0},
    }  # fmt: skip
    request = OptimStepRequest.model_validate(body)
    assert request.adam_params == AdamParams(grad_clip_norm=1.0)
    assert request.seq_id == 4


@pytest.mark.parametrize("key", ["optimizer_params", "optim_params"])
def test_optim_step_accepts_the_params_aliases(key):
    body = {"model_id": "M", key: {"learning_rate": 0.5}}
    assert OptimStepRequest.model_validate(body).adam_params.learning_rate == 0.5


def test_captured_asample_body_with_stop_strings_parses():
    body = {
        "num_samples": 2,
        "prompt": {"chunks": [{"tokens": [100, 101, 102, 103, 104, 105], "type": "encoded_text"}]},
        "sampling_params": {"max_tokens": 8, "seed": 1234, "stop": ["\n\n"], "temperature": 0.7,
                            "top_k": -1, "top_p": 0.95},
        "sampling_session_id": "S:sample:1", "seq_id": 0,
        "prompt_logprobs": False, "topk_prompt_logprobs": 0, "topk_sample_logprobs": 0,
        "prompt_alt_tokens_k": 0, "record_stability_info": False, "type": "sample",
    }  # fmt: skip
    request = SampleRequest.model_validate(body)
    assert request.num_samples == 2
    assert request.prompt.chunks == [EncodedTextChunk(tokens=[100, 101, 102, 103, 104, 105])]
    assert request.sampling_params.stop_conditions() == StopConditions(
        stop_strings=["\n\n"], stop_token_ids=[], ignore_eos=False
    )


def test_captured_image_prompt_parses_with_decoded_bytes():
    encoded = base64.b64encode(PNG_BYTES).decode()
    prompt = {"chunks": [
        {"tokens": [100, 101, 102], "type": "encoded_text"},
        {"data": encoded, "format": "png", "expected_tokens": 4, "type": "image"},
        {"tokens": [103, 104], "type": "encoded_text"},
    ]}  # fmt: skip
    model_input = ModelInput.model_validate(prompt)
    image = model_input.chunks[1]
    assert isinstance(image, ImageChunk)
    assert (image.data, image.format, image.expected_tokens) == (PNG_BYTES, "png", 4)
    # And it serializes back to what the SDK reads.
    assert sdk.ModelInput.model_validate(model_input.model_dump(mode="json")).chunks[1].data == PNG_BYTES


def test_captured_session_and_future_bodies_parse():
    create = CreateSessionRequest.model_validate(
        {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "display_name": "smoke", "type": "create_session"}
    )
    assert create.display_name == "smoke"
    assert SessionHeartbeatRequest.model_validate({"session_id": "S", "type": "session_heartbeat"}).session_id == "S"
    finish = FinishSessionRequest.model_validate({"reason": {"type": "interrupted"}, "detail": None})
    assert finish.reason.type == "interrupted"
    poll = FutureRetrieveRequest.model_validate({"request_id": "r1", "allow_metadata_only": True})
    assert poll.allow_metadata_only is True
    telemetry = {"events": [{"event": "GENERIC_EVENT", "x": 1}], "platform": "linux", "process_uuid": "u"}
    assert TelemetryBatch.model_validate(telemetry).events[0]["event"] == "GENERIC_EVENT"


def test_captured_weights_bodies_parse():
    named = SaveWeightsForSamplerRequest.model_validate(
        {"model_id": "M", "path": "smoke-sampler-000", "kind": "snapshot", "seq_id": 5, "type": "save_weights_for_sampler"}
    )
    assert named.path == "smoke-sampler-000"
    ephemeral = SaveWeightsForSamplerRequest.model_validate(
        {"model_id": "M", "sampling_session_seq_id": 2, "kind": "inflight", "seq_id": 6}
    )
    assert (ephemeral.path, ephemeral.sampling_session_seq_id) == (None, 2)
    save = SaveWeightsRequest.model_validate(
        {"model_id": "M", "path": "smoke-state-000", "seq_id": 7, "overwrite": False, "type": "save_weights"}
    )
    assert save.path == "smoke-state-000"
    into = LoadWeightsRequest.model_validate(
        {"model_id": "M", "seq_id": 8, "path": "tinker://M/weights/a", "optimizer": False, "type": "load_weights"}
    )
    assert into.session_id is None
    create = LoadWeightsRequest.model_validate(
        {"session_id": "S", "model_seq_id": 1, "path": "tinker://M/weights/a", "optimizer": True}
    )
    assert (create.model_id, create.model_seq_id, create.optimizer) == (None, 1, True)
    session = CreateSamplingSessionRequest.model_validate(
        {"session_id": "S", "sampling_session_seq_id": 0, "model_path": "tinker://S:train:0/sampler_weights/x",
         "type": "create_sampling_session"}
    )  # fmt: skip
    assert session.base_model is None


# ---------------------------------------------------------------------------------------------
# Bodies serialized by the SDK's own request models


def test_every_sdk_request_body_parses_into_ours():
    image = sdk.ImageChunk(data=PNG_BYTES, format="jpeg", expected_tokens=3)
    pointer = sdk.ImageAssetPointerChunk(format="png", location="/data/cat.png", expected_tokens=2)
    prompt = sdk.ModelInput(chunks=[sdk.EncodedTextChunk(tokens=[1, 2]), image, pointer])
    targets = SdkTensorData.from_torch_sparse(torch.tensor([[5, -1], [-1, -1], [-1, 9]]), pad_value=-1)
    cases = [
        (sdk.CreateSessionRequest(tags=["a"], user_metadata=None, sdk_version="0.38.0"), CreateSessionRequest),
        (sdk.SessionHeartbeatRequest(session_id="S"), SessionHeartbeatRequest),
        (
            sdk.CreateModelRequest(
                session_id="S", model_seq_id=0, base_model="b", lora_config=sdk.LoraConfig(rank=4, train_mlp=False),
                optimizer_config=DimuonOptimizerConfig(), user_metadata={"k": "v"},
            ),
            CreateModelRequest,
        ),
        (sdk.GetInfoRequest(model_id="M"), GetInfoRequest),
        (sdk.OptimStepRequest(model_id="M", seq_id=2, optim_params=sdk.AdamParams(learning_rate=3e-4)), OptimStepRequest),
        (sdk.OptimStepRequest(model_id="M", optim_params=SdkDimuonParams(learning_rate=1e-3)), OptimStepRequest),
        (sdk.SaveWeightsRequest(model_id="M", path="n", seq_id=1, ttl_seconds=3600, user_metadata={"a": "b"}), SaveWeightsRequest),
        (sdk.SaveWeightsForSamplerRequest(model_id="M", sampling_session_seq_id=3, seq_id=2), SaveWeightsForSamplerRequest),
        (sdk.LoadWeightsRequest(session_id="S", model_seq_id=2, path="tinker://M/weights/n", optimizer=True), LoadWeightsRequest),
        (sdk.CreateSamplingSessionRequest(session_id="S", sampling_session_seq_id=1, base_model="b"), CreateSamplingSessionRequest),
        (sdk.FutureRetrieveRequest(request_id="r", allow_metadata_only=True), FutureRetrieveRequest),
        (
            sdk.SampleRequest(
                sampling_session_id="S:sample:0", seq_id=7, num_samples=3, prompt=prompt,
                sampling_params=sdk.SamplingParams(max_tokens=5, stop=[13, 14], top_k=20),
                prompt_logprobs=True, prompt_logprobs_last_n=2, topk_prompt_logprobs=4, topk_sample_logprobs=1,
                target_prompt_logprobs=targets, record_stability_info=True,
            ),
            SampleRequest,
        ),
    ]  # fmt: skip
    for request, ours in cases:
        body = sent_by_sdk(request)
        parsed = ours.model_validate(body)
        # Every field the SDK sent that we model came through with the same JSON value.
        ours_json = parsed.model_dump(mode="json", exclude_none=True)
        for key, value in body.items():
            if key in ours.model_fields:
                assert ours_json[key] == value, (ours.__name__, key)


def test_sdk_sample_request_details_survive():
    dense_targets = torch.full((6, 4), -1)
    dense_targets[0, 0], dense_targets[5, 3] = 5, 9
    targets = SdkTensorData.from_torch_sparse(dense_targets, pad_value=-1)
    prompt = sdk.ModelInput(chunks=[sdk.EncodedTextChunk(tokens=[1, 2, 3, 4, 5, 6, 7])])
    request = SampleRequest.model_validate(sent_by_sdk(sdk.SampleRequest(
        sampling_session_id="S:sample:0", seq_id=1, prompt=prompt,
        sampling_params=sdk.SamplingParams(stop=[13, 14]), target_prompt_logprobs=targets,
        prompt_logprobs=True,
    )))  # fmt: skip
    assert request.sampling_params.stop_conditions() == StopConditions([], [13, 14], False)
    assert request.target_prompt_logprobs.sparse_crow_indices == [0, 1, 1, 1, 1, 1, 2]
    rows, ids = request.target_prompt_logprobs.cells()
    assert rows.tolist() == [0, 5] and ids.tolist() == [5, 9]


def test_dimuon_optimizer_params_are_kept_apart_from_adam():
    body = sent_by_sdk(sdk.OptimStepRequest(model_id="M", optim_params=SdkDimuonParams(learning_rate=1e-3)))
    assert "optimizer_params" in body
    params = OptimStepRequest.model_validate(body).adam_params
    assert isinstance(params, DimuonParams)
    assert params.learning_rate == 1e-3
    create = CreateModelRequest.model_validate(
        sent_by_sdk(sdk.CreateModelRequest(session_id="S", model_seq_id=0, base_model="b", optimizer_config=DimuonOptimizerConfig()))
    )
    assert create.optimizer_config.model_dump() == {"type": "dimuon", "version": 1}


# ---------------------------------------------------------------------------------------------
# Sampling params


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        (None, StopConditions([], [], ignore_eos=False)),
        ("</s>", StopConditions(["</s>"], [], ignore_eos=False)),
        (["a", "bc"], StopConditions(["a", "bc"], [], ignore_eos=False)),
        ([7, 8], StopConditions([], [7, 8], ignore_eos=False)),
        ([], StopConditions([], [], ignore_eos=True)),
    ],
)
def test_stop_is_normalized_into_strings_token_ids_and_eos(stop, expected):
    assert SamplingParams(stop=stop).stop_conditions() == expected


def test_sampling_params_defaults_match_the_sdk():
    params = SamplingParams()
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p) == (None, 1.0, -1, 1.0)
    assert SamplingParams(top_k=0).top_k == -1


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"stop": ["a", 1]}, "stop"),
        ({"stop": [""]}, "stop strings must be non-empty"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_sampling_params_are_refused(params, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        SamplingParams.model_validate(params)


# ---------------------------------------------------------------------------------------------
# Malformed requests


def test_malformed_base64_image_is_a_validation_error_that_says_so():
    chunk = {"type": "image", "data": "not base64!!", "format": "png"}
    with pytest.raises(pydantic.ValidationError, match="image data is not valid standard base64"):
        ModelInput.model_validate({"chunks": [chunk]})


def test_dmel_chunk_is_refused_with_a_clear_message():
    body = sent_by_sdk(sdk.ModelInput(chunks=[sdk.DmelChunk(dmel=b"\x00\x01")]))
    assert body["chunks"][0]["type"] == "dmel"
    with pytest.raises(pydantic.ValidationError, match=r"audio \(dmel\) chunks are not supported"):
        ModelInput.model_validate(body)


@pytest.mark.parametrize(
    ("model", "body", "message"),
    [
        (LoraConfig, {"rank": 0}, "rank"),
        (LoraConfig, {"rank": 8, "train_unembed": False, "train_mlp": False, "train_attn": False}, "at least one"),
        (LoadWeightsRequest, {"model_id": "M", "session_id": "S", "model_seq_id": 1, "path": "p"}, "not both"),
        (LoadWeightsRequest, {"path": "p", "optimizer": True}, "needs either model_id"),
        (LoadWeightsRequest, {"session_id": "S", "path": "p"}, "both session_id and model_seq_id"),
        (SaveWeightsRequest, {"model_id": "M", "path": "a/b"}, "contain no '/'"),
        (SaveWeightsForSamplerRequest, {"model_id": "M"}, "path or a sampling_session_seq_id"),
        (SaveWeightsForSamplerRequest, {"model_id": "M", "path": "n", "kind": "inflight"}, "a named save is a snapshot"),
        (CreateSamplingSessionRequest, {"session_id": "S", "sampling_session_seq_id": 0}, "model_path or a base_model"),
        (OptimStepRequest, {"model_id": "M", "adam_params": {"learning_rate": -1}}, "learning_rate"),
        (OptimStepRequest, {"model_id": "M", "optimizer_params": {"type": "sgd"}}, "sgd"),
        (OptimStepRequest, {"model_id": "M"}, "adam_params"),
        (CreateModelRequest, {"session_id": "S", "model_seq_id": 0, "base_model": "b", "type": "get_info"}, "type"),
        (FinishSessionRequest, {"reason": {"type": "done"}}, "reason"),
        (ModelInput, {"chunks": [{"type": "encoded_text", "tokens": [-1]}]}, "tokens"),
        (TensorData, {"data": [1, 2, 3], "dtype": "int64", "shape": [2, 2]}, "does not hold 3 values"),
    ],
)  # fmt: skip
def test_malformed_requests_are_refused_with_a_message(model, body, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        model.model_validate(body)


def test_malformed_sample_requests_are_refused():
    base = {"sampling_session_id": "S:sample:0", "prompt": {"chunks": []}, "sampling_params": {}}
    with pytest.raises(pydantic.ValidationError, match="requires prompt_logprobs"):
        SampleRequest.model_validate({**base, "prompt_logprobs_last_n": 2})
    with pytest.raises(pydantic.ValidationError, match="sampling_session_id, a model_path or a base_model"):
        SampleRequest.model_validate({**base, "sampling_session_id": None})
    targets = {"data": [1.0], "dtype": "float32", "shape": [1, 1]}
    with pytest.raises(pydantic.ValidationError, match="int64 tensor of shape"):
        SampleRequest.model_validate({**base, "target_prompt_logprobs": targets})


# ---------------------------------------------------------------------------------------------
# Responses, validated by the SDK's own models


NOW = datetime(2025, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
CHECKPOINT = Checkpoint(
    checkpoint_id="weights/step-1", checkpoint_type="training", time=NOW,
    tinker_path="tinker://S:train:0/weights/step-1", size_bytes=123,
)  # fmt: skip
RUN = TrainingRun(
    training_run_id="S:train:0", base_model="b", model_owner="me", is_lora=True, lora_rank=8,
    last_request_time=NOW, last_checkpoint=CHECKPOINT,
)  # fmt: skip

RESPONSES = [
    (ClientConfigResponse(proto_compress_fwdbwd=True), sdk.ClientConfigResponse),
    (CreateSessionResponse(session_id="S", warning_message="w"), sdk.CreateSessionResponse),
    (SessionHeartbeatResponse(), sdk.SessionHeartbeatResponse),
    (TelemetryResponse(), sdk.TelemetryResponse),
    (UntypedAPIFuture(request_id="r", model_id="S:train:0"), sdk.UntypedAPIFuture),
    (UntypedAPIFuture(request_id="r", sample_sequence_ids=["a", "b"]), sdk.UntypedAPIFuture),
    (TryAgainResponse(request_id="r"), SdkTryAgainResponse),
    (RequestFailedResponse(error="bad", category="user"), sdk.RequestFailedResponse),
    (CreateModelResponse(model_id="S:train:0"), sdk.CreateModelResponse),
    (
        GetInfoResponse(
            model_id="S:train:0", model_data=ModelData(arch="qwen3", model_name="b", tokenizer_id="t"),
            is_lora=True, lora_rank=8, model_name="b", optimizer_config=OptimizerConfig(),
        ),
        sdk.GetInfoResponse,
    ),
    (GetInfoResponse(model_id="M", model_data=ModelData(model_name="b")), sdk.GetInfoResponse),
    (OptimStepResponse(metrics={"grad_norm:mean": 0.5}), sdk.OptimStepResponse),
    (OptimStepResponse(), sdk.OptimStepResponse),
    (SaveWeightsResponse(path="tinker://S:train:0/weights/n"), sdk.SaveWeightsResponse),
    (SaveWeightsForSamplerResponse(path="tinker://S:train:0/sampler_weights/n"), sdk.SaveWeightsForSamplerResponse),
    (SaveWeightsForSamplerResponse(sampling_session_id="S:sample:1"), sdk.SaveWeightsForSamplerResponseInternal),
    (LoadWeightsResponse(path="tinker://S:train:0/weights/n", model_id="S:train:1"), sdk.LoadWeightsResponse),
    (CreateSamplingSessionResponse(sampling_session_id="S:sample:0"), sdk.CreateSamplingSessionResponse),
    (GetSamplerResponse(sampler_id="S:sample:0", base_model="b"), sdk.GetSamplerResponse),
    (
        GetServerCapabilitiesResponse(
            supported_models=[SupportedModel(model_name="b", max_context_length=4096, trainable=True)]
        ),
        sdk.GetServerCapabilitiesResponse,
    ),
    (CheckpointsListResponse(checkpoints=[CHECKPOINT]), sdk.CheckpointsListResponse),
    (
        CheckpointsListResponse(checkpoints=[], cursor=Cursor(offset=0, limit=10, total_count=0)),
        sdk.CheckpointsListResponse,
    ),
    (CHECKPOINT, sdk.Checkpoint),
    (RUN, sdk.TrainingRun),
    (TrainingRunsResponse(training_runs=[RUN], cursor=Cursor(offset=0, limit=20, total_count=1)), sdk.TrainingRunsResponse),
    (WeightsInfoResponse(base_model="b", is_lora=True, lora_rank=8, train_mlp=True), sdk.WeightsInfoResponse),
    (ListSessionsResponse(sessions=["S"]), sdk.ListSessionsResponse),
    (GetSessionResponse(training_run_ids=["S:train:0"], sampler_ids=[]), sdk.GetSessionResponse),
    (HealthResponse(), sdk.HealthResponse),
]  # fmt: skip


@pytest.mark.parametrize(("ours", "theirs"), RESPONSES, ids=[type(o).__name__ for o, _ in RESPONSES])
def test_every_response_validates_in_the_sdk_model(ours, theirs):
    body = ours.model_dump(mode="json")
    assert None not in body.values(), "None fields must be omitted"
    parsed = theirs.model_validate(body)
    reparsed = parsed.model_dump(mode="json", exclude_none=True)
    for key, value in body.items():
        if key in reparsed and key != "optimizer_config":
            assert reparsed[key] == value, key


def test_none_fields_are_omitted_in_nested_responses_and_json_text():
    text = CheckpointsListResponse(checkpoints=[CHECKPOINT]).model_dump_json()
    assert "null" not in text
    assert "expires_at" not in text


def test_try_again_and_error_bodies_are_what_the_poll_loop_looks_for():
    assert TryAgainResponse(request_id="r").model_dump(mode="json") == {
        "type": "try_again", "request_id": "r", "queue_state": "active",
    }  # fmt: skip
    failed = RequestFailedResponse(error="boom", category="server").model_dump(mode="json")
    assert sdk.RequestErrorCategory(failed["category"]) is sdk.RequestErrorCategory.Server
