"""The training forward as one module: token ids -> log-probabilities of the target tokens, and the
loss through a fused unembedding that never keeps full-vocabulary logits for backward. Logprobs are of
the distribution the samplers sample from (media placeholders get zero probability). Knows nothing
about the wire, the optimizer or how ranks share the work.

Shapes: B = rows, T = padded length, D = hidden size, N = real (unpadded) positions of all rows,
C = positions of a chunk, K = targets per position, V = vocabulary, J = LoRA columns.
"""

from typing import Protocol

import torch
from torch import nn

from server.models.logprobs import mask_refused, refused_ids_tensor, zero_refused_targets


class ChunkLoss(Protocol):
    """The loss of a micro-batch's positions, as the fused unembedding asks for it (training/losses.py)."""

    elementwise: bool
    """Each position's gradient follows from its own logprob (and inputs): chunks can be done one by one."""

    def prepare(self, logprobs_NK: torch.Tensor) -> None:
        """Take all the logprobs at once (a loss that is not elementwise), before `gradient` is asked."""

    def gradient(self, logprobs_CK: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """dLoss/dlogprob [C, K] for positions start:stop, given their logprobs (kept for the outputs)."""

    def total(self) -> torch.Tensor:
        """The summed loss (fp32 scalar), once every chunk was seen."""


def _chunk_logprobs(logits_CV: torch.Tensor, targets_CK: torch.Tensor,
                    refused_M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 log p(target) [C, K] and the log-normaliser [C] of the renormalised distribution."""
    logits_CV = mask_refused(logits_CV.float(), refused_M)
    normaliser_C = torch.logsumexp(logits_CV, dim=-1)
    logprobs_CK = logits_CV.gather(-1, targets_CK) - normaliser_C[:, None]
    return zero_refused_targets(logprobs_CK, targets_CK, refused_M), normaliser_C


def _chunk_logits_grad(logits_CV: torch.Tensor, normaliser_C: torch.Tensor, targets_CK: torch.Tensor,
                       grad_CK: torch.Tensor, refused_M: torch.Tensor) -> torch.Tensor:
    """d/dlogits of sum(grad * log p(target)), in the logits' dtype: grad at the targets minus p times its sum."""
    probs_CV = torch.exp(mask_refused(logits_CV.float(), refused_M) - normaliser_C[:, None])
    grad_CK = zero_refused_targets(grad_CK, targets_CK, refused_M)  # a refused target's logprob is a constant 0
    grad_logits_CV = probs_CV * -grad_CK.sum(-1, keepdim=True)
    # The targets' terms by comparison, not by a scatter: compiled, the whole function is then one pass
    # over the chunk (a scatter needs the chunk's fp32 gradient written out first, then cast).
    vocab_V = torch.arange(logits_CV.shape[-1], device=logits_CV.device)
    for k in range(targets_CK.shape[1]):
        grad_logits_CV = grad_logits_CV + torch.where(vocab_V == targets_CK[:, k, None], grad_CK[:, k, None], 0.0)
    return grad_logits_CV.to(logits_CV.dtype)


class TargetLogprobs(nn.Module):
    """Token ids -> target logprobs (and the loss), media placeholders at zero probability
    (server/models/logprobs.py).

    Embedding, decoder, final norm and the unembedding all run inside `forward`, so that as FSDP's root
    its hooks gather the root-level weights for every piece of it. Full-vocabulary logits exist for at
    most `chunk_size` positions at a time, and are never kept for backward: when the loss's gradient with
    respect to each target logprob can be had chunk by chunk (every loss that is elementwise in it), the
    unembedding's whole backward (to the hidden states and to lm_head's LoRA) is computed in the forward,
    right after the chunk's logits, so the vocabulary-wide matmul runs twice instead of three times
    (forward, recompute, backward). Otherwise (gspo's per-datum ratio) the logprobs come first, then one
    more pass.

    The unembedding's LoRA (one adapter, or one per row of a multi-run pass) is applied here, from what
    lm_head's wrapper holds; the decoder's LoRA is the wrappers' own business (lora/layers.py).
    """

    def __init__(self, model: nn.Module, chunk_size: int, compile: bool = False,
                 refused_token_ids: frozenset[int] = frozenset()):
        super().__init__()
        self.model = model
        """The HF *ForCausalLM / *ForConditionalGeneration model (with LoRA wrappers)."""
        self.chunk_size = chunk_size
        self.refused_M = refused_ids_tensor(refused_token_ids, next(model.parameters()).device)
        self._chunk_logprobs, self._chunk_logits_grad = _chunk_logprobs, _chunk_logits_grad
        if compile:
            # One fused pass each over [chunk, vocabulary] floats, instead of one per element-wise op.
            self._chunk_logprobs = torch.compile(_chunk_logprobs)
            self._chunk_logits_grad = torch.compile(_chunk_logits_grad)

    def forward(self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None,
                real_positions_N: torch.Tensor, targets_NK: torch.Tensor, position_ids: torch.Tensor | None = None,
                loss: ChunkLoss | None = None, **model_kwargs) -> torch.Tensor:
        """Without `loss`: log p(target) [N, K] at every real position (rows in order, each row's positions
        in order; `real_positions_N` indexes them in the flattened [B*T]), with no gradient through the
        unembedding. With `loss`: the summed loss, whose backward reaches the decoder and every LoRA.
        `model_kwargs` go to the HF model (cached image features, a packed row's segment_lengths)."""
        hidden_BTD = self.model.model(input_ids=input_ids_BT, attention_mask=attention_mask_BT,
                                      position_ids=position_ids, use_cache=False, **model_kwargs).last_hidden_state
        # An index computed on the host, not a boolean mask: no device sync in the middle of the step.
        hidden_ND = hidden_BTD.flatten(0, 1).index_select(0, real_positions_N)
        lm_head = self.model.lm_head
        delta = lm_head.active_delta(hidden_ND.dtype)
        lora_A_JD = lora_B_VJ = scale_NJ = None
        if delta is not None:
            lora_A_JD, lora_B_VJ, row_scale_BJ = delta
            if row_scale_BJ is not None:  # a scale per row, or per position (a packed row of several runs)
                scale_NJ = row_scale_BJ[real_positions_N // (input_ids_BT.numel() // row_scale_BJ.shape[0])]
        weight_VD = lm_head.base.weight
        if loss is None:
            with torch.no_grad():
                return self._logprobs(hidden_ND, weight_VD, lora_A_JD, lora_B_VJ, scale_NJ, targets_NK)
        return _FusedUnembedding.apply(hidden_ND, weight_VD, lora_A_JD, lora_B_VJ, scale_NJ, targets_NK, self, loss)

    def _logits(self, hidden_CD, weight_VD, lora_A_JD, lora_B_VJ, scale_CJ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A chunk's logits [C, V] in the activations' dtype, and its LoRA intermediate [C, J] (None without)."""
        logits_CV = hidden_CD @ weight_VD.T
        if lora_A_JD is None:
            return logits_CV, None
        mid_CJ = hidden_CD @ lora_A_JD.T
        if scale_CJ is not None:
            mid_CJ = mid_CJ * scale_CJ
        return logits_CV.addmm_(mid_CJ, lora_B_VJ.T), mid_CJ

    def _logprobs(self, hidden_ND, weight_VD, lora_A_JD, lora_B_VJ, scale_NJ, targets_NK) -> torch.Tensor:
        pieces = []
        for start in range(0, hidden_ND.shape[0], self.chunk_size):
            chunk = slice(start, start + self.chunk_size)
            logits_CV, _ = self._logits(hidden_ND[chunk], weight_VD, lora_A_JD, lora_B_VJ,
                                        None if scale_NJ is None else scale_NJ[chunk])
            pieces.append(self._chunk_logprobs(logits_CV, targets_NK[chunk], self.refused_M)[0])
        return torch.cat(pieces)

    def _loss_and_gradients(self, hidden_ND, weight_VD, lora_A_JD, lora_B_VJ, scale_NJ, targets_NK,
                            loss: ChunkLoss):
        """The loss, and its gradient with respect to the hidden states and lm_head's LoRA factors."""
        if not loss.elementwise:
            loss.prepare(self._logprobs(hidden_ND, weight_VD, lora_A_JD, lora_B_VJ, scale_NJ, targets_NK))
        grad_hidden_ND = torch.empty_like(hidden_ND)
        # Summed over the chunks in fp32: lm_head's B is the vocabulary wide.
        grad_A_JD = None if lora_A_JD is None else torch.zeros(lora_A_JD.shape, dtype=torch.float32,
                                                               device=lora_A_JD.device)
        grad_B_VJ = None if lora_B_VJ is None else torch.zeros(lora_B_VJ.shape, dtype=torch.float32,
                                                               device=lora_B_VJ.device)
        for start in range(0, hidden_ND.shape[0], self.chunk_size):
            stop = min(start + self.chunk_size, hidden_ND.shape[0])
            hidden_CD, scale_CJ = hidden_ND[start:stop], None if scale_NJ is None else scale_NJ[start:stop]
            logits_CV, mid_CJ = self._logits(hidden_CD, weight_VD, lora_A_JD, lora_B_VJ, scale_CJ)
            logprobs_CK, normaliser_C = self._chunk_logprobs(logits_CV, targets_NK[start:stop], self.refused_M)
            grad_CK = loss.gradient(logprobs_CK, start, stop)
            grad_logits_CV = self._chunk_logits_grad(logits_CV, normaliser_C, targets_NK[start:stop], grad_CK,
                                                     self.refused_M)
            del logits_CV
            torch.mm(grad_logits_CV, weight_VD, out=grad_hidden_ND[start:stop])
            if lora_A_JD is not None:
                grad_mid_CJ = grad_logits_CV @ lora_B_VJ
                if scale_CJ is not None:
                    grad_mid_CJ = grad_mid_CJ * scale_CJ
                grad_hidden_ND[start:stop].addmm_(grad_mid_CJ, lora_A_JD)
                grad_B_VJ += (grad_logits_CV.T @ mid_CJ).float()
                grad_A_JD += (grad_mid_CJ.T @ hidden_CD).float()
        return loss.total(), grad_hidden_ND, grad_A_JD, grad_B_VJ


class _FusedUnembedding(torch.autograd.Function):
    """The unembedding and the loss as one autograd node: its backward only scales what forward found."""

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, lora_A_JD, lora_B_VJ, scale_NJ, targets_NK, module: TargetLogprobs,
                loss: ChunkLoss):
        total, grad_hidden_ND, grad_A_JD, grad_B_VJ = module._loss_and_gradients(
            hidden_ND, weight_VD, lora_A_JD, lora_B_VJ, scale_NJ, targets_NK, loss)
        ctx.save_for_backward(grad_hidden_ND, grad_A_JD, grad_B_VJ)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden_ND, grad_A_JD, grad_B_VJ = ctx.saved_tensors
        dtype = grad_hidden_ND.dtype  # the LoRA factors came in the activations' dtype too
        scale = grad_total.to(dtype)
        return (grad_hidden_ND * scale, None, None if grad_A_JD is None else (grad_A_JD * grad_total).to(dtype),
                None if grad_B_VJ is None else (grad_B_VJ * grad_total).to(dtype), None, None, None, None)
