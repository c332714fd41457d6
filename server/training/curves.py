"""What a run's curves record for a forward_backward besides its own metrics: the sampler/trainer KL.

For policy losses the datums carry the sampler's logprob of each sampled token; the trainer has
just computed its own. Their gap is the cookbook's `kl_sample_train` (v1: mean of sampler minus
trainer logprob; v2: half the mean squared difference) over the sampled tokens, here per request.
Returned as extra curve points only: the response's metrics stay what Tinker returns.
"""

import numpy as np
import torch

from server.rendering.provenance import RECORDED_LOGPROBS, SAMPLED_MASK
from server.rendering.training import TrainingExample


def curve_metrics(examples: list[TrainingExample], outputs: list[dict[str, np.ndarray]],
                  metrics: dict[str, float]) -> dict[str, float]:
    """The request's metrics, plus kl_sample_train_v1/v2 when its datums carry sampler logprobs."""
    differences = []
    for example, output in zip(examples, outputs):
        inputs = example.loss_fn_inputs
        sampler = inputs.get(RECORDED_LOGPROBS, inputs.get("logprobs"))
        if sampler is None or sampler.dim() != 1:
            continue
        # Sampled tokens: as recorded (stable_reinforce), else where the client put a sampler logprob
        # (prompt and observation positions carry 0).
        sampled = inputs[SAMPLED_MASK] != 0 if SAMPLED_MASK in inputs else sampler != 0
        trainer = torch.from_numpy(np.asarray(output["logprobs"], dtype=np.float32))
        differences.append((sampler.float() - trainer)[sampled])
    if not differences or not sum(d.numel() for d in differences):
        return metrics
    gap = torch.cat(differences).double()
    return {**metrics, "kl_sample_train_v1:mean": float(gap.mean()),
            "kl_sample_train_v2:mean": float(0.5 * (gap ** 2).mean())}
