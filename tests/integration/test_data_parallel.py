"""Data-parallel training (`--gpus 2`, here two CPU processes over gloo) gives the same losses, logprobs
and adapter as one training process (unsharded), so sharding the frozen base with FSDP2 changes nothing."""

import numpy as np
import pytest

from support.data_parallel import train_with_one_and_two_ranks


@pytest.fixture(scope="module")
def runs(models_dir, tmp_path_factory):
    return train_with_one_and_two_ranks(models_dir, tmp_path_factory)


def test_two_ranks_give_the_same_losses_and_logprobs_as_one(runs):
    one, two = runs[1], runs[2]
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    for a, b in zip(two["logprobs"], one["logprobs"]):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert one["losses"][2] < one["losses"][0]


def test_two_ranks_train_the_same_adapter_as_one(runs):
    one, two = runs[1]["adapter"], runs[2]["adapter"]
    assert one.keys() == two.keys()
    for name in one:
        np.testing.assert_allclose(two[name].numpy(), one[name].numpy(), atol=1e-6, rtol=1e-4, err_msg=name)
    assert max(float(t.abs().max()) for name, t in one.items() if "lora_B" in name) > 1e-3
