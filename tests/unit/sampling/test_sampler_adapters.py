"""Sampler adapters: ephemeral snapshots are bounded per run; inflight sessions follow their run's newest
inflight save; saved ones reload after eviction."""

import pytest
import torch
from safetensors.torch import load_file

from server.config import SamplerConfig
from server.errors import InvalidRequest, NotFound
from server.lora.checkpoint_io import save_peft_adapter
from server.lora.layers import LoraAdapter, LoraTarget
from server.sampling.adapters import SamplerAdapters

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


def test_snapshots_are_written_in_the_served_dtype_and_the_run_keeps_its_own(tmp_path):
    """A bfloat16 vLLM casts an adapter to bfloat16 as it loads it: the file holds what it would make of the
    float32 weights, in half the bytes."""
    adapters = SamplerAdapters(SamplerConfig(), "cpu", snapshot_dir=tmp_path, snapshot_dtype=torch.bfloat16)
    trained = _adapter(0)
    adapters.add_ephemeral("s:sample:0", "s:train:0", trained, "base")
    snapshot = adapters.ephemeral("s:sample:0")
    written = load_file(snapshot.directory / "adapter_model.safetensors")
    expected = trained.peft_state_dict()
    assert written.keys() == expected.keys()
    for name, tensor in written.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name].to(torch.bfloat16))
    assert all(t.dtype == torch.float32 for t in expected.values())  # the run's own adapter is untouched
    # As trained without a served dtype (a float32 vLLM, or a saved checkpoint).
    save_peft_adapter(tmp_path / "as-trained", trained, "base")
    as_trained = load_file(tmp_path / "as-trained" / "adapter_model.safetensors")
    assert all(t.dtype == torch.float32 for t in as_trained.values())


def test_written_snapshots_are_their_files_alone_and_leave_the_fallbacks_cache_when_dropped(tmp_path):
    """With vLLM the snapshot's files are what every engine samples: no copy stays in memory (the newest 8
    per run of a 30B MoE's experts' adapter would be 40 GB on the training GPU); the embedded engine beside
    vLLM loads them like a saved checkpoint's, and a dropped snapshot leaves that cache with its files."""
    adapters = SamplerAdapters(SamplerConfig(max_ephemeral_per_model=1), "cpu", snapshot_dir=tmp_path)
    trained = _adapter(0)
    adapters.add_ephemeral("s:sample:0", "s:train:0", trained, "base")
    snapshot = adapters.ephemeral("s:sample:0")
    assert snapshot.adapter is None
    loaded = adapters.saved(snapshot.directory)  # what the embedded fallback samples
    assert all(torch.equal(loaded.lora_B[name], trained.lora_B[name]) for name in trained.lora_B)
    adapters.add_ephemeral("s:sample:1", "s:train:0", _adapter(1), "base")  # drops s:sample:0
    assert adapters.cached(snapshot.directory) is None and not snapshot.directory.exists()


def test_inflight_sessions_sample_the_runs_newest_inflight_save_and_a_pinned_version_stays(tmp_path):
    adapters = SamplerAdapters(SamplerConfig(max_ephemeral_per_model=2), "cpu")
    first, second = _adapter(1), _adapter(2)
    adapters.add_ephemeral("s:sample:0", "s:train:0", first, "base", inflight=True)
    pinned = adapters.ephemeral("s:sample:0")  # what a request accepted now samples with
    adapters.add_ephemeral("s:sample:1", "s:train:0", second, "base", inflight=True)
    for session in ("s:sample:0", "s:sample:1"):
        now = adapters.ephemeral(session)
        assert now.adapter is second and now.name == "s:sample:1"
    assert pinned.adapter is first and pinned.name == "s:sample:0"
    # Snapshot saves of the run push out older versions, never the run's newest inflight one.
    for index in range(2, 5):
        adapters.add_ephemeral(f"s:sample:{index}", "s:train:0", _adapter(index), "base")
    assert adapters.ephemeral("s:sample:0").adapter is second
    with pytest.raises(NotFound):
        adapters.ephemeral("s:sample:2")
    adapters.forget_run("s:train:0")
    with pytest.raises(NotFound, match="while the run is loaded"):
        adapters.ephemeral("s:sample:0")


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


def test_a_saved_adapter_with_non_finite_weights_is_refused_not_sampled(tmp_path):
    # As an older server may have saved it, before optim_step refused to make such weights.
    poisoned = _adapter(3)
    poisoned.lora_B[TARGETS[0].name].data[0, 0] = float("nan")
    save_peft_adapter(tmp_path / "poisoned", poisoned, "base")
    adapters = SamplerAdapters(SamplerConfig(), "cpu")
    with pytest.raises(InvalidRequest, match="the checkpoint's weights are not finite"):
        adapters.saved(tmp_path / "poisoned")
    assert adapters.cached(tmp_path / "poisoned") is None
