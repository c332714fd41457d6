"""The training backend: per-run LoRA adapters and AdamW state over one shared, frozen base model.

Forward/forward_backward passes with Tinker's token-sum losses (one run, or several at once, each
row with its own run's adapter and each run's gradient in its own accumulators), gradients
accumulated until optim_step, checkpoints copied and loaded, on every training rank in step (rank 0
leads, see `follow_leader`). Knows nothing about HTTP, futures or the database.

Shapes: B = rows of a micro-batch (one per datum, or one packed row), T = row length, N = real positions,
K = targets per position.
"""

import dataclasses
import logging
import math
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from server.config import ModelConfig, TrainerConfig
from server.errors import InvalidRequest, NotFound
from server.lora import checkpoint_io
from server.lora.layers import (AdapterStack, LoraAdapter, LoraTarget, all_finite, apply_lora_wrappers,
                                select_targets, use_adapter, use_adapter_rows)
from server.models.loading import LoadedModel, load_base_model, resolve_model_dir
from server.models.vision_features import VisionEncoder
from server.rendering.training import TrainingExample
from server.training.forward import TargetLogprobs
from server.training.losses import DatumLoss, MicrobatchLoss, combine_metrics, resolve_loss
from server.training.operations import CreateModel, ForwardBackward, LoadState, OptimStep, RankCommand, Unload
from server.training.packing import apply_segment_attention, cumulative_lengths, pack_balanced, packed_attention
from server.training.parallel import TrainingGroup, choose_base_sharding, prepare_blocks
from server.wire.models import LoraConfig
from server.wire.training import AdamParams

logger = logging.getLogger(__name__)

PassItem = tuple[int, int, TrainingExample]
"""(index of the request in the pass, index of the datum in its request, datum)."""
MicroBatch = list[PassItem]
"""Datums run together; empty on a rank that only keeps pace."""


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
    datum_metrics: list[dict[str, float]]
    """Per datum, what its loss reports (empty for most losses)."""
    loss: float
    """The sum of every datum's elementwise loss."""

    @property
    def metrics(self) -> dict[str, float]:
        return {"loss:sum": self.loss, **combine_metrics(self.datum_metrics)}

    def extend(self, later: "ForwardBackwardResult") -> None:
        """Append the result of the request's next datums (a request run over several passes)."""
        self.outputs += later.outputs
        self.datum_metrics += later.datum_metrics
        self.loss += later.loss


@dataclass
class _LoadedMicroBatch:
    """A micro-batch's tensors on the training device, and whose each datum is."""

    keys: list[tuple[int, int]]
    """(request, datum) of each datum."""
    datum_request: list[int]
    input_ids_BT: torch.Tensor
    """Padded: a row per datum. Packed: one row [1, N], the datums end to end."""
    attention_mask_BT: torch.Tensor | None
    """Padded rows' padding mask; None for a packed row (attention stays within each datum)."""
    real_positions_N: torch.Tensor
    targets_NK: torch.Tensor
    datums: list[DatumLoss]
    images: list
    position_ids: torch.Tensor | None
    """Padded: [3, B, T] multimodal rope positions when there are images, else None (plain). Packed: [1, N]
    positions restarting at each datum, or with images [4, 1, N], those then the three rope axes."""
    segment_lengths: torch.Tensor | None
    """Packed: each datum's length (int64, on the host), for the attention (training/packing.py)."""
    cu_seqlens: torch.Tensor | None
    """Packed, varlen attention: where each datum starts, and the row's end (int32 [S + 1], on the device)."""

    @property
    def packed(self) -> bool:
        return self.segment_lengths is not None


def _new_optimizer(adapter: LoraAdapter) -> torch.optim.AdamW:
    # Hyperparameters are set from AdamParams on every optim_step; these are placeholders. Fused: one
    # kernel for all of a run's tensors (hundreds of them) instead of a dozen launches per group of them.
    return torch.optim.AdamW(adapter.parameters(), lr=0.0, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0,
                             fused=True)


def _optimizer_tensors(optimizer: torch.optim.AdamW) -> list[torch.Tensor]:
    """The weights and AdamW moments a step changes."""
    tensors = []
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            tensors.append(parameter.data)
            tensors.extend(optimizer.state.get(parameter, {}).values())
    return tensors


def _check_finite(loaded: checkpoint_io.LoadedCheckpoint) -> None:
    """A checkpoint with non-finite weights or moments (written before optim_step refused to make them) is refused
    before any rank loads it: such moments would make every later optim_step refuse."""
    loaded.adapter.check_finite("the checkpoint's weights")
    if loaded.optimizer_state is not None and not all_finite(list(loaded.optimizer_state.values())):
        raise InvalidRequest("the checkpoint's optimizer state is not finite; load its weights without it "
                             "(load_state) or a checkpoint saved before the run went bad")


class _UndoCopy:
    """What an AdamW step changes (weights and moments), copied to put back a step that made them non-finite.

    One flat buffer per dtype: a 4B model's adapter and moments are about 2,000 tensors, and one allocation and
    one copy kernel for all of them cost a fraction of one each."""

    def __init__(self, optimizer: torch.optim.AdamW):
        self.optimizer = optimizer
        self.without_moments = [parameter for group in optimizer.param_groups for parameter in group["params"]
                                if not optimizer.state.get(parameter)]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in _optimizer_tensors(optimizer):
            by_dtype.setdefault(tensor.dtype, []).append(tensor.reshape(-1))  # a view where contiguous
        self.flats = {dtype: torch.cat(tensors) for dtype, tensors in by_dtype.items()}

    def restore(self) -> None:
        for parameter in self.without_moments:  # the step made their moments
            self.optimizer.state.pop(parameter, None)
        tensors = _optimizer_tensors(self.optimizer)  # the same tensors, in the same order, as when copied
        for dtype, flat in self.flats.items():
            targets = [t for t in tensors if t.dtype == dtype]
            pieces = flat.split([t.numel() for t in targets])
            torch._foreach_copy_(targets, [piece.view_as(t) for piece, t in zip(pieces, targets)])


def build_trainer(model: ModelConfig, config: TrainerConfig, feature_cache_bytes: int,
                  group: TrainingGroup) -> "Trainer":
    """Load the base model on this rank's device and shard or replicate it for training."""
    if group.world_size > 1:
        # The ranks find (or build) the base's files in turn: the first builds a built-in model, the others
        # find it built (ranks that built it at once, under a file lock, still lost or broke its directory).
        for turn in range(group.world_size):
            if turn == group.rank:
                resolve_model_dir(model)
            dist.barrier(group=group.objects)
    # Over several ranks the decoder blocks reach the device once the ranks have chosen how to hold them:
    # one at a time, each as FSDP shards it, or whole.
    base = load_base_model(model, device=group.device, blocks_on_host=group.world_size > 1)
    vision = VisionEncoder(base.model, feature_cache_bytes) if base.vision is not None else None
    trainer = Trainer(base, config, group, vision)
    logger.info("training rank %d of %d ready on %s (pid %d)", group.rank, group.world_size, group.device, os.getpid())
    if group.world_size > 1:
        # Every rank holds its model before rank 0 goes on to start the sampler: a vLLM colocated with a rank
        # sizes its KV cache from the memory it sees in use, which must not be a rank still loading.
        dist.barrier(group=group.objects)
    return trainer


class Trainer:
    def __init__(self, base: LoadedModel, config: TrainerConfig, group: TrainingGroup,
                 vision: VisionEncoder | None = None):
        self.base = base
        self.config = config
        self.group = group
        self.vision = vision
        self.device = group.device
        self.dtype = next(base.model.parameters()).dtype
        self.targets: list[LoraTarget]
        self.targets, self.slot = apply_lora_wrappers(base.model, base.family)
        # Linear attention (hybrid families) would carry its recurrent state from one datum into the next
        # of a packed row: transformers' PyTorch path takes no sequence boundaries.
        self.packed = config.microbatch_layout == "packed" and not base.family.hybrid
        self.packed_attention = packed_attention(config.packed_attention, self.device, self.dtype)
        apply_segment_attention(base.model)
        refused = base.vision.reserved_token_ids if base.vision is not None else frozenset()
        self.forward_model = TargetLogprobs(base.model, config.logprob_chunk_size, config.compile, refused)
        tower = base.family.vision.tower_module if base.family.vision is not None else None
        self.base_sharding = choose_base_sharding(config.base_sharding, base.model, group, config.local_ranks)
        prepare_blocks(self.forward_model, base.model.get_submodule(base.family.language_model_prefix.rstrip(".")),
                       base.model.get_submodule(tower) if tower else None, group, self.base_sharding,
                       config.activation_checkpointing or base.family.recomputes_blocks, config.compile)
        self.models: dict[str, TrainableModel] = {}

    def _lead(self, command: RankCommand) -> None:
        """On rank 0: have the other ranks run `command` too (bulk data travels separately)."""
        if self.group.is_leader and self.group.world_size > 1:
            self.group.broadcast(command)

    def follow_leader(self) -> None:
        """On ranks other than 0: run rank 0's commands until it says stop.

        Every rank runs the same methods in the same order: rank 0 (called from the scheduler's training
        thread through the executor) first sends each collective call to the others as a typed command
        (operations.py's `RankCommand`), then splits the datums among them. A pass moves its inputs to
        the device before its first micro-batch and its outputs back after the last, so that nothing in
        between waits for the device.
        """
        while (command := self.group.broadcast()) is not None:
            try:
                self._follow(command)
            except Exception:  # rank 0 met the same error and reported it; keep in step with it
                logger.exception("rank %d: %s failed", self.group.rank, type(command).__name__)

    def _follow(self, command: RankCommand) -> None:
        match command:
            case CreateModel(model_id, lora_config, seed):
                self.create_model(model_id, lora_config, seed)
            case LoadState(model_id, _, _, create):
                # The checkpoint's files come from rank 0: only its node needs the checkpoint directory.
                loaded = checkpoint_io.parse_checkpoint(self.group.broadcast(), self.device)
                self._install(model_id, loaded.lora_config if create else self.get(model_id).lora_config, loaded)
            case OptimStep(model_id, params):
                self.optim_step(model_id, params)
            case Unload(model_id):
                self.unload(model_id)
            case list():
                self.forward_backward_pass(command)
            case _:
                raise TypeError(f"not a command for a training rank: {command!r}")

    def stop_followers(self) -> None:
        """Tell the other ranks to stop, and leave the process group with them: under NCCL a rank's
        destroy_process_group waits for every rank's (the followers call theirs as they stop), so a leader
        that only waited for them to exit would wait out each of its join timeouts."""
        if self.group.is_leader and self.group.world_size > 1:
            self.group.lifelines.stop()
            self.group.broadcast(None)
            dist.destroy_process_group()

    # -- lifecycle ---------------------------------------------------------------------------

    def create_model(self, model_id: str, lora_config: LoraConfig, seed: int | None = None) -> None:
        """Start a run with a freshly initialised adapter (the same on every rank)."""
        targets = select_targets(self.targets, train_attn=lora_config.train_attn, train_mlp=lora_config.train_mlp,
                                 train_unembed=lora_config.train_unembed)
        if not targets:
            raise InvalidRequest("the LoraConfig's train_* flags select no layer of this model")
        if seed is None:
            seed = lora_config.seed if lora_config.seed is not None else random.randrange(2**31)
        self._lead(CreateModel(model_id, lora_config, seed))
        adapter = LoraAdapter.initialize(targets, lora_config.rank, self.config.lora_alpha, seed, self.device)
        self.models[model_id] = TrainableModel(model_id, lora_config, adapter, _new_optimizer(adapter))

    def get(self, model_id: str) -> TrainableModel:
        model = self.models.get(model_id)
        if model is None:
            raise NotFound(f"model {model_id} is not loaded on this server (after a restart, "
                           f"create it again from a checkpoint with create_training_client_from_state)")
        return model

    def unload(self, model_id: str) -> None:
        self._lead(Unload(model_id))
        self.models.pop(model_id, None)

    # -- forward / backward --------------------------------------------------------------------

    def forward_backward(self, model_id: str, examples: list[TrainingExample] | None, loss_fn: str,
                         loss_fn_config: dict[str, float | str] | None,
                         forward_only: bool) -> ForwardBackwardResult | None:
        """Run the loss on every datum; unless forward_only, add its gradient to the run's accumulators."""
        results = self.forward_backward_pass([ForwardBackward(model_id, examples, loss_fn, loss_fn_config,
                                                              forward_only)])
        return results[0] if results is not None else None

    def forward_backward_pass(self, requests: list[ForwardBackward]) -> list[ForwardBackwardResult] | None:
        """Several requests (of one run or of several, all forward_only or none) in one pass: each datum
        with its own run's adapter and loss, each run's gradient in its own accumulators.

        Rank 0 returns one result per request; the other ranks (given no examples) compute their share
        and return None.
        """
        forward_only = requests[0].forward_only
        assert all(request.forward_only == forward_only for request in requests)
        adapters = [self.get(request.model_id).adapter for request in requests]
        losses = [resolve_loss(request.loss_fn, request.loss_fn_config) for request in requests]
        self._lead([dataclasses.replace(request, examples=None) for request in requests])
        plan = None
        if self.group.is_leader:
            items = [(r, d, example) for r, request in enumerate(requests)
                     for d, example in enumerate(request.examples)]
            plan = [[[items[i] for i in batch] for batch in batches]
                    for batches in self._plan([example for _, _, example in items])]
        microbatches: list[MicroBatch] = self.group.scatter(plan) if self.group.world_size > 1 else plan[0]
        with torch.set_grad_enabled(not forward_only):
            loaded = [self._load(batch, losses) for batch in microbatches]
            done = [self._run_microbatch(batch, adapters, forward_only) for batch in loaded]
        share = {key: output for batch, loss in zip(loaded, done)
                 for key, output in zip(batch.keys, loss.datum_outputs()) if key[0] >= 0}
        shares = self.group.gather(share) if self.group.world_size > 1 else [share]
        if not self.group.is_leader:
            return None
        merged = {key: output for share in shares for key, output in share.items()}
        results = []
        for r, request in enumerate(requests):
            per_datum = [merged[r, d] for d in range(len(request.examples))]
            outputs = [{name: tensor.contiguous().numpy() for name, tensor in output.items()}
                       for output, _ in per_datum]
            results.append(ForwardBackwardResult(
                outputs=outputs, datum_metrics=[metrics for _, metrics in per_datum],
                loss=sum(float(output["elementwise_loss"].sum()) for output in outputs)))
        return results

    def _plan(self, examples: list[TrainingExample]) -> list[list[list[int]]]:
        """Datums (by index) split among ranks by tokens, then into micro-batches under the token budget.

        Packed micro-batches are as few as first fit needs and even in tokens; padded ones are length-sorted,
        which keeps padding small. With the base sharded every rank gets the same number of micro-batches
        (padded with empty ones), because each forward and backward is a collective under FSDP; a replicated
        base has no collective before the gradients' sum, so a rank with less work stops sooner.
        """
        order = sorted(range(len(examples)), key=lambda i: len(examples[i].input_ids), reverse=True)
        per_rank: list[list[int]] = [[] for _ in range(self.group.world_size)]
        load = [0] * self.group.world_size
        for index in order:
            rank = load.index(min(load))
            per_rank[rank].append(index)
            load[rank] += len(examples[index].input_ids)
        budget = self.config.max_tokens_per_microbatch
        plans = []
        for indices in per_rank:
            batches: list[list[int]] = []
            if self.packed:
                bins = pack_balanced([len(examples[i].input_ids) for i in indices], budget)
                plans.append([[indices[i] for i in batch] for batch in bins])
                continue
            for index in indices:  # longest first, so a batch's first datum sets its padded length
                batch_length = len(examples[batches[-1][0]].input_ids) if batches else 0
                if batches and batch_length * (len(batches[-1]) + 1) <= budget:
                    batches[-1].append(index)
                else:
                    batches.append([index])
            plans.append(batches)
        if self.base_sharding == "replicate":
            return plans
        most = max(len(batches) for batches in plans)
        return [batches + [[]] * (most - len(batches)) for batches in plans]

    def _load(self, batch: MicroBatch, losses) -> _LoadedMicroBatch:
        """A micro-batch's tensors on the device, in the trainer's layout; the datums' positions end to end."""
        if not batch:
            # A rank with no datum left still joins the collectives of the others' forward and backward (a
            # sharded base), with the first request's adapter and a datum whose loss is exactly zero (not an output).
            keep_pace = TrainingExample(input_ids=[0], loss_fn_inputs={"target_tokens": torch.zeros(1, dtype=torch.long),
                                                                       "weights": torch.zeros(1)})
            loaded = self._load([(0, 0, keep_pace)], [resolve_loss("cross_entropy", None)])
            loaded.keys = [(-1, -1)]
            return loaded
        examples = [example for _, _, example in batch]
        lengths = [len(e.input_ids) for e in examples]
        targets = [e.loss_fn_inputs["target_tokens"] for e in examples]
        width = max(t.shape[1] if t.dim() == 2 else 1 for t in targets)
        targets_NK = torch.zeros(sum(lengths), width, dtype=torch.long)
        datums, start = [], 0
        for (r, _, example), target, length in zip(batch, targets, lengths):
            target_NK = target if target.dim() == 2 else target[:, None]
            targets_NK[start:start + length, :target_NK.shape[1]] = target_NK
            spec, config = losses[r]
            datums.append(DatumLoss(spec, config, {name: t.to(self.device) for name, t in example.loss_fn_inputs.items()},
                                    start, start + length))
            start += length
        images = [image for example in examples for image in example.images]
        # Each datum's own rope positions: the multimodal ones of a datum with images, else plain ones.
        rope_positions = [example.position_ids if example.position_ids is not None
                          else torch.arange(length).expand(3, -1) for example, length in zip(examples, lengths)]
        # Datums of one length fill rows exactly: padded rows then hold the same tokens, and attention runs as one
        # batched call instead of one per datum (10 % of a fixed-shape 4B step on an H100).
        if self.packed and len(set(lengths)) > 1:
            input_ids_BT = torch.tensor([[token for e in examples for token in e.input_ids]])
            attention_mask_BT = None
            real_positions_N = torch.arange(start)
            position_ids = torch.cat([torch.arange(length) for length in lengths])[None]
            if images:  # transformers' 4-row form: the text positions (where datums restart), then rope's three axes
                position_ids = torch.cat([position_ids, torch.cat(rope_positions, dim=1)])[:, None]
            segment_lengths = torch.tensor(lengths)
            cu_seqlens = cumulative_lengths(segment_lengths, self.device) if self.packed_attention == "varlen" else None
        else:
            longest = max(lengths)
            input_ids_BT = torch.zeros(len(examples), longest, dtype=torch.long)
            attention_mask_BT = torch.zeros(len(examples), longest, dtype=torch.long)
            position_ids = torch.zeros(3, len(examples), longest, dtype=torch.long) if images else None
            for row, (example, length) in enumerate(zip(examples, lengths)):
                input_ids_BT[row, :length] = torch.tensor(example.input_ids)
                attention_mask_BT[row, :length] = 1
                if images:  # every row explicit, text-only rows the plain positions on all three axes
                    position_ids[:, row, :length] = rope_positions[row]
            real_positions_N = torch.cat([torch.arange(length) + row * longest for row, length in enumerate(lengths)])
            attention_mask_BT = attention_mask_BT.to(self.device)
            segment_lengths = cu_seqlens = None
        return _LoadedMicroBatch(
            keys=[(r, d) for r, d, _ in batch], datum_request=[r for r, _, _ in batch],
            input_ids_BT=input_ids_BT.to(self.device), attention_mask_BT=attention_mask_BT,
            real_positions_N=real_positions_N.to(self.device), targets_NK=targets_NK.to(self.device),
            datums=datums, images=images, position_ids=None if position_ids is None else position_ids.to(self.device),
            segment_lengths=segment_lengths, cu_seqlens=cu_seqlens)

    def _run_microbatch(self, batch: _LoadedMicroBatch, adapters: list[LoraAdapter],
                        forward_only: bool) -> MicrobatchLoss:
        """Forward (and, unless forward_only, backward) of one micro-batch; returns its losses and outputs."""
        loss = MicrobatchLoss(batch.datums, tuple(batch.targets_NK.shape), self.device)
        model_kwargs = {}
        if batch.images:
            # Image features come from the cache (the vision tower is frozen).
            model_kwargs["mm_encoder_outputs"] = self.vision.encoder_outputs(batch.images)
        if batch.packed:
            model_kwargs["segment_lengths"] = batch.segment_lengths
            if batch.cu_seqlens is not None:
                model_kwargs["cu_seqlens"] = batch.cu_seqlens
        datum_adapters = [adapters[r] for r in batch.datum_request]
        # A packed row holds datums of several runs: then the adapter is chosen per position.
        repeats = [datum.stop - datum.start for datum in batch.datums] if batch.packed else None
        with self._row_adapters(datum_adapters, repeats):
            result = self.forward_model(batch.input_ids_BT, batch.attention_mask_BT, batch.real_positions_N,
                                        batch.targets_NK, position_ids=batch.position_ids,
                                        loss=None if forward_only else loss, **model_kwargs)
            if forward_only:
                loss.evaluate(result)
            else:
                result.backward()  # in the adapters' block: checkpointed layers recompute in backward
        return loss

    def _row_adapters(self, row_adapters: list[LoraAdapter], repeats: list[int] | None = None):
        """Each row (each datum of a packed row: `repeats` positions each) with its own adapter: one adapter
        for all when they agree, else a stack of them."""
        distinct = list({id(adapter): adapter for adapter in row_adapters}.values())
        if len(distinct) == 1:
            return use_adapter(self.slot, distinct[0])
        index = {id(adapter): position for position, adapter in enumerate(distinct)}
        # Built under autograd, per micro-batch: each backward frees its graph.
        stack = AdapterStack(self.slot, distinct, self.dtype)
        adapter_B = torch.tensor([index[id(a)] for a in row_adapters])
        if repeats is not None:
            adapter_B = adapter_B.repeat_interleave(torch.tensor(repeats))
        return use_adapter_rows(self.slot, stack, adapter_B.to(self.device))

    # -- optimizer -------------------------------------------------------------------------------

    def optim_step(self, model_id: str, params: AdamParams) -> dict[str, float]:
        """One AdamW step applying every AdamParams field, then clear the accumulated gradients.

        Each rank holds the gradient of its own datums: their sum is the gradient of the whole
        batch, so every rank's replica takes the same step.
        """
        run = self.get(model_id)
        self._lead(OptimStep(model_id, params))
        if self.group.world_size > 1:
            self._sum_gradients(run.adapter.parameters())
        trained = [t for t in run.adapter.parameters() if t.grad is not None]
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
        # A finite gradient can still give non-finite weights (an update past float range): keep what the
        # step changes, to put it back rather than poison the run for good.
        before = _UndoCopy(run.optimizer)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        if not all_finite(_optimizer_tensors(run.optimizer)):
            with torch.no_grad():
                before.restore()
            raise InvalidRequest(f"this optim_step would have made the weights of {model_id} non-finite; it was not "
                                 f"applied and the gradients were cleared: the weights and optimizer state are as they "
                                 f"were (a smaller learning_rate, or grad_clip_norm, may help)")
        run.num_steps += 1
        return {"grad_norm:mean": grad_norm, "learning_rate:mean": params.learning_rate}

    def _sum_gradients(self, tensors: list[torch.Tensor]) -> None:
        """Sum the tensors' gradients over the ranks, in one all-reduce.

        A rank may hold none for a run whose datums of a multi-run pass all went to other ranks: it
        adds zeros, and a tensor keeps no gradient only if no rank has one.
        """
        held = torch.tensor([t.grad is not None for t in tensors], dtype=torch.float32, device=self.device)
        flat = torch.cat([t.grad.flatten() if t.grad is not None else t.new_zeros(t.numel()) for t in tensors]
                         + [held])
        dist.all_reduce(flat)
        *summed, held = flat.split([t.numel() for t in tensors] + [len(tensors)])
        for tensor, gradient, anyone in zip(tensors, summed, held.tolist()):
            tensor.grad = gradient.view_as(tensor) if anyone else None  # views of `flat`, which the step then frees

    # -- checkpoints ---------------------------------------------------------------------------

    # Copying needs rank 0 alone: adapters and optimizer states are the same on every rank.

    def copy_state(self, model_id: str, with_optimizer: bool) -> checkpoint_io.AdapterState:
        """The adapter (and the optimizer moments) in host memory, for a checkpoint written off this thread."""
        run = self.get(model_id)
        run.adapter.check_finite(f"the weights of {model_id}")
        return checkpoint_io.copy_state(run.adapter, run.optimizer if with_optimizer else None, run.lora_config,
                                        run.num_steps, self.base.name)

    def snapshot(self, model_id: str) -> LoraAdapter:
        """A frozen copy of the current adapter, for an ephemeral sampling session."""
        run = self.get(model_id)
        run.adapter.check_finite(f"the weights of {model_id}")
        return run.adapter.frozen_copy()

    def load_state(self, model_id: str, directory, with_optimizer: bool) -> None:
        """Replace an existing run's weights (and optimizer moments) with a checkpoint's (on every rank)."""
        run = self.get(model_id)
        files = checkpoint_io.read_checkpoint(directory, with_optimizer)
        loaded = checkpoint_io.parse_checkpoint(files, self.device)
        _check_finite(loaded)
        if loaded.lora_config.rank != run.lora_config.rank or loaded.adapter.lora_A.keys() != run.adapter.lora_A.keys():
            raise InvalidRequest(f"checkpoint has rank {loaded.lora_config.rank} and other layers than run "
                                 f"{model_id} (rank {run.lora_config.rank})")
        self._lead_load(LoadState(model_id, directory, with_optimizer, create=False), files)
        self._install(model_id, run.lora_config, loaded)

    def create_model_from_checkpoint(self, model_id: str, directory, with_optimizer: bool) -> LoraConfig:
        """Start a run from a checkpoint (create-via-load, on every rank); returns the LoRA config it carried."""
        files = checkpoint_io.read_checkpoint(directory, with_optimizer)
        loaded = checkpoint_io.parse_checkpoint(files, self.device)
        _check_finite(loaded)
        self._lead_load(LoadState(model_id, directory, with_optimizer, create=True), files)
        self._install(model_id, loaded.lora_config, loaded)
        return loaded.lora_config

    def _lead_load(self, command: LoadState, files: checkpoint_io.CheckpointFiles) -> None:
        """Have the other ranks load the checkpoint too, from the files rank 0 read."""
        if self.group.is_leader and self.group.world_size > 1:
            self._lead(command)
            self.group.broadcast(files)

    def _install(self, model_id: str, lora_config: LoraConfig, loaded: checkpoint_io.LoadedCheckpoint) -> None:
        optimizer = _new_optimizer(loaded.adapter)
        if loaded.optimizer_state is not None:
            moments = checkpoint_io.optimizer_moments(loaded.adapter, loaded.optimizer_state)
            optimizer.load_state_dict({"state": moments, "param_groups": optimizer.state_dict()["param_groups"]})
        self.models[model_id] = TrainableModel(model_id, lora_config, loaded.adapter, optimizer,
                                               num_steps=loaded.num_steps)
