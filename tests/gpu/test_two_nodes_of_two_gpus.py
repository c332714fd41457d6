"""Two "nodes" of two GPUs each on a lent 4-GPU machine (NCCL): the server as node 0 on GPUs 0-1 and torchrun's
ranks 2-3 as node 1 on GPUs 2-3 train as one node of four GPUs does, within bf16 rounding (the one node's
base sharded with FSDP2, the two nodes' replicated, as --base-sharding auto holds the tiny model).

Run: `NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
PYTHONPATH=$PWD python -m pytest -m gpu tests/gpu/test_two_nodes_of_two_gpus.py -x -q -s`.
"""

import os

import pytest
import torch

from support.data_parallel import (CUDA_BF16, NO_MULTICAST, assert_trained_alike_in_bf16, start_ranks, start_two_nodes,
                                   train)

pytestmark = pytest.mark.gpu


def test_two_nodes_of_two_gpus_train_as_one_node_of_four(models_dir, tmp_path_factory):
    if torch.cuda.device_count() < 4:
        pytest.fail("needs four GPUs (the lent 4-GPU kinds)")
    os.environ.update(NO_MULTICAST)
    one_node = start_ranks(models_dir, tmp_path_factory, 4, *CUDA_BF16, "--base-sharding", "shard")
    try:
        four = train(one_node)
    finally:
        one_node.stop()
    nodes = start_two_nodes(tmp_path_factory.mktemp("two-by-two") / "data", models_dir, *CUDA_BF16,
                            ranks_per_node=2,
                            environments=({"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}))
    try:
        assert_trained_alike_in_bf16(train(nodes.server), four)
    finally:
        nodes.server.stop()
        nodes.node.kill()
        nodes.node.wait()
