"""Where a training step's time goes, one decoder layer at a time: forward + backward of one
Qwen3-VL-4B-shaped text decoder layer with rank-32 LoRA on its seven projections, in variants.

    python benchmarks/layer_speed.py --tokens 8192
    python benchmarks/layer_speed.py --device cpu --dtype float32 --tokens 256 --variants lora,frozen,"lora+4 adapters by row"

Variants: the server's LoRA layer; plain frozen layer (no LoRA, the floor); each with the
layer's RMSNorms compiled; the whole layer compiled; and the LoRA layer with a different adapter
on each row (four runs sharing one pass). Prints milliseconds per layer and the implied seconds per
65,536-token step for 36 layers (lm_head and attention outside the layer excluded).
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.lora.layers import (AdapterSlot, AdapterStack, LoraAdapter, LoraLinear, LoraTarget,  # noqa: E402
                                use_adapter, use_adapter_rows)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VARIANTS = ("lora", "frozen", "lora+compiled norms", "frozen+compiled norms", "lora+compiled layer",
            "lora+4 adapters by row")


def build_layer(device: str, dtype: torch.dtype):
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextDecoderLayer, Qwen3VLTextRotaryEmbedding

    config = Qwen3VLTextConfig(hidden_size=2560, intermediate_size=9728, num_hidden_layers=1, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, vocab_size=151936,
                               rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                "mrope_section": [24, 20, 20], "mrope_interleaved": True})
    config._attn_implementation = "sdpa"
    with torch.device(device):
        layer = Qwen3VLTextDecoderLayer(config, 0).to(dtype).requires_grad_(False)
        rotary = Qwen3VLTextRotaryEmbedding(config)
    return config, layer, rotary


def wrap(layer, rank: int, device: str, num_adapters: int):
    """LoRA on the layer's projections; the adapters (B set to noise, so they change the output)."""
    slot = AdapterSlot()
    targets = []
    for name, module in list(layer.named_modules()):
        leaf = name.rpartition(".")[2]
        if leaf in PROJECTIONS and isinstance(module, torch.nn.Linear):
            parent = layer.get_submodule(name.rpartition(".")[0])
            wrapper = LoraLinear(module, name)
            setattr(parent, leaf, wrapper)
            slot.layers.append(wrapper)
            targets.append(LoraTarget(name, "attn", module.in_features, module.out_features))
    adapters = [LoraAdapter.initialize(targets, rank, 32.0, seed, device) for seed in range(num_adapters)]
    for adapter in adapters:
        for b in adapter.lora_B.values():
            torch.nn.init.normal_(b.data, std=0.01)
    return slot, adapters


def compile_norms(layer):
    for module in layer.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = torch.compile(module.forward, dynamic=False)


def time_layer(layer, rotary, slot, adapters, tokens: int, rows: int, device: str, dtype: torch.dtype,
               repeats: int = 10) -> float:
    hidden = torch.randn(rows, tokens // rows, 2560, device=device, dtype=dtype, requires_grad=True)
    position_ids = torch.arange(tokens // rows, device=device).expand(3, rows, -1)
    cos_sin = rotary(hidden, position_ids)
    synchronize = torch.cuda.synchronize if device == "cuda" else lambda: None

    def adapted():
        if slot is None:
            return torch.enable_grad()
        if len(adapters) == 1:
            return use_adapter(slot, adapters[0])
        # Built per step, as the trainer builds it per micro-batch.
        stack = AdapterStack(slot, adapters, dtype)
        return use_adapter_rows(slot, stack, torch.arange(rows, device=device) % len(adapters))

    def step():
        with adapted():
            out = layer(hidden, attention_mask=None, position_embeddings=cos_sin, position_ids=None)
            out = out[0] if isinstance(out, tuple) else out
            out.float().square().mean().backward()

    for _ in range(3):
        step()
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    synchronize()
    return (time.perf_counter() - start) / repeats * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", help="float32 on a CPU without fast bf16 matmuls")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {'; '.join(VARIANTS)}")
    args = parser.parse_args()
    step_tokens, layers = 65536, 36
    results = []
    for name in args.variants.split(","):
        assert name in VARIANTS, f"unknown variant {name!r}"
        torch.manual_seed(0)
        dtype = getattr(torch, args.dtype)
        _, layer, rotary = build_layer(args.device, dtype)
        slot = adapters = None
        if name.startswith("lora"):
            slot, adapters = wrap(layer, args.rank, args.device, 4 if "by row" in name else 1)
        if "compiled norms" in name:
            compile_norms(layer)
        if "compiled layer" in name:
            layer = torch.compile(layer, dynamic=False)
        try:
            milliseconds = time_layer(layer, rotary, slot, adapters, args.tokens, args.rows, args.device,
                                      dtype, args.repeats)
            results.append((name, milliseconds))
        except Exception as error:  # a variant that does not compile here is reported, not fatal
            results.append((name, f"failed: {type(error).__name__}: {str(error)[:200]}"))
        print(results[-1], flush=True)
    print(f"\none decoder layer, {args.tokens} tokens ({args.rows} rows), forward + backward")
    for name, value in results:
        if isinstance(value, float):
            print(f"{name:28} {value:8.2f} ms/layer   {value * layers * step_tokens / args.tokens / 1000:6.2f} s/step")
        else:
            print(f"{name:28} {value}")


if __name__ == "__main__":
    main()
