"""Rendering fixtures: the built-in tiny models, loaded once per test run."""

import pytest

from server.models.loading import LoadedModel

from vision_helpers import VISION_MODELS, load


@pytest.fixture(scope="session", params=VISION_MODELS)
def vision_base(request, builtin_models) -> LoadedModel:
    return load(request.param, builtin_models)


@pytest.fixture(scope="session")
def qwen2_vl(builtin_models) -> LoadedModel:
    return load("builtin:tiny-qwen2-vl", builtin_models)


@pytest.fixture(scope="session")
def text_base(builtin_models) -> LoadedModel:
    return load("builtin:tiny-qwen3", builtin_models)
