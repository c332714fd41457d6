"""Each training run's metrics per step, kept for the dashboard's curves.

Why a table of its own and not the journal: the journal keeps futures for a bounded time
(`future_retention_seconds`, a day) and their results as encoded bytes (protobuf for
forward_backward), so a curve read from it would vanish after a day and cost a decode of every
result per look. Here a step's forward_backward calls (chunks included) are combined into one
row per metric when each completes, by the metric's reduction (sum, max, min, mean), and the
optim_step that closes the step adds its own; a run keeps its newest MAX_STEPS_PER_RUN steps.
Knows nothing about losses or HTTP.
"""

import logging
import math
from dataclasses import dataclass
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from server.store.rows import RunMetricRow

logger = logging.getLogger(__name__)

FORWARD_BACKWARD, OPTIM_STEP = "forward_backward", "optim_step"
MAX_STEPS_PER_RUN = 10_000
"""Steps of curve a run keeps (about ten rows each); older ones are dropped PRUNE_EVERY steps at a time."""
PRUNE_EVERY = 100


@dataclass(frozen=True, slots=True)
class Curve:
    kind: str
    """forward_backward or optim_step."""
    name: str
    points: list[tuple[int, float]]
    """(step, value), steps ascending."""


def combine(name: str, old: float, count: int, new: float) -> float:
    """A metric's value after one more request's `new`, by its reduction ("loss:sum" adds)."""
    reduction = name.rpartition(":")[2]
    if reduction == "sum":
        return old + new
    if reduction == "max":
        return max(old, new)
    if reduction == "min":
        return min(old, new)
    if reduction == "mean":
        return (old * count + new) / (count + 1)
    return new


class RunMetrics:
    """Queries over the run_metrics table; shares the Store's engine. Called from the training thread only."""

    def __init__(self, engine: sa.Engine):
        self._transaction = sessionmaker(engine, expire_on_commit=False).begin

    def record(self, model_id: str, kind: str, metrics: dict[str, float]) -> None:
        """Add one completed request's metrics to its run's current step (an optim_step then closes it).

        Never raises: a lost curve point is logged, and must not fail the training request it describes.
        """
        try:
            self._record(model_id, kind, metrics)
        except Exception as error:  # a full disk or an unreachable database
            logger.warning("event=metrics_not_recorded model_id=%s kind=%s error=%r", model_id, kind, str(error))

    def _record(self, model_id: str, kind: str, metrics: dict[str, float]) -> None:
        now = datetime.now(UTC)
        with self._transaction() as db:
            step = self._current_step(db, model_id)
            existing = {row.name: row for row in db.scalars(sa.select(RunMetricRow).where(
                RunMetricRow.model_id == model_id, RunMetricRow.kind == kind, RunMetricRow.step == step))}
            for name, value in metrics.items():
                if not math.isfinite(value):  # a diverged step shows as a gap, not as a poisoned curve
                    continue
                row = existing.get(name)
                if row is None:
                    db.add(RunMetricRow(model_id=model_id, kind=kind, step=step, name=name, value=float(value),
                                        count=1, recorded_at=now))
                else:
                    row.value = combine(name, row.value, row.count, value)
                    row.count, row.recorded_at = row.count + 1, now
            if kind == OPTIM_STEP and step >= MAX_STEPS_PER_RUN and step % PRUNE_EVERY == 0:
                db.execute(sa.delete(RunMetricRow).where(RunMetricRow.model_id == model_id,
                                                         RunMetricRow.step <= step - MAX_STEPS_PER_RUN))

    @staticmethod
    def _current_step(db, model_id: str) -> int:
        """The optim_steps recorded so far: the step a forward_backward now counts toward."""
        last = db.scalar(sa.select(sa.func.max(RunMetricRow.step)).where(RunMetricRow.model_id == model_id,
                                                                          RunMetricRow.kind == OPTIM_STEP))
        return 0 if last is None else last + 1

    def num_steps(self, model_ids: list[str]) -> dict[str, int]:
        """Optim steps recorded for each of `model_ids` (0 for a run that has taken none)."""
        if not model_ids:
            return {}
        with self._transaction() as db:
            rows = db.execute(sa.select(RunMetricRow.model_id, sa.func.max(RunMetricRow.step))
                              .where(RunMetricRow.model_id.in_(model_ids), RunMetricRow.kind == OPTIM_STEP)
                              .group_by(RunMetricRow.model_id)).all()
        steps = {model_id: last + 1 for model_id, last in rows}
        return {model_id: steps.get(model_id, 0) for model_id in model_ids}

    def curves(self, model_id: str) -> list[Curve]:
        """Every metric of the run as a curve over its steps."""
        with self._transaction() as db:
            rows = db.execute(sa.select(RunMetricRow.kind, RunMetricRow.name, RunMetricRow.step, RunMetricRow.value)
                              .where(RunMetricRow.model_id == model_id)
                              .order_by(RunMetricRow.kind, RunMetricRow.name, RunMetricRow.step)).all()
        curves: dict[tuple[str, str], Curve] = {}
        for kind, name, step, value in rows:
            curves.setdefault((kind, name), Curve(kind, name, [])).points.append((step, value))
        return list(curves.values())
