"""Tinker's loss functions on one datum's target logprobs: token sums, no normalisation.

Each loss maps a datum's target logprobs, loss_fn_inputs and loss_fn_config to a per-token loss whose
sum is the datum's `loss:sum` (see `LossSpec`). Knows nothing about models or the wire;
stable_reinforce's recorded inputs are put on each datum by the provenance check before the loss runs.

Shapes: N = positions of a datum (of a micro-batch in MicrobatchLoss), K = targets per position.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from server.errors import InvalidRequest
from server.rendering.provenance import RECORDED_LOGPROBS, SAMPLED_MASK

LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], dict[str, float]], torch.Tensor]
MetricsFn = Callable[[torch.Tensor, dict[str, torch.Tensor], dict[str, float]], dict[str, float]]


@dataclass(frozen=True)
class LossSpec:
    """One loss. `fn` takes the current policy's logprobs of the targets (`logprobs_N`, or `logprobs_NK` for
    top-K cross-entropy), the datum's loss_fn_inputs and the loss_fn_config, and returns the per-token loss
    (same shape) whose sum is the datum's contribution to `loss:sum`."""

    fn: LossFn
    inputs: tuple[str, ...]
    """loss_fn_inputs every datum must carry besides target_tokens."""
    config_defaults: dict[str, float]
    """The loss_fn_config keys this loss understands, with their defaults."""
    optional_inputs: tuple[str, ...] = ()
    """loss_fn_inputs used when a datum carries them."""
    metrics: MetricsFn | None = None
    """Per-datum metrics, "name:reduction" with reduction sum, max or mean (over datums)."""
    needs_provenance: bool = False
    """Datums must carry provenance spans, checked against the recorded samples (stable_reinforce)."""
    elementwise: bool = True
    """A position's loss depends on its own logprob alone (given the inputs), so its gradient does too."""


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


# -- gspo: GSPO-token (Zheng et al. 2025, arXiv 2507.18071 eqs. 14-15), as Tinker documents it -----------


def _sequence_log_ratio(logprobs_N: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """log s: the unweighted mean of sg(logp) - q over the datum's masked positions (0 if there are none).

    The mask is sequence_ratio_mask != 0; a datum without one (the cookbook's rl/train.py never sends
    it) uses its positions with a nonzero advantage, which are the sampled tokens.
    """
    mask = inputs.get("sequence_ratio_mask")
    mask_N = (mask if mask is not None else inputs["advantages"]) != 0
    log_ratio_N = torch.where(mask_N, logprobs_N.detach() - inputs["logprobs"], 0.0)
    # No division by zero and no host sync: an empty mask gives 0 / 1.
    return log_ratio_N.sum() / mask_N.sum().clamp(min=1)


def gspo(logprobs_N: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> torch.Tensor:
    # One ratio per datum: every position's ratio has the value s and the gradient s * grad(logp).
    ratio_N = torch.exp(_sequence_log_ratio(logprobs_N, inputs) + logprobs_N - logprobs_N.detach())
    advantages_N = inputs["advantages"]
    clipped_N = ratio_N.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio_N * advantages_N, clipped_N * advantages_N)


def gspo_metrics(logprobs_N: torch.Tensor, inputs: dict[str, torch.Tensor],
                 config: dict[str, float]) -> dict[str, float]:
    ratio = float(torch.exp(_sequence_log_ratio(logprobs_N, inputs)))
    return {"sequence_ratio:mean": ratio, "sequence_ratio:max": ratio,
            "sequence_ratio_mask_missing:sum": float("sequence_ratio_mask" not in inputs)}


# -- stable_reinforce: this server's own objective (the hosted one is not public; see the README) ----------


def stable_reinforce(logprobs_N: torch.Tensor, inputs: dict[str, torch.Tensor],
                     config: dict[str, float]) -> torch.Tensor:
    """Truncated-importance-weighted REINFORCE on the sampled tokens, plus a quadratic pull toward the sampler.

    loss_t = -sg(min(exp(logp_t - q*_t), C)) * A_t * logp_t + kl_coeff / 2 * (logp_t - q*_t)^2 on sampled
    tokens (0 elsewhere), where q* is the sampler's logprob as recorded when the token was sampled.
    """
    sampled_N = inputs[SAMPLED_MASK] != 0
    # where(), not a product with the mask: a -inf logprob off the sampled tokens must not become NaN.
    log_ratio_N = torch.where(sampled_N, logprobs_N - inputs[RECORDED_LOGPROBS], 0.0)
    weight_N = torch.exp(log_ratio_N.detach()).clamp(max=config["ratio_cap"])
    policy_N = torch.where(sampled_N, -weight_N * inputs["advantages"] * logprobs_N, 0.0)
    return policy_N + 0.5 * config["kl_coeff"] * log_ratio_N ** 2


def stable_reinforce_metrics(logprobs_N: torch.Tensor, inputs: dict[str, torch.Tensor],
                             config: dict[str, float]) -> dict[str, float]:
    sampled_N = inputs[SAMPLED_MASK] != 0
    ratio_S = torch.exp(logprobs_N[sampled_N] - inputs[RECORDED_LOGPROBS][sampled_N])
    # The client's copy of the sampler logprobs should be the recorded one; count where it is not.
    mismatched = (inputs["logprobs"][sampled_N] - inputs[RECORDED_LOGPROBS][sampled_N]).abs() > 1e-4
    return {"importance_weight:mean": float(ratio_S.clamp(max=config["ratio_cap"]).mean()) if ratio_S.numel() else 1.0,
            "importance_ratio:max": float(ratio_S.max()) if ratio_S.numel() else 1.0,
            "importance_ratio_capped:sum": float((ratio_S > config["ratio_cap"]).sum()),
            "sampled_tokens:sum": float(ratio_S.numel()),
            "sampler_logprobs_mismatched:sum": float(mismatched.sum())}


_POLICY_INPUTS = ("logprobs", "advantages")
LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, ("weights",), {}),
    "importance_sampling": LossSpec(importance_sampling, _POLICY_INPUTS, {}),
    "ppo": LossSpec(ppo, _POLICY_INPUTS, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": LossSpec(cispo, _POLICY_INPUTS, {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    "dro": LossSpec(dro, _POLICY_INPUTS, {"beta": 0.05}),
    # The clip defaults are not documented by Tinker; PPO's, under the same keys.
    "gspo": LossSpec(gspo, _POLICY_INPUTS, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
                     optional_inputs=("sequence_ratio_mask",), metrics=gspo_metrics, elementwise=False),
    "stable_reinforce": LossSpec(stable_reinforce, _POLICY_INPUTS, {"kl_coeff": 0.05, "ratio_cap": 2.0},
                                 metrics=stable_reinforce_metrics, needs_provenance=True),
}


@dataclass
class DatumLoss:
    """One datum of a micro-batch: its positions start:stop among the micro-batch's, and its loss."""

    spec: LossSpec
    config: dict[str, float]
    inputs: dict[str, torch.Tensor]
    """loss_fn_inputs on the training device, target_tokens included."""
    start: int
    stop: int

    def logprobs(self, logprobs_NK: torch.Tensor, first: int = 0) -> torch.Tensor:
        """This datum's view of [positions, K] logprobs starting at position `first`: [N] or [N, K] like its targets."""
        targets = self.inputs["target_tokens"]
        rows = slice(self.start - first, self.stop - first)
        return logprobs_NK[rows, :targets.shape[1]] if targets.dim() == 2 else logprobs_NK[rows, 0]


class MicrobatchLoss:
    """The losses of a micro-batch's datums, laid end to end over its N positions, so that the fused
    unembedding can ask for the gradient chunk by chunk; keeps every position's logprob and loss for the
    outputs (the ChunkLoss of training/forward.py)."""

    def __init__(self, datums: list[DatumLoss], logprobs_shape: tuple[int, int], device: torch.device):
        self.datums = datums
        self.elementwise = all(datum.spec.elementwise for datum in datums)
        self.logprobs_NK = torch.zeros(logprobs_shape, dtype=torch.float32, device=device)
        self.elementwise_NK = torch.zeros(logprobs_shape, dtype=torch.float32, device=device)
        self._grad_NK: torch.Tensor | None = None

    def evaluate(self, logprobs_NK: torch.Tensor) -> None:
        """Every datum's loss from all its logprobs, with no gradient (forward only)."""
        self.logprobs_NK.copy_(logprobs_NK)
        for datum in self.datums:
            datum.logprobs(self.elementwise_NK).copy_(datum.spec.fn(datum.logprobs(logprobs_NK), datum.inputs,
                                                                    datum.config))

    def prepare(self, logprobs_NK: torch.Tensor) -> None:
        self.logprobs_NK.copy_(logprobs_NK)
        self._grad_NK = torch.zeros_like(logprobs_NK)
        for datum in self.datums:
            self._differentiate(datum, datum.start, datum.stop, logprobs_NK, self._grad_NK, 0)

    def gradient(self, logprobs_CK: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        if self._grad_NK is not None:
            return self._grad_NK[start:stop]
        self.logprobs_NK[start:stop] = logprobs_CK
        grad_CK = torch.zeros_like(logprobs_CK)
        for datum in self.datums:
            if datum.start < stop and start < datum.stop:
                self._differentiate(datum, max(start, datum.start), min(stop, datum.stop), logprobs_CK, grad_CK,
                                    start)
        return grad_CK

    def total(self) -> torch.Tensor:
        return self.elementwise_NK.sum()

    def _differentiate(self, datum: DatumLoss, start: int, stop: int, logprobs_CK: torch.Tensor,
                       grad_CK: torch.Tensor, first: int) -> None:
        """The loss and its gradient at the datum's positions start:stop (of logprobs_CK, which begin at `first`)."""
        assert datum.spec.elementwise or (start, stop) == (datum.start, datum.stop)
        part = DatumLoss(datum.spec, datum.config, {name: t[start - datum.start:stop - datum.start]
                                                    for name, t in datum.inputs.items()}, start, stop)
        logprobs = part.logprobs(logprobs_CK, first).detach().requires_grad_()
        with torch.enable_grad():
            elementwise = datum.spec.fn(logprobs, part.inputs, datum.config)
            (grad,) = torch.autograd.grad(elementwise.sum(), logprobs, materialize_grads=True)
        part.logprobs(self.elementwise_NK).copy_(elementwise.detach())
        part.logprobs(grad_CK, first).copy_(grad)

    def datum_outputs(self) -> list[tuple[dict[str, torch.Tensor], dict[str, float]]]:
        """Per datum, its logprobs and elementwise loss (host tensors) and its metrics (if the loss has any)."""
        logprobs_NK, elementwise_NK = self.logprobs_NK.cpu(), self.elementwise_NK.cpu()
        results = []
        for datum in self.datums:
            metrics = {}
            if datum.spec.metrics is not None:
                metrics = datum.spec.metrics(datum.logprobs(self.logprobs_NK), datum.inputs, datum.config)
            results.append(({"logprobs": datum.logprobs(logprobs_NK),
                             "elementwise_loss": datum.logprobs(elementwise_NK)}, metrics))
        return results


def combine_metrics(per_datum: list[dict[str, float]]) -> dict[str, float]:
    """One request's metrics from its datums' (the same keys each), by each key's reduction."""
    combined = {}
    for key in per_datum[0] if per_datum else ():
        values = [metrics[key] for metrics in per_datum]
        reduction = key.split(":")[1]
        combined[key] = {"sum": sum, "max": max, "mean": lambda v: sum(v) / len(v)}[reduction](values)
    return combined


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
