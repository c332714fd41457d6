"""The sampler/trainer KL that a run's curves record for policy losses (and nothing for cross-entropy)."""

import numpy as np
import pytest
import torch

from server.rendering.provenance import RECORDED_LOGPROBS, SAMPLED_MASK
from server.rendering.training import TrainingExample
from server.training.curves import curve_metrics


def example(**inputs) -> TrainingExample:
    return TrainingExample(input_ids=[1, 2, 3], loss_fn_inputs={k: torch.tensor(v) for k, v in inputs.items()})


def test_kl_is_over_the_sampled_tokens_where_the_datums_carry_sampler_logprobs():
    # Position 0 is prompt (sampler logprob 0), positions 1 and 2 were sampled.
    datum = example(target_tokens=[5, 6, 7], logprobs=[0.0, -1.0, -2.0], advantages=[0.0, 1.0, 1.0])
    trainer = {"logprobs": np.array([-3.0, -1.5, -1.5], dtype=np.float32)}
    metrics = curve_metrics([datum], [trainer], {"loss:sum": 1.0})
    assert metrics["loss:sum"] == 1.0
    assert metrics["kl_sample_train_v1:mean"] == pytest.approx(0.0)  # (0.5 - 0.5) / 2
    assert metrics["kl_sample_train_v2:mean"] == pytest.approx(0.125)  # 0.5 * (0.25 + 0.25) / 2


def test_recorded_sampler_logprobs_and_mask_win_over_the_clients_copy():
    datum = example(target_tokens=[5, 6, 7], logprobs=[9.0, 9.0, 9.0], advantages=[0.0, 0.0, 1.0],
                    **{RECORDED_LOGPROBS: [0.0, 0.0, -1.0], SAMPLED_MASK: [0.0, 0.0, 1.0]})
    metrics = curve_metrics([datum], [{"logprobs": np.array([0.0, 0.0, -2.0], dtype=np.float32)}], {})
    assert metrics["kl_sample_train_v1:mean"] == pytest.approx(1.0)


def test_cross_entropy_adds_no_kl():
    datum = example(target_tokens=[5, 6, 7], weights=[1.0, 1.0, 1.0])
    assert curve_metrics([datum], [{"logprobs": np.zeros(3, dtype=np.float32)}], {"loss:sum": 2.0}) == \
        {"loss:sum": 2.0}
