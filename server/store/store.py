"""The Store: synchronous, thread-safe queries over the durable state, returning frozen records.

Every call opens its own short transaction on the one shared engine, so the async scheduler can
run calls in asyncio.to_thread. Callers get records, never ORM rows, so nothing lazy-loads later.
Knows nothing about HTTP, wire types or where checkpoint files come from.
"""

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, Literal, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import sessionmaker

from server.store.db import build_engine, upgrade_to_head
from server.store.rows import (DEFAULT_PROJECT, ApiKeyRow, Base, CheckpointRow, FutureRow, SamplingSessionRow,
                               SessionRow, TrainingRunRow)
from server.store.run_metrics import RunMetrics
from server.store.sampled_sequences import SampledSequences
from server.store.tenant_data import TenantData

FutureStatus = Literal["pending", "complete", "failed"]
MAX_REMEMBERED_RECORDS = 4096
CheckpointType = Literal["training", "sampler", "external"]


def utcnow() -> datetime:
    """The current time, timezone-aware UTC (the only kind the store accepts)."""
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """One SDK session."""

    session_id: str
    owner: str
    tags: list[str]
    user_metadata: dict[str, str]
    sdk_version: str | None
    display_name: str | None
    created_at: datetime
    last_heartbeat_at: datetime
    finished_at: datetime | None
    finish_reason: str | None
    project_id: str = DEFAULT_PROJECT


@dataclass(frozen=True)
class SessionQuery:
    """A search over one owner's sessions, newest first (keyset-paged by (created_at, session_id))."""

    owner: str
    session_id: str | None = None
    display_name_words: tuple[str, ...] = ()
    """Each must appear in the display name, ignoring case. With session_id, matching either one is enough."""
    project_ids: tuple[str, ...] | None = None
    user_metadata: dict[str, str] = field(default_factory=dict)
    """Every pair must be in the session's user_metadata."""
    statuses: tuple[str, ...] | None = None
    """"active" and finish reasons ("success", ...); a session matching any of them matches. None: any status."""
    after: tuple[datetime, str] | None = None
    """The (created_at, session_id) of the previous page's last session."""
    limit: int = 50


@dataclass(frozen=True, slots=True)
class SessionSearchHit:
    session: SessionRecord
    num_checkpoints: int
    checkpoint_bytes: int


@dataclass(frozen=True, slots=True)
class TrainingRunRecord:
    """One LoRA training run; model_id = f"{session_id}:train:{model_seq_id}"."""

    model_id: str
    session_id: str
    owner: str
    base_model: str
    model_seq_id: int
    lora_rank: int
    seed: int | None
    train_mlp: bool
    train_attn: bool
    train_unembed: bool
    optimizer_type: str = "adamw"
    user_metadata: dict[str, str] = field(default_factory=dict)
    created_at: datetime = field(default_factory=utcnow)
    last_request_time: datetime = field(default_factory=utcnow)


@dataclass(frozen=True, slots=True)
class FutureRecord:
    """One journaled request; `result` holds the encoded response bytes once complete."""

    request_id: str
    request_type: str
    owner: str | None
    model_id: str | None
    seq_id: int | None
    payload_hash: str
    status: FutureStatus
    result: bytes | None
    content_type: str | None
    error: str | None
    error_category: str | None
    created_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    """One saved checkpoint; checkpoint_id is "weights/NAME", "sampler_weights/NAME" or "external_weights/NAME"."""

    tinker_path: str
    model_id: str
    checkpoint_id: str
    checkpoint_type: CheckpointType
    directory: str
    size_bytes: int | None
    owner: str
    public: bool = False
    user_metadata: dict[str, str] = field(default_factory=dict)
    created_at: datetime = field(default_factory=utcnow)
    expires_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class SamplingSessionRecord:
    """One sampler: the base model alone (model_path None) or a sampler checkpoint on top of it."""

    sampling_session_id: str
    session_id: str
    owner: str
    base_model: str
    model_path: str | None
    source_model_id: str | None = None
    """Set for an unsaved snapshot: the training run it was taken from (its weights live in memory)."""
    created_at: datetime = field(default_factory=utcnow)


@dataclass(frozen=True, slots=True)
class ApiKeyRecord:
    """An issued API key: its public id, the SHA-256 of the secret, and whose it is."""

    key_id: str
    key_hash: str
    tenant: str
    admin: bool = False
    label: str | None = None
    created_at: datetime = field(default_factory=utcnow)
    revoked_at: datetime | None = None


RecordT = TypeVar("RecordT")


def _to_record(record_type: type[RecordT], row: Base) -> RecordT:
    # Records and rows share field names, so the conversion is one loop in each direction.
    return record_type(**{f.name: getattr(row, f.name) for f in fields(record_type)})


def _to_values(record: Any) -> dict[str, Any]:
    return {f.name: getattr(record, f.name) for f in fields(record)}


class Store:
    """Durable sessions, training runs, futures, checkpoints and sampling sessions."""

    def __init__(self, database_url: str):
        self.engine = build_engine(database_url)
        upgrade_to_head(self.engine)
        self._transaction = sessionmaker(self.engine, expire_on_commit=False).begin
        # INSERT ... ON CONFLICT lets the database settle races between threads and replicas.
        self._insert = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}[self.engine.dialect.name]
        self.sampled_sequences = SampledSequences(self.engine)
        """Sequences sampled with record_stability_info (stable_reinforce); a module of its own."""
        self.run_metrics = RunMetrics(self.engine)
        """Each run's metrics per step (the dashboard's curves); a module of its own."""
        self.tenant_data = TenantData(self.engine)
        """Each tenant's journal bytes (in its storage quota); a module of its own, as is deleting a session."""
        self._sampling_sessions = _Remembered[SamplingSessionRecord]()
        """Sampling sessions read lately: they never change once written, and every sample request names one."""
        self._checkpoints = _Remembered[CheckpointRecord]()
        """Checkpoints read lately (a sample request names one): forgotten by every write to their row here, the
        only writer while this server owns the journal."""

    def close(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()

    # sessions

    def create_session(
        self,
        session_id: str,
        *,
        tags: list[str],
        user_metadata: dict[str, str],
        sdk_version: str | None,
        display_name: str | None,
        owner: str,
    ) -> None:
        """Record a new session."""
        now = utcnow()
        row = SessionRow(
            session_id=session_id,
            owner=owner,
            tags=tags,
            user_metadata=user_metadata,
            sdk_version=sdk_version,
            display_name=display_name,
            created_at=now,
            last_heartbeat_at=now,
        )
        with self._transaction() as db:
            db.add(row)

    def heartbeat_session(self, session_id: str) -> bool:
        """Mark a session alive; False if it is unknown or finished."""
        statement = (
            sa.update(SessionRow)
            .where(SessionRow.session_id == session_id, SessionRow.finished_at.is_(None))
            .values(last_heartbeat_at=utcnow())
        )
        with self._transaction() as db:
            return db.execute(statement).rowcount == 1

    def finish_session(self, session_id: str, reason: str) -> bool:
        """Mark a session finished; False if it is unknown or already finished."""
        statement = (
            sa.update(SessionRow)
            .where(SessionRow.session_id == session_id, SessionRow.finished_at.is_(None))
            .values(finished_at=utcnow(), finish_reason=reason)
        )
        with self._transaction() as db:
            return db.execute(statement).rowcount == 1

    def silent_session_ids(self, seconds: float) -> list[str]:
        """Unfinished sessions whose last heartbeat is more than `seconds` old."""
        cutoff = utcnow() - timedelta(seconds=seconds)
        statement = sa.select(SessionRow.session_id).where(SessionRow.finished_at.is_(None),
                                                          SessionRow.last_heartbeat_at < cutoff)
        with self._transaction() as db:
            return list(db.scalars(statement))

    def get_session(self, session_id: str) -> SessionRecord | None:
        """The session, or None."""
        with self._transaction() as db:
            row = db.get(SessionRow, session_id)
            return None if row is None else _to_record(SessionRecord, row)

    def list_sessions(self, *, owner: str, limit: int, offset: int) -> list[SessionRecord]:
        """One page of the owner's sessions, newest first."""
        statement = (
            sa.select(SessionRow)
            .where(SessionRow.owner == owner)
            .order_by(SessionRow.created_at.desc(), SessionRow.session_id.desc())
            .limit(limit)
            .offset(offset)
        )
        with self._transaction() as db:
            return [_to_record(SessionRecord, row) for row in db.scalars(statement)]

    def list_training_run_ids(self, session_id: str) -> list[str]:
        """The model_ids of a session's training runs, in model_seq_id order."""
        statement = (
            sa.select(TrainingRunRow.model_id)
            .where(TrainingRunRow.session_id == session_id)
            .order_by(TrainingRunRow.model_seq_id)
        )
        with self._transaction() as db:
            return list(db.scalars(statement))

    def list_sampling_session_ids(self, session_id: str) -> list[str]:
        """The ids of a session's sampling sessions, oldest first."""
        statement = (
            sa.select(SamplingSessionRow.sampling_session_id)
            .where(SamplingSessionRow.session_id == session_id)
            .order_by(SamplingSessionRow.created_at, SamplingSessionRow.sampling_session_id)
        )
        with self._transaction() as db:
            return list(db.scalars(statement))

    def set_session_project(self, session_id: str, project_id: str) -> bool:
        """Move a session (and with it its runs and samplers) into a project; False if it is unknown."""
        statement = sa.update(SessionRow).where(SessionRow.session_id == session_id).values(project_id=project_id)
        with self._transaction() as db:
            return db.execute(statement).rowcount == 1

    def search_sessions(self, query: SessionQuery) -> list[SessionSearchHit]:
        """One page of the owner's sessions matching the query, newest first, with their checkpoint totals."""
        where = [SessionRow.owner == query.owner]
        by_name = [sa.func.lower(SessionRow.display_name).contains(word.lower(), autoescape=True)
                   for word in query.display_name_words]
        if query.session_id is not None and by_name:
            where.append(sa.or_(SessionRow.session_id == query.session_id, sa.and_(*by_name)))
        elif query.session_id is not None:
            where.append(SessionRow.session_id == query.session_id)
        else:
            where.extend(by_name)
        if query.project_ids is not None:
            where.append(SessionRow.project_id.in_(query.project_ids))
        metadata = sa.type_coerce(SessionRow.user_metadata, sa.JSON)
        where.extend(metadata[key].as_string() == value for key, value in query.user_metadata.items())
        if query.statuses is not None:
            reasons = [status for status in query.statuses if status != "active"]
            active = [SessionRow.finished_at.is_(None)] if "active" in query.statuses else []
            where.append(sa.or_(sa.false(), *active, SessionRow.finish_reason.in_(reasons)))
        if query.after is not None:
            created_at, session_id = query.after
            where.append(sa.or_(SessionRow.created_at < created_at,
                                sa.and_(SessionRow.created_at == created_at, SessionRow.session_id < session_id)))
        page = (sa.select(SessionRow).where(*where)
                .order_by(SessionRow.created_at.desc(), SessionRow.session_id.desc()).limit(query.limit))
        with self._transaction() as db:
            sessions = [_to_record(SessionRecord, row) for row in db.scalars(page)]
            totals = sa.select(TrainingRunRow.session_id, sa.func.count(), sa.func.sum(CheckpointRow.size_bytes)) \
                .join(CheckpointRow, CheckpointRow.model_id == TrainingRunRow.model_id) \
                .where(TrainingRunRow.session_id.in_([s.session_id for s in sessions])) \
                .group_by(TrainingRunRow.session_id)
            counts = {session_id: (count, size or 0) for session_id, count, size in db.execute(totals)}
        return [SessionSearchHit(session, *counts.get(session.session_id, (0, 0))) for session in sessions]

    def count_active_training_runs(self, owner: str) -> int:
        """The owner's training runs whose session is still open (their adapters are in memory)."""
        statement = (
            sa.select(sa.func.count())
            .select_from(TrainingRunRow)
            .join(SessionRow, SessionRow.session_id == TrainingRunRow.session_id)
            .where(TrainingRunRow.owner == owner, SessionRow.finished_at.is_(None))
        )
        with self._transaction() as db:
            return db.scalar(statement)

    # training runs

    def create_training_run(self, run: TrainingRunRecord) -> None:
        """Record a new training run (its session must exist)."""
        with self._transaction() as db:
            db.add(TrainingRunRow(**_to_values(run)))

    def get_training_run(self, model_id: str) -> TrainingRunRecord | None:
        """The training run, or None."""
        with self._transaction() as db:
            row = db.get(TrainingRunRow, model_id)
            return None if row is None else _to_record(TrainingRunRecord, row)

    def list_training_runs(self, *, owner: str, limit: int, offset: int,
                           project_id: str | None = None) -> tuple[list[TrainingRunRecord], int]:
        """One page of the owner's training runs (of one project, or all), newest first, and their total count."""
        where = TrainingRunRow.owner == owner
        if project_id is not None:
            in_project = sa.select(SessionRow.session_id).where(SessionRow.project_id == project_id)
            where = sa.and_(where, TrainingRunRow.session_id.in_(in_project))
        page = (
            sa.select(TrainingRunRow)
            .where(where)
            .order_by(TrainingRunRow.created_at.desc(), TrainingRunRow.model_id.desc())
            .limit(limit)
            .offset(offset)
        )
        with self._transaction() as db:
            total = db.scalar(sa.select(sa.func.count()).select_from(TrainingRunRow).where(where))
            return [_to_record(TrainingRunRecord, row) for row in db.scalars(page)], total

    def touch_training_run(self, model_id: str) -> None:
        """Set the run's last_request_time to now."""
        statement = (
            sa.update(TrainingRunRow).where(TrainingRunRow.model_id == model_id).values(last_request_time=utcnow())
        )
        with self._transaction() as db:
            db.execute(statement)

    # futures

    def insert_future(
        self,
        *,
        request_id: str,
        request_type: str,
        model_id: str | None,
        seq_id: int | None,
        payload_hash: str,
        owner: str | None = None,
    ) -> FutureRecord:
        """Journal a pending request, or return the row already holding (model_id, seq_id) unchanged.

        The caller compares the returned request_type and payload_hash with its own to tell a retry
        from a conflicting reuse of the seq_id.
        """
        statement = (
            self._insert(FutureRow)
            .values(
                request_id=request_id,
                request_type=request_type,
                owner=owner,
                model_id=model_id,
                seq_id=seq_id,
                payload_hash=payload_hash,
                status="pending",
                created_at=utcnow(),
            )
            .on_conflict_do_nothing(index_elements=["model_id", "seq_id"])
        )
        # NULLs never collide in a unique constraint, so requests without a seq_id are always new.
        if model_id is None or seq_id is None:
            lookup = sa.select(FutureRow).where(FutureRow.request_id == request_id)
        else:
            lookup = sa.select(FutureRow).where(FutureRow.model_id == model_id, FutureRow.seq_id == seq_id)
        with self._transaction() as db:
            db.execute(statement)
            return _to_record(FutureRecord, db.scalars(lookup).one())

    def complete_future(self, request_id: str, *, result: bytes, content_type: str) -> None:
        """Store the result of a pending future; a finished future keeps its first outcome."""
        self._finish_future(request_id, status="complete", result=result, content_type=content_type)

    def fail_future(self, request_id: str, *, error: str, category: str) -> None:
        """Fail a pending future; a finished future keeps its first outcome."""
        self._finish_future(request_id, status="failed", error=error, error_category=category)

    def _finish_future(self, request_id: str, **values: Any) -> None:
        statement = (
            sa.update(FutureRow)
            .where(FutureRow.request_id == request_id, FutureRow.status == "pending")
            .values(finished_at=utcnow(), **values)
        )
        with self._transaction() as db:
            db.execute(statement)

    def get_future(self, request_id: str) -> FutureRecord | None:
        """The future, or None (unknown, or deleted by retention)."""
        with self._transaction() as db:
            row = db.get(FutureRow, request_id)
            return None if row is None else _to_record(FutureRecord, row)

    def fail_pending_futures(self, error: str) -> int:
        """Fail every pending future (category "server"); run at startup, when nothing can finish them."""
        statement = (
            sa.update(FutureRow)
            .where(FutureRow.status == "pending")
            .values(status="failed", error=error, error_category="server", finished_at=utcnow())
        )
        with self._transaction() as db:
            return db.execute(statement).rowcount

    def delete_finished_futures_older_than(self, seconds: float) -> int:
        """Delete futures that finished more than `seconds` ago; returns how many."""
        cutoff = utcnow() - timedelta(seconds=seconds)
        statement = sa.delete(FutureRow).where(FutureRow.status != "pending", FutureRow.finished_at < cutoff)
        with self._transaction() as db:
            return db.execute(statement).rowcount

    # checkpoints

    def add_checkpoint(self, ckpt: CheckpointRecord) -> None:
        """Record a checkpoint, replacing any row with the same tinker_path."""
        values = _to_values(ckpt)
        statement = self._insert(CheckpointRow).values(**values)
        statement = statement.on_conflict_do_update(
            index_elements=["tinker_path"],
            set_={name: statement.excluded[name] for name in values if name != "tinker_path"},
        )
        with self._transaction() as db:
            db.execute(statement)
        self._checkpoints.forget(ckpt.tinker_path)

    def get_checkpoint(self, tinker_path: str) -> CheckpointRecord | None:
        """The checkpoint, or None (from memory when it was read lately)."""
        if (record := self._checkpoints.get(tinker_path)) is not None:
            return record
        era = self._checkpoints.era()
        with self._transaction() as db:
            row = db.get(CheckpointRow, tinker_path)
            record = None if row is None else _to_record(CheckpointRecord, row)
        if record is not None:
            self._checkpoints.put(tinker_path, record, era)
        return record

    def remembered_checkpoint(self, tinker_path: str) -> CheckpointRecord | None:
        """The checkpoint if it was read lately, without touching the database (safe on the event loop)."""
        return self._checkpoints.get(tinker_path)

    def list_checkpoints(
        self, *, model_id: str | None, owner: str, limit: int, offset: int
    ) -> tuple[list[CheckpointRecord], int]:
        """One page of the owner's checkpoints (of one run, or all), newest first, and the total count."""
        where = [CheckpointRow.owner == owner]
        if model_id is not None:
            where.append(CheckpointRow.model_id == model_id)
        page = (
            sa.select(CheckpointRow)
            .where(*where)
            .order_by(CheckpointRow.created_at.desc(), CheckpointRow.tinker_path.desc())
            .limit(limit)
            .offset(offset)
        )
        with self._transaction() as db:
            total = db.scalar(sa.select(sa.func.count()).select_from(CheckpointRow).where(*where))
            return [_to_record(CheckpointRecord, row) for row in db.scalars(page)], total

    def stored_checkpoint_bytes(self, owner: str) -> int:
        """Bytes of checkpoint files the owner keeps."""
        statement = sa.select(sa.func.coalesce(sa.func.sum(CheckpointRow.size_bytes), 0)).where(
            CheckpointRow.owner == owner
        )
        with self._transaction() as db:
            return int(db.scalar(statement))

    def checkpoint_directories(self) -> set[str]:
        """The directory of every listed checkpoint (files elsewhere under the checkpoint dir are leftovers)."""
        with self._transaction() as db:
            return set(db.scalars(sa.select(CheckpointRow.directory)))

    def set_checkpoint_public(self, tinker_path: str, public: bool) -> bool:
        """Publish or unpublish a checkpoint; False if it is unknown."""
        return self._update_checkpoint(tinker_path, public=public)

    def set_checkpoint_expires_at(self, tinker_path: str, expires_at: datetime | None) -> bool:
        """Set or clear a checkpoint's expiry time; False if it is unknown."""
        return self._update_checkpoint(tinker_path, expires_at=expires_at)

    def _update_checkpoint(self, tinker_path: str, **values: Any) -> bool:
        statement = sa.update(CheckpointRow).where(CheckpointRow.tinker_path == tinker_path).values(**values)
        with self._transaction() as db:
            updated = db.execute(statement).rowcount == 1
        self._checkpoints.forget(tinker_path)
        return updated

    def expired_checkpoints(self, now: datetime) -> list[CheckpointRecord]:
        """Checkpoints whose expiry has passed and that no sampler uses (see `_checkpoint_in_use`)."""
        statement = (sa.select(CheckpointRow)
                     .where(CheckpointRow.expires_at <= now, ~_checkpoint_in_use())
                     .order_by(CheckpointRow.expires_at))
        with self._transaction() as db:
            return [_to_record(CheckpointRecord, row) for row in db.scalars(statement)]

    def delete_expired_checkpoint(self, record: CheckpointRecord, now: datetime) -> bool:
        """Forget an expired checkpoint in one statement, unless it was saved again since `record` was read, its
        expiry moved, or a sampler started using it; True if it was forgotten (its files are the caller's)."""
        statement = sa.delete(CheckpointRow).where(
            CheckpointRow.tinker_path == record.tinker_path, CheckpointRow.created_at == record.created_at,
            CheckpointRow.expires_at <= now, ~_checkpoint_in_use())
        with self._transaction() as db:
            deleted = db.execute(statement).rowcount == 1
        self._checkpoints.forget(record.tinker_path)
        return deleted

    def delete_checkpoint(self, tinker_path: str) -> bool:
        """Forget a checkpoint (its files are the caller's); False if it is unknown."""
        with self._transaction() as db:
            deleted = db.execute(sa.delete(CheckpointRow).where(CheckpointRow.tinker_path == tinker_path)).rowcount == 1
        self._checkpoints.forget(tinker_path)
        return deleted

    # sampling sessions

    def create_sampling_session(self, rec: SamplingSessionRecord) -> None:
        """Record a new sampling session (its session must exist)."""
        with self._transaction() as db:
            db.add(SamplingSessionRow(**_to_values(rec)))

    def get_sampling_session(self, sampling_session_id: str) -> SamplingSessionRecord | None:
        """The sampling session, or None (from memory when it was read lately)."""
        if (record := self._sampling_sessions.get(sampling_session_id)) is not None:
            return record
        era = self._sampling_sessions.era()
        with self._transaction() as db:
            row = db.get(SamplingSessionRow, sampling_session_id)
            record = None if row is None else _to_record(SamplingSessionRecord, row)
        if record is not None:
            self._sampling_sessions.put(sampling_session_id, record, era)
        return record

    def remembered_sampling_session(self, sampling_session_id: str) -> SamplingSessionRecord | None:
        """The sampling session if it was read lately, without touching the database (safe on the event loop)."""
        return self._sampling_sessions.get(sampling_session_id)

    def delete_session(self, session_id: str) -> None:
        """Delete a session with its runs and samplers (see TenantData.delete_session)."""
        self.tenant_data.delete_session(session_id)
        self._sampling_sessions.forget(where=lambda record: record.session_id == session_id)

    # API keys

    def add_api_key(self, key: ApiKeyRecord) -> None:
        """Record an issued key."""
        with self._transaction() as db:
            db.add(ApiKeyRow(**_to_values(key)))

    def find_api_key(self, key_hash: str) -> ApiKeyRecord | None:
        """The unrevoked key with this hash, or None."""
        statement = sa.select(ApiKeyRow).where(ApiKeyRow.key_hash == key_hash, ApiKeyRow.revoked_at.is_(None))
        with self._transaction() as db:
            row = db.scalars(statement).one_or_none()
            return None if row is None else _to_record(ApiKeyRecord, row)

    def list_api_keys(self, tenant: str | None = None) -> list[ApiKeyRecord]:
        """Every issued key (of one tenant, or all), oldest first, revoked ones included."""
        statement = sa.select(ApiKeyRow).order_by(ApiKeyRow.created_at, ApiKeyRow.key_id)
        if tenant is not None:
            statement = statement.where(ApiKeyRow.tenant == tenant)
        with self._transaction() as db:
            return [_to_record(ApiKeyRecord, row) for row in db.scalars(statement)]

    def revoke_api_key(self, key_id: str) -> bool:
        """Revoke a key; False if it is unknown or already revoked."""
        statement = (
            sa.update(ApiKeyRow)
            .where(ApiKeyRow.key_id == key_id, ApiKeyRow.revoked_at.is_(None))
            .values(revoked_at=utcnow())
        )
        with self._transaction() as db:
            return db.execute(statement).rowcount == 1

    def has_api_keys(self) -> bool:
        """Whether any key was ever issued (revoked ones count)."""
        with self._transaction() as db:
            return db.scalar(sa.select(sa.func.count()).select_from(ApiKeyRow)) > 0

class _Remembered(Generic[RecordT]):
    """Records read lately, by key, the least recently used forgotten past MAX_REMEMBERED_RECORDS; thread-safe."""

    def __init__(self):
        self._records: OrderedDict[str, RecordT] = OrderedDict()
        self._lock = threading.Lock()
        self._forgets = 0
        """Counts `forget` calls: a record read from the database before one is not kept (it may be stale)."""

    def era(self) -> int:
        """Take before reading a record from the database; give to `put`."""
        with self._lock:
            return self._forgets

    def get(self, key: str) -> RecordT | None:
        with self._lock:
            record = self._records.get(key)
            if record is not None:
                self._records.move_to_end(key)
            return record

    def put(self, key: str, record: RecordT, era: int) -> None:
        with self._lock:
            if era != self._forgets:
                return
            self._records[key] = record
            while len(self._records) > MAX_REMEMBERED_RECORDS:
                self._records.popitem(last=False)

    def forget(self, *keys: str, where: Callable[[RecordT], bool] | None = None) -> None:
        """Forget the given keys, and every record that `where` holds for."""
        with self._lock:
            self._forgets += 1
            matching = [key for key, record in self._records.items() if where(record)] if where is not None else []
            for key in [*keys, *matching]:
                self._records.pop(key, None)


def _checkpoint_in_use() -> sa.ColumnElement[bool]:
    """A checkpoint is in use while a sampling session of a session that is not finished samples from it (its
    client may sample at any time; a sample request running now holds a pin of the server's own). Correlated
    to the checkpoints row of the enclosing statement, so a check and a delete happen in one statement."""
    session_live = sa.select(SessionRow.session_id).where(SessionRow.session_id == SamplingSessionRow.session_id,
                                                          SessionRow.finished_at.is_(None)).exists()
    return sa.select(SamplingSessionRow.sampling_session_id).where(
        SamplingSessionRow.model_path == CheckpointRow.tinker_path, session_live).exists()
