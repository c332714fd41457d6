"""Provenance of training tokens: a datum's spans checked against what was sampled (stable_reinforce).

A datum's `model_input_spans` tile its input positions and its `loss_fn_input_spans` tile its
target rows; each run claims its tokens are positions of a recorded sampling request's prompt, or
of one of its sampled sequences. `attach_recorded_samples` checks those claims token for token
(images by content) and puts the recorded sampler logprobs on the datum's sampled target
positions, where the loss reads them. Positions are the expanded view, as the client counts them.
Knows nothing about the database (the caller looks the records up) or about the loss itself.
"""

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import torch

from server.errors import InvalidRequest
from server.models.image_processor import PreparedImage
from server.rendering.training import TrainingExample
from server.wire.training import Datum, ProvenanceSpan

RECORDED_LOGPROBS = "recorded_logprobs"
"""float32 [N]: the recorded sampler logprob at sampled target positions, 0 elsewhere (server-side input)."""
SAMPLED_MASK = "sampled_mask"
"""float32 [N]: 1 at target positions covered by a sampled span, else 0 (server-side input)."""


class RecordedSample(Protocol):
    """What was recorded for one sampled sequence (the store's record has these fields)."""

    prompt_keys: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray


def position_keys(input_ids: Sequence[int], images: Sequence[PreparedImage], image_token_id: int | None) -> np.ndarray:
    """int64 per position of an expanded sequence: the token id, or its image's key at an image position.

    An image's key is negative (never a token id) and depends only on the image's bytes, so the
    same image in a sampling prompt and in a training datum has the same key.
    """
    keys = np.asarray(input_ids, dtype=np.int64).copy()
    if images:
        image_keys = [-1 - int(image.sha256[:15], 16) for image in images]
        pads = np.flatnonzero(keys == image_token_id)
        keys[pads] = np.repeat(image_keys, [image.num_tokens for image in images])
    return keys


def named_sequence_ids(datums: Sequence[Datum]) -> set[str]:
    """Every sequence the datums' spans name; a datum without spans is a 400."""
    names = set()
    for index, datum in enumerate(datums):
        if datum.model_input_spans is None or datum.loss_fn_input_spans is None:
            raise InvalidRequest(f"datum {index}: stable_reinforce needs provenance on every datum: sample with "
                                 f"record_stability_info=True and attach the spans with Datum.with_provenance")
        names.update(span.sequence_id for span in (*datum.model_input_spans, *datum.loss_fn_input_spans))
    return names


def attach_recorded_samples(example: TrainingExample, datum: Datum, index: int,
                            recorded: Mapping[str, RecordedSample], image_token_id: int | None) -> None:
    """Check the datum's spans against the records and add RECORDED_LOGPROBS and SAMPLED_MASK to its inputs.

    Args:
        recorded: every sequence the spans name, already checked to be the caller's and unexpired.
    """
    where = f"datum {index}"
    targets_N = example.loss_fn_inputs["target_tokens"]
    if targets_N.dim() != 1:
        raise InvalidRequest(f"{where}: stable_reinforce takes target_tokens of shape [N], got {list(targets_N.shape)}")
    keys = position_keys(example.input_ids, example.images, image_token_id)
    _check_tiling(where, "model_input_spans", datum.model_input_spans, len(keys), "the model input")
    _check_tiling(where, "loss_fn_input_spans", datum.loss_fn_input_spans, len(targets_N), "target_tokens")

    position = 0
    for span in datum.model_input_spans:
        claimed = _recorded_run(where, "model_input_spans", span, recorded[span.sequence_id])
        _check_equal(where, f"model input positions [{position}, {position + span.length})",
                     keys[position:position + span.length], claimed, span)
        position += span.length

    targets = targets_N.numpy()
    advantages = example.loss_fn_inputs["advantages"].numpy()
    recorded_logprobs_N = np.zeros(len(targets), dtype=np.float32)
    sampled_N = np.zeros(len(targets), dtype=np.float32)
    position = 0
    for span in datum.loss_fn_input_spans:
        record = recorded[span.sequence_id]
        claimed = _recorded_run(where, "loss_fn_input_spans", span, record)
        rows = slice(position, position + span.length)
        if span.source == "sampled":
            _check_equal(where, f"target_tokens [{rows.start}, {rows.stop})", targets[rows], claimed, span)
            recorded_logprobs_N[rows] = record.logprobs[span.offset:span.offset + span.length]
            sampled_N[rows] = 1.0
        elif np.any(advantages[rows] != 0):
            # The targets of prompt runs carry no loss, so their values are not checked (rl_loop sends 0).
            first = rows.start + int(np.flatnonzero(advantages[rows] != 0)[0])
            raise InvalidRequest(f"{where}: stable_reinforce only accepts nonzero advantages on sampled tokens; "
                                 f"target {first} is in a prompt span of sequence {span.sequence_id} and has "
                                 f"advantage {float(advantages[first]):g}")
        position += span.length
    example.loss_fn_inputs[RECORDED_LOGPROBS] = torch.from_numpy(recorded_logprobs_N)
    example.loss_fn_inputs[SAMPLED_MASK] = torch.from_numpy(sampled_N)


def _check_tiling(where: str, field: str, spans: list[ProvenanceSpan], expected: int, what: str) -> None:
    total = sum(span.length for span in spans)
    if total != expected:
        raise InvalidRequest(f"{where}: {field} cover {total} positions but {what} has {expected}; "
                             f"the runs must tile it exactly")


def _recorded_run(where: str, field: str, span: ProvenanceSpan, record: RecordedSample) -> np.ndarray:
    """The recorded tokens (or prompt keys) that a span claims."""
    source = record.prompt_keys if span.source == "prompt" else record.tokens
    if span.offset + span.length > len(source):
        what = "prompt" if span.source == "prompt" else "sampled tokens"
        raise InvalidRequest(f"{where}: a {field} run claims positions [{span.offset}, {span.offset + span.length}) "
                             f"of the {what} of sequence {span.sequence_id}, which has {len(source)}")
    return source[span.offset:span.offset + span.length]


def _check_equal(where: str, what: str, given: np.ndarray, claimed: np.ndarray, span: ProvenanceSpan) -> None:
    differs = np.flatnonzero(given != claimed)
    if len(differs):
        first = int(differs[0])
        source = "prompt" if span.source == "prompt" else "sampled tokens"
        found, expected = (_describe(key, claimed[first] < 0 and given[first] < 0) for key in (given[first],
                                                                                              claimed[first]))
        raise InvalidRequest(f"{where}: {what} do not match the {source} of sequence {span.sequence_id} at offset "
                             f"{span.offset} (first difference {first} positions in: {found} where {expected} "
                             f"was recorded)")


def _describe(key: np.integer, both_images: bool) -> str:
    if key >= 0:
        return f"token {int(key)}"
    return f"image {-int(key) - 1:015x}" if both_images else "an image"
