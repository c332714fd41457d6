"""The training forward as one module: token ids -> log-probabilities of the target tokens.

Logprobs are of the distribution the samplers sample from: media placeholders get zero
probability (server/models/logprobs.py). Embedding, decoder, final norm and the unembedding all
run inside `TargetLogprobs.forward`, so that
as FSDP's root its hooks gather the root-level weights for every piece of it, backward included.
Full-vocabulary logits exist for at most `chunk_size` positions at a time: under autograd each
chunk is checkpointed, so only hidden states are kept for backward.

Shapes: B = rows, T = padded length, D = hidden size, N = real (unpadded) positions of all rows,
K = targets per position, V = vocabulary.
"""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from server.models.logprobs import refused_ids_tensor, target_logprobs


class TargetLogprobs(nn.Module):
    def __init__(self, model: nn.Module, chunk_size: int, compile: bool = False,
                 refused_token_ids: frozenset[int] = frozenset()):
        super().__init__()
        self.model = model
        """The HF *ForCausalLM / *ForConditionalGeneration model (with LoRA wrappers)."""
        self.chunk_size = chunk_size
        self.refused_M = refused_ids_tensor(refused_token_ids, next(model.parameters()).device)
        if compile:
            # One fused pass for the unembedding's fp32 cast, log-softmax and gather, instead of several
            # over [chunk, vocabulary] floats.
            self._chunk_logprobs = torch.compile(self._chunk_logprobs)

    def forward(self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, targets_NK: torch.Tensor,
                position_ids: torch.Tensor | None = None, mm_encoder_outputs: dict | None = None) -> torch.Tensor:
        """log p(target) [N, K] at every real position, rows in order, each row's positions in order."""
        vision = {} if mm_encoder_outputs is None else {"mm_encoder_outputs": mm_encoder_outputs}
        hidden_BTD = self.model.model(input_ids=input_ids_BT, attention_mask=attention_mask_BT,
                                      position_ids=position_ids, use_cache=False, **vision).last_hidden_state
        hidden_ND = hidden_BTD[attention_mask_BT.bool()]
        pieces = []
        for start in range(0, hidden_ND.shape[0], self.chunk_size):
            stop = start + self.chunk_size
            if torch.is_grad_enabled():
                pieces.append(checkpoint(self._chunk_logprobs, hidden_ND[start:stop], targets_NK[start:stop],
                                         use_reentrant=False))
            else:
                pieces.append(self._chunk_logprobs(hidden_ND[start:stop], targets_NK[start:stop]))
        return torch.cat(pieces)

    def _chunk_logprobs(self, hidden_CD: torch.Tensor, targets_CK: torch.Tensor) -> torch.Tensor:
        return target_logprobs(self.model.lm_head(hidden_CD), targets_CK, self.refused_M)
