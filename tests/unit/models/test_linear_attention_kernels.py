"""When flash-linear-attention's kernels can train Qwen3.5's linear attention: the start-up check's rule."""

import pytest

from server.models.loading import linear_attention_kernels_problem


@pytest.mark.parametrize("triton_version", ["3.4.0", "3.6.0", "3.7.0"])
def test_hopper_with_a_triton_whose_backward_is_wrong_is_refused_with_what_to_install(triton_version):
    problem = linear_attention_kernels_problem((9, 0), triton_version)
    assert problem is not None and triton_version in problem and "3.7.1" in problem


@pytest.mark.parametrize("capability, triton_version", [((9, 0), "3.7.1"), ((9, 0), "3.9.0"), ((9, 0), "3.3.1"),
                                                        ((8, 0), "3.6.0"), ((10, 0), "3.6.0")])
def test_other_gpus_and_tritons_are_accepted(capability, triton_version):
    assert linear_attention_kernels_problem(capability, triton_version) is None
