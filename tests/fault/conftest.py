"""The fault-and-fuzz tier: a live server fed garbage, killed mid-write, out of disk, shut down mid-request.

Its figures (5xx answers, wedged runs, leaks, lost checkpoints) must all be 0; `benchmarks/RESULTS.md`
records a run of them.
"""

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.fault import GAP_SECONDS
from support.live_server import LiveServer, start_server


@pytest.fixture(scope="session")
def fault_server(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One server for the fuzzing, malformed-input and load campaigns, with a short seq_id gap timeout."""
    live = start_server(tmp_path_factory.mktemp("fault"), None, models_dir, "--seq-gap-timeout", str(GAP_SECONDS))
    yield live
    live.stop()

