"""Training runs and sampling sessions as the journal records them: their ids, their records, and the
per-tenant quotas a new run or checkpoint must fit in.

Functions take the store and the limits they need, not the whole server. Knows nothing about HTTP,
the scheduler or the model.
"""

import logging

from server.config import LimitsConfig
from server.errors import InvalidRequest
from server.store.store import SamplingSessionRecord, Store, TrainingRunRecord
from server.wire.base import MAX_ID_LENGTH
from server.wire.models import LoraConfig

logger = logging.getLogger(__name__)


def storable_id(identifier: str) -> bool:
    """Whether an id from a URL path can name a row (ids in paths are not validated by a body model)."""
    # None of ours is this long or holds NUL.
    return len(identifier) <= MAX_ID_LENGTH and "\x00" not in identifier


def string_map(metadata: dict | None) -> dict[str, str]:
    """user_metadata as stored: the wire allows any JSON values, the journal keeps strings."""
    return {str(key): str(value) for key, value in (metadata or {}).items()}


def model_id_for(session_id: str, model_seq_id: int) -> str:
    """The SDK builds this id on its own side for create-via-load, so it must be exactly this."""
    return f"{session_id}:train:{model_seq_id}"


def sampling_session_id_for(session_id: str, sampling_session_seq_id: int) -> str:
    return f"{session_id}:sample:{sampling_session_seq_id}"


def training_run_record(*, base_model: str, session_id: str, model_seq_id: int, owner: str, lora: LoraConfig,
                        user_metadata: dict | None) -> TrainingRunRecord:
    """The journal's record of a new training run (create_model, create-via-load, copy_weights)."""
    return TrainingRunRecord(
        model_id=model_id_for(session_id, model_seq_id), session_id=session_id, owner=owner,
        base_model=base_model, model_seq_id=model_seq_id, lora_rank=lora.rank, seed=lora.seed,
        train_mlp=lora.train_mlp, train_attn=lora.train_attn, train_unembed=lora.train_unembed,
        user_metadata=string_map(user_metadata))


def ensure_sampling_session(store: Store, *, base_model: str, session_id: str, sampling_session_seq_id: int,
                            owner: str, model_path: str | None = None, source_model_id: str | None = None) -> str:
    """Journal a sampling session unless a retry already did; returns its id."""
    sampling_session_id = sampling_session_id_for(session_id, sampling_session_seq_id)
    if store.get_sampling_session(sampling_session_id) is None:
        store.create_sampling_session(SamplingSessionRecord(
            sampling_session_id=sampling_session_id, session_id=session_id, owner=owner,
            base_model=base_model, model_path=model_path, source_model_id=source_model_id))
    return sampling_session_id


def touch_run(store: Store, model_id: str) -> None:
    """Note a run's latest request; best effort, since the request itself already happened."""
    try:
        store.touch_training_run(model_id)
    except Exception:
        logger.warning("could not update last_request_time of %s", model_id, exc_info=True)


def check_lora_rank(limits: LimitsConfig, rank: int) -> None:
    if rank > limits.max_lora_rank:
        raise InvalidRequest(f"lora rank {rank} is over this server's limit of {limits.max_lora_rank} "
                             f"(--max-lora-rank)")


def check_run_quota(store: Store, limits: LimitsConfig, owner: str) -> None:
    """A tenant keeps at most --max-runs-per-tenant runs in memory (runs of its open sessions)."""
    limit = limits.max_runs_per_tenant
    if store.count_active_training_runs(owner) >= limit:
        raise InvalidRequest(f"tenant {owner!r} already has {limit} training runs in open sessions, the limit "
                             f"(--max-runs-per-tenant); close a ServiceClient (its session) to free them")


def check_storage_quota(store: Store, limits: LimitsConfig, owner: str) -> None:
    """A tenant keeps at most --max-stored-gb-per-tenant of checkpoint files and journal rows (sessions, runs,
    results, recorded samples) together. It sums over the journal: call it on a worker thread."""
    limit = limits.max_stored_bytes_per_tenant
    checkpoints = store.stored_checkpoint_bytes(owner)
    journal = store.tenant_data.journal_bytes(owner)
    if checkpoints + journal >= limit:
        raise InvalidRequest(f"tenant {owner!r} stores {checkpoints} bytes of checkpoints and {journal} of journal "
                             f"(sessions, runs, results), at or over the limit of {limit} "
                             f"(--max-stored-gb-per-tenant); delete checkpoints or sessions to store more")
