"""The training backend: per-run LoRA adapters and AdamW state over one shared, frozen base model.

Runs forward/forward_backward with Tinker's token-sum losses, accumulates gradients across calls
until optim_step, and saves/loads checkpoints. Called from the scheduler's single training thread,
in each run's seq_id order; it knows nothing about HTTP, futures or the database.

Shapes: B = datums in a micro-batch, T = padded length, D = hidden size, N = a datum's positions,
K = targets per position.
"""

import logging
import random
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from server.config import TrainerConfig
from server.errors import InvalidRequest, NotFound
from server.models.loading import LoadedModel
from server.models.vision_features import VisionEncoder
from server.rendering.training import TrainingExample
from server.training import checkpoint_io
from server.training.lora import LoraAdapter, LoraTarget, apply_lora_wrappers, select_targets, use_adapter
from server.training.losses import resolve_loss
from server.wire.types import AdamParams, LoraConfig

logger = logging.getLogger(__name__)


@dataclass
class TrainableModel:
    """One training run's mutable state."""

    model_id: str
    lora_config: LoraConfig
    adapter: LoraAdapter
    optimizer: torch.optim.AdamW
    num_steps: int = 0


@dataclass
class ForwardBackwardResult:
    outputs: list[dict[str, np.ndarray]]
    """Per datum: logprobs and elementwise_loss, shaped like target_tokens."""
    metrics: dict[str, float]


def _new_optimizer(adapter: LoraAdapter) -> torch.optim.AdamW:
    # Hyperparameters are set from AdamParams on every optim_step; these are placeholders.
    return torch.optim.AdamW(adapter.parameters(), lr=0.0, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)


class Trainer:
    def __init__(self, base: LoadedModel, config: TrainerConfig, vision: VisionEncoder | None = None):
        self.base = base
        self.config = config
        self.vision = vision
        self.device = next(base.model.parameters()).device
        self.targets: list[LoraTarget] = apply_lora_wrappers(base.model, base.family)
        self.models: dict[str, TrainableModel] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    def create_model(self, model_id: str, lora_config: LoraConfig) -> None:
        """Start a run with a freshly initialised adapter."""
        targets = select_targets(self.targets, train_attn=lora_config.train_attn, train_mlp=lora_config.train_mlp,
                                 train_unembed=lora_config.train_unembed)
        if not targets:
            raise InvalidRequest("the LoraConfig's train_* flags select no layer of this model")
        seed = lora_config.seed if lora_config.seed is not None else random.randrange(2**31)
        adapter = LoraAdapter.initialize(targets, lora_config.rank, self.config.lora_alpha, seed, self.device)
        self.models[model_id] = TrainableModel(model_id, lora_config, adapter, _new_optimizer(adapter))

    def get(self, model_id: str) -> TrainableModel:
        model = self.models.get(model_id)
        if model is None:
            raise NotFound(f"model {model_id} is not loaded on this server (after a restart, "
                           f"create it again from a checkpoint with create_training_client_from_state)")
        return model

    def unload(self, model_id: str) -> None:
        self.models.pop(model_id, None)

    # -- forward / backward --------------------------------------------------------------------

    def forward_backward(self, model_id: str, examples: list[TrainingExample], loss_fn: str,
                         loss_fn_config: dict[str, float | str] | None, forward_only: bool) -> ForwardBackwardResult:
        """Run the loss on every datum; unless forward_only, add its gradient to the run's accumulators."""
        run = self.get(model_id)
        spec, config = resolve_loss(loss_fn, loss_fn_config)
        # The renderer has validated every input against the datum's length and the vocabulary.
        inputs = [{name: t.to(self.device) for name, t in example.loss_fn_inputs.items()} for example in examples]
        outputs: list[dict[str, np.ndarray]] = []
        total_loss = 0.0
        with use_adapter(run.adapter), torch.set_grad_enabled(not forward_only):
            for batch in self._microbatches(examples):
                hidden_BTD = self._hidden_states([examples[i] for i in batch])
                batch_loss = hidden_BTD.new_zeros((), dtype=torch.float32)
                for row, index in enumerate(batch):
                    datum_inputs = inputs[index]
                    num_positions = len(examples[index].input_ids)
                    logprobs = self._target_logprobs(hidden_BTD[row, :num_positions], datum_inputs["target_tokens"],
                                                     run.adapter)
                    elementwise = spec.fn(logprobs, datum_inputs, config)
                    batch_loss = batch_loss + elementwise.sum()
                    outputs.append({"logprobs": logprobs.detach().float().cpu().numpy(),
                                    "elementwise_loss": elementwise.detach().float().cpu().numpy()})
                if not forward_only:
                    batch_loss.backward()
                total_loss += float(batch_loss.detach())
        return ForwardBackwardResult(outputs=outputs, metrics={"loss:sum": total_loss})

    def _microbatches(self, examples: list[TrainingExample]) -> list[list[int]]:
        """Consecutive datums grouped so padded tokens per micro-batch stay under the budget."""
        batches: list[list[int]] = []
        longest = 0
        for index, example in enumerate(examples):
            length = len(example.input_ids)
            if batches and max(longest, length) * (len(batches[-1]) + 1) <= self.config.max_tokens_per_microbatch:
                batches[-1].append(index)
                longest = max(longest, length)
            else:
                batches.append([index])
                longest = length
        return batches

    def _hidden_states(self, examples: list[TrainingExample]) -> torch.Tensor:
        """Final hidden states [B, T, D] of right-padded datums (padding never affects earlier positions)."""
        longest = max(len(e.input_ids) for e in examples)
        input_ids_BT = torch.zeros(len(examples), longest, dtype=torch.long)
        attention_mask_BT = torch.zeros(len(examples), longest, dtype=torch.long)
        for row, example in enumerate(examples):
            input_ids_BT[row, :len(example.input_ids)] = torch.tensor(example.input_ids)
            attention_mask_BT[row, :len(example.input_ids)] = 1
        vision_kwargs = {}
        images = [image for example in examples for image in example.images]
        if images:
            # Image features come from the cache (the vision tower is frozen); every row gets explicit
            # multimodal rope positions, text-only rows the plain ones on all three axes.
            vision_kwargs["mm_encoder_outputs"] = self.vision.encoder_outputs(images)
            position_ids_3BT = torch.zeros(3, len(examples), longest, dtype=torch.long)
            for row, example in enumerate(examples):
                length = len(example.input_ids)
                position_ids_3BT[:, row, :length] = (example.position_ids if example.position_ids is not None
                                                     else torch.arange(length))
            vision_kwargs["position_ids"] = position_ids_3BT.to(self.device)
        backbone = self.base.model.model
        out = backbone(input_ids=input_ids_BT.to(self.device), attention_mask=attention_mask_BT.to(self.device),
                       use_cache=False, **vision_kwargs)
        return out.last_hidden_state

    def _target_logprobs(self, hidden_ND: torch.Tensor, targets: torch.Tensor, adapter: LoraAdapter) -> torch.Tensor:
        """log p(target) per position, through lm_head in chunks of positions.

        Under autograd each chunk is checkpointed, so only hidden states are kept for backward:
        full-vocabulary logits exist for at most `logprob_chunk_size` positions at a time.
        """
        targets_NK = targets if targets.dim() == 2 else targets[:, None]
        pieces = []
        for start in range(0, hidden_ND.shape[0], self.config.logprob_chunk_size):
            stop = start + self.config.logprob_chunk_size
            if torch.is_grad_enabled():
                pieces.append(checkpoint(self._chunk_logprobs, hidden_ND[start:stop], targets_NK[start:stop], adapter,
                                         use_reentrant=False))
            else:
                pieces.append(self._chunk_logprobs(hidden_ND[start:stop], targets_NK[start:stop], adapter))
        logprobs_NK = torch.cat(pieces) if pieces else hidden_ND.new_zeros((0, targets_NK.shape[1]))
        return logprobs_NK if targets.dim() == 2 else logprobs_NK[:, 0]

    def _chunk_logprobs(self, hidden_CD: torch.Tensor, targets_CK: torch.Tensor, adapter: LoraAdapter) -> torch.Tensor:
        # The adapter is entered here, not only by the caller: checkpoint recomputes this chunk during
        # backward, which on CUDA runs on autograd's device thread, where the thread-local adapter is unset.
        with use_adapter(adapter):
            logits_CV = self.base.model.lm_head(hidden_CD).float()
        return torch.log_softmax(logits_CV, dim=-1).gather(-1, targets_CK)

    # -- optimizer -------------------------------------------------------------------------------

    def optim_step(self, model_id: str, params: AdamParams) -> dict[str, float]:
        """One AdamW step applying every AdamParams field, then clear the accumulated gradients."""
        run = self.get(model_id)
        tensors = run.adapter.parameters()
        max_norm = params.grad_clip_norm if params.grad_clip_norm > 0 else float("inf")
        grads = [t for t in tensors if t.grad is not None]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(grads, max_norm)) if grads else 0.0
        for group in run.optimizer.param_groups:
            group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                         weight_decay=params.weight_decay)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.num_steps += 1
        return {"grad_norm:mean": grad_norm, "learning_rate:mean": params.learning_rate}

    # -- checkpoints ---------------------------------------------------------------------------

    def save_state(self, model_id: str, directory) -> int:
        """Adapter + optimizer state (a training checkpoint); returns bytes written."""
        run = self.get(model_id)
        return checkpoint_io.save_training_checkpoint(directory, run.adapter, run.optimizer, run.lora_config,
                                                      run.num_steps, self.base.name)

    def save_for_sampler(self, model_id: str, directory) -> int:
        """The adapter alone, in the PEFT layout; returns bytes written."""
        run = self.get(model_id)
        return checkpoint_io.save_peft_adapter(directory, run.adapter, self.base.name)

    def snapshot(self, model_id: str) -> LoraAdapter:
        """A frozen copy of the current adapter, for an ephemeral sampling session."""
        return self.get(model_id).adapter.frozen_copy()

    def load_state(self, model_id: str, directory, with_optimizer: bool) -> None:
        """Replace an existing run's weights (and optimizer moments) with a checkpoint's."""
        run = self.get(model_id)
        loaded = checkpoint_io.load_checkpoint(directory, self.device, with_optimizer)
        if loaded.lora_config.rank != run.lora_config.rank or loaded.adapter.lora_A.keys() != run.adapter.lora_A.keys():
            raise InvalidRequest(f"checkpoint has rank {loaded.lora_config.rank} and other layers than run "
                                 f"{model_id} (rank {run.lora_config.rank})")
        self._install(model_id, run.lora_config, loaded)

    def create_model_from_checkpoint(self, model_id: str, directory, with_optimizer: bool) -> LoraConfig:
        """Start a run from a checkpoint (create-via-load); returns the LoRA config it carried."""
        loaded = checkpoint_io.load_checkpoint(directory, self.device, with_optimizer)
        self._install(model_id, loaded.lora_config, loaded)
        return loaded.lora_config

    def _install(self, model_id: str, lora_config: LoraConfig, loaded: checkpoint_io.LoadedCheckpoint) -> None:
        optimizer = _new_optimizer(loaded.adapter)
        if loaded.optimizer_state is not None:
            moments = checkpoint_io.optimizer_moments(loaded.adapter, loaded.optimizer_state)
            optimizer.load_state_dict({"state": moments, "param_groups": optimizer.state_dict()["param_groups"]})
        self.models[model_id] = TrainableModel(model_id, lora_config, loaded.adapter, optimizer,
                                               num_steps=loaded.num_steps)
