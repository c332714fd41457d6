"""Who may read a checkpoint: its owner, every tenant once it is published, or the holder of its weights
access token. Another tenant's private checkpoint is not found (404), exactly like a missing one."""

from pathlib import Path

from server.errors import InvalidRequest, NotFound
from server.runs import storable_id
from server.store.checkpoints import parse_tinker_path
from server.store.exports import AGE_SUFFIX, Signer
from server.store.retention import CheckpointPins
from server.store.store import CheckpointRecord, Store


def checkpoint_of(store: Store, signer: Signer, path: str, owner: str,
                  access_token: str | None = None) -> CheckpointRecord:
    """The checkpoint behind a tinker:// path that the caller may read (load, sample, copy), or 404."""
    tinker_path = str(parse_tinker_path(path))
    record = store.get_checkpoint(tinker_path) if storable_id(tinker_path) else None
    return readable_checkpoint(signer, record, path, owner, access_token)


def readable_checkpoint(signer: Signer, record: CheckpointRecord | None, path: str, owner: str,
                        access_token: str | None = None) -> CheckpointRecord:
    """`record` (the checkpoint behind `path`) if the caller may read it, or 404."""
    if record is not None and (record.owner == owner or record.public or (
            access_token is not None and signer.valid_weights_access_token(
                access_token, record.tinker_path, record.created_at.isoformat()))):
        return record
    raise NotFound(f"no checkpoint {path}")


def owned_checkpoint_of(store: Store, path: str, owner: str) -> CheckpointRecord:
    """The caller's own checkpoint behind a tinker:// path (to publish, expire or delete it), or 404."""
    tinker_path = str(parse_tinker_path(path))
    record = store.get_checkpoint(tinker_path) if storable_id(tinker_path) else None
    if record is None or record.owner != owner:
        raise NotFound(f"no checkpoint {path}")
    return record


def pin_for_load(store: Store, signer: Signer, pins: CheckpointPins, path: str, owner: str,
                 access_token: str | None) -> CheckpointRecord:
    """The checkpoint a load_weights names, pinned (the TTL sweeper leaves it alone) until the caller
    releases it; an age-encrypted export cannot be loaded."""
    record = checkpoint_of(store, signer, path, owner, access_token)
    if any(Path(record.directory).glob(f"*{AGE_SUFFIX}")):
        raise InvalidRequest(f"{path} is age-encrypted: download it (external_weights_urls), it cannot be loaded")
    pins.acquire(record.tinker_path)
    return record
