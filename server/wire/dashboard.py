"""Response shapes of the dashboard's API (this server's own, not Tinker's): a tenant's overview and a run's curves."""

from datetime import datetime

from pydantic import BaseModel


class DashboardRun(BaseModel):
    model_id: str
    session_id: str
    base_model: str
    lora_rank: int
    created_at: datetime
    last_request_time: datetime
    loaded: bool
    """In memory (its session is open); else continue it from a checkpoint."""
    queue_depth: int
    """Its requests queued or running now."""
    num_steps: int
    """optim_steps recorded for its curves."""


class DashboardCheckpoint(BaseModel):
    tinker_path: str
    model_id: str
    checkpoint_type: str
    size_bytes: int | None
    public: bool
    created_at: datetime
    expires_at: datetime | None
    """None: kept until deleted."""
    expires_in_seconds: float | None


class DashboardSession(BaseModel):
    session_id: str
    project_id: str
    display_name: str | None
    created_at: datetime
    last_heartbeat_at: datetime
    status: str
    """active, silent (no heartbeat for a while; finished at the session timeout) or its finish reason."""
    num_runs: int


class DashboardSampling(BaseModel):
    """The tenant's sampling since the server started; the page turns two polls into rates."""

    requests: int
    in_flight: int
    sampled_tokens: int
    prompt_cached_tokens: int
    prompt_computed_tokens: int


class DashboardGpu(BaseModel):
    device: int
    allocated_bytes: int
    reserved_bytes: int
    total_bytes: int


class DashboardOverview(BaseModel):
    tenant: str
    base_model: str
    sampler: str
    now: datetime
    queue_depth: int
    """The tenant's requests queued or running, all runs together."""
    stored_bytes: int
    sampling: DashboardSampling
    gpus: list[DashboardGpu]
    """The server process's memory on each GPU (empty on CPU)."""
    runs: list[DashboardRun]
    checkpoints: list[DashboardCheckpoint]
    sessions: list[DashboardSession]


class DashboardCurve(BaseModel):
    kind: str
    """forward_backward (a step's calls combined) or optim_step."""
    name: str
    points: list[tuple[int, float]]
    """(step, value)."""


class DashboardCurves(BaseModel):
    model_id: str
    num_steps: int
    curves: list[DashboardCurve]
