"""Training models: create_model, get_info, and what the server can serve."""

import asyncio

from fastapi import APIRouter, Request

from server.api.deps import (OwnerDep, ServicesDep, TrainingSubmission, check_base_model, check_optimizer, json_result,
                             read_body, run_of, session_of, submit_training_op)
from server.runs import check_lora_rank, check_run_quota, check_storage_quota, training_run_record
from server.scheduler.ordering import CREATION_SEQ_ID
from server.training.operations import CreateModel
from server.wire.futures import UntypedAPIFuture
from server.wire.models import (CreateModelRequest, CreateModelResponse, GetInfoRequest, GetInfoResponse,
                                GetServerCapabilitiesResponse, ModelData, OptimizerConfig, ServerLimits, SupportedModel)

router = APIRouter(prefix="/api/v1")


@router.post("/create_model")
async def create_model(request: Request, services: ServicesDep, owner: OwnerDep) -> UntypedAPIFuture:
    """Start a LoRA training run on the served base model."""
    body = await read_body(request, services.config.limits.max_request_bytes)
    create = CreateModelRequest.model_validate_json(body)
    await session_of(services.store, create.session_id, owner)
    check_base_model(services, create.base_model)
    check_optimizer(create.optimizer_config)
    check_lora_rank(services.config.limits, create.lora_config.rank)
    await asyncio.to_thread(check_run_quota, services.store, services.config.limits, owner)
    await asyncio.to_thread(check_storage_quota, services.store, services.config.limits, owner)
    record = training_run_record(base_model=services.base.name, session_id=create.session_id,
                                 model_seq_id=create.model_seq_id, owner=owner, lora=create.lora_config,
                                 user_metadata=create.user_metadata)
    model_id = record.model_id

    def respond(_):
        services.store.create_training_run(record)
        return json_result(CreateModelResponse(model_id=model_id))

    request_id = await submit_training_op(
        services, owner=owner, model_id=model_id, seq_id=CREATION_SEQ_ID, request_type="CreateModel", body=body,
        prepare=lambda: TrainingSubmission(CreateModel(model_id, create.lora_config), respond))
    return UntypedAPIFuture(request_id=request_id, model_id=model_id)


@router.post("/get_info")
async def get_info(body: GetInfoRequest, services: ServicesDep, owner: OwnerDep) -> GetInfoResponse:
    """Describe a training run; `tokenizer_id` is a directory the SDK's get_tokenizer() loads offline."""
    run = await run_of(services.store, body.model_id, owner)
    base = services.base
    return GetInfoResponse(
        model_id=run.model_id,
        model_data=ModelData(arch=base.family.arch, model_name=base.name, tokenizer_id=str(base.path)),
        optimizer_config=OptimizerConfig(type="adamw"), is_lora=True, lora_rank=run.lora_rank, model_name=base.name)


@router.get("/get_server_capabilities")
async def get_server_capabilities(services: ServicesDep) -> GetServerCapabilitiesResponse:
    """The served base model, and the limits of what one request may ask for."""
    limits = services.config.limits
    return GetServerCapabilitiesResponse(
        supported_models=[SupportedModel(model_name=services.base.name, max_context_length=limits.max_sequence_length,
                                         trainable=True, sampleable=True)],
        limits=ServerLimits(max_sequence_length=limits.max_sequence_length, max_sample_tokens=limits.max_sample_tokens,
                            max_num_samples=limits.max_num_samples,
                            max_sampled_tokens_per_request=limits.max_sampled_tokens_per_request,
                            max_images_per_prompt=services.config.sampler.max_images_per_prompt,
                            max_lora_rank=limits.max_lora_rank, max_request_bytes=limits.max_request_bytes,
                            max_datums_per_request=limits.max_datums_per_request))

