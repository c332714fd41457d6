"""Checkpoints of training runs: save_weights, save_weights_for_sampler, save_weights_external, load_weights,
weights_info."""

import asyncio
import logging
import time
from datetime import timedelta
from pathlib import Path

from fastapi import APIRouter, Request

from server.api.deps import (
    OwnerDep,
    Services,
    ServicesDep,
    check_base_model,
    check_optimizer,
    check_run_quota,
    check_storage_quota,
    checkpoint_of,
    ensure_sampling_session,
    forget_checkpoint,
    json_result,
    model_id_for,
    read_body,
    run_of,
    sampling_session_id_for,
    session_of,
    submit_training_op,
    training_run_record,
    TrainingSubmission,
)
from server.errors import InvalidRequest
from server.progress import Progress
from server.scheduler.ordering import CREATION_SEQ_ID
from server.store.checkpoints import TinkerPath, parse_tinker_path, remove_checkpoint_files, sync_directory_tree
from server.store.db import is_disk_full, storage_failure
from server.store.exports import AGE_SUFFIX, encrypt_files, parse_age_recipients
from server.store.store import CheckpointRecord, TrainingRunRecord, utcnow
from server.lora.checkpoint_io import AdapterState, save_state
from server.training.operations import LoadState, SaveState, Snapshot
from server.wire.lifecycle import SaveWeightsExternalRequest, SaveWeightsExternalResponse
from server.wire.types import (
    LoadWeightsRequest,
    LoadWeightsResponse,
    SaveWeightsForSamplerRequest,
    SaveWeightsForSamplerResponse,
    SaveWeightsRequest,
    SaveWeightsResponse,
    UntypedAPIFuture,
    WeightsInfoRequest,
    WeightsInfoResponse,
)

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/api/v1")


def _save(services: Services, run: TrainingRunRecord, tinker_path: TinkerPath, *, overwrite: bool,
          ttl_seconds: int | None, user_metadata: dict[str, str] | None, write) -> int:
    """Write a checkpoint's files with `write(directory)` and record it (on the checkpoint writer, from the
    copy the training thread took; saves are written in the order they ran); returns its size. Pinned
    meanwhile, so that the TTL sweeper never removes a version being written."""
    with services.checkpoint_pins.hold(str(tinker_path)):
        return _write_and_record(services, run, tinker_path, overwrite=overwrite, ttl_seconds=ttl_seconds,
                                 user_metadata=user_metadata, write=write)


def _write_and_record(services: Services, run: TrainingRunRecord, tinker_path: TinkerPath, *, overwrite: bool,
                      ttl_seconds: int | None, user_metadata: dict[str, str] | None, write) -> int:
    """The files go to a new version directory; the journal's row is switched to it only once they are
    complete and on disk, and the old version is deleted after that (see server/store/checkpoints.py)."""
    checkpoint_dir = services.config.store.checkpoint_dir
    existing = services.store.get_checkpoint(str(tinker_path))
    if existing is not None and not overwrite:
        raise InvalidRequest(f"checkpoint {tinker_path} already exists; choose another name")
    check_storage_quota(services, run.owner)
    directory = tinker_path.new_version_directory(checkpoint_dir)
    started = time.perf_counter()
    try:
        with Progress("checkpoint_save", f"Saving {tinker_path}", logger, delay=2.0, tinker_path=tinker_path):
            size = write(directory)
            sync_directory_tree(directory)
        now = utcnow()
        services.store.add_checkpoint(CheckpointRecord(
            tinker_path=str(tinker_path), model_id=run.model_id, checkpoint_id=tinker_path.checkpoint_id,
            checkpoint_type=tinker_path.checkpoint_type, directory=str(directory), size_bytes=size,
            owner=run.owner, user_metadata=user_metadata or {}, created_at=now,
            expires_at=now + timedelta(seconds=ttl_seconds) if ttl_seconds else None))
    except Exception as error:
        remove_checkpoint_files(directory, checkpoint_dir)
        logger.warning("event=checkpoint_failed tinker_path=%s error=%r", tinker_path, type(error).__name__)
        if isinstance(error, OSError) or is_disk_full(error):
            raise storage_failure(error, f"save checkpoint {tinker_path}") from error
        raise
    if existing is not None:
        forget_checkpoint(services, existing)
        remove_checkpoint_files(Path(existing.directory), checkpoint_dir)
    logger.info("event=checkpoint_saved tinker_path=%s tenant=%s bytes=%d seconds=%.3f overwrote=%s", tinker_path,
                run.owner, size, time.perf_counter() - started, existing is not None)
    return size


@router.post("/save_weights")
async def save_weights(request: Request, services: ServicesDep, owner: OwnerDep) -> UntypedAPIFuture:
    """Save adapter + optimizer state as tinker://MODEL/weights/NAME (save_state)."""
    body = await read_body(request, services.config.limits.max_request_bytes)
    save = SaveWeightsRequest.model_validate_json(body)
    run = run_of(services.store, save.model_id, owner)

    def prepare():
        tinker_path = TinkerPath(run.model_id, "weights", save.path or f"state-{save.seq_id}")
        parse_tinker_path(str(tinker_path))  # validates the name

        def respond(state: AdapterState):
            _save(services, run, tinker_path, overwrite=save.overwrite, ttl_seconds=save.ttl_seconds,
                  user_metadata=save.user_metadata, write=lambda directory: save_state(directory, state))
            return json_result(SaveWeightsResponse(path=str(tinker_path)))

        return TrainingSubmission(SaveState(run.model_id, with_optimizer=True), respond)

    request_id = await submit_training_op(services, owner=owner, model_id=run.model_id, seq_id=save.seq_id,
                                          request_type="SaveWeights", body=body, prepare=prepare)
    return UntypedAPIFuture(request_id=request_id, model_id=run.model_id)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request, services: ServicesDep, owner: OwnerDep) -> UntypedAPIFuture:
    """Save the adapter for sampling: named (a PEFT checkpoint) or ephemeral (a new sampling session)."""
    body = await read_body(request, services.config.limits.max_request_bytes)
    save = SaveWeightsForSamplerRequest.model_validate_json(body)
    run = run_of(services.store, save.model_id, owner)

    def prepare():
        if save.path is None:
            return TrainingSubmission(Snapshot(run.model_id), ephemeral_session)

        tinker_path = TinkerPath(run.model_id, "sampler_weights", save.path)
        parse_tinker_path(str(tinker_path))

        def respond(state: AdapterState):
            _save(services, run, tinker_path, overwrite=True, ttl_seconds=save.ttl_seconds,
                  user_metadata=save.user_metadata, write=lambda directory: save_state(directory, state))
            return json_result(SaveWeightsForSamplerResponse(path=str(tinker_path)))

        return TrainingSubmission(SaveState(run.model_id, with_optimizer=False), respond)

    def ephemeral_session(adapter):
        sampling_session_id = sampling_session_id_for(run.session_id, save.sampling_session_seq_id)
        services.adapters.add_ephemeral(sampling_session_id, run.model_id, adapter, services.base.name,
                                        inflight=save.kind == "inflight")
        ensure_sampling_session(services, session_id=run.session_id, owner=owner, source_model_id=run.model_id,
                                sampling_session_seq_id=save.sampling_session_seq_id)
        return json_result(SaveWeightsForSamplerResponse(sampling_session_id=sampling_session_id))

    request_id = await submit_training_op(services, owner=owner, model_id=run.model_id, seq_id=save.seq_id,
                                          request_type="SaveWeightsForSampler", body=body, prepare=prepare)
    return UntypedAPIFuture(request_id=request_id, model_id=run.model_id)


@router.post("/save_weights_external")
async def save_weights_external(request: Request, services: ServicesDep, owner: OwnerDep) -> UntypedAPIFuture:
    """Export the adapter (PEFT layout) as tinker://MODEL/external_weights/NAME, optionally age-encrypted."""
    body = await read_body(request, services.config.limits.max_request_bytes)
    save = SaveWeightsExternalRequest.model_validate_json(body)
    run = run_of(services.store, save.model_id, owner)

    def prepare():
        tinker_path = TinkerPath(run.model_id, "external_weights", save.path)
        parse_tinker_path(str(tinker_path))
        recipients = parse_age_recipients(save.age_encryption_recipients) if save.age_encryption_recipients \
            else None

        def respond(state: AdapterState):
            def write(directory):
                size = save_state(directory, state)
                return size if recipients is None else encrypt_files(directory, recipients)

            size = _save(services, run, tinker_path, overwrite=True, ttl_seconds=save.ttl_seconds,
                         user_metadata=None, write=write)
            return json_result(SaveWeightsExternalResponse(path=str(tinker_path), size_bytes=size))

        return TrainingSubmission(SaveState(run.model_id, with_optimizer=False), respond)

    request_id = await submit_training_op(services, owner=owner, model_id=run.model_id, seq_id=save.seq_id,
                                          request_type="SaveWeightsExternal", body=body, prepare=prepare)
    return UntypedAPIFuture(request_id=request_id, model_id=run.model_id)


@router.post("/load_weights")
async def load_weights(request: Request, services: ServicesDep, owner: OwnerDep) -> UntypedAPIFuture:
    """Load a checkpoint into an existing run, or create a run from it (create-via-load)."""
    body = await read_body(request, services.config.limits.max_request_bytes)
    load = LoadWeightsRequest.model_validate_json(body)

    if load.model_id is not None:
        run = run_of(services.store, load.model_id, owner)
        model_id, seq_id, create = run.model_id, load.seq_id, False

        def respond(lora):
            return json_result(LoadWeightsResponse(path=load.path, model_id=model_id))
    else:
        session_of(services.store, load.session_id, owner)
        check_base_model(services, load.base_model)
        check_optimizer(load.optimizer_config)
        check_run_quota(services, owner)
        await asyncio.to_thread(check_storage_quota, services, owner)
        model_id, seq_id, create = model_id_for(load.session_id, load.model_seq_id), CREATION_SEQ_ID, True

        def respond(lora):
            services.store.create_training_run(training_run_record(
                services, session_id=load.session_id, model_seq_id=load.model_seq_id, owner=owner, lora=lora,
                user_metadata=load.user_metadata))
            return json_result(LoadWeightsResponse(path=load.path, model_id=model_id))

    def prepare():
        # The checkpoint is looked up and pinned when the request is accepted (a 404 at once), and stays
        # pinned until the request is over: the TTL sweeper leaves it alone while it waits for its turn.
        record = checkpoint_of(services, load.path, owner, access_token=load.weights_access_token)
        if any(Path(record.directory).glob(f"*{AGE_SUFFIX}")):
            raise InvalidRequest(f"{load.path} is age-encrypted: download it (external_weights_urls), it cannot "
                                 f"be loaded")
        services.checkpoint_pins.acquire(record.tinker_path)
        return TrainingSubmission(LoadState(model_id, Path(record.directory), load.optimizer, create), respond,
                                  release=lambda: services.checkpoint_pins.release(record.tinker_path))

    request_id = await submit_training_op(services, owner=owner, model_id=model_id, seq_id=seq_id,
                                          request_type="LoadWeights", body=body, prepare=prepare)
    return UntypedAPIFuture(request_id=request_id, model_id=model_id)


@router.post("/weights_info")
async def weights_info(body: WeightsInfoRequest, services: ServicesDep, owner: OwnerDep) -> WeightsInfoResponse:
    """What a checkpoint is: base model and LoRA settings (used by the CLI and cookbook tools)."""
    checkpoint = checkpoint_of(services, body.tinker_path, owner)
    run = services.store.get_training_run(checkpoint.model_id)  # maybe another tenant's, for a published one
    return WeightsInfoResponse(base_model=run.base_model, is_lora=True, lora_rank=run.lora_rank,
                               train_unembed=run.train_unembed, train_mlp=run.train_mlp, train_attn=run.train_attn)
