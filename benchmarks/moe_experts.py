"""One MoE layer's routed experts, forward and backward: transformers' own implementations (a loop over the
experts, and one grouped GEMM per projection) against the server's experts with per-expert LoRA on both
projections (`server/lora/experts.py`); a Qwen3.6-35B-A3B layer's shape, side by side in one process.

    python benchmarks/moe_experts.py --device cuda --tokens 8192 --rank 16
"""

import argparse
import time

import torch

from server.lora.experts import LoraExperts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of one micro-batch")
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=512, help="one expert's intermediate size")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    config = Qwen3_5MoeTextConfig(hidden_size=args.hidden, moe_intermediate_size=args.intermediate,
                                  num_experts=args.experts, num_experts_per_tok=args.top_k)
    torch.manual_seed(0)
    experts = Qwen3_5MoeExperts(config).to(device, dtype)
    with torch.no_grad():
        for weight in (experts.gate_up_proj, experts.down_proj):
            weight.normal_(std=0.02).requires_grad_(False)
    lora = LoraExperts(experts, "experts")
    for projection in (lora.gate_up, lora.down):
        lora_A = (torch.randn(args.experts * args.rank, projection.in_features, device=device) * 0.02)
        lora_B = torch.randn(projection.out_features, args.rank * args.experts, device=device) * 0.02
        projection.put_adapter(lora_A=lora_A.requires_grad_(), lora_B=lora_B.requires_grad_(), scale=2.0)
    hidden_NH = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype)
    router_NE = torch.randn(args.tokens, args.experts, device=device)
    top_k_weights_NK, top_k_index_NK = router_NE.softmax(-1).topk(args.top_k, dim=-1)
    top_k_weights_NK = top_k_weights_NK.to(dtype)

    def transformers_with(implementation: str):
        def forward(x):
            config._experts_implementation = implementation
            return experts(x, top_k_index_NK, top_k_weights_NK)
        return forward

    sides = [("transformers, a loop over experts (no LoRA)", transformers_with("eager")),
             ("transformers, grouped GEMMs (no LoRA)", transformers_with("grouped_mm")),
             (f"server, grouped GEMMs, LoRA rank {args.rank} on both", lambda x: lora(x, top_k_index_NK,
                                                                                     top_k_weights_NK))]
    print(f"{args.tokens} tokens, {args.experts} experts (top {args.top_k}), hidden {args.hidden}, expert "
          f"intermediate {args.intermediate}, {args.dtype}, {device}")
    print(f"{'experts':52} {'fwd+bwd ms':>11} {'peak GiB':>9} {'max |out - loop|':>17}")
    first = None
    for name, forward in sides:
        milliseconds, peak, output = measure(forward, hidden_NH, device, args.repeats)
        first = output if first is None else first
        print(f"{name:52} {milliseconds:11.2f} {peak:9.2f} {(output - first).abs().max().item():17.2e}")
    print("(the server's row differs from the loop's by its LoRA delta)")


def measure(forward, hidden_NH: torch.Tensor, device: torch.device, repeats: int):
    """Median milliseconds of a forward and a backward (of the input and any LoRA factors), peak memory in
    GiB, and the output (fp32)."""
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(repeats + 1):  # the first is a warm-up
        x = hidden_NH.detach().requires_grad_()
        synchronize(device)
        start = time.perf_counter()
        output = forward(x)
        output.float().square().mean().backward()
        synchronize(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return sorted(times[1:])[len(times[1:]) // 2] * 1000, peak, output.detach().float()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
