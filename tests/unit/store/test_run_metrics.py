"""The dashboard's per-step metrics: steps advance at optim_step, a step's calls combine by reduction, bounded."""

import math

from server.store import run_metrics
from server.store.run_metrics import FORWARD_BACKWARD, OPTIM_STEP, combine


def curves_of(store, model_id):
    return {(c.kind, c.name): c.points for c in store.run_metrics.curves(model_id)}


def test_a_steps_forward_backward_calls_combine_by_reduction_until_its_optim_step(store):
    metrics = store.run_metrics
    metrics.record("run-a", FORWARD_BACKWARD, {"loss:sum": 3.0, "ratio:max": 1.5, "kl:mean": 0.2})
    metrics.record("run-a", FORWARD_BACKWARD, {"loss:sum": 4.0, "ratio:max": 1.2, "kl:mean": 0.4})
    metrics.record("run-a", OPTIM_STEP, {"grad_norm:mean": 2.0})
    metrics.record("run-a", FORWARD_BACKWARD, {"loss:sum": 5.0, "ratio:max": 1.0, "kl:mean": 0.1})
    metrics.record("run-b", FORWARD_BACKWARD, {"loss:sum": 9.0})

    curves = curves_of(store, "run-a")
    assert curves[(FORWARD_BACKWARD, "loss:sum")] == [(0, 7.0), (1, 5.0)]
    assert curves[(FORWARD_BACKWARD, "ratio:max")] == [(0, 1.5), (1, 1.0)]
    assert math.isclose(curves[(FORWARD_BACKWARD, "kl:mean")][0][1], 0.3)
    assert curves[(OPTIM_STEP, "grad_norm:mean")] == [(0, 2.0)]
    assert curves_of(store, "run-b") == {(FORWARD_BACKWARD, "loss:sum"): [(0, 9.0)]}
    assert metrics.num_steps(["run-a", "run-b", "run-c"]) == {"run-a": 1, "run-b": 0, "run-c": 0}


def test_a_non_finite_value_is_a_gap_and_a_storage_failure_never_raises(store, monkeypatch):
    store.run_metrics.record("run-a", FORWARD_BACKWARD, {"loss:sum": float("nan"), "other:sum": 1.0})
    assert curves_of(store, "run-a") == {(FORWARD_BACKWARD, "other:sum"): [(0, 1.0)]}

    def broken(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.run_metrics, "_record", broken)
    store.run_metrics.record("run-a", OPTIM_STEP, {"grad_norm:mean": 1.0})  # logged, not raised


def test_a_run_keeps_its_newest_steps_only(store, monkeypatch):
    monkeypatch.setattr(run_metrics, "MAX_STEPS_PER_RUN", 6)
    monkeypatch.setattr(run_metrics, "PRUNE_EVERY", 2)
    for step in range(11):
        store.run_metrics.record("run-a", FORWARD_BACKWARD, {"loss:sum": float(step)})
        store.run_metrics.record("run-a", OPTIM_STEP, {"grad_norm:mean": 1.0})
    steps = [step for step, _ in curves_of(store, "run-a")[(FORWARD_BACKWARD, "loss:sum")]]
    assert steps[-1] == 10 and 6 <= len(steps) <= 6 + 2
    assert store.run_metrics.num_steps(["run-a"]) == {"run-a": 11}


def test_combine_follows_the_metric_names_reduction():
    assert combine("loss:sum", 1.0, 1, 2.0) == 3.0
    assert combine("x:max", 1.0, 1, 2.0) == 2.0
    assert combine("x:min", 1.0, 1, 2.0) == 1.0
    assert combine("x:mean", 1.0, 3, 5.0) == 2.0
    assert combine("x", 1.0, 1, 5.0) == 5.0
