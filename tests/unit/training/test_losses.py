"""Tinker's losses against the formulas of the wire-protocol notes (section 8), on random tensors.

Each reference below is written from the doc's table, not from server/training/losses.py: its
value is the table's token sum and its gradient w.r.t. the policy logprobs is derived by hand.

Shapes: N = positions of a datum, K = targets per position.
"""

import pytest
import torch

from server.errors import InvalidRequest
from server.training.losses import LOSSES, resolve_loss

N = 64
K = 5


def _policy_inputs(seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Current logprobs plus sampler logprobs and advantages, with ratios well inside and outside every clip."""
    generator = torch.Generator().manual_seed(seed)
    sampler_logprobs_N = -torch.rand(N, generator=generator) * 3 - 0.1
    # log-ratios from -3 to 3: ratios from 0.05 to 20, so 0.8/1.2 and 4.0 all clip some tokens.
    log_ratio_N = torch.linspace(-3.0, 3.0, N)[torch.randperm(N, generator=generator)]
    logprobs_N = sampler_logprobs_N + log_ratio_N
    advantages_N = torch.randn(N, generator=generator)
    return logprobs_N, {"logprobs": sampler_logprobs_N, "advantages": advantages_N}


def _value_and_gradient(loss_fn: str, logprobs: torch.Tensor, inputs: dict[str, torch.Tensor],
                        config: dict[str, float] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The server's loss:sum, elementwise loss and d(loss:sum)/d(logprobs)."""
    spec, resolved = resolve_loss(loss_fn, config)
    logprobs = logprobs.clone().requires_grad_(True)
    elementwise = spec.fn(logprobs, inputs, resolved)
    total = elementwise.sum()
    (gradient,) = torch.autograd.grad(total, logprobs)
    return total.detach(), elementwise.detach(), gradient


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


# -- reference formulas (doc section 8), each returning (loss:sum, dloss/dlogp) ------------------


def reference_cross_entropy(logp, weights):
    return -(logp * weights).sum(), -weights


def reference_importance_sampling(logp, q, advantages):
    ratio = torch.exp(logp - q)
    return -(ratio * advantages).sum(), -ratio * advantages


def reference_ppo(logp, q, advantages, low, high):
    ratio = torch.exp(logp - q)
    unclipped = ratio * advantages
    clipped = torch.clip(ratio, low, high) * advantages
    # The unclipped term carries gradient where it is the minimum: inside the clip range, or
    # outside it on the side where clipping would not help (ratio high with A<0, low with A>0).
    active = ((ratio >= low) & (ratio <= high)) | ((ratio > high) & (advantages < 0)) \
        | ((ratio < low) & (advantages > 0))
    return -torch.where(unclipped < clipped, unclipped, clipped).sum(), torch.where(active, -ratio * advantages, 0.0)


def reference_cispo(logp, q, advantages, low, high):
    weight = torch.clip(torch.exp(logp - q), low, high)
    return -(weight * logp * advantages).sum(), -weight * advantages


def reference_dro(logp, q, advantages, beta):
    return -(logp * advantages - 0.5 * beta * (logp - q) ** 2).sum(), -(advantages - beta * (logp - q))


def test_every_registered_loss_has_a_reference_test_here():
    assert set(LOSSES) == {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro"}
    assert LOSSES["cross_entropy"].inputs == ("weights",)
    for name in ("importance_sampling", "ppo", "cispo", "dro"):
        assert set(LOSSES[name].inputs) == {"logprobs", "advantages"}, name


@pytest.mark.parametrize("shape", [(N,), (N, K)], ids=["targets_N", "top_k_targets_NK"])
def test_cross_entropy_value_and_gradient_match_the_weighted_logprob_sum_with_negative_weights(shape):
    generator = torch.Generator().manual_seed(1)
    logprobs = -torch.rand(shape, generator=generator) * 5
    weights = torch.randn(shape, generator=generator)
    assert (weights < 0).any() and (weights > 0).any()

    total, elementwise, gradient = _value_and_gradient("cross_entropy", logprobs, {"weights": weights}, None)
    expected_total, expected_gradient = reference_cross_entropy(logprobs, weights)

    _assert_close(total, expected_total)
    _assert_close(elementwise, -logprobs * weights)
    assert elementwise.shape == shape
    _assert_close(gradient, expected_gradient)


def test_importance_sampling_value_and_gradient_match_the_ratio_weighted_advantage_sum():
    logprobs, inputs = _policy_inputs(2)
    total, elementwise, gradient = _value_and_gradient("importance_sampling", logprobs, inputs, None)
    expected_total, expected_gradient = reference_importance_sampling(logprobs, inputs["logprobs"],
                                                                      inputs["advantages"])
    _assert_close(total, expected_total)
    _assert_close(elementwise.sum(), expected_total)
    _assert_close(gradient, expected_gradient)


@pytest.mark.parametrize(("config", "low", "high"), [
    (None, 0.8, 1.2),
    ({"clip_high_threshold": 1.5}, 0.8, 1.5),
    ({"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}, 0.5, 2.0),
], ids=["doc_defaults", "high_overridden", "both_overridden"])
def test_ppo_value_and_gradient_match_the_clipped_surrogate(config, low, high):
    logprobs, inputs = _policy_inputs(3)
    ratio = torch.exp(logprobs - inputs["logprobs"])
    assert (ratio < low).any() and (ratio > high).any()

    total, _, gradient = _value_and_gradient("ppo", logprobs, inputs, config)
    expected_total, expected_gradient = reference_ppo(logprobs, inputs["logprobs"], inputs["advantages"], low, high)

    _assert_close(total, expected_total)
    _assert_close(gradient, expected_gradient)
    # Clipping must matter on this data, so a server ignoring the thresholds fails above.
    assert (expected_gradient == 0).any()


@pytest.mark.parametrize(("config", "low", "high"), [
    (None, 0.0, 4.0),
    ({"clip_low_threshold": 0.5}, 0.5, 4.0),
    ({"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, 0.9, 1.1),
], ids=["doc_defaults", "low_overridden", "both_overridden"])
def test_cispo_value_matches_and_its_gradient_is_the_stop_gradient_clipped_ratio_times_advantage(config, low, high):
    logprobs, inputs = _policy_inputs(4)
    ratio = torch.exp(logprobs - inputs["logprobs"])
    assert (ratio > high).any()

    total, _, gradient = _value_and_gradient("cispo", logprobs, inputs, config)
    expected_total, expected_gradient = reference_cispo(logprobs, inputs["logprobs"], inputs["advantages"], low, high)

    _assert_close(total, expected_total)
    # d/dlogp of -(sg(clip(r))*logp*A) is -clip(r)*A exactly: no term from differentiating the ratio.
    _assert_close(gradient, -torch.clip(ratio, low, high) * inputs["advantages"])
    _assert_close(gradient, expected_gradient)


@pytest.mark.parametrize(("config", "beta"), [(None, 0.05), ({"beta": 0.7}, 0.7)], ids=["doc_default", "overridden"])
def test_dro_value_and_gradient_match_the_quadratic_penalised_objective(config, beta):
    logprobs, inputs = _policy_inputs(5)
    total, _, gradient = _value_and_gradient("dro", logprobs, inputs, config)
    expected_total, expected_gradient = reference_dro(logprobs, inputs["logprobs"], inputs["advantages"], beta)
    _assert_close(total, expected_total)
    _assert_close(gradient, expected_gradient)


def test_resolve_loss_applies_defaults_and_overrides_them_key_by_key():
    assert resolve_loss("ppo", None)[1] == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert resolve_loss("ppo", {"clip_low_threshold": 0.7})[1] == {"clip_low_threshold": 0.7,
                                                                   "clip_high_threshold": 1.2}
    assert resolve_loss("cispo", {})[1] == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert resolve_loss("dro", None)[1] == {"beta": 0.05}
    assert resolve_loss("dro", {"beta": 1})[1] == {"beta": 1.0}
    assert resolve_loss("cross_entropy", None)[1] == {}
    # Overriding one run's config never leaks into the registry's defaults.
    assert LOSSES["ppo"].config_defaults == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


@pytest.mark.parametrize(("loss_fn", "config", "message"), [
    ("gspo", None, "unsupported loss_fn"),
    ("custom", None, "unsupported loss_fn"),
    ("ppo", {"beta": 0.1}, "'beta'"),
    ("dro", {"clip_low_threshold": 0.8}, "'clip_low_threshold'"),
    ("cross_entropy", {"clip_high_threshold": 1.2}, "'clip_high_threshold'"),
    ("ppo", {"clip_low_threshold": "low"}, "must be a number"),
])
def test_resolve_loss_rejects_unknown_names_unknown_config_keys_and_non_numbers(loss_fn, config, message):
    with pytest.raises(InvalidRequest, match=message):
        resolve_loss(loss_fn, config)
