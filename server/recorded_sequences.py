"""stable_reinforce's recorded sequences: what a record_stability_info request sampled, kept per returned
sequence when it is sampled and looked up (the tenant's own, from the run's session) when it is trained on.

Functions take the store, not the whole server. Knows nothing about HTTP, spans or losses
(rendering/provenance.py checks a datum against the records).
"""

from server.errors import InvalidRequest
from server.rendering.chunks import RenderedInput
from server.rendering.provenance import position_keys
from server.store.sampled_sequences import SampledSequenceRecord
from server.store.store import SamplingSessionRecord, Store
from server.wire.proto import SampledSequence


def record_sampled_sequences(store: Store, sampler: SamplingSessionRecord, prompt: RenderedInput,
                             adapter: str | None, sequence_ids: list[str],
                             sequences: list[SampledSequence]) -> None:
    """Keep what a record_stability_info request sampled, per returned sequence, for its session.

    Args:
        adapter: the name of the adapter version that sampled them; None for the base model.
    """
    keys = position_keys(prompt.expanded_token_ids(), prompt.images, prompt.image_token_id)
    store.sampled_sequences.record([
        SampledSequenceRecord(sequence_id=sequence_id, owner=sampler.owner, session_id=sampler.session_id,
                              sampling_session_id=sampler.sampling_session_id,
                              adapter=adapter, prompt_keys=keys,
                              tokens=sequence.tokens, logprobs=sequence.logprobs)
        for sequence_id, sequence in zip(sequence_ids, sequences, strict=True)])


def recorded_sequences_of(store: Store, sequence_ids: set[str], owner: str,
                          session_id: str) -> dict[str, SampledSequenceRecord]:
    """The recorded sequences a training request names, each given another day; a 400 names the first
    one that is unknown (or another tenant's), expired, or sampled in another session."""
    found = store.sampled_sequences.use(sequence_ids, owner)
    for sequence_id in sorted(sequence_ids):
        record = found.get(sequence_id)
        if record is None:
            raise InvalidRequest(f"sequence {sequence_id} is unknown or expired: sample it with "
                                 f"record_stability_info=True; recorded sequences can be trained on for one day "
                                 f"after sampling or their last use")
        if record.session_id != session_id:
            raise InvalidRequest(f"sequence {sequence_id} was sampled in session {record.session_id}, not in this "
                                 f"run's session {session_id}: recorded sequences belong to the session that "
                                 f"sampled them")
    return found
