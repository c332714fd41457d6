"""Objects between training ranks: their CPU tensors travel beside the pickle and come back equal, views of one
buffer; a real gloo group of two processes scatters and gathers them."""

import multiprocessing
from dataclasses import dataclass

import torch
import torch.distributed as dist

from server.training import object_transfer
from server.training.parallel import TrainingGroup, free_port


@dataclass
class Carrier:
    name: str
    pixels: torch.Tensor
    rest: dict


def _value():
    shared = torch.arange(12, dtype=torch.uint8).reshape(3, 4)
    return [Carrier("a", shared, {"weights": torch.tensor([0.5, 1.0, 0.0]), "same": shared}),
            {"bf16": torch.tensor([1.5, -2.25], dtype=torch.bfloat16), "flags": torch.tensor([True, False]),
             "scalar": torch.tensor(7, dtype=torch.int64), "empty": torch.zeros(0, 5),
             "strided": torch.arange(20.0).reshape(4, 5)[:, 1::2], "ids": [1, 2, 3]},
            (b"raw", 3.5, None)]


def _assert_equal(received, sent):
    assert type(received) is type(sent)
    if isinstance(sent, torch.Tensor):
        assert received.dtype == sent.dtype and received.shape == sent.shape and torch.equal(received, sent)
    elif isinstance(sent, dict):
        assert received.keys() == sent.keys()
        for key in sent:
            _assert_equal(received[key], sent[key])
    elif isinstance(sent, (list, tuple)):
        assert len(received) == len(sent)
        for r, s in zip(received, sent):
            _assert_equal(r, s)
    elif isinstance(sent, Carrier):
        _assert_equal((received.name, received.pixels, received.rest), (sent.name, sent.pixels, sent.rest))
    else:
        assert received == sent


def test_packed_objects_come_back_equal_with_every_dtype_and_layout_and_a_shared_tensor_travels_once():
    value = _value()
    skeleton, flat = object_transfer.pack(value)
    # The shared 12-byte tensor once, each piece at an aligned offset: far less than two copies of everything.
    assert flat.numel() < 16 * 9
    received = object_transfer.unpack(skeleton, flat)
    _assert_equal(received, value)
    # The tensors are views of the buffer, and writable.
    assert received[0].pixels.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    received[1]["bf16"].add_(1)


def _rank(rank: int, world_size: int, port: int, results) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
    group = TrainingGroup(rank=rank, world_size=world_size, device=torch.device("cpu"), mesh=None,
                          objects=dist.group.WORLD)
    values = [[rank_index, _value()] for rank_index in range(world_size)] if rank == 0 else None
    mine = group.scatter(values)
    # The last rank sends a value without tensors (a rank that got no datum): nothing travels beside its pickle.
    gathered = group.gather([rank, mine] if rank < world_size - 1 else {})
    if rank == 0:
        results.put(gathered)
    dist.destroy_process_group()


def test_scatter_gives_each_rank_its_value_and_gather_brings_every_rank_s_back_in_rank_order():
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank, args=(rank, 3, port, results)) for rank in range(3)]
    for process in processes:
        process.start()
    gathered = results.get(timeout=120)
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert gathered[-1] == {}
    for rank, (sender, value) in enumerate(gathered[:-1]):
        assert sender == rank
        _assert_equal(value, [rank, _value()])
