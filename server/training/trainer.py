"""The training backend: per-run LoRA adapters and AdamW state over one shared, frozen base model.

Runs forward/forward_backward with Tinker's token-sum losses, accumulates gradients across calls
until optim_step, and saves/loads checkpoints. Every training rank runs the same methods in the
same order: rank 0 (in the server, called from the scheduler's single training thread in each
run's seq_id order) first sends each collective call to the other ranks, then splits the datums
among them; the other ranks follow in `follow_leader`. It knows nothing about HTTP, futures or the
database.

Shapes: B = datums in a micro-batch, T = padded length, N = real positions, K = targets per position.
"""

import logging
import math
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from server.config import ServerConfig, TrainerConfig
from server.errors import InvalidRequest, NotFound
from server.models.loading import LoadedModel, load_base_model
from server.models.vision_features import VisionEncoder
from server.rendering.training import TrainingExample
from server.training import checkpoint_io
from server.training.forward import TargetLogprobs
from server.training.lora import LoraAdapter, LoraTarget, apply_lora_wrappers, select_targets, use_adapter
from server.training.losses import LossSpec, combine_metrics, resolve_loss
from server.training.parallel import TrainingGroup, apply_fsdp
from server.wire.types import AdamParams, LoraConfig

logger = logging.getLogger(__name__)

MicroBatch = list[tuple[int, TrainingExample]]
"""(index in the request, datum) pairs run together; empty on a rank that only keeps pace."""


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


def build_trainer(config: ServerConfig, group: TrainingGroup) -> "Trainer":
    """Load the base model on this rank's device and shard it for training."""
    base = load_base_model(config.model, device=group.device)
    vision = VisionEncoder(base.model, config.images.feature_cache_bytes) if base.vision is not None else None
    return Trainer(base, config.trainer, group, vision)


class Trainer:
    def __init__(self, base: LoadedModel, config: TrainerConfig, group: TrainingGroup,
                 vision: VisionEncoder | None = None):
        self.base = base
        self.config = config
        self.group = group
        self.vision = vision
        self.device = group.device
        self.targets: list[LoraTarget]
        self.targets, self.slot = apply_lora_wrappers(base.model, base.family)
        refused = base.vision.reserved_token_ids if base.vision is not None else frozenset()
        self.forward_model = TargetLogprobs(base.model, config.logprob_chunk_size, config.compile, refused)
        tower = base.family.vision.tower_module if base.family.vision is not None else None
        apply_fsdp(self.forward_model, base.model.get_submodule(base.family.language_model_prefix.rstrip(".")),
                   base.model.get_submodule(tower) if tower else None, group.mesh, config.activation_checkpointing,
                   config.compile)
        self.models: dict[str, TrainableModel] = {}

    def _lead(self, method: str, *args) -> None:
        """On rank 0: have the other ranks run `method(*args)` too (bulk data travels separately)."""
        if self.group.is_leader and self.group.world_size > 1:
            self.group.broadcast((method, args))

    def follow_leader(self) -> None:
        """On ranks other than 0: run rank 0's collective calls until it says stop."""
        while (command := self.group.broadcast()) is not None:
            method, args = command
            try:
                getattr(self, method)(*args)
            except Exception:  # rank 0 met the same error and reported it; keep in step with it
                logger.exception("rank %d: %s failed", self.group.rank, method)

    def stop_followers(self) -> None:
        if self.group.is_leader and self.group.world_size > 1:
            self.group.broadcast(None)

    # -- lifecycle ---------------------------------------------------------------------------

    def create_model(self, model_id: str, lora_config: LoraConfig, seed: int | None = None) -> None:
        """Start a run with a freshly initialised adapter (the same on every rank)."""
        targets = select_targets(self.targets, train_attn=lora_config.train_attn, train_mlp=lora_config.train_mlp,
                                 train_unembed=lora_config.train_unembed)
        if not targets:
            raise InvalidRequest("the LoraConfig's train_* flags select no layer of this model")
        if seed is None:
            seed = lora_config.seed if lora_config.seed is not None else random.randrange(2**31)
        self._lead("create_model", model_id, lora_config, seed)
        adapter = LoraAdapter.initialize(targets, lora_config.rank, self.config.lora_alpha, seed, self.device)
        self.models[model_id] = TrainableModel(model_id, lora_config, adapter, _new_optimizer(adapter))

    def get(self, model_id: str) -> TrainableModel:
        model = self.models.get(model_id)
        if model is None:
            raise NotFound(f"model {model_id} is not loaded on this server (after a restart, "
                           f"create it again from a checkpoint with create_training_client_from_state)")
        return model

    def unload(self, model_id: str) -> None:
        self._lead("unload", model_id)
        self.models.pop(model_id, None)

    # -- forward / backward --------------------------------------------------------------------

    def forward_backward(self, model_id: str, examples: list[TrainingExample] | None, loss_fn: str,
                         loss_fn_config: dict[str, float | str] | None,
                         forward_only: bool) -> ForwardBackwardResult | None:
        """Run the loss on every datum; unless forward_only, add its gradient to the run's accumulators.

        Rank 0 returns the result; the other ranks (given no examples) compute their share and return None.
        """
        run = self.get(model_id)
        spec, config = resolve_loss(loss_fn, loss_fn_config)
        self._lead("forward_backward", model_id, None, loss_fn, loss_fn_config, forward_only)
        plan = self._plan(examples) if self.group.is_leader else None
        microbatches: list[MicroBatch] = self.group.scatter(plan) if self.group.world_size > 1 else plan[0]
        outputs: dict[int, dict[str, np.ndarray]] = {}
        datum_metrics: dict[int, dict[str, float]] = {}
        total_loss = 0.0
        with use_adapter(self.slot, run.adapter), torch.set_grad_enabled(not forward_only):
            for batch in microbatches:
                batch_loss = self._run_microbatch(batch, spec, config, outputs, datum_metrics)
                if not forward_only:
                    batch_loss.backward()
                total_loss += float(batch_loss.detach())
        share = (outputs, datum_metrics, total_loss)
        shares = self.group.gather(share) if self.group.world_size > 1 else [share]
        if not self.group.is_leader:
            return None
        merged = {index: output for outputs, _, _ in shares for index, output in outputs.items()}
        merged_metrics = {index: metrics for _, per_datum, _ in shares for index, metrics in per_datum.items()}
        metrics = combine_metrics([merged_metrics[index] for index in sorted(merged_metrics)])
        return ForwardBackwardResult(outputs=[merged[index] for index in range(len(examples))],
                                     metrics={"loss:sum": sum(loss for _, _, loss in shares), **metrics})

    def _plan(self, examples: list[TrainingExample]) -> list[list[MicroBatch]]:
        """Datums split among ranks by tokens, then into length-sorted micro-batches under the token budget.

        Sorting by length keeps padding small; every rank gets the same number of micro-batches
        (padded with empty ones), because each forward and backward is a collective under FSDP.
        """
        order = sorted(range(len(examples)), key=lambda i: len(examples[i].input_ids), reverse=True)
        per_rank: list[list[int]] = [[] for _ in range(self.group.world_size)]
        load = [0] * self.group.world_size
        for index in order:
            rank = load.index(min(load))
            per_rank[rank].append(index)
            load[rank] += len(examples[index].input_ids)
        plans = []
        for indices in per_rank:
            batches: list[MicroBatch] = []
            for index in indices:  # longest first, so a batch's first datum sets its padded length
                batch_length = len(batches[-1][0][1].input_ids) if batches else 0
                if batches and batch_length * (len(batches[-1]) + 1) <= self.config.max_tokens_per_microbatch:
                    batches[-1].append((index, examples[index]))
                else:
                    batches.append([(index, examples[index])])
            plans.append(batches)
        most = max(len(batches) for batches in plans)
        return [batches + [[]] * (most - len(batches)) for batches in plans]

    def _run_microbatch(self, batch: MicroBatch, spec: LossSpec, config: dict[str, float],
                        outputs: dict[int, dict[str, np.ndarray]],
                        datum_metrics: dict[int, dict[str, float]]) -> torch.Tensor:
        """The summed loss of one micro-batch; each datum's logprobs and elementwise loss go to `outputs`,
        and its metrics (if the loss has any) to `datum_metrics`."""
        if not batch:
            # A rank with no datum left still joins the collectives of the others' forward and backward.
            keep_pace = [TrainingExample(input_ids=[0],
                                         loss_fn_inputs={"target_tokens": torch.zeros(1, dtype=torch.long)})]
            return self._logprobs(keep_pace).sum() * 0.0
        examples = [example for _, example in batch]
        logprobs_NK = self._logprobs(examples)
        batch_loss = logprobs_NK.new_zeros((), dtype=torch.float32)
        start = 0
        for index, example in batch:
            inputs = {name: t.to(self.device) for name, t in example.loss_fn_inputs.items()}
            targets = inputs["target_tokens"]
            stop = start + targets.shape[0]
            logprobs = logprobs_NK[start:stop, :targets.shape[1]] if targets.dim() == 2 else logprobs_NK[start:stop, 0]
            elementwise = spec.fn(logprobs, inputs, config)
            batch_loss = batch_loss + elementwise.sum()
            outputs[index] = {"logprobs": logprobs.detach().float().cpu().numpy(),
                              "elementwise_loss": elementwise.detach().float().cpu().numpy()}
            if spec.metrics is not None:
                datum_metrics[index] = spec.metrics(logprobs.detach(), inputs, config)
            start = stop
        return batch_loss

    def _logprobs(self, examples: list[TrainingExample]) -> torch.Tensor:
        """log p(target) [N, K] for the real positions of right-padded datums, datum after datum."""
        longest = max(len(e.input_ids) for e in examples)
        input_ids_BT = torch.zeros(len(examples), longest, dtype=torch.long)
        attention_mask_BT = torch.zeros(len(examples), longest, dtype=torch.long)
        targets = [e.loss_fn_inputs["target_tokens"] for e in examples]
        width = max(t.shape[1] if t.dim() == 2 else 1 for t in targets)
        targets_NK = torch.zeros(sum(len(e.input_ids) for e in examples), width, dtype=torch.long)
        start = 0
        for row, (example, target) in enumerate(zip(examples, targets)):
            length = len(example.input_ids)
            input_ids_BT[row, :length] = torch.tensor(example.input_ids)
            attention_mask_BT[row, :length] = 1
            target_NK = target if target.dim() == 2 else target[:, None]
            targets_NK[start:start + length, :target_NK.shape[1]] = target_NK
            start += length
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
        return self.forward_model(input_ids_BT.to(self.device), attention_mask_BT.to(self.device),
                                  targets_NK.to(self.device), **vision_kwargs)

    # -- optimizer -------------------------------------------------------------------------------

    def optim_step(self, model_id: str, params: AdamParams) -> dict[str, float]:
        """One AdamW step applying every AdamParams field, then clear the accumulated gradients.

        Each rank holds the gradient of its own datums: their sum is the gradient of the whole
        batch, so every rank's replica takes the same step.
        """
        run = self.get(model_id)
        self._lead("optim_step", model_id, params)
        trained = [t for t in run.adapter.parameters() if t.grad is not None]
        if trained and self.group.world_size > 1:
            flat = torch.cat([t.grad.flatten() for t in trained])
            dist.all_reduce(flat)
            for tensor, summed in zip(trained, flat.split([t.numel() for t in trained])):
                tensor.grad.copy_(summed.view_as(tensor))
        total_norm = torch.nn.utils.get_total_norm([t.grad for t in trained]) if trained else torch.tensor(0.0)
        grad_norm = float(total_norm)
        if not math.isfinite(grad_norm):
            # A step on NaN/inf would poison the weights and AdamW moments for good: refuse it, and drop
            # the accumulated gradients so the run can go on from where it was.
            run.optimizer.zero_grad(set_to_none=True)
            raise InvalidRequest(f"the accumulated gradient of {model_id} is not finite (norm {grad_norm}); the step "
                                 f"was not applied and the gradients were cleared: the weights and optimizer state "
                                 f"are as they were")
        if params.grad_clip_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(trained, params.grad_clip_norm, total_norm)
        for group in run.optimizer.param_groups:
            group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                         weight_decay=params.weight_decay)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.num_steps += 1
        return {"grad_norm:mean": grad_norm, "learning_rate:mean": params.learning_rate}

    # -- checkpoints ---------------------------------------------------------------------------

    # Saving needs rank 0 alone: adapters and optimizer states are the same on every rank.

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
        """Replace an existing run's weights (and optimizer moments) with a checkpoint's (on every rank)."""
        run = self.get(model_id)
        loaded = checkpoint_io.load_checkpoint(directory, self.device, with_optimizer)
        if loaded.lora_config.rank != run.lora_config.rank or loaded.adapter.lora_A.keys() != run.adapter.lora_A.keys():
            raise InvalidRequest(f"checkpoint has rank {loaded.lora_config.rank} and other layers than run "
                                 f"{model_id} (rank {run.lora_config.rank})")
        self._lead("load_state", model_id, directory, with_optimizer)
        self._install(model_id, run.lora_config, loaded)

    def create_model_from_checkpoint(self, model_id: str, directory, with_optimizer: bool) -> LoraConfig:
        """Start a run from a checkpoint (create-via-load, on every rank); returns the LoRA config it carried."""
        loaded = checkpoint_io.load_checkpoint(directory, self.device, with_optimizer)
        self._lead("create_model_from_checkpoint", model_id, directory, with_optimizer)
        self._install(model_id, loaded.lora_config, loaded)
        return loaded.lora_config

    def _install(self, model_id: str, lora_config: LoraConfig, loaded: checkpoint_io.LoadedCheckpoint) -> None:
        optimizer = _new_optimizer(loaded.adapter)
        if loaded.optimizer_state is not None:
            moments = checkpoint_io.optimizer_moments(loaded.adapter, loaded.optimizer_state)
            optimizer.load_state_dict({"state": moments, "param_groups": optimizer.state_dict()["param_groups"]})
        self.models[model_id] = TrainableModel(model_id, lora_config, loaded.adapter, optimizer,
                                               num_steps=loaded.num_steps)
