"""Rendering fixtures: the built-in tiny models, loaded once per test run."""

import pytest

from server.models.loading import LoadedModel

from support.vision import VISION_MODELS, load


@pytest.fixture(scope="session", params=VISION_MODELS)
def vision_base(request, models_dir) -> LoadedModel:
    return load(request.param, models_dir)


@pytest.fixture(scope="session")
def qwen2_vl(models_dir) -> LoadedModel:
    return load("builtin:tiny-qwen2-vl", models_dir)


@pytest.fixture(scope="session")
def text_base(models_dir) -> LoadedModel:
    return load("builtin:tiny-qwen3", models_dir)
