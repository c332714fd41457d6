"""Adapters in and models out. PEFT LoRA adapters made elsewhere, imported into a tenant (REST route and
`python -m server adapters import`): the real SDK samples and trains them and gets what PEFT computes; a
mismatched base, rank, target module or shape is a 400 that names it. A trained checkpoint exported merged
into its base model (`python -m server export --merged`): transformers loads the folder, and its greedy
tokens are the SDK's greedy samples of the checkpoint."""

import base64
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tinker import types
from transformers import AutoTokenizer

from server.adapter_imports import run_adapters_command
from server.config import parse_adapters_command, parse_export_command
from server.merged_export import run_export_command
from support.live_server import LiveServer
from support.sdk import SENTENCES, forward_logprobs, peft_logprobs, supervised_datum

MODEL = "builtin/tiny-qwen3"


@pytest.fixture(scope="module")
def peft_adapter(lifecycle_server: LiveServer, tmp_path_factory) -> tuple[Path, Path]:
    """(base model directory, an adapter PEFT trained-looking: rank 4 on q_proj and v_proj, B not zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base_dir = lifecycle_server.data_dir / "models" / "tiny-qwen3"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    adapter_dir = tmp_path_factory.mktemp("peft-adapter")
    model.save_pretrained(adapter_dir)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    (adapter_dir / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": MODEL}))
    return base_dir, adapter_dir


@pytest.fixture(scope="module")
def key(lifecycle_server: LiveServer) -> str:
    """A tenant of these tests' own on the shared server."""
    return lifecycle_server.create_key("importer")


def import_body(adapter_dir: Path, name: str, config_changes: dict | None = None, weights: bytes | None = None) -> dict:
    config = {**json.loads((adapter_dir / "adapter_config.json").read_text()), **(config_changes or {})}
    data = weights if weights is not None else (adapter_dir / "adapter_model.safetensors").read_bytes()
    return {"name": name, "adapter_config": config, "adapter_model": base64.b64encode(data).decode()}


def test_an_imported_peft_adapter_samples_and_trains_as_peft_computes_it(lifecycle_server, key, peft_adapter, capsys):
    base_dir, adapter_dir = peft_adapter
    answer = httpx.post(f"{lifecycle_server.url}/api/v1/adapters/import", headers=lifecycle_server.headers(key),
                        json=import_body(adapter_dir, "from-peft"), timeout=60)
    assert answer.status_code == 200, answer.text
    imported = answer.json()
    service = lifecycle_server.service_client(key)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    ids = tokenizer.encode(SENTENCES[2])
    expected = peft_logprobs(base_dir, adapter_dir, ids)

    sampler = service.create_sampling_client(model_path=imported["sampler_path"]).result()
    sampled = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()[1:]
    np.testing.assert_allclose(sampled, expected, atol=1e-4)

    training = service.create_training_client_from_state(imported["tinker_path"]).result()
    datum = supervised_datum(tokenizer, SENTENCES[2])
    np.testing.assert_allclose(forward_logprobs(training, [datum])[0], expected, atol=1e-4)
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert forward_logprobs(training, [datum])[0].sum() > expected.sum()  # it goes on learning

    # The operator's command does the same from the server's machine, into the tenant it names (run in this
    # process: an interpreter of its own would double the test's time).
    assert run_adapters_command(parse_adapters_command([
        "import", str(adapter_dir), "--tenant", "importer", "--name", "by-cli", "--base-model", "builtin:tiny-qwen3",
        "--data-dir", str(lifecycle_server.data_dir)])) == 0
    by_cli = json.loads(capsys.readouterr().out)
    sampler = service.create_sampling_client(model_path=by_cli["sampler_path"]).result()
    np.testing.assert_allclose(sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()[1:], expected,
                               atol=1e-4)


def test_an_adapter_that_does_not_fit_the_served_model_is_refused_by_what_does_not_fit(lifecycle_server, key,
                                                                                      peft_adapter):
    _, adapter_dir = peft_adapter
    from safetensors.torch import load, save

    tensors = load((adapter_dir / "adapter_model.safetensors").read_bytes())
    first = sorted(tensors)[0]  # a lora_A of layer 0's q_proj: [rank, in_features]
    renamed = {key.replace("self_attn.q_proj", "self_attn.nope_proj"): value for key, value in tensors.items()}
    narrowed = {**tensors, first: tensors[first][:, :-8].contiguous()}
    poisoned = {**tensors, first: tensors[first].clone().fill_(float("nan"))}
    cases = [
        (import_body(adapter_dir, "bad", {"base_model_name_or_path": "Qwen/Qwen3-8B"}), "'Qwen/Qwen3-8B'"),
        (import_body(adapter_dir, "bad", {"r": 8}), "at rank 8 needs"),
        (import_body(adapter_dir, "bad", {"r": 4096}), "--max-lora-rank"),
        (import_body(adapter_dir, "bad", weights=save(renamed)), "self_attn.nope_proj' is not a LoRA target"),
        (import_body(adapter_dir, "bad", weights=save(narrowed)), f"{first} has shape [4, 120]"),
        (import_body(adapter_dir, "bad", {"use_dora": True}), "use_dora"),
        (import_body(adapter_dir, "bad", weights=b"not safetensors"), "could not be read"),
        (import_body(adapter_dir, "bad", weights=save(poisoned)), "not finite"),
    ]
    with httpx.Client(base_url=lifecycle_server.url, headers=lifecycle_server.headers(key), timeout=60) as http:
        for body, words in cases:
            answer = http.post("/api/v1/adapters/import", json=body)
            assert answer.status_code == 400 and words in answer.json()["detail"], (words, answer.text)
        assert http.post("/api/v1/adapters/import", json=import_body(adapter_dir, "good")).status_code == 200


def test_a_checkpoint_exported_merged_into_its_base_model_decodes_greedily_as_the_sdk_samples_it(lifecycle_server,
                                                                                                key, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    service = lifecycle_server.service_client(key)
    training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()  # lm_head too
    tokenizer = AutoTokenizer.from_pretrained(lifecycle_server.data_dir / "models" / "tiny-qwen3")
    datum = supervised_datum(tokenizer, SENTENCES[3])
    for _ in range(2):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = training.save_weights_for_sampler("to-merge").result().path
    prompt = tokenizer.encode(SENTENCES[3])[:5]
    sampled = service.create_sampling_client(model_path=path).result().sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=8, temperature=0.0)).result()

    out = tmp_path / "merged"
    assert run_export_command(parse_export_command(["--merged", path, "--out", str(out), "--data-dir",
                                                    str(lifecycle_server.data_dir)])) == 0
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert AutoTokenizer.from_pretrained(out).encode(SENTENCES[3]) == tokenizer.encode(SENTENCES[3])
    ids = list(prompt)
    with torch.no_grad():
        for _ in sampled.sequences[0].tokens:
            ids.append(int(merged(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert ids[len(prompt):] == sampled.sequences[0].tokens

    # Weights that are not finite (a checkpoint an older server saved before optim_step refused them) are refused.
    poisoned = training.save_weights_for_sampler("poisoned").result().path
    weights_file = next((lifecycle_server.data_dir / "checkpoints" / training.model_id / "sampler_weights" /
                         "poisoned").glob("v-*/adapter_model.safetensors"))
    tensors = load_file(weights_file)
    save_file({name: tensor.fill_(float("nan")) for name, tensor in tensors.items()}, weights_file)
    assert run_export_command(parse_export_command(["--merged", poisoned, "--out", str(tmp_path / "poisoned"),
                                                    "--data-dir", str(lifecycle_server.data_dir)])) == 2
    assert "the checkpoint's weights are not finite" in capsys.readouterr().err
    assert httpx.delete(f"{lifecycle_server.url}/api/v1/training_runs/{training.model_id}/checkpoints/"
                        f"sampler_weights/poisoned", headers=lifecycle_server.headers(key)).status_code == 200
