"""How training ranks of one host share it: each takes its share of the CPUs for torch's threads."""

import os

import torch

from server.training.parallel import host_thread_share


def test_each_local_rank_takes_its_share_of_the_cpus_never_more_threads_than_torch_has_nor_fewer_than_one():
    cpus, threads = len(os.sched_getaffinity(0)), torch.get_num_threads()
    assert host_thread_share(1) == min(threads, cpus)
    assert host_thread_share(2) == max(1, min(threads, cpus // 2))
    assert host_thread_share(cpus) == 1
    assert host_thread_share(4 * cpus) == 1
