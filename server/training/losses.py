"""Tinker's loss functions on one datum's target logprobs: token sums, no normalisation.

Each loss takes the current policy's logprobs of the targets (`logprobs_N`, or `logprobs_NK` for
top-K cross-entropy), the datum's loss_fn_inputs and the loss_fn_config, and returns the per-token
loss (`elementwise`, same shape) whose sum is the datum's contribution to `loss:sum`.
Knows nothing about models, batching or the wire.

Shapes: N = positions of the datum, K = targets per position.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from server.errors import InvalidRequest

LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], dict[str, float]], torch.Tensor]


@dataclass(frozen=True)
class LossSpec:
    fn: LossFn
    inputs: tuple[str, ...]
    """loss_fn_inputs every datum must carry besides target_tokens."""
    config_defaults: dict[str, float]
    """The loss_fn_config keys this loss understands, with their defaults."""


def cross_entropy(logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> torch.Tensor:
    return -logprobs * inputs["weights"]


def importance_sampling(logprobs_N: torch.Tensor, inputs: dict[str, torch.Tensor],
                        config: dict[str, float]) -> torch.Tensor:
    ratio_N = torch.exp(logprobs_N - inputs["logprobs"])
    return -ratio_N * inputs["advantages"]


def ppo(logprobs_N: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> torch.Tensor:
    advantages_N = inputs["advantages"]
    ratio_N = torch.exp(logprobs_N - inputs["logprobs"])
    clipped_N = ratio_N.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio_N * advantages_N, clipped_N * advantages_N)


def cispo(logprobs_N: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> torch.Tensor:
    ratio_N = torch.exp(logprobs_N - inputs["logprobs"])
    # The clipped ratio is a constant weight (stop-gradient); the gradient flows through logprobs only.
    weight_N = ratio_N.clamp(config["clip_low_threshold"], config["clip_high_threshold"]).detach()
    return -weight_N * logprobs_N * inputs["advantages"]


def dro(logprobs_N: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> torch.Tensor:
    penalty_N = 0.5 * config["beta"] * (logprobs_N - inputs["logprobs"]) ** 2
    return -(logprobs_N * inputs["advantages"] - penalty_N)


_POLICY_INPUTS = ("logprobs", "advantages")
LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, ("weights",), {}),
    "importance_sampling": LossSpec(importance_sampling, _POLICY_INPUTS, {}),
    "ppo": LossSpec(ppo, _POLICY_INPUTS, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": LossSpec(cispo, _POLICY_INPUTS, {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    "dro": LossSpec(dro, _POLICY_INPUTS, {"beta": 0.05}),
}


def resolve_loss(loss_fn: str, loss_fn_config: dict[str, float | str] | None) -> tuple[LossSpec, dict[str, float]]:
    """Look up a loss and merge the client's config over its defaults; unknown names or keys are 400s."""
    spec = LOSSES.get(loss_fn)
    if spec is None:
        raise InvalidRequest(f"unsupported loss_fn {loss_fn!r}; supported: {sorted(LOSSES)}")
    config = dict(spec.config_defaults)
    for key, value in (loss_fn_config or {}).items():
        if key not in spec.config_defaults:
            allowed = sorted(spec.config_defaults) or "none"
            raise InvalidRequest(f"loss_fn_config key {key!r} is not understood by {loss_fn} (allowed: {allowed})")
        if not isinstance(value, (int, float)):
            raise InvalidRequest(f"loss_fn_config[{key!r}] must be a number, got {value!r}")
        config[key] = float(value)
    return spec, config
