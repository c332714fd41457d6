"""Checkpoints of training runs: save_weights, save_weights_for_sampler, save_weights_external, load_weights,
weights_info."""

import asyncio
from pathlib import Path

from fastapi import APIRouter, Request

from server.api.deps import (OwnerDep, Services, ServicesDep, TrainingSubmission, check_base_model, check_optimizer,
                             json_result, read_body, run_of, sequenced, session_of, submit_training_op)
from server.checkpoints.access import checkpoint_of, pin_for_load
from server.checkpoints.saving import PlannedSave, plan_save, write_checkpoint
from server.runs import (check_run_quota, check_storage_quota, ensure_sampling_session, model_id_for,
                         sampling_session_id_for, training_run_record)
from server.scheduler.ordering import CREATION_SEQ_ID
from server.training.operations import LoadState, SaveState, Snapshot
from server.wire.futures import UntypedAPIFuture
from server.wire.lifecycle import SaveWeightsExternalRequest, SaveWeightsExternalResponse
from server.wire.weights import (LoadWeightsRequest, LoadWeightsResponse, SaveWeightsForSamplerRequest,
                                 SaveWeightsForSamplerResponse, SaveWeightsRequest, SaveWeightsResponse,
                                 WeightsInfoRequest, WeightsInfoResponse)

router = APIRouter(prefix="/api/v1")


async def _submit_save(services: Services, owner: str, body: bytes, request_type: str, seq_id: int | None,
                       model_id: str, plan, with_optimizer: bool, response) -> UntypedAPIFuture:
    """The one path of the three saves: `plan(run)` checks the request when it is accepted, the training
    thread copies the adapter, and the checkpoint writer writes it; `response(save, size)` answers."""
    run = await run_of(services.store, model_id, owner)

    def prepare():
        save: PlannedSave = plan(run)

        def respond(state):
            return json_result(response(save, write_checkpoint(services.checkpoints, save, state)))

        return TrainingSubmission(SaveState(run.model_id, with_optimizer=with_optimizer), respond)

    request_id = await submit_training_op(services, owner=owner, model_id=run.model_id, seq_id=seq_id,
                                          request_type=request_type, body=body, prepare=prepare)
    return UntypedAPIFuture(request_id=request_id, model_id=run.model_id)


@router.post("/save_weights")
@sequenced("SaveWeights")
async def save_weights(request: Request, services: ServicesDep, owner: OwnerDep) -> UntypedAPIFuture:
    """Save adapter + optimizer state as tinker://MODEL/weights/NAME (save_state)."""
    body = await read_body(request, services.config.limits.max_request_bytes)
    save = SaveWeightsRequest.model_validate_json(body)
    return await _submit_save(
        services, owner, body, "SaveWeights", save.seq_id, save.model_id, with_optimizer=True,
        plan=lambda run: plan_save(run, "weights", save.path or f"state-{save.seq_id}", overwrite=save.overwrite,
                                   ttl_seconds=save.ttl_seconds, user_metadata=save.user_metadata),
        response=lambda planned, _: SaveWeightsResponse(path=str(planned.tinker_path)))


@router.post("/save_weights_for_sampler")
@sequenced("SaveWeightsForSampler")
async def save_weights_for_sampler(request: Request, services: ServicesDep, owner: OwnerDep) -> UntypedAPIFuture:
    """Save the adapter for sampling: named (a PEFT checkpoint) or ephemeral (a new sampling session)."""
    body = await read_body(request, services.config.limits.max_request_bytes)
    save = SaveWeightsForSamplerRequest.model_validate_json(body)
    if save.path is not None:
        return await _submit_save(
            services, owner, body, "SaveWeightsForSampler", save.seq_id, save.model_id, with_optimizer=False,
            plan=lambda run: plan_save(run, "sampler_weights", save.path, overwrite=True,
                                       ttl_seconds=save.ttl_seconds, user_metadata=save.user_metadata),
            response=lambda planned, _: SaveWeightsForSamplerResponse(path=str(planned.tinker_path)))
    run = await run_of(services.store, save.model_id, owner)

    def ephemeral_session(adapter):
        sampling_session_id = sampling_session_id_for(run.session_id, save.sampling_session_seq_id)
        services.adapters.add_ephemeral(sampling_session_id, run.model_id, adapter, services.base.name,
                                        inflight=save.kind == "inflight")
        ensure_sampling_session(services.store, base_model=services.base.name, session_id=run.session_id,
                                owner=owner, source_model_id=run.model_id,
                                sampling_session_seq_id=save.sampling_session_seq_id)
        return json_result(SaveWeightsForSamplerResponse(sampling_session_id=sampling_session_id))

    request_id = await submit_training_op(services, owner=owner, model_id=run.model_id, seq_id=save.seq_id,
                                          request_type="SaveWeightsForSampler", body=body,
                                          prepare=lambda: TrainingSubmission(Snapshot(run.model_id), ephemeral_session))
    return UntypedAPIFuture(request_id=request_id, model_id=run.model_id)


@router.post("/save_weights_external")
@sequenced("SaveWeightsExternal")
async def save_weights_external(request: Request, services: ServicesDep, owner: OwnerDep) -> UntypedAPIFuture:
    """Export the adapter (PEFT layout) as tinker://MODEL/external_weights/NAME, optionally age-encrypted."""
    body = await read_body(request, services.config.limits.max_request_bytes)
    save = SaveWeightsExternalRequest.model_validate_json(body)
    return await _submit_save(
        services, owner, body, "SaveWeightsExternal", save.seq_id, save.model_id, with_optimizer=False,
        plan=lambda run: plan_save(run, "external_weights", save.path, overwrite=True, ttl_seconds=save.ttl_seconds,
                                   age_recipients=save.age_encryption_recipients),
        response=lambda planned, size: SaveWeightsExternalResponse(path=str(planned.tinker_path), size_bytes=size))


@router.post("/load_weights")
@sequenced("LoadWeights")
async def load_weights(request: Request, services: ServicesDep, owner: OwnerDep) -> UntypedAPIFuture:
    """Load a checkpoint into an existing run, or create a run from it (create-via-load)."""
    body = await read_body(request, services.config.limits.max_request_bytes)
    load = LoadWeightsRequest.model_validate_json(body)

    if load.model_id is not None:
        run = await run_of(services.store, load.model_id, owner)
        model_id, seq_id, create = run.model_id, load.seq_id, False

        def respond(lora):
            return json_result(LoadWeightsResponse(path=load.path, model_id=model_id))
    else:
        await session_of(services.store, load.session_id, owner)
        check_base_model(services, load.base_model)
        check_optimizer(load.optimizer_config)
        await asyncio.to_thread(check_run_quota, services.store, services.config.limits, owner)
        await asyncio.to_thread(check_storage_quota, services.store, services.config.limits, owner)
        model_id, seq_id, create = model_id_for(load.session_id, load.model_seq_id), CREATION_SEQ_ID, True

        def respond(lora):
            services.store.create_training_run(training_run_record(
                base_model=services.base.name, session_id=load.session_id, model_seq_id=load.model_seq_id,
                owner=owner, lora=lora, user_metadata=load.user_metadata))
            return json_result(LoadWeightsResponse(path=load.path, model_id=model_id))

    def prepare():
        # The checkpoint is looked up and pinned when the request is accepted (a 404 at once), and stays
        # pinned until the request is over: the TTL sweeper leaves it alone while it waits for its turn.
        record = pin_for_load(services.store, services.signer, services.checkpoint_pins, load.path, owner,
                              load.weights_access_token)
        return TrainingSubmission(LoadState(model_id, Path(record.directory), load.optimizer, create), respond,
                                  release=lambda: services.checkpoint_pins.release(record.tinker_path))

    request_id = await submit_training_op(services, owner=owner, model_id=model_id, seq_id=seq_id,
                                          request_type="LoadWeights", body=body, prepare=prepare)
    return UntypedAPIFuture(request_id=request_id, model_id=model_id)


@router.post("/weights_info")
async def weights_info(body: WeightsInfoRequest, services: ServicesDep, owner: OwnerDep) -> WeightsInfoResponse:
    """What a checkpoint is: base model and LoRA settings (used by the CLI and cookbook tools)."""
    checkpoint = await asyncio.to_thread(checkpoint_of, services.store, services.signer, body.tinker_path, owner)
    # Maybe another tenant's run, for a published checkpoint.
    run = await asyncio.to_thread(services.store.get_training_run, checkpoint.model_id)
    return WeightsInfoResponse(base_model=run.base_model, is_lora=True, lora_rank=run.lora_rank,
                               train_unembed=run.train_unembed, train_mlp=run.train_mlp, train_attn=run.train_attn)
