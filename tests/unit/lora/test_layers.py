"""One adapter per row (use_adapter_rows): equal to each row run with its own adapter, forward and
backward, for adapters of different ranks and targets and base-model rows; nothing outlives the block.
Layers that read the same input (q, k, v; gate, up) share one product with it, in any call order.
On a VLM, an adapter gives PEFT's logits on an image prompt and adapts the language model only.

Shapes: B = rows, T = positions, V = vocabulary.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from server.config import ModelConfig
from server.lora.checkpoint_io import save_peft_adapter
from server.lora.layers import (AdapterStack, LoraAdapter, SharedInput, apply_lora_wrappers, select_targets,
                                use_adapter, use_adapter_rows)
from server.models.loading import load_base_model

BASE_MODEL = "builtin:tiny-qwen3"


@pytest.fixture(scope="module")
def model_and_adapters(models_dir):
    base = load_base_model(ModelConfig(base_model=BASE_MODEL, model_path=None, model_cache_dir=models_dir))
    targets, slot = apply_lora_wrappers(base.model, base.family)
    adapters = []
    # Different ranks and targets: the second adapts neither the MLP nor lm_head.
    for seed, rank, mlp_and_unembed in [(1, 4, True), (2, 8, False)]:
        chosen = select_targets(targets, train_attn=True, train_mlp=mlp_and_unembed, train_unembed=mlp_and_unembed)
        adapter = LoraAdapter.initialize(chosen, rank, alpha=16.0, seed=seed, device="cpu")
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for lora_B in adapter.lora_B.values():
                lora_B.copy_(torch.randn(lora_B.shape, generator=generator) * 0.2)
        adapters.append(adapter)
    return base.model, slot, adapters


def logits_BTV(model, input_ids_BT: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids_BT).logits.float()


def trainable_copy(adapter: LoraAdapter) -> LoraAdapter:
    return LoraAdapter(adapter.rank, adapter.alpha,
                       {k: v.detach().clone().requires_grad_() for k, v in adapter.lora_A.items()},
                       {k: v.detach().clone().requires_grad_() for k, v in adapter.lora_B.items()})


def test_each_row_gets_exactly_its_own_adapter(model_and_adapters):
    model, slot, (first, second) = model_and_adapters
    input_ids_BT = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16], [5, 6, 7, 8]])
    row_adapters = [first, second, None, second]
    stack = AdapterStack(slot, [None, first, second], torch.float32)
    with torch.no_grad(), use_adapter_rows(slot, stack, torch.tensor([1, 2, 0, 2])):
        together = logits_BTV(model, input_ids_BT)
    for row, adapter in enumerate(row_adapters):
        with torch.no_grad(), use_adapter(slot, adapter):
            alone = logits_BTV(model, input_ids_BT[row:row + 1])[0]
        torch.testing.assert_close(together[row], alone, atol=1e-5, rtol=0)
    # Rows 0 and 3 share the prompt but not the adapter.
    assert (together[0] - together[3]).abs().max() > 1e-2


def test_gradients_land_in_each_adapters_own_tensors(model_and_adapters):
    model, slot, adapters = model_and_adapters
    trainable = [trainable_copy(adapter) for adapter in adapters]
    input_ids_BT = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    weights_BTV = torch.randn(3, 4, model.config.vocab_size, generator=torch.Generator().manual_seed(0))
    stack = AdapterStack(slot, [trainable[0], trainable[1], None], torch.float32)
    with use_adapter_rows(slot, stack, torch.tensor([0, 1, 2])):
        (logits_BTV(model, input_ids_BT).log_softmax(-1) * weights_BTV).sum().backward()
    together = [[t.grad.clone() for t in a.parameters()] for a in trainable]
    for row, adapter in enumerate(trainable):
        for tensor in adapter.parameters():
            tensor.grad = None
        with use_adapter(slot, adapter):
            rows = slice(row, row + 1)
            (logits_BTV(model, input_ids_BT[rows]).log_softmax(-1) * weights_BTV[rows]).sum().backward()
        for got, expected in zip(together[row], [t.grad for t in adapter.parameters()]):
            # fp32 sums over other shapes round differently: relative to the gradient's own scale (up to ~1e3).
            torch.testing.assert_close(got, expected, atol=1e-5 * float(expected.abs().max()), rtol=1e-4)


def test_nothing_one_forward_sets_outlives_its_block(model_and_adapters):
    model, slot, (first, second) = model_and_adapters
    input_ids_BT = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        plain = logits_BTV(model, input_ids_BT)
        with use_adapter_rows(slot, AdapterStack(slot, [second], torch.float32), torch.tensor([0])):
            logits_BTV(model, input_ids_BT)
        with use_adapter(slot, first):
            logits_BTV(model, input_ids_BT)
        assert torch.equal(logits_BTV(model, input_ids_BT), plain)
    assert all(layer.lora_A is None and layer.grouped_A is None and layer.row_scale_BJ is None for layer in slot.layers)


def test_a_forward_stopped_half_way_leaves_nothing_for_the_next(model_and_adapters):
    model, slot, (first, _) = model_and_adapters
    attention = model.get_submodule("model.layers.0.self_attn")
    x = torch.randn(1, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), use_adapter(slot, first):
        attention.q_proj(x)  # k and v never called: their intermediates wait
        assert attention.q_proj.siblings._input is x
    assert attention.q_proj.siblings._input is None
    assert all(waiting is None for waiting in attention.q_proj.siblings._waiting)


class CountProducts(TorchDispatchMode):
    """Counts the matrix products run inside it."""

    def __init__(self):
        super().__init__()
        self.products = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.products += func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


def without_shared_inputs(slot):
    """The slot's layers with no siblings (each multiplies its input by its own A), restored on exit."""
    class Unshared:
        def __enter__(self):
            self.saved = [layer.siblings for layer in slot.layers]
            for layer in slot.layers:
                layer.siblings = None

        def __exit__(self, *exc):
            for layer, siblings in zip(slot.layers, self.saved):
                layer.siblings = siblings
    return Unshared()


@pytest.mark.parametrize("per_row", [False, True])
def test_layers_reading_the_same_input_share_one_product_and_keep_nothing(model_and_adapters, per_row):
    model, slot, (first, _) = model_and_adapters
    shared = {id(layer.siblings): layer.siblings for layer in slot.layers if layer.siblings is not None}
    assert sorted(len(group.layers) for group in shared.values()) == [2, 2, 3, 3]  # 2 blocks: q/k/v, gate/up
    input_ids_BT = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    weights_BTV = torch.randn(2, 4, model.config.vocab_size, generator=torch.Generator().manual_seed(1))
    adapted = trainable_copy(first)

    def run():
        context = (use_adapter_rows(slot, AdapterStack(slot, [adapted], torch.float32), torch.tensor([0, 0]))
                   if per_row else use_adapter(slot, adapted))
        for tensor in adapted.parameters():
            tensor.grad = None
        counter = CountProducts()
        with context, counter:
            logits = logits_BTV(model, input_ids_BT)
        (logits.log_softmax(-1) * weights_BTV).sum().backward()
        return logits.detach(), [t.grad.clone() for t in adapted.parameters()], counter.products

    logits, grads, products = run()
    assert all(group._input is None and not any(m is not None for m in group._waiting) for group in shared.values())
    with without_shared_inputs(slot):
        alone_logits, alone_grads, alone_products = run()
    # Per block, q/k/v's three A products become one and gate/up's two become one.
    blocks = len(shared) // 2
    assert alone_products - products == 3 * blocks
    torch.testing.assert_close(logits, alone_logits, atol=1e-5, rtol=0)
    for got, expected in zip(grads, alone_grads):
        torch.testing.assert_close(got, expected, atol=1e-5 * float(expected.abs().max()), rtol=1e-4)


def test_siblings_called_in_any_order_or_with_other_inputs_get_their_own_delta(model_and_adapters):
    model, slot, (first, _) = model_and_adapters
    attention = model.get_submodule("model.layers.0.self_attn")
    x = torch.randn(1, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    other = torch.randn(1, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    layers = [attention.q_proj, attention.k_proj, attention.v_proj]
    assert all(isinstance(layer.siblings, SharedInput) for layer in layers)
    with torch.no_grad(), use_adapter(slot, first):
        with without_shared_inputs(slot):
            expected = [layer(x) for layer in layers]
            expected_other = attention.k_proj(other)
        # v first; then k with another input (it computes afresh); then q and k with the first input again.
        got_v, got_k_other, got_q, got_k = layers[2](x), layers[1](other), layers[0](x), layers[1](x)
    for got, want in zip([got_q, got_k, got_v], expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_k_other, expected_other, atol=1e-6, rtol=0)


@pytest.mark.parametrize("vlm", ["builtin:tiny-qwen2-vl", "builtin:tiny-qwen3-vl"])
def test_a_vlm_adapter_on_an_image_prompt_equals_peft_and_adapts_only_the_language_model(vlm, models_dir, tmp_path):
    # An independent reference for the VLM targets: PEFT on transformers' own model, fed the processor's
    # pixel values; the vision tower runs in both and no LoRA layer sits in it.
    from peft import PeftModel
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    base = load_base_model(ModelConfig(base_model=vlm, model_path=None, model_cache_dir=models_dir))
    targets, slot = apply_lora_wrappers(base.model, base.family)
    adapter = LoraAdapter.initialize(select_targets(targets, train_attn=True, train_mlp=True, train_unembed=True),
                                     rank=4, alpha=8.0, seed=5, device="cpu")
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for lora_B in adapter.lora_B.values():
            lora_B.copy_(torch.randn(lora_B.shape, generator=generator) * 0.2)
    save_peft_adapter(tmp_path, adapter, vlm)
    processor, tokenizer = AutoImageProcessor.from_pretrained(base.path), AutoTokenizer.from_pretrained(base.path)
    image = Image.fromarray(torch.randint(0, 256, (56, 56, 3), generator=generator, dtype=torch.uint8).numpy())
    inputs = dict(processor(images=[image], return_tensors="pt"))
    num_pads = int(inputs["image_grid_thw"].prod()) // processor.merge_size ** 2
    ids = tokenizer.encode("<|vision_start|>") + tokenizer.encode("<|image_pad|>") * num_pads + \
        tokenizer.encode("<|vision_end|>What is it?")
    inputs["input_ids"] = torch.tensor([ids])
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == tokenizer.convert_tokens_to_ids("<|image_pad|>")).long()
    with torch.no_grad(), use_adapter(slot, adapter):
        ours = base.model(**inputs).logits.float()
    peft_model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base.path), tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(**inputs).logits.float(), ours, atol=1e-4, rtol=0)
        with peft_model.disable_adapter():
            assert (peft_model(**inputs).logits.float() - ours).abs().max() > 1e-2  # the adapter changes it
    adapted = {name.removeprefix("base_model.model.").removesuffix(".lora_A") for name, _ in
               peft_model.named_modules() if name.endswith(".lora_A")}
    assert adapted == set(adapter.lora_A)
    assert all(name.startswith(base.family.language_model_prefix) or name == base.family.unembed_module
               for name in adapted)
