"""The engine's small host-to-device copies (a step's random numbers, rows' settings and indices, a prompt's
tokens), made without waiting for the device.

PyTorch waits for the stream to drain after any copy from pageable host memory to a GPU: a tensor of a few
numbers made mid-step stops the host until every kernel queued before it has run, and the GPU then idles
while the host prepares the next launches. Copied from pinned memory, the copy is queued behind that work
instead; PyTorch's pinned-memory cache keeps the host buffer until the copy has run.
"""

import torch


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (a host tensor or a list of numbers) as a tensor on `device`, queued without a wait on a GPU."""
    tensor = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
