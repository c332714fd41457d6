"""Data parallelism for training: the process group, the FSDP2 sharding of the frozen base, and the
objects rank 0 sends to the other ranks.

Every training rank holds the frozen base sharded with FSDP2 (`fully_shard` per decoder block, then
the root) and a full replica of each run's LoRA adapter and AdamW state, which are small; LoRA
gradients are summed across ranks before each optimizer step. At world size 1 the base is not
sharded: there FSDP would only copy each block's weights into a gather buffer and out again, in every
forward and every backward. Knows nothing about losses, requests or the API.
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
    """The data-parallel mesh the base model is sharded over."""
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
        """values[rank] (given on rank 0) on each rank."""
        box = [None]
        dist.scatter_object_list(box, values if self.is_leader else None, src=0, group=self.objects)
        return box[0]

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's value, in rank order, on rank 0 (None elsewhere)."""
        values = [None] * self.world_size if self.is_leader else None
        dist.gather_object(value, values, dst=0, group=self.objects)
        return values


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


def prepare_blocks(root: nn.Module, decoder_layers: nn.ModuleList, ignored: nn.Module | None, mesh: DeviceMesh,
                   activation_checkpointing: bool, compile: bool) -> None:
    """Checkpoint and compile each decoder block as asked; over several ranks, shard the frozen base
    (each decoder block is one FSDP unit, the rest of `root` another).

    Args:
        root: the module whose forward runs the whole computation, so that its hooks gather the
            embedding, final norm and unembedding around it.
        ignored: parameters FSDP leaves whole on every rank (the vision tower, which runs outside
            the root's forward, once per image, and must not wait for other ranks' collectives).
    """
    for index, layer in enumerate(decoder_layers):
        # Checkpointing, then compiling, then sharding each block: torchtitan's order.
        if activation_checkpointing:
            layer = checkpoint_wrapper(layer)
            decoder_layers[index] = layer
        if compile:
            layer.compile()
        if mesh.size() > 1:
            fully_shard(layer, mesh=mesh)
    if mesh.size() > 1:
        fully_shard(root, mesh=mesh, ignored_params=set(ignored.parameters()) if ignored is not None else None)
