"""How training ranks of one host share it (each takes its share of the CPUs for torch's threads), and how
they choose to hold the frozen base."""

import os

import pytest
import torch

from server.config import TrainerConfig, parse_config
from server.training.parallel import auto_base_sharding, host_thread_share


def test_each_local_rank_takes_its_share_of_the_cpus_never_more_threads_than_torch_has_nor_fewer_than_one():
    cpus, threads = len(os.sched_getaffinity(0)), torch.get_num_threads()
    assert host_thread_share(1) == min(threads, cpus)
    assert host_thread_share(2) == max(1, min(threads, cpus // 2))
    assert host_thread_share(cpus) == 1
    assert host_thread_share(4 * cpus) == 1


def test_auto_base_sharding_replicates_a_base_of_at_most_35_percent_of_a_device_and_shards_a_larger_one():
    gpu = 80 << 30
    assert auto_base_sharding(int(8.9e9), gpu) == "replicate"  # Qwen3-VL-4B in bf16
    assert auto_base_sharding(int(17.5e9), gpu) == "replicate"  # the 8B
    assert auto_base_sharding(int(0.35 * gpu), gpu) == "replicate"
    assert auto_base_sharding(int(0.35 * gpu) + 1, gpu) == "shard"
    assert auto_base_sharding(int(70e9), gpu) == "shard"  # the 35B-A3B


def test_base_sharding_is_auto_by_default_and_refuses_other_values():
    assert parse_config(["--base-model", "m"]).trainer.base_sharding == "auto"
    assert parse_config(["--base-model", "m", "--base-sharding", "replicate"]).trainer.base_sharding == "replicate"
    with pytest.raises(ValueError, match="base_sharding must be auto, shard or replicate"):
        TrainerConfig(base_sharding="mirror")
