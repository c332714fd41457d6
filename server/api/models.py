"""Training models: create_model, get_info, and what the server can serve."""

from fastapi import APIRouter, Request

from server.api.deps import (
    OwnerDep,
    ServicesDep,
    json_result,
    read_body,
    run_of,
    session_of,
    string_map,
    submit_training_op,
)
from server.errors import InvalidRequest
from server.scheduler.scheduler import CREATION_SEQ_ID
from server.store.store import TrainingRunRecord
from server.wire.types import (
    CreateModelRequest,
    CreateModelResponse,
    GetInfoRequest,
    GetInfoResponse,
    GetServerCapabilitiesResponse,
    HealthResponse,
    ModelData,
    OptimizerConfig,
    SupportedModel,
    UntypedAPIFuture,
)

router = APIRouter(prefix="/api/v1")


def model_id_for(session_id: str, model_seq_id: int) -> str:
    """The SDK builds this id on its own side for create-via-load, so it must be exactly this."""
    return f"{session_id}:train:{model_seq_id}"


def check_base_model(services, base_model: str | None) -> None:
    if base_model is not None and base_model != services.base.name:
        raise InvalidRequest(f"base_model {base_model!r} is not served here; this server serves "
                             f"{services.base.name!r}")


def check_optimizer(config: OptimizerConfig | None) -> None:
    if config is not None and config.type != "adamw":
        raise InvalidRequest(f"optimizer {config.type!r} is not supported; use adamw")


@router.post("/create_model")
async def create_model(request: Request, services: ServicesDep, owner: OwnerDep) -> UntypedAPIFuture:
    """Start a LoRA training run on the served base model."""
    body = await read_body(request, services.config.limits.max_request_bytes)
    create = CreateModelRequest.model_validate_json(body)
    session_of(services.store, create.session_id, owner)
    check_base_model(services, create.base_model)
    check_optimizer(create.optimizer_config)
    model_id = model_id_for(create.session_id, create.model_seq_id)
    lora = create.lora_config

    def work():
        services.trainer.create_model(model_id, lora)
        services.store.create_training_run(TrainingRunRecord(
            model_id=model_id, session_id=create.session_id, owner=owner, base_model=services.base.name,
            model_seq_id=create.model_seq_id, lora_rank=lora.rank, seed=lora.seed, train_mlp=lora.train_mlp,
            train_attn=lora.train_attn, train_unembed=lora.train_unembed,
            user_metadata=string_map(create.user_metadata)))
        return json_result(CreateModelResponse(model_id=model_id))

    request_id = await submit_training_op(services, model_id=model_id, seq_id=CREATION_SEQ_ID,
                                          request_type="CreateModel", body=body, prepare=lambda: work)
    return UntypedAPIFuture(request_id=request_id, model_id=model_id)


@router.post("/get_info")
async def get_info(body: GetInfoRequest, services: ServicesDep, owner: OwnerDep) -> GetInfoResponse:
    """Describe a training run; `tokenizer_id` is a directory the SDK's get_tokenizer() loads offline."""
    run = run_of(services.store, body.model_id, owner)
    base = services.base
    return GetInfoResponse(
        model_id=run.model_id,
        model_data=ModelData(arch=base.family.arch, model_name=base.name, tokenizer_id=str(base.path)),
        optimizer_config=OptimizerConfig(type="adamw"), is_lora=True, lora_rank=run.lora_rank, model_name=base.name)


@router.get("/get_server_capabilities")
async def get_server_capabilities(services: ServicesDep) -> GetServerCapabilitiesResponse:
    """The served base model."""
    return GetServerCapabilitiesResponse(supported_models=[SupportedModel(
        model_name=services.base.name, max_context_length=services.config.limits.max_sequence_length,
        trainable=True, sampleable=True)])


@router.get("/healthz")
async def healthz() -> HealthResponse:
    """Liveness: the app only serves once the model is loaded."""
    return HealthResponse()
