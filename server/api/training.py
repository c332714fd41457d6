"""forward_backward (protobuf in, protobuf out; also `forward`) and optim_step."""

import asyncio

from fastapi import APIRouter, Request

from server.api.deps import (OwnerDep, ServicesDep, TrainingSubmission, check_loss_config, json_result, read_body,
                             run_of, sequenced, submit_training_op)
from server.errors import InvalidRequest
from server.recorded_sequences import recorded_sequences_of
from server.rendering.provenance import attach_recorded_samples, named_sequence_ids
from server.rendering.training import render_training_data
from server.runs import touch_run
from server.store.run_metrics import FORWARD_BACKWARD, OPTIM_STEP
from server.training.curves import curve_metrics
from server.training.losses import resolve_loss
from server.training.operations import ForwardBackward, OptimStep
from server.wire import PROTOBUF
from server.wire.futures import UntypedAPIFuture
from server.wire.proto import (decode_forward_backward_request, encode_forward_backward_output,
                               inflate_forward_backward_body)
from server.wire.training import AdamParams, OptimStepRequest, OptimStepResponse

router = APIRouter(prefix="/api/v1")


@router.post("/forward_backward")
@sequenced("ForwardBackward")
async def forward_backward(request: Request, services: ServicesDep, owner: OwnerDep) -> UntypedAPIFuture:
    """Compute the loss on a batch and, unless forward_only, accumulate its gradients."""
    limits = services.config.limits
    body = await read_body(request, limits.max_request_bytes)
    # Off the event loop: a large body takes a while to inflate and parse, and other connections must not wait.
    # Journaled and hashed as decoded: the same request resent in another encoding is the same request.
    body = request.state.body = await asyncio.to_thread(inflate_forward_backward_body, body,
                                                        request.headers.get("content-encoding"),
                                                        limits.max_decompressed_bytes)
    request.state.inflated = True
    try:
        fwdbwd = await asyncio.to_thread(decode_forward_backward_request, body, None)
    except InvalidRequest:
        raise  # says what is wrong, with its own status (413 for a body that inflates past the limit)
    except ValueError as error:
        raise InvalidRequest(f"malformed forward_backward request: {error}") from None
    if len(fwdbwd.data) > limits.max_datums_per_request:
        raise InvalidRequest(f"forward_backward has {len(fwdbwd.data)} datums, over this server's limit of "
                             f"{limits.max_datums_per_request} (--max-datums-per-request); send them in several calls")
    run = await run_of(services.store, fwdbwd.model_id, owner)

    def prepare():
        if not fwdbwd.data:
            raise InvalidRequest("forward_backward needs at least one datum")
        spec, config = resolve_loss(fwdbwd.loss_fn, fwdbwd.loss_fn_config)
        check_loss_config(config)
        examples = render_training_data(fwdbwd.data, services.render_context, spec.inputs, spec.optional_inputs)
        if spec.needs_provenance:
            recorded = recorded_sequences_of(services.store, named_sequence_ids(fwdbwd.data), owner, run.session_id)
            vision = services.render_context.vision
            for index, (datum, example) in enumerate(zip(fwdbwd.data, examples)):
                attach_recorded_samples(example, datum, index, recorded, vision.image_token_id if vision else None)

        def respond(result):
            touch_run(services.store, fwdbwd.model_id)
            if not fwdbwd.forward_only:
                services.store.run_metrics.record(fwdbwd.model_id, FORWARD_BACKWARD,
                                                  curve_metrics(examples, result.outputs, result.metrics))
            return encode_forward_backward_output(result.outputs, result.metrics), PROTOBUF

        return TrainingSubmission(ForwardBackward(fwdbwd.model_id, examples, fwdbwd.loss_fn, fwdbwd.loss_fn_config,
                                                  fwdbwd.forward_only), respond)

    request_id = await submit_training_op(services, owner=owner, model_id=fwdbwd.model_id, seq_id=fwdbwd.seq_id,
                                          request_type="Forward" if fwdbwd.forward_only else "ForwardBackward",
                                          body=body, prepare=prepare)
    return UntypedAPIFuture(request_id=request_id, model_id=fwdbwd.model_id)


@router.post("/optim_step")
@sequenced("OptimStep")
async def optim_step(request: Request, services: ServicesDep, owner: OwnerDep) -> UntypedAPIFuture:
    """Apply one AdamW step with every AdamParams field, then clear the gradients."""
    body = await read_body(request, services.config.limits.max_request_bytes)
    step = OptimStepRequest.model_validate_json(body)
    await run_of(services.store, step.model_id, owner)

    def prepare():
        if not isinstance(step.adam_params, AdamParams):
            raise InvalidRequest("this server trains with AdamW; send adam_params")

        def respond(metrics):
            services.store.run_metrics.record(step.model_id, OPTIM_STEP, metrics)
            return json_result(OptimStepResponse(metrics=metrics))

        return TrainingSubmission(OptimStep(step.model_id, step.adam_params), respond)

    request_id = await submit_training_op(services, owner=owner, model_id=step.model_id, seq_id=step.seq_id,
                                          request_type="OptimStep", body=body, prepare=prepare)
    return UntypedAPIFuture(request_id=request_id, model_id=step.model_id)
