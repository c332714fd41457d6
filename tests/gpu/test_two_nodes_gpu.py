"""Two "nodes" of one GPU each on the lent 2-GPU machine (NCCL): the server as node 0 on GPU 0 and torchrun's
rank 1 as node 1 on GPU 1, each seeing only its own GPU, train as one GPU does within bf16 rounding (the
tolerances of test_data_parallel_gpu.py); then rank 1 is killed mid-step and the server stops with the cause.

Run: `NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
PYTHONPATH=$PWD python -m pytest -m gpu tests/gpu/test_two_nodes_gpu.py -x -q -s` (NVLink multicast off, as
benchmarks/README.md asks on a machine of several GPUs).
"""

import os

import pytest
import torch

from support.data_parallel import (BASE_MODEL, CUDA_BF16, NO_MULTICAST, assert_trained_alike_in_bf16, mixed_batch,
                                   rank_pid, start_ranks, start_two_nodes, train)
from support.fault import check_stopped_for_lost_rank, kill_rank_mid_step
from support.vision_sdk import ImagePrompts

pytestmark = pytest.mark.gpu


def test_two_nodes_of_one_gpu_train_as_one_gpu_and_a_killed_node_stops_the_server(models_dir, tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.fail("needs two GPUs")
    os.environ.update(NO_MULTICAST)
    one_gpu = start_ranks(models_dir, tmp_path_factory, 1, *CUDA_BF16)  # builds the model both nodes load
    try:
        one = train(one_gpu)
    finally:
        one_gpu.stop()
    nodes = start_two_nodes(tmp_path_factory.mktemp("two-gpu-nodes") / "data", models_dir, *CUDA_BF16,
                            environments=({"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}))
    try:
        assert_trained_alike_in_bf16(train(nodes.server), one)
        training = nodes.server.service_client().create_lora_training_client(base_model=BASE_MODEL, rank=8,
                                                                              seed=5).result()
        kill_rank_mid_step(nodes.server, rank_pid(nodes.node_log.read_text(), 1), training,
                           mixed_batch(ImagePrompts(training)))
        check_stopped_for_lost_rank(nodes.server, 1, training.model_id)
        assert nodes.node.wait(timeout=120) != 0
    finally:
        nodes.server.stop()
        nodes.node.kill()
        nodes.node.wait()

