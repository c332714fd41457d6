"""Random weights for a model of any size, made one module at a time and handed on as they are made.

The model is built on the meta device; each module's tensors are then made on the write device,
initialized as transformers' `initialize_weights` does (children first, by the init of the nearest
PreTrainedModel; norms, biases and the like exactly as there), handed on once the last init that may
touch them has run, and dropped: memory holds about one decoder layer, not the model. Matrices are
drawn faster than transformers draws them (one CPU thread: minutes for a 35B model): normal values of
the same scale from the GPU's generator, or on a CPU read from one block of normal values at random
offsets. Knows nothing about files or the server.
"""

import random
from collections.abc import Callable, Iterator

import torch
from transformers import PreTrainedModel
from transformers.initialization import guard_torch_init_functions

# Odd, so the block's period never lines up with rows of a power-of-two length: the rows of a matrix
# larger than the block are shifted reads of it, never copies of each other.
CPU_BLOCK_VALUES = (1 << 24) + 1

Fill = Callable[[torch.Tensor, float], None]  # fills a tensor with normal values of a standard deviation


@torch.no_grad()
def random_state_dict(model: PreTrainedModel, device: str, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """`model`'s state dict (the model built on the meta device) with random values on `device`, tensor by
    tensor; a tied tensor once, under its first name, as save_pretrained writes it."""
    parameters_and_buffers = {name for name, _ in (*model.named_parameters(), *model.named_buffers())}
    names = set(model.state_dict()) & parameters_and_buffers  # deduplicated, persistent buffers only
    fill = _normal_fill(torch.device(device), seed)
    yield from _initialize(model, "", model, names, fill, device)
    yield from _release(model, "", names)


def _normal_fill(device: torch.device, seed: int) -> Fill:
    """On a GPU its own generator; on a CPU reads of one block of normal values, scaled (a multithreaded
    elementwise pass instead of drawing every value)."""
    generator = torch.Generator(device).manual_seed(seed)
    if device.type != "cpu":
        return lambda tensor, std: tensor.normal_(0.0, std, generator=generator)
    block = torch.randn(CPU_BLOCK_VALUES, generator=generator)
    blocks = {}  # the block in each dtype filled: a multiply that also converts is ten times slower
    offsets = random.Random(seed)

    def fill(tensor: torch.Tensor, std: float) -> None:
        if tensor.dtype not in blocks:
            blocks[tensor.dtype] = block.to(tensor.dtype)
        flat, start, done = tensor.view(-1), offsets.randrange(CPU_BLOCK_VALUES), 0
        while done < flat.numel():
            count = min(flat.numel() - done, CPU_BLOCK_VALUES - start)
            torch.mul(blocks[tensor.dtype][start:start + count], std, out=flat[done:done + count])
            done, start = done + count, 0

    return fill


def _initialize(module: torch.nn.Module, prefix: str, owner: PreTrainedModel, names: set[str], fill: Fill,
                device: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Make and initialize `module`'s subtree, yielding every tensor below `module` (its own are yielded by
    the caller: an init may set its direct children's tensors, as a MoE block sets its router's)."""
    for name, child in module.named_children():
        child_owner = child if isinstance(child, PreTrainedModel) else owner
        yield from _initialize(child, f"{prefix}{name}.", child_owner, names, fill, device)
    module.to_empty(device=device, recurse=False)
    config = owner.config  # transformers' default for the scale of its normal init
    std = getattr(config, "initializer_range", None) or getattr(config.get_text_config(), "initializer_range", 0.02)
    for name, tensor in _own_tensors(module):
        if tensor.dim() >= 2 and tensor.is_floating_point():  # a matrix: drawn here (a tied copy: not at all)
            if prefix + name in names:
                fill(tensor, std)
            tensor._is_hf_initialized = True  # transformers' init functions skip a tensor so marked
    with guard_torch_init_functions():  # and so do torch's, while this lasts (as in initialize_weights)
        owner._init_weights(module)
    for name, child in module.named_children():
        yield from _release(child, f"{prefix}{name}.", names)


def _release(module: torch.nn.Module, prefix: str, names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `module`'s own tensors (those the state dict writes), then drop them."""
    for name, tensor in _own_tensors(module):
        if prefix + name in names:
            yield prefix + name, tensor.detach()
    module.to_empty(device="meta", recurse=False)


def _own_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
