"""What a new shape costs PyTorch's SDPA: boolean and additive masks, with cuDNN attention and without.

    python benchmarks/attention_masks.py                  (CUDA; on CPU it runs, but the question is cuDNN's)

On the H100, SDPA with a mask picks cuDNN attention, which builds a plan for each shape it has not seen
(benchmarks/RESULTS.md). Two workloads whose shapes change from call to call, as the server's do:
- decode: one query per row against a key length that grows by one each call (the embedded sampler's steps),
  rows x heads x kv heads x head dim as the tiny Qwen2-VL and a 4B model, one row left-padded;
- train: forward and backward over padded rows of about 1,000 tokens, a new length each call (the trainer's
  length-sorted micro-batches), 4 rows, 32 heads, 8 kv heads, head dim 128, one row half padding.
Key and value heads are repeated to the query's, as transformers does when it passes a mask. Each workload
runs its shapes once (new shapes) and again (seen shapes), for each mask kind, with every backend allowed
(cuDNN first) and with cuDNN left out. It prints milliseconds per call and the GPU's peak memory.
"""

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"any (cuDNN first)": None,
            "flash, efficient, math": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]}


def decode_calls(mask_kind: str, rows: int, heads: int, kv_heads: int, dim: int, lengths: range, device: str,
                 dtype: torch.dtype) -> float:
    """Milliseconds per decode call over `lengths` (one call per key length)."""
    query = torch.randn(rows, heads, 1, dim, device=device, dtype=dtype)
    synchronize(device)
    start = time.perf_counter()
    for length in lengths:
        key, value = (torch.randn(rows, kv_heads, length, dim, device=device, dtype=dtype) for _ in range(2))
        keep = torch.ones(rows, 1, 1, length, device=device, dtype=torch.bool)
        keep[0, ..., :length // 4] = False  # one row left-padded
        attention(query, key, value, as_mask(keep, mask_kind, dtype))
    synchronize(device)
    return 1e3 * (time.perf_counter() - start) / len(lengths)


def train_calls(mask_kind: str, lengths: range, device: str, dtype: torch.dtype) -> float:
    """Milliseconds per forward + backward over `lengths` (one padded micro-batch per length)."""
    total = 0.0
    for length in lengths:
        query = torch.randn(4, 32, length, 128, device=device, dtype=dtype, requires_grad=True)
        key, value = (torch.randn(4, 8, length, 128, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        padding = torch.ones(4, length, device=device, dtype=torch.bool)
        padding[-1, length // 2:] = False
        keep = torch.ones(length, length, device=device, dtype=torch.bool).tril()[None, None] & padding[:, None, None]
        synchronize(device)
        start = time.perf_counter()
        attention(query, key, value, as_mask(keep, mask_kind, dtype)).sum().backward()
        synchronize(device)
        total += time.perf_counter() - start
    return 1e3 * total / len(lengths)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA as transformers calls it with a mask: key and value heads repeated to the query's."""
    repeat = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    with BACKEND[0]():
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask)


BACKEND = [contextlib.nullcontext]


def as_mask(keep: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    if kind == "boolean":
        return keep
    return torch.zeros(keep.shape, device=keep.device, dtype=dtype).masked_fill_(~keep, torch.finfo(dtype).min)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {args.device} "
          f"({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}), {args.dtype}\n")
    print("| workload | shape | mask | SDPA backends | new shapes ms/call | seen shapes ms/call |")
    print("|---|---|---|---|---|---|")
    decode_shapes = {"tiny (64 rows, 4/2 heads, dim 32)": (64, 4, 2, 32), "4B (64 rows, 32/8 heads, dim 128)":
                     (64, 32, 8, 128)}
    first_length = 40
    for backend_name, backends in BACKENDS.items():
        BACKEND[0] = contextlib.nullcontext if backends is None else lambda backends=backends: sdpa_kernel(backends)
        for mask_kind in ("boolean", "additive"):  # untimed: cuDNN's and the allocator's first calls
            decode_calls(mask_kind, 8, 4, 2, 32, range(7, 9), args.device, dtype)
            train_calls(mask_kind, range(64, 66), args.device, dtype)
        for mask_kind in ("boolean", "additive"):
            for name, shape in decode_shapes.items():
                lengths = range(first_length, first_length + 200)  # lengths no earlier run has seen
                first_length += 200
                new = decode_calls(mask_kind, *shape, lengths, args.device, dtype)
                seen = decode_calls(mask_kind, *shape, lengths, args.device, dtype)
                print(f"| decode | {name} | {mask_kind} | {backend_name} | {new:.3f} | {seen:.3f} |")
            lengths = range(first_length + 1000, first_length + 1096, 16)
            first_length += 200
            new = train_calls(mask_kind, lengths, args.device, dtype)
            seen = train_calls(mask_kind, lengths, args.device, dtype)
            print(f"| train, forward + backward | 4 rows of ~1,000 tokens, 32/8 heads, dim 128 | {mask_kind} | "
                  f"{backend_name} | {new:.1f} | {seen:.1f} |")
    if args.device == "cuda":
        print(f"\npeak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
