"""Routes over a fake trainer and sampling engine: FastAPI's TestClient against the real app, store and
scheduler, with no model and no server process. What a route checks, journals and answers, and that a
refused sequenced request still takes its seq_id."""

from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from server.api.deps import Services
from server.app import create_app
from server.checkpoints.lifecycle import Checkpoints
from server.config import ModelConfig, ServerConfig, StoreConfig
from server.metrics import ServerMetrics
from server.scheduler.sampling import SamplingFutures
from server.scheduler.scheduler import Scheduler
from server.store.api_keys import KnownKeys
from server.store.exports import Signer
from server.store.retention import CheckpointPins
from server.store.store import CheckpointRecord, Store, utcnow
from server.training.operations import CreateModel, OptimStep

BASE_MODEL = "fake-model"


class FakeExecutor:
    """Stands for the trainer: records the operations it is given; an optim_step reports one metric."""

    def __init__(self):
        self.ran = []

    def run(self, operation):
        self.ran.append(operation)
        return {"grad_norm:mean": 0.5} if isinstance(operation, OptimStep) else None

    def run_pass(self, operations):
        raise AssertionError("these tests send no forward_backward")


class FakeEngine:
    """Stands for a sampling engine: nothing here samples."""

    def submit(self, request) -> Future:
        raise AssertionError("these tests send no sample")

    def forget(self, adapter_name: str) -> None:
        pass

    def close(self) -> None:
        pass


def _fake_services(executor: FakeExecutor, tmp_path: Path):
    def build(config: ServerConfig, metrics: ServerMetrics) -> Services:
        store = Store(config.store.database_url)
        pins = CheckpointPins()
        engine = FakeEngine()
        return Services(
            config=config, store=store, scheduler=Scheduler(store, executor, metrics=metrics),
            sampling=SamplingFutures(engine, metrics), sampler=engine, training_ranks=[],
            base=SimpleNamespace(name=BASE_MODEL, path=tmp_path, family=SimpleNamespace(model_type="fake")),
            trainer=SimpleNamespace(models={}, stop_followers=lambda: None, group=SimpleNamespace(lifelines=None),
                                    base_sharding="replicate"),
            adapters=SimpleNamespace(forget=lambda directory: None, forget_run=lambda model_id: None),
            render_context=None, sampling_renderer=None, checkpoint_pins=pins,
            checkpoints=Checkpoints(store, config.store.checkpoint_dir, pins, config.limits, lambda record: None),
            signer=Signer(b"k" * 32), metrics=metrics, keys=KnownKeys(store),
            ownership=SimpleNamespace(release=lambda: None))

    return build


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """A client of the app, one run created in it, and the fake trainer's log."""
    tmp_path = tmp_path_factory.mktemp("routes")
    config = ServerConfig(model=ModelConfig(base_model=BASE_MODEL, model_path=None, model_cache_dir=tmp_path),
                          store=StoreConfig(database_url=f"sqlite:///{tmp_path}/journal.db",
                                            checkpoint_dir=tmp_path / "checkpoints"),
                          data_dir=tmp_path, auth="none")
    executor = FakeExecutor()
    with TestClient(create_app(config, _fake_services(executor, tmp_path))) as client:
        session_id = client.post("/api/v1/create_session", json={}).json()["session_id"]
        future = client.post("/api/v1/create_model", json={"session_id": session_id, "model_seq_id": 0,
                                                           "base_model": BASE_MODEL, "lora_config": {"rank": 4}})
        model_id = _result(client, future.json()["request_id"])["model_id"]
        yield SimpleNamespace(client=client, model_id=model_id, executor=executor, config=config,
                              store=client.app.state.services.store)


def _result(client: TestClient, request_id: str) -> dict:
    answer = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_refused_optim_step_keeps_its_seq_id_so_the_next_one_runs(api):
    refused = api.client.post("/api/v1/optim_step", json={"model_id": api.model_id, "seq_id": 1,
                                                          "adam_params": {"learning_rate": -1.0}})
    accepted = api.client.post("/api/v1/optim_step", json={"model_id": api.model_id, "seq_id": 2,
                                                           "adam_params": {"learning_rate": 1e-3}})
    assert refused.status_code == 400 and "learning_rate" in refused.text
    assert _result(api.client, accepted.json()["request_id"])["metrics"] == {"grad_norm:mean": 0.5}
    assert [type(operation) for operation in api.executor.ran] == [CreateModel, OptimStep]


def test_an_unknown_run_is_a_404_and_runs_nothing(api):
    before = len(api.executor.ran)
    answer = api.client.post("/api/v1/optim_step", json={"model_id": "nobody:train:0", "seq_id": 1,
                                                         "adam_params": {}})
    assert answer.status_code == 404 and "no model nobody:train:0" in answer.text
    assert len(api.executor.ran) == before


def test_a_checkpoint_is_published_once_expired_and_deleted_with_its_files(api):
    directory = api.config.store.checkpoint_dir / "saved"
    directory.mkdir(parents=True)
    (directory / "adapter_model.safetensors").write_bytes(b"weights")
    api.store.add_checkpoint(CheckpointRecord(
        tinker_path=f"tinker://{api.model_id}/weights/saved", model_id=api.model_id, checkpoint_id="weights/saved",
        checkpoint_type="training", directory=str(directory), size_bytes=7, owner="default", user_metadata={},
        created_at=utcnow(), expires_at=None))
    route = f"/api/v1/training_runs/{api.model_id}/checkpoints/weights/saved"
    assert api.client.post(f"{route}/publish").status_code == 200
    again = api.client.post(f"{route}/publish")
    assert again.status_code == 409 and "already public" in again.text
    assert api.client.put(f"{route}/ttl", json={"ttl_seconds": 7200}).status_code == 200
    assert api.store.get_checkpoint(f"tinker://{api.model_id}/weights/saved").expires_at is not None
    assert api.client.delete(route).status_code == 200
    assert not directory.exists() and api.client.delete(route).status_code == 404
