"""Where a training step's time goes, one decoder layer at a time: forward + backward of one
Qwen3-VL-4B-shaped text decoder layer with rank-32 LoRA on its seven projections, in variants.

    python benchmarks/layer_speed.py --tokens 8192

Variants: the server's LoRA layer; plain frozen layer (no LoRA, the floor); each with the
layer's RMSNorms compiled; and the whole layer compiled. Prints milliseconds per layer and the
implied seconds per 65,536-token step for 36 layers (lm_head and attention outside the layer excluded).
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.training.lora import AdapterSlot, LoraAdapter, LoraLinear, LoraTarget, use_adapter  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_layer(tokens_per_row: int):
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextDecoderLayer, Qwen3VLTextRotaryEmbedding

    config = Qwen3VLTextConfig(hidden_size=2560, intermediate_size=9728, num_hidden_layers=1, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, vocab_size=151936,
                               rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                "mrope_section": [24, 20, 20], "mrope_interleaved": True})
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        layer = Qwen3VLTextDecoderLayer(config, 0).to(torch.bfloat16).requires_grad_(False)
        rotary = Qwen3VLTextRotaryEmbedding(config)
    return config, layer, rotary


def wrap(layer, rank: int):
    slot = AdapterSlot()
    targets = []
    for name, module in list(layer.named_modules()):
        leaf = name.rpartition(".")[2]
        if leaf in PROJECTIONS and isinstance(module, torch.nn.Linear):
            parent = layer.get_submodule(name.rpartition(".")[0])
            setattr(parent, leaf, LoraLinear(module, name, slot))
            targets.append(LoraTarget(name, "attn", module.in_features, module.out_features))
    adapter = LoraAdapter.initialize(targets, rank, 32.0, 0, "cuda")
    for b in adapter.lora_B.values():
        torch.nn.init.normal_(b.data, std=0.01)
    return slot, adapter


def compile_norms(layer):
    for module in layer.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = torch.compile(module.forward, dynamic=False)


def time_layer(layer, rotary, slot, adapter, tokens: int, rows: int, repeats: int = 10) -> float:
    hidden = torch.randn(rows, tokens // rows, 2560, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    position_ids = torch.arange(tokens // rows, device="cuda").expand(3, rows, -1)
    cos_sin = rotary(hidden, position_ids)

    def step():
        with use_adapter(slot, adapter) if slot is not None else torch.enable_grad():
            out = layer(hidden, attention_mask=None, position_embeddings=cos_sin, position_ids=None)
            out = out[0] if isinstance(out, tuple) else out
            out.float().square().mean().backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--rank", type=int, default=32)
    args = parser.parse_args()
    step_tokens, layers = 65536, 36
    results = []
    for name in ["lora", "frozen", "lora+compiled norms", "frozen+compiled norms", "lora, layer compiled"]:
        torch.manual_seed(0)
        _, layer, rotary = build_layer(args.tokens // args.rows)
        slot = adapter = None
        if name.startswith("lora"):
            slot, adapter = wrap(layer, args.rank)
        if "compiled norms" in name:
            compile_norms(layer)
        if "layer compiled" in name:
            layer = torch.compile(layer, dynamic=False)
        try:
            milliseconds = time_layer(layer, rotary, slot, adapter, args.tokens, args.rows)
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
