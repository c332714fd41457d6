"""Data parallelism for training: the process group, how the ranks hold the frozen base, and the objects
rank 0 sends to the other ranks.

Each training rank holds a full replica of each run's LoRA adapter and AdamW state, which are small;
LoRA gradients are summed across ranks before each optimizer step. The frozen base is either sharded
with FSDP2 (`fully_shard` per decoder block, then the root: a rank holds 1/N of it, and every forward
and backward gathers each block's weights) or, when it fits each device with room to spare, replicated
whole on every rank (no collective until the gradients' sum). At world size 1 it is whole: there FSDP
would only copy each block's weights into a gather buffer and out again. Knows nothing about losses,
requests or the API.
"""

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from server.config import REPLICATE_SHARE
from server.training import object_transfer
from server.training.lifelines import Lifelines

# Generous: rank 0 may wait a long time between two training requests.
_COMMAND_TIMEOUT = timedelta(days=365)


@dataclass
class TrainingGroup:
    """This process's place among the training ranks."""

    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh
    """The data-parallel mesh the base model is sharded over (when it is)."""
    objects: dist.ProcessGroup
    """A gloo group for Python objects (commands, datums, outputs), whatever the device backend."""
    lifelines: Lifelines | None = None
    """How this rank learns that another died (None at world size 1)."""

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def broadcast(self, value: Any = None) -> Any:
        """Rank 0's `value`, on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.objects)
        return box[0]

    def scatter(self, values: list[Any] | None = None) -> Any:
        """values[rank] (given on rank 0) on each rank; rank 0 keeps its own without a copy. Each rank's value
        is on its way while rank 0 packs the next one's."""
        if not self.is_leader:
            return object_transfer.receive(0, self.objects)
        sending = [work for rank in range(1, self.world_size)
                   for work in object_transfer.send(values[rank], rank, self.objects)]
        for work in sending:
            work.wait()
        return values[0]

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's value, in rank order, on rank 0 (None elsewhere)."""
        if self.is_leader:
            return [value] + [object_transfer.receive(rank, self.objects) for rank in range(1, self.world_size)]
        for work in object_transfer.send(value, 0, self.objects):
            work.wait()
        return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def host_thread_share(local_ranks: int) -> int:
    """torch's intra-op threads for one of `local_ranks` training processes of this host: its share of the
    CPUs, never more than torch uses already (OMP_NUM_THREADS). Each process taking every CPU puts its host
    ops' threads on cores the others' threads hold: on the 2-core CPU box, 4 processes of 2 threads prepared
    an image 8x slower than 4 of one thread (benchmarks/RESULTS.md, "RL-like batches over ranks")."""
    return max(1, min(torch.get_num_threads(), len(os.sched_getaffinity(0)) // local_ranks))


def init_training_group(rank: int, world_size: int, device_type: str, master_addr: str,
                        master_port: int, devices: tuple[int, ...] | None = None,
                        local_ranks: int = 1) -> TrainingGroup:
    """Join (or, on rank 0, open) the training process group: NCCL on GPUs, gloo on CPUs; with other
    training processes on this host, use only this one's share of its CPUs.

    Args:
        devices: the GPU of each local rank (--training-devices); None: local rank r on GPU r.
    """
    if local_ranks > 1:
        torch.set_num_threads(host_thread_share(local_ranks))
    if device_type == "cuda" and torch.cuda.device_count() == 0:
        raise ValueError("--device cuda, but this machine has no CUDA GPU that torch can use "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use --device cpu")
    device = torch.device(device_type)
    if device_type == "cuda":
        seen = torch.cuda.device_count()
        index = rank % seen if devices is None else devices[rank % len(devices)]
        if index >= seen:
            raise ValueError(f"--training-devices {','.join(map(str, devices))}: this machine shows the server "
                             f"{seen} GPU(s) (0..{seen - 1}, after CUDA_VISIBLE_DEVICES)")
        device = torch.device("cuda", index)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size,
                                init_method=f"tcp://{master_addr}:{master_port}", timeout=_COMMAND_TIMEOUT,
                                device_id=device if device.type == "cuda" else None)
    objects = dist.new_group(backend="gloo", timeout=_COMMAND_TIMEOUT) if device.type == "cuda" \
        else dist.group.WORLD
    mesh = init_device_mesh(device.type, (world_size,))
    group = TrainingGroup(rank=rank, world_size=world_size, device=device, mesh=mesh, objects=objects)
    if world_size > 1:
        group.lifelines = Lifelines.connect(rank, world_size, master_addr, share_port=group.broadcast)
    return group


def choose_base_sharding(setting: str, base: nn.Module, group: TrainingGroup, local_ranks: int) -> str:
    """How the ranks hold the frozen base for --base-sharding `setting`: `shard` or `replicate` (also at world
    size 1, where the one rank holds it whole); the same answer on every rank.

    auto replicates when the base's parameters take at most REPLICATE_SHARE of the smallest training device's
    memory: a GPU's, or on CPUs this rank's share of its host's (each local rank keeps its own copy there).
    """
    if group.world_size == 1:
        return "replicate"
    setting = group.broadcast(setting)  # rank 0's flag: a torchrun node started without it must agree
    if setting != "auto":
        return setting
    if group.device.type == "cuda":
        memory = torch.cuda.get_device_properties(group.device).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local_ranks
    smallest = torch.tensor([memory], dtype=torch.int64)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=group.objects)  # ranks of other nodes may have less
    parameter_bytes = sum(parameter.numel() * parameter.element_size() for parameter in base.parameters())
    return auto_base_sharding(parameter_bytes, int(smallest))


def auto_base_sharding(parameter_bytes: int, device_memory_bytes: int) -> str:
    """--base-sharding auto's choice for a base of `parameter_bytes` on devices of `device_memory_bytes`."""
    return "replicate" if parameter_bytes <= REPLICATE_SHARE * device_memory_bytes else "shard"


def prepare_blocks(root: nn.Module, decoder_layers: nn.ModuleList, ignored: nn.Module | None, group: TrainingGroup,
                   sharding: str, activation_checkpointing: bool, compile: bool) -> None:
    """Checkpoint and compile each decoder block as asked; then over several ranks either shard the frozen
    base (`sharding` shard: each decoder block is one FSDP unit, the rest of `root` another) or move the
    blocks that the load left on the host to this rank's device whole (replicate).

    Args:
        root: the module whose forward runs the whole computation, so that its hooks gather the
            embedding, final norm and unembedding around it.
        ignored: parameters FSDP leaves whole on every rank (the vision tower, which runs outside
            the root's forward, once per image, and must not wait for other ranks' collectives).
    """
    shard = group.world_size > 1 and sharding == "shard"
    if not shard:
        decoder_layers.to(group.device)
    if compile:
        # Every block shares its frames' compiled code, and transformers' `deprecate_kwarg` wrapper is one code
        # object for the block's and its attention's forward: block 0's input needing no gradient, packed rows'
        # first length and then any, padded rows, each times both callers, pass the default limit of 8 and that
        # frame falls back to eager (seen on RL batches). Each variant compiles once; 32 bounds them still.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    for index, layer in enumerate(decoder_layers):
        # Checkpointing, then compiling, then sharding each block: torchtitan's order.
        if activation_checkpointing:
            layer = checkpoint_wrapper(layer)
            decoder_layers[index] = layer
        if compile:
            layer.compile()
        if shard:
            fully_shard(layer, mesh=group.mesh)
    if shard:
        fully_shard(root, mesh=group.mesh, ignored_params=set(ignored.parameters()) if ignored is not None else None)
