"""Database rows: the SQLAlchemy tables for sessions, training runs, futures, checkpoints, samplers.

This is the only module that declares tables; migrations/ is generated from its metadata.
Rows never leave server.store: store.py converts them into frozen records inside the session.
"""

from datetime import UTC, datetime
from typing import Any, ClassVar

import sqlalchemy as sa
from pydantic import TypeAdapter
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class UTCDateTime(sa.TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend (SQLite stores it naive, in UTC)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: the store only takes timezone-aware datetimes")
        value = value.astimezone(UTC)
        # SQLite has no time zones; naive UTC strings also keep `<` comparisons correct.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class _ValidatedJSON(sa.TypeDecorator[Any]):
    """A JSON column whose value is validated by a pydantic TypeAdapter on the way in and out."""

    impl = sa.JSON
    # Subclasses set cache_ok themselves: SQLAlchemy reads it from each class's own body.
    adapter: ClassVar[TypeAdapter[Any]]

    def process_bind_param(self, value: Any, dialect: sa.Dialect) -> Any:
        return self.adapter.dump_python(self.adapter.validate_python(value))

    def process_result_value(self, value: Any, dialect: sa.Dialect) -> Any:
        return self.adapter.validate_python(value)


class StringList(_ValidatedJSON):
    """JSON list[str] (session tags)."""

    cache_ok = True
    adapter = TypeAdapter(list[str])


class StringMap(_ValidatedJSON):
    """JSON dict[str, str] (user_metadata)."""

    cache_ok = True
    adapter = TypeAdapter(dict[str, str])


class Base(DeclarativeBase):
    """Declarative base; fixed constraint names keep migrations identical on SQLite and PostgreSQL."""

    metadata = sa.MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_N_name)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )


DEFAULT_PROJECT = "default"
"""The project of a session created without one (projects are labels within a tenant)."""


class SessionRow(Base):
    """One SDK session (a ServiceClient); owns training runs and sampling sessions."""

    __tablename__ = "sessions"

    session_id: Mapped[str] = mapped_column(sa.String, primary_key=True)
    owner: Mapped[str] = mapped_column(sa.String)
    tags: Mapped[list[str]] = mapped_column(StringList)
    user_metadata: Mapped[dict[str, str]] = mapped_column(StringMap)
    sdk_version: Mapped[str | None] = mapped_column(sa.String)
    display_name: Mapped[str | None] = mapped_column(sa.String)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    last_heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finish_reason: Mapped[str | None] = mapped_column(sa.String)
    project_id: Mapped[str] = mapped_column(sa.String, server_default=DEFAULT_PROJECT)

    __table_args__ = (sa.Index(None, "owner", "created_at"),)


class TrainingRunRow(Base):
    """One LoRA training run ("model"); model_id = f"{session_id}:train:{model_seq_id}"."""

    __tablename__ = "training_runs"

    model_id: Mapped[str] = mapped_column(sa.String, primary_key=True)
    session_id: Mapped[str] = mapped_column(sa.ForeignKey("sessions.session_id"))
    owner: Mapped[str] = mapped_column(sa.String)
    base_model: Mapped[str] = mapped_column(sa.String)
    model_seq_id: Mapped[int] = mapped_column(sa.Integer)
    lora_rank: Mapped[int] = mapped_column(sa.Integer)
    seed: Mapped[int | None] = mapped_column(sa.BigInteger)
    train_mlp: Mapped[bool] = mapped_column(sa.Boolean)
    train_attn: Mapped[bool] = mapped_column(sa.Boolean)
    train_unembed: Mapped[bool] = mapped_column(sa.Boolean)
    optimizer_type: Mapped[str] = mapped_column(sa.String)
    user_metadata: Mapped[dict[str, str]] = mapped_column(StringMap)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    last_request_time: Mapped[datetime] = mapped_column(UTCDateTime)

    __table_args__ = (sa.Index(None, "owner", "created_at"), sa.Index(None, "session_id"))


class FutureRow(Base):
    """The request journal: one row per accepted request, holding its result bytes once done.

    (model_id, seq_id) is unique so that a retried request finds the original row; sampling
    requests use the sampling_session_id as model_id, so their seq_ids never meet training's.
    """

    __tablename__ = "futures"

    request_id: Mapped[str] = mapped_column(sa.String, primary_key=True)
    request_type: Mapped[str] = mapped_column(sa.String)
    owner: Mapped[str | None] = mapped_column(sa.String)
    """The tenant that sent the request: only it may read the result."""
    model_id: Mapped[str | None] = mapped_column(sa.String)
    seq_id: Mapped[int | None] = mapped_column(sa.BigInteger)
    """Sampling clones number their requests clone_id * 1e9 + k, past 32 bits."""
    payload_hash: Mapped[str] = mapped_column(sa.String)
    status: Mapped[str] = mapped_column(sa.String)
    result: Mapped[bytes | None] = mapped_column(sa.LargeBinary)
    content_type: Mapped[str | None] = mapped_column(sa.String)
    error: Mapped[str | None] = mapped_column(sa.Text)
    error_category: Mapped[str | None] = mapped_column(sa.String)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    __table_args__ = (sa.UniqueConstraint("model_id", "seq_id"), sa.Index(None, "status", "finished_at"))


class CheckpointRow(Base):
    """A saved checkpoint of a training run; its files live in `directory`."""

    __tablename__ = "checkpoints"

    tinker_path: Mapped[str] = mapped_column(sa.String, primary_key=True)
    model_id: Mapped[str] = mapped_column(sa.ForeignKey("training_runs.model_id"))
    checkpoint_id: Mapped[str] = mapped_column(sa.String)
    checkpoint_type: Mapped[str] = mapped_column(sa.String)
    directory: Mapped[str] = mapped_column(sa.String)
    size_bytes: Mapped[int | None] = mapped_column(sa.BigInteger)
    owner: Mapped[str] = mapped_column(sa.String)
    public: Mapped[bool] = mapped_column(sa.Boolean)
    user_metadata: Mapped[dict[str, str]] = mapped_column(StringMap)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    __table_args__ = (sa.Index(None, "owner", "created_at"), sa.Index(None, "model_id", "created_at"))


class SamplingSessionRow(Base):
    """A sampler: the base model, or a LoRA checkpoint at model_path, that sample requests name."""

    __tablename__ = "sampling_sessions"

    sampling_session_id: Mapped[str] = mapped_column(sa.String, primary_key=True)
    session_id: Mapped[str] = mapped_column(sa.ForeignKey("sessions.session_id"))
    owner: Mapped[str] = mapped_column(sa.String)
    base_model: Mapped[str] = mapped_column(sa.String)
    model_path: Mapped[str | None] = mapped_column(sa.String)
    source_model_id: Mapped[str | None] = mapped_column(sa.String)
    """Set for an unsaved snapshot (save_weights_and_get_sampling_client): the run it was taken from."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)

    __table_args__ = (sa.Index(None, "session_id"),)


# ---------------------------------------------------------------------------------------------
# stable_reinforce: what was sampled with record_stability_info (queries in sampled_sequences.py)


class SampledSequenceRow(Base):
    """One sampled sequence, kept so that training on it can be checked against what was sampled.

    The arrays are little-endian bytes: prompt_keys int64 (token ids, and an image's key at each of
    its positions), tokens int32, logprobs float32.
    """

    __tablename__ = "sampled_sequences"

    sequence_id: Mapped[str] = mapped_column(sa.String, primary_key=True)
    owner: Mapped[str] = mapped_column(sa.String)
    session_id: Mapped[str] = mapped_column(sa.String)
    sampling_session_id: Mapped[str] = mapped_column(sa.String)
    adapter: Mapped[str | None] = mapped_column(sa.String)
    """The adapter version that sampled it; None for the base model."""
    prompt_keys: Mapped[bytes] = mapped_column(sa.LargeBinary)
    tokens: Mapped[bytes] = mapped_column(sa.LargeBinary)
    logprobs: Mapped[bytes] = mapped_column(sa.LargeBinary)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)

    __table_args__ = (sa.Index(None, "expires_at"),)


class ApiKeyRow(Base):
    """An API key an operator issued to a tenant; only its SHA-256 is kept, never the key."""

    __tablename__ = "api_keys"

    key_id: Mapped[str] = mapped_column(sa.String, primary_key=True)
    """Short public name of the key (`keys list`, `keys revoke`)."""
    key_hash: Mapped[str] = mapped_column(sa.String, unique=True)
    tenant: Mapped[str] = mapped_column(sa.String)
    admin: Mapped[bool] = mapped_column(sa.Boolean)
    """May read server-wide data (/metrics)."""
    label: Mapped[str | None] = mapped_column(sa.String)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    __table_args__ = (sa.Index(None, "tenant"),)


# ---------------------------------------------------------------------------------------------
# the dashboard's curves (queries in run_metrics.py)


class RunMetricRow(Base):
    """One metric of one training step of a run: the step's forward_backward calls combined, or its optim_step."""

    __tablename__ = "run_metrics"

    model_id: Mapped[str] = mapped_column(sa.String, primary_key=True)
    kind: Mapped[str] = mapped_column(sa.String, primary_key=True)
    """forward_backward or optim_step."""
    step: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    """optim_steps the run had taken before it (a forward_backward counts toward the next one)."""
    name: Mapped[str] = mapped_column(sa.String, primary_key=True)
    """"name:reduction", as the request's metrics name it."""
    value: Mapped[float] = mapped_column(sa.Float)
    count: Mapped[int] = mapped_column(sa.Integer)
    """Requests combined into `value` (a mean is their running mean)."""
    recorded_at: Mapped[datetime] = mapped_column(UTCDateTime)
