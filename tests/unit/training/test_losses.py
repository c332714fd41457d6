"""Tinker's losses against the formulas of the wire-protocol notes (section 8), on random tensors.

Each reference below is written from the doc's table, not from server/training/losses.py: its
value is the table's token sum and its gradient w.r.t. the policy logprobs is derived by hand.

Shapes: N = positions of a datum, K = targets per position.
"""

import math

import pytest
import torch

from server.errors import InvalidRequest
from server.rendering.provenance import RECORDED_LOGPROBS, SAMPLED_MASK
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
    assert set(LOSSES) == {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"}
    assert LOSSES["cross_entropy"].inputs == ("weights",)
    for name in ("importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"):
        assert set(LOSSES[name].inputs) == {"logprobs", "advantages"}, name
    assert LOSSES["gspo"].optional_inputs == ("sequence_ratio_mask",)
    assert LOSSES["stable_reinforce"].needs_provenance


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
    ("gspo", {"kl_coeff": 0.1}, "'kl_coeff'"),
    ("stable_reinforce", {"beta": 0.1}, "'beta'"),
    ("custom", None, "unsupported loss_fn"),
    ("ppo", {"beta": 0.1}, "'beta'"),
    ("dro", {"clip_low_threshold": 0.8}, "'clip_low_threshold'"),
    ("cross_entropy", {"clip_high_threshold": 1.2}, "'clip_high_threshold'"),
    ("ppo", {"clip_low_threshold": "low"}, "must be a number"),
])
def test_resolve_loss_rejects_unknown_names_unknown_config_keys_and_non_numbers(loss_fn, config, message):
    with pytest.raises(InvalidRequest, match=message):
        resolve_loss(loss_fn, config)


# -- gspo: GSPO-token as Tinker documents it (reference-notes section 1.1) ------------------------------


def reference_gspo(logp, q, advantages, mask, low, high):
    """Tinker's snippet written out: one detached log-ratio per datum, the mean over `mask != 0`."""
    masked = mask != 0
    log_s = (logp[masked] - q[masked]).mean() if masked.any() else torch.tensor(0.0)
    s = torch.exp(log_s)
    value = -torch.minimum(s * advantages, torch.clip(s, low, high) * advantages).sum()
    # d/dlogp_t of -min(s_t A_t, clip(s_t) A_t) with s_t = exp(log s + logp_t - sg(logp_t)): the unclipped
    # branch carries -s A_t where it is the minimum, the clipped one nothing outside [low, high].
    active = ((s >= low) & (s <= high)) | ((s > high) & (advantages < 0)) | ((s < low) & (advantages > 0))
    return value, torch.where(active, -s * advantages, 0.0), s


def _gspo_datum(seed: int, log_s: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A datum whose first 16 positions are prompt (mask 0, advantage 0) and whose sequence log-ratio is log_s."""
    generator = torch.Generator().manual_seed(seed)
    logprobs_N = -torch.rand(N, generator=generator) * 3 - 0.1
    noise_N = torch.randn(N, generator=generator)
    mask_N = torch.ones(N)
    mask_N[:16] = 0
    noise_N[16:] -= noise_N[16:].mean()  # per-token log-ratios that average exactly log_s over the mask
    sampler_N = logprobs_N - log_s - noise_N
    advantages_N = torch.randn(N, generator=generator)
    advantages_N[:16] = 0
    return logprobs_N, {"logprobs": sampler_N, "advantages": advantages_N, "sequence_ratio_mask": mask_N}


@pytest.mark.parametrize("log_s", [0.05, 0.5, -0.5], ids=["inside_the_clip", "above_high", "below_low"])
def test_gspo_gives_every_position_the_sequence_ratio_and_clips_it_per_token(log_s):
    logprobs, inputs = _gspo_datum(10, log_s)
    total, elementwise, gradient = _value_and_gradient("gspo", logprobs, inputs, None)
    expected_total, expected_gradient, s = reference_gspo(logprobs, inputs["logprobs"], inputs["advantages"],
                                                          inputs["sequence_ratio_mask"], 0.8, 1.2)
    assert float(s) == pytest.approx(math.exp(log_s), rel=1e-5)
    _assert_close(total, expected_total)
    _assert_close(gradient, expected_gradient)
    advantages = inputs["advantages"]
    unclipped = gradient[16:] != 0
    # Unclipped positions get exactly -s * A_t; clipped ones (only outside [0.8, 1.2]) get nothing.
    _assert_close(gradient[16:][unclipped], -s * advantages[16:][unclipped])
    if log_s == 0.5:
        assert (gradient[16:][advantages[16:] > 0] == 0).all() and (gradient[16:][advantages[16:] < 0] != 0).all()
    elif log_s == -0.5:
        assert (gradient[16:][advantages[16:] < 0] == 0).all() and (gradient[16:][advantages[16:] > 0] != 0).all()
    else:
        assert unclipped.all()
    assert (elementwise[:16] == 0).all() and (gradient[:16] == 0).all()


def test_gspo_thresholds_come_from_the_config():
    logprobs, inputs = _gspo_datum(11, 0.5)  # s = 1.65: clipped at 1.2, not at 2.0
    _, _, clipped = _value_and_gradient("gspo", logprobs, inputs, None)
    _, _, wide = _value_and_gradient("gspo", logprobs, inputs, {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0})
    _assert_close(wide, reference_gspo(logprobs, inputs["logprobs"], inputs["advantages"],
                                       inputs["sequence_ratio_mask"], 0.5, 2.0)[1])
    assert (clipped == 0).sum() > (wide == 0).sum()


def test_gspo_without_a_mask_takes_the_ratio_over_positions_with_an_advantage_and_counts_it():
    logprobs, inputs = _gspo_datum(12, 0.1)
    without_mask = {key: value for key, value in inputs.items() if key != "sequence_ratio_mask"}
    _, elementwise, gradient = _value_and_gradient("gspo", logprobs, without_mask, None)
    as_mask = {**without_mask, "sequence_ratio_mask": (inputs["advantages"] != 0).float()}
    _, expected_elementwise, expected_gradient = _value_and_gradient("gspo", logprobs, as_mask, None)
    _assert_close(elementwise, expected_elementwise)
    _assert_close(gradient, expected_gradient)
    spec, config = resolve_loss("gspo", None)
    assert spec.metrics(logprobs, without_mask, config)["sequence_ratio_mask_missing:sum"] == 1.0
    metrics = spec.metrics(logprobs, inputs, config)
    assert metrics["sequence_ratio_mask_missing:sum"] == 0.0
    assert metrics["sequence_ratio:mean"] == pytest.approx(math.exp(0.1), rel=1e-5)


def test_gspo_with_an_empty_mask_uses_a_unit_ratio_instead_of_nan():
    logprobs, inputs = _gspo_datum(13, 0.7)
    inputs["sequence_ratio_mask"] = torch.zeros(N)
    total, _, gradient = _value_and_gradient("gspo", logprobs, inputs, None)
    assert torch.isfinite(total)
    _assert_close(gradient, -inputs["advantages"])  # s = 1: inside the clip, plain REINFORCE


# -- stable_reinforce: this server's objective (README, "stable_reinforce") ---------------------------------


def reference_stable_reinforce(logp, recorded, advantages, sampled, kl_coeff, cap):
    """Value and gradient of the README's formula, written out by hand on the sampled positions."""
    on = sampled != 0
    ratio = torch.exp(logp - recorded)
    weight = torch.clip(ratio, max=cap)
    value = (-(weight * advantages * logp) + 0.5 * kl_coeff * (logp - recorded) ** 2)[on].sum()
    gradient = torch.where(on, -weight * advantages + kl_coeff * (logp - recorded), 0.0)
    return value, gradient


def _stable_reinforce_inputs(seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logprobs, inputs = _policy_inputs(seed)  # log-ratios from -3 to 3: some ratios far over the cap
    sampled_N = torch.ones(N)
    sampled_N[:10] = 0
    advantages_N = inputs["advantages"] * sampled_N
    # The client's logprobs are rounded like a float16 copy: the loss must use the recorded ones.
    return logprobs, {"logprobs": inputs["logprobs"].half().float(), "advantages": advantages_N,
                      RECORDED_LOGPROBS: inputs["logprobs"] * sampled_N, SAMPLED_MASK: sampled_N}


@pytest.mark.parametrize(("config", "kl_coeff", "cap"),
                         [(None, 0.05, 2.0), ({"kl_coeff": 0.5, "ratio_cap": 1.5}, 0.5, 1.5)],
                         ids=["defaults", "overridden"])
def test_stable_reinforce_value_and_gradient_match_the_documented_formula(config, kl_coeff, cap):
    logprobs, inputs = _stable_reinforce_inputs(20)
    total, elementwise, gradient = _value_and_gradient("stable_reinforce", logprobs, inputs, config)
    expected_total, expected_gradient = reference_stable_reinforce(
        logprobs, inputs[RECORDED_LOGPROBS], inputs["advantages"], inputs[SAMPLED_MASK], kl_coeff, cap)
    _assert_close(total, expected_total)
    _assert_close(gradient, expected_gradient)
    assert (elementwise[:10] == 0).all() and (gradient[:10] == 0).all()
    spec, resolved = resolve_loss("stable_reinforce", config)
    metrics = spec.metrics(logprobs, inputs, resolved)
    ratio = torch.exp(logprobs - inputs[RECORDED_LOGPROBS])[10:]
    assert metrics["sampled_tokens:sum"] == N - 10
    assert metrics["importance_ratio_capped:sum"] == float((ratio > cap).sum()) > 0
    assert metrics["importance_ratio:max"] == pytest.approx(float(ratio.max()), rel=1e-5)
    assert metrics["importance_weight:mean"] == pytest.approx(float(ratio.clip(max=cap).mean()), rel=1e-5)
    assert metrics["sampler_logprobs_mismatched:sum"] > 0


def test_stable_reinforce_on_policy_is_plain_reinforce_and_ignores_minus_infinity_off_the_sampled_tokens():
    logprobs, inputs = _stable_reinforce_inputs(21)
    inputs[RECORDED_LOGPROBS] = torch.where(inputs[SAMPLED_MASK] != 0, logprobs, 0.0)
    logprobs = logprobs.clone()
    logprobs[0] = -math.inf
    total, _, gradient = _value_and_gradient("stable_reinforce", logprobs, inputs, None)
    assert torch.isfinite(total) and torch.isfinite(gradient).all()
    _assert_close(gradient, -inputs["advantages"])
