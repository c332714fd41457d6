"""The chunked gated delta rule (Qwen3.5's linear attention) forward and backward: transformers' PyTorch
path (what training and prefill run today) against flash-linear-attention's kernel where it is
installed; one layer of a Qwen3.5-4B shape, side by side in one process.

    python benchmarks/gated_delta_speed.py --device cuda --batch 4 --length 2048
"""

import argparse
import importlib.util
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--key-heads", type=int, default=16)
    parser.add_argument("--value-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from transformers.models.qwen3_5 import modeling_qwen3_5

    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    torch_path = modeling_qwen3_5.torch_chunk_gated_delta_rule.__wrapped__
    # (name, function, dtype of q, k, v); the first is the reference the others are compared with.
    implementations = [("transformers fp32 (reference)", torch_path, torch.float32)]
    if dtype != torch.float32:
        implementations.append((f"transformers {args.dtype}", torch_path, dtype))
    if importlib.util.find_spec("fla") is not None:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

        implementations.append((f"flash-linear-attention {args.dtype}", fla_chunk, dtype))
    generator = torch.Generator(device="cpu").manual_seed(0)
    b, n, hk, h, d = args.batch, args.length, args.key_heads, args.value_heads, args.head_dim
    inputs = [torch.randn(b, n, hk, d, generator=generator), torch.randn(b, n, hk, d, generator=generator),
              torch.randn(b, n, h, d, generator=generator), -torch.rand(b, n, h, generator=generator) * 0.3,
              torch.rand(b, n, h, generator=generator)]
    inputs = [x.to(device) for x in inputs]
    print(f"{b} x {n} positions, {hk} key heads, {h} value heads, head dim {d}, {args.dtype}, {device}")
    # Gaps against the first implementation (transformers'): the output's largest absolute difference, and
    # each gradient's largest difference relative to that gradient's largest magnitude.
    names = ("q", "k", "v", "g", "beta")
    print(f"{'implementation':34} {'fwd+bwd ms':>11} {'peak GiB':>9} {'max |out - ref|':>16} "
          + " ".join(f"{'d' + name + ' rel':>10}" for name in names))
    reference = None
    for name, function, qkv_dtype in implementations:
        try:
            times, peak, outputs = measure(args, device, function,
                                           [x.to(qkv_dtype) if i < 3 else x for i, x in enumerate(inputs)])
        except Exception as error:  # e.g. a kernel that refuses this GPU's Triton
            print(f"{name:34} failed: {type(error).__name__}: {str(error)[:200]}")
            continue
        reference = outputs if reference is None else reference
        gaps = [((mine - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30)).item()
                for mine, theirs in zip(outputs, reference)]
        out_gap = (outputs[0] - reference[0]).abs().max().item()
        print(f"{name:34} {1000 * sorted(times)[len(times) // 2]:11.1f} {peak:9.2f} {out_gap:16.2e} "
              + " ".join(f"{gap:10.2e}" for gap in gaps[1:]))


def measure(args, device, function, inputs):
    """Seconds of each timed forward + backward, the peak memory (GiB) of the last, and its output and the
    inputs' gradients (fp32)."""
    times, peak = [], float("nan")
    for repeat in range(args.repeats + 1):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out, _ = function(leaves[0], leaves[1], leaves[2], g=leaves[3], beta=leaves[4],
                          use_qk_l2norm_in_kernel=True)
        out.float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**30
        if repeat:  # the first call compiles (Triton) or warms the allocator
            times.append(time.perf_counter() - start)
    return times, peak, [out.detach().float()] + [leaf.grad.float() for leaf in leaves]


if __name__ == "__main__":
    main()
