"""Sampler adapters: ephemeral snapshots are bounded per run; saved ones reload after eviction."""

import pytest
import torch

from server.config import SamplerConfig
from server.errors import NotFound
from server.sampling.adapters import SamplerAdapters
from server.training.checkpoint_io import save_peft_adapter
from server.training.lora import LoraAdapter, LoraTarget

TARGETS = [LoraTarget("model.layers.0.self_attn.q_proj", "attn", 8, 8)]


def _adapter(seed: int) -> LoraAdapter:
    return LoraAdapter.initialize(TARGETS, rank=2, alpha=4.0, seed=seed, device="cpu")


def test_only_the_newest_ephemeral_snapshots_of_a_run_are_kept():
    adapters = SamplerAdapters(SamplerConfig(max_ephemeral_per_model=2), "cpu")
    for index in range(4):
        adapters.add_ephemeral(f"s:sample:{index}", "s:train:0", _adapter(index), "base")
    adapters.add_ephemeral("s:sample:9", "s:train:1", _adapter(9), "base")
    with pytest.raises(NotFound, match="save_weights_for_sampler"):
        adapters.ephemeral("s:sample:1")
    assert adapters.ephemeral("s:sample:3") is not None and adapters.ephemeral("s:sample:9") is not None


def test_dropped_snapshots_leave_the_disk_and_the_engine(tmp_path):
    forgotten = []
    adapters = SamplerAdapters(SamplerConfig(max_ephemeral_per_model=1), "cpu", snapshot_dir=tmp_path,
                               on_forget=forgotten.append)
    adapters.add_ephemeral("s:sample:0", "s:train:0", _adapter(0), "base")
    first = adapters.ephemeral("s:sample:0").directory
    assert (first / "adapter_config.json").exists()
    adapters.add_ephemeral("s:sample:1", "s:train:0", _adapter(1), "base")
    assert forgotten == ["s:sample:0"] and not first.exists()
    adapters.forget_run("s:train:0")
    assert forgotten == ["s:sample:0", "s:sample:1"] and list(tmp_path.iterdir()) == []


def test_saved_adapters_are_reloaded_after_eviction(tmp_path):
    adapters = SamplerAdapters(SamplerConfig(max_loaded_adapters=1), "cpu")
    first, second = _adapter(1), _adapter(2)
    save_peft_adapter(tmp_path / "a", first, "base")
    save_peft_adapter(tmp_path / "b", second, "base")
    loaded_a = adapters.saved(tmp_path / "a")
    adapters.saved(tmp_path / "b")  # evicts a
    reloaded_a = adapters.saved(tmp_path / "a")
    assert reloaded_a is not loaded_a
    name = TARGETS[0].name
    torch.testing.assert_close(reloaded_a.lora_A[name], first.lora_A[name].detach())
