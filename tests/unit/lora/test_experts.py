"""LoRA on a MoE layer's routed experts: equal to transformers' own experts with each expert's weights
merged (W + scale * B_e @ A_e, the factors read in PEFT's fused-expert layout), in the forward and in the
factors' gradients; saved adapters that PEFT loads (`target_parameters`) with the same logits, per-row
adapters equal to each row alone, gradients in each adapter's own tensors, and train_mlp selecting the
experts.

Shapes: E experts, r rank, B rows, T positions, V vocabulary.
"""

import copy
import json

import pytest
import torch
from transformers import AutoModelForImageTextToText

from server.config import ModelConfig
from server.lora.checkpoint_io import load_checkpoint, save_peft_adapter
from server.lora.layers import AdapterStack, LoraAdapter, apply_lora_wrappers, select_targets, use_adapter, \
    use_adapter_rows
from server.models.loading import load_base_model

MOE_MODELS = ["builtin:tiny-qwen3.5-moe", "builtin:tiny-qwen3-vl-moe"]
INPUT_IDS_BT = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16], [17, 18, 19, 20, 21, 22]])


def random_adapter(targets, seed: int, rank: int) -> LoraAdapter:
    adapter = LoraAdapter.initialize(targets, rank, alpha=2.0 * rank, seed=seed, device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lora_B in adapter.lora_B.values():
            lora_B.copy_(torch.randn(lora_B.shape, generator=generator) * 0.3)
    return adapter


@pytest.fixture(scope="module", params=MOE_MODELS)
def moe(request, models_dir):
    base = load_base_model(ModelConfig(base_model=request.param, model_path=None, model_cache_dir=models_dir))
    reference = copy.deepcopy(base.model)  # transformers' own experts, weights merged per test
    targets, slot = apply_lora_wrappers(base.model, base.family)
    return base.model, reference, targets, slot, base.path


def logits_BTV(model, input_ids_BT: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids_BT).logits.float()


def test_train_mlp_selects_both_projections_of_every_experts_module(moe):
    _, reference, targets, _, _ = moe
    experts = [name for name, module in reference.named_modules() if name.endswith("mlp.experts")]
    chosen = {t.name: t for t in select_targets(targets, train_attn=False, train_mlp=True, train_unembed=False)}
    for name in experts:
        module = reference.get_submodule(name)
        num_experts, double_intermediate, hidden = module.gate_up_proj.shape
        assert (chosen[name + ".base_layer"].in_features, chosen[name + ".base_layer"].out_features) == \
            (hidden, double_intermediate)
        assert (chosen[name].in_features, chosen[name].out_features) == (double_intermediate // 2, hidden)
        assert chosen[name].experts == chosen[name + ".base_layer"].experts == num_experts


def test_an_expert_adapter_equals_its_merged_weights_in_transformers_own_experts(moe):
    model, reference, targets, slot, _ = moe
    rank = 3
    expert_targets = [t for t in targets if t.experts]
    adapter = random_adapter(expert_targets, seed=1, rank=rank)
    merged = copy.deepcopy(reference)
    with torch.no_grad():
        for target in expert_targets:
            experts_name, is_gate_up = target.name.removesuffix(".base_layer"), target.name.endswith(".base_layer")
            weight = getattr(merged.get_submodule(experts_name), "gate_up_proj" if is_gate_up else "down_proj")
            lora_A, lora_B = adapter.lora_A[target.name], adapter.lora_B[target.name]
            for expert in range(target.experts):
                # PEFT's layout: expert e's A is rows e*r..e*r+r; column k of its B is column k*E + e.
                expert_A = lora_A[expert * rank:(expert + 1) * rank]
                expert_B = lora_B[:, expert::target.experts]
                weight[expert] += adapter.scale * expert_B @ expert_A
    with torch.no_grad(), use_adapter(slot, adapter):
        adapted = logits_BTV(model, INPUT_IDS_BT)
    expected = logits_BTV(merged, INPUT_IDS_BT)
    torch.testing.assert_close(adapted, expected, atol=1e-4, rtol=0)
    assert (adapted - logits_BTV(reference, INPUT_IDS_BT)).abs().max() > 1e-2  # the experts did change
    with torch.no_grad():
        torch.testing.assert_close(logits_BTV(model, INPUT_IDS_BT), logits_BTV(reference, INPUT_IDS_BT))


def test_an_expert_adapters_gradients_equal_those_through_its_merged_weights(moe):
    # The reference differentiates transformers' own experts with W_e + scale * B_e @ A_e in place of W_e: the
    # gradients that reach each expert's factors from the grouped products (their backward) must be the same.
    model, reference, targets, slot, _ = moe
    rank = 3
    expert_targets = [t for t in targets if t.experts]
    adapter = random_adapter(expert_targets, seed=5, rank=rank)
    twin = LoraAdapter(rank, adapter.alpha, {name: t.detach().clone().requires_grad_() for name, t in
                                             adapter.lora_A.items()},
                       {name: t.detach().clone().requires_grad_() for name, t in adapter.lora_B.items()})
    merged = copy.deepcopy(reference)
    for target in expert_targets:
        experts_name, is_gate_up = target.name.removesuffix(".base_layer"), target.name.endswith(".base_layer")
        module, attribute = merged.get_submodule(experts_name), "gate_up_proj" if is_gate_up else "down_proj"
        lora_A, lora_B = twin.lora_A[target.name], twin.lora_B[target.name]
        deltas = [lora_B[:, expert::target.experts] @ lora_A[expert * rank:(expert + 1) * rank]
                  for expert in range(target.experts)]
        weight = getattr(module, attribute).detach() + twin.scale * torch.stack(deltas)
        delattr(module, attribute)
        setattr(module, attribute, weight)
    with use_adapter(slot, adapter):
        logits_BTV(model, INPUT_IDS_BT).square().mean().backward()
    logits_BTV(merged, INPUT_IDS_BT).square().mean().backward()
    for name in adapter.lora_A:
        for ours, expected in ((adapter.lora_A[name].grad, twin.lora_A[name].grad),
                               (adapter.lora_B[name].grad, twin.lora_B[name].grad)):
            assert expected.abs().max() > 0
            torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-4)


def test_rows_of_different_adapters_each_get_their_own_experts_forward_and_backward(moe):
    model, _, targets, slot, _ = moe
    every = select_targets(targets, train_attn=True, train_mlp=True, train_unembed=True)
    mlp_only = select_targets(targets, train_attn=False, train_mlp=True, train_unembed=False)
    first, second = random_adapter(every, seed=2, rank=4), random_adapter(mlp_only, seed=3, rank=2)
    row_adapters = [first, second, None]
    stack = AdapterStack(slot, [None, first, second], torch.float32)
    with use_adapter_rows(slot, stack, torch.tensor([1, 2, 0])):
        together = logits_BTV(model, INPUT_IDS_BT)
    together.square().mean(-1).sum().backward()
    stacked = {id(a): {name: t.grad.clone() for name, t in a.lora_B.items()} for a in (first, second)}
    for adapter in (first, second):
        for tensor in [*adapter.lora_A.values(), *adapter.lora_B.values()]:
            tensor.grad = None
    for row, adapter in enumerate(row_adapters):
        with use_adapter(slot, adapter):
            alone = logits_BTV(model, INPUT_IDS_BT[row:row + 1])
        torch.testing.assert_close(together[row], alone[0].detach(), atol=1e-5, rtol=0)
        if adapter is not None:
            alone.square().mean(-1).sum().backward()
            for name, tensor in adapter.lora_B.items():
                torch.testing.assert_close(stacked[id(adapter)][name], tensor.grad, atol=1e-5, rtol=1e-4)
    expert_B = next(name for name in second.lora_B if name.endswith(".experts"))
    assert stacked[id(second)][expert_B].abs().max() > 0  # the experts' factors do learn


def test_a_saved_expert_adapter_loads_in_peft_with_the_same_logits(moe, tmp_path):
    from peft import PeftModel

    model, _, targets, slot, base_dir = moe
    adapter = random_adapter(select_targets(targets, train_attn=True, train_mlp=True, train_unembed=False), 4, 4)
    save_peft_adapter(tmp_path, adapter, "tiny")
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert all(name.endswith(("gate_up_proj", "down_proj")) for name in config["target_parameters"])
    assert not any(".experts" in name for name in config["target_modules"])
    with torch.no_grad(), use_adapter(slot, adapter):
        ours = logits_BTV(model, INPUT_IDS_BT)
    peft_model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base_dir), tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(logits_BTV(peft_model, INPUT_IDS_BT), ours, atol=1e-4, rtol=0)


@pytest.mark.parametrize("flags", [dict(train_attn=False, train_mlp=True, train_unembed=False),
                                   dict(train_attn=True, train_mlp=False, train_unembed=True)])
def test_a_sampler_checkpoint_of_an_expert_adapter_loads_with_the_flags_it_was_trained_with(moe, tmp_path, flags):
    # A sampler checkpoint keeps no LoraConfig; the flags come back from its modules' names, where the routed
    # experts are named by their module (its `.base_layer` the fused gate_up projection), not by a projection.
    _, _, targets, _, _ = moe
    adapter = random_adapter(select_targets(targets, **flags), 5, 4)
    save_peft_adapter(tmp_path, adapter, "tiny")
    loaded = load_checkpoint(tmp_path, "cpu", with_optimizer=False)
    assert loaded.lora_config.model_dump(include=set(flags)) == flags
    assert loaded.adapter.lora_A.keys() == adapter.lora_A.keys()
    for name, lora_B in adapter.lora_B.items():
        torch.testing.assert_close(loaded.adapter.lora_B[name], lora_B, atol=0, rtol=0)
