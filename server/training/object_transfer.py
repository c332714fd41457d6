"""Python objects sent between training ranks with their CPU tensors set apart from the pickle.

A training request's datums carry tensors: each image's pixels (hundreds of KB), each datum's targets,
weights and positions. torch.distributed's object collectives pickle them as torch tensors at the default
protocol, which copies each one through a serialiser twice: for 30 new 448x448 images (29 MB) 43 ms to
pickle and 41 ms to unpickle on the CPU box, on rank 0's serial path between a request and its pass.
Here the pickle holds only a reference to each tensor, and the tensors' bytes travel as one flat buffer
beside it; the receiver's tensors are views of that buffer (no copy).
"""

import io
import pickle
from typing import Any

import torch
import torch.distributed as dist

# Each tensor's bytes start at a multiple of this in the flat buffer, so that a view of them can take any dtype.
_ALIGNMENT = 16


class _Packer(pickle.Pickler):
    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.pieces: list[tuple[int, torch.Tensor]] = []
        self.size = 0
        # A tensor met twice (an image in two datums) travels once; each is kept here with its reference, so that
        # its id is not reused during the dump by a tensor that a __reduce__ makes and drops.
        self.references: dict[int, tuple[tuple, torch.Tensor]] = {}

    def persistent_id(self, obj):
        if type(obj) is not torch.Tensor or obj.device.type != "cpu" or obj.layout != torch.strided:
            return None
        if id(obj) not in self.references:
            data = obj.detach().contiguous().reshape(-1).view(torch.uint8)
            start = -(-self.size // _ALIGNMENT) * _ALIGNMENT
            self.pieces.append((start, data))
            self.size = start + data.numel()
            self.references[id(obj)] = ((start, data.numel(), obj.dtype, tuple(obj.shape)), obj)
        return self.references[id(obj)][0]


class _Unpacker(pickle.Unpickler):
    def __init__(self, file, flat: torch.Tensor):
        super().__init__(file)
        self.flat = flat

    def persistent_load(self, reference):
        start, size, dtype, shape = reference
        return self.flat[start:start + size].view(dtype).view(shape)


def pack(value: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`value` as (its pickle without CPU tensors, those tensors' bytes), both uint8 tensors."""
    buffer = io.BytesIO()
    packer = _Packer(buffer)
    packer.dump(value)
    flat = torch.empty(packer.size, dtype=torch.uint8)
    for start, data in packer.pieces:
        flat[start:start + data.numel()] = data
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8), flat


def unpack(skeleton: torch.Tensor, flat: torch.Tensor) -> Any:
    return _Unpacker(io.BytesIO(skeleton.numpy().tobytes()), flat).load()


def send(value: Any, destination: int, group: dist.ProcessGroup) -> list[dist.Work]:
    """Start sending `value` to rank `destination`, packed into buffers of its own (the value may change at once);
    the returned works complete once it is sent."""
    skeleton, flat = pack(value)
    works = [dist.isend(torch.tensor([skeleton.numel(), flat.numel()]), destination, group=group),
             dist.isend(skeleton, destination, group=group)]
    if flat.numel():
        works.append(dist.isend(flat, destination, group=group))
    return works


def receive(source: int, group: dist.ProcessGroup) -> Any:
    """The value that rank `source` sends this rank with `send`."""
    sizes = torch.empty(2, dtype=torch.int64)
    dist.recv(sizes, source, group=group)
    skeleton = torch.empty(int(sizes[0]), dtype=torch.uint8)
    dist.recv(skeleton, source, group=group)
    flat = torch.empty(int(sizes[1]), dtype=torch.uint8)
    if flat.numel():
        dist.recv(flat, source, group=group)
    return unpack(skeleton, flat)
