"""A checkpoint exported merged into its base model (`python -m server export --merged`) is a model folder that
vLLM serves without LoRA, and its greedy completions are the ones the embedded engine samples from the adapter."""

import json
from pathlib import Path

import numpy as np
import pytest
from hf_reference import write_adapter
from transformers import AutoTokenizer

from server.adapter_imports import run_adapters_command
from server.config import (DEFAULT_VLLM_PYTHON, SamplerConfig, VLLMConfig, parse_adapters_command, parse_config,
                           parse_export_command)
from server.merged_export import run_export_command
from server.models.builtin import ensure_builtin_model
from server.rendering.chunks import RenderedInput
from server.sampling.adapters import SamplerAdapters
from server.sampling.embedded import EmbeddedEngine
from server.sampling.types import AdapterRef, SamplingOptions, SamplingRequest
from server.sampling.vllm import VLLMEngine
from server.sampling.vllm_process import ServedModel, VLLMProcess
from server.store.store import Store
from support.engines import REFUSED_TOKEN_IDS

BASE_MODEL = "builtin:tiny-qwen2-vl"
GREEDY = SamplingOptions(max_tokens=16, temperature=0.0)


def test_a_merged_export_served_by_vllm_decodes_greedily_as_the_adapter_samples(models_dir, tmp_path):
    if not DEFAULT_VLLM_PYTHON.exists():
        pytest.fail(f"no vLLM venv at {DEFAULT_VLLM_PYTHON.parent.parent}: run `bash scripts/install_vllm.sh`",
                    pytrace=False)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "models").symlink_to(models_dir, target_is_directory=True)
    config = parse_config(["--base-model", BASE_MODEL, "--data-dir", str(data_dir)])
    base_dir = ensure_builtin_model(BASE_MODEL.removeprefix("builtin:"), models_dir)
    Store(config.store.database_url).close()  # the journal a server's first start creates

    # An adapter made elsewhere (attention, MLP and lm_head), imported as a tenant's checkpoint, exported merged.
    peft = write_adapter(base_dir, tmp_path / "peft", seed=5, train_unembed=True)
    adapter_config = json.loads((peft / "adapter_config.json").read_text())
    (peft / "adapter_config.json").write_text(json.dumps({**adapter_config, "base_model_name_or_path": BASE_MODEL}))
    assert run_adapters_command(parse_adapters_command(["import", str(peft), "--tenant", "alice", "--name", "x",
                                                        "--base-model", BASE_MODEL, "--data-dir", str(data_dir)])) == 0
    store = Store(config.store.database_url)
    try:
        records, _ = store.list_checkpoints(model_id=None, owner="alice", limit=10, offset=0)
    finally:
        store.close()
    checkpoint = next(record for record in records if record.checkpoint_type == "sampler")
    merged_dir = tmp_path / "merged"
    assert run_export_command(parse_export_command(["--merged", checkpoint.tinker_path, "--out", str(merged_dir),
                                                    "--data-dir", str(data_dir)])) == 0

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def requests(adapter: AdapterRef | None = None) -> list[SamplingRequest]:
        return [SamplingRequest(prompt=RenderedInput(token_ids=tokenizer.encode(text), images=[],
                                                     image_token_id=image_pad), options=GREEDY, adapter=adapter)
                for text in ("One two three four", "The colour of the sky is", "def f(x):")]

    sampler = SamplerConfig()
    embedded = EmbeddedEngine.on_demand(config.model, 1 << 26, SamplerAdapters(sampler, "cpu"), sampler)
    try:
        expected = [embedded.sample(r).sequences[0]
                    for r in requests(AdapterRef(name="x", directory=Path(checkpoint.directory)))]
        base = [embedded.sample(r).sequences[0] for r in requests()]
    finally:
        embedded.close()
    server = VLLMProcess(VLLMConfig(python=DEFAULT_VLLM_PYTHON, max_model_len=512, max_num_seqs=4, max_loras=0,
                                    kv_cache_space_gib=1, enforce_eager=True, chunked_prefill=False),
                         ServedModel(directory=merged_dir, name="merged", dtype="float32",
                                     refused_token_ids=REFUSED_TOKEN_IDS, max_images_per_prompt=1),
                         log_path=tmp_path / "vllm.log")
    vllm = None
    try:
        server.wait_until_ready()
        vllm = VLLMEngine([server])
        got = [vllm.sample(r).sequences[0] for r in requests()]
    finally:
        if vllm is not None:
            vllm.close()
        server.close()

    assert [s.tokens for s in got] == [s.tokens for s in expected]
    assert [s.tokens for s in base] != [s.tokens for s in expected], "the adapter should change the completions"
    gap = max(float(np.abs(np.subtract(g.logprobs, e.logprobs)).max()) for g, e in zip(got, expected))
    assert gap < 1e-3, gap
