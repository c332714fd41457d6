"""The embedded engine under the real SDK's concurrency: runs sampling at once each sample with their own
adapter (lm_head trained or not), and a prompt over the image limit is a 400 that names the limit."""

import pytest

from support.engine_checks import check_concurrent_runs_sample_with_their_own_adapters, check_image_limit
from support.live_server import start_server

BASE_MODEL = "builtin:tiny-qwen2-vl"


@pytest.fixture(scope="module")
def server(models_dir, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("isolation")
    live = start_server(data_dir, f"sqlite:///{data_dir}/server.db", models_dir, base_model=BASE_MODEL)
    yield live
    live.stop()


@pytest.mark.parametrize("train_unembed", [True, False], ids=["with-lm-head", "without-lm-head"])
def test_runs_sampling_at_once_each_sample_with_their_own_adapter(server, train_unembed):
    check_concurrent_runs_sample_with_their_own_adapters(server.service_client(), BASE_MODEL,
                                                         train_unembed=train_unembed)


def test_a_prompt_over_the_image_limit_is_refused_with_the_limit(server):
    check_image_limit(server.service_client(), BASE_MODEL, limit=16)
