"""The LoRA trainer on the built-in tiny Qwen3, against plain HF forwards, torch's AdamW and PEFT.

Every reference here is computed outside the trainer: full unpadded forwards of another, unsharded
copy of the HF model with the adapter active, `torch.optim.AdamW` on copies of the adapter's
tensors, and PEFT loading the saved sampler checkpoint. The trainer runs as a one-rank group.

Shapes: N = positions of a datum, K = targets per position, V = vocabulary.
"""

import itertools
import logging
import math
import re
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from transformers import AutoModelForCausalLM

from server.config import ModelConfig, TrainerConfig
from server.errors import InvalidRequest
from server.lora import checkpoint_io
from server.lora.layers import AdapterSlot, LoraAdapter, all_finite, apply_lora_wrappers, use_adapter
from server.models.builtin import ensure_builtin_model
from server.models.loading import LoadedModel, load_base_model
from server.rendering.provenance import RECORDED_LOGPROBS, SAMPLED_MASK
from server.rendering.training import TrainingExample
from server.training.operations import ForwardBackward
from server.training.parallel import free_port, init_training_group
from server.training.trainer import Trainer
from server.wire.models import LoraConfig
from server.wire.training import AdamParams

BASE_MODEL = "builtin:tiny-qwen3"
RANK = 4
_model_ids = itertools.count()


@pytest.fixture(scope="module")
def model_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("builtin-models")
    ensure_builtin_model(BASE_MODEL.removeprefix("builtin:"), cache)
    return cache


def load(model_cache_dir: Path) -> LoadedModel:
    return load_base_model(ModelConfig(base_model=BASE_MODEL, model_path=None, model_cache_dir=model_cache_dir))


def build_trainer(model_cache_dir: Path, config: TrainerConfig) -> Trainer:
    """A one-rank trainer over its own copy of the base model (it wraps and shards that copy)."""
    return Trainer(load(model_cache_dir), config, init_training_group(0, 1, "cpu", "127.0.0.1", free_port()))


@pytest.fixture(scope="module")
def reference(model_cache_dir: Path) -> tuple[LoadedModel, AdapterSlot]:
    """A plain copy of the base model with LoRA wrappers, for reference forwards."""
    base = load(model_cache_dir)
    return base, apply_lora_wrappers(base.model, base.family)[1]


@pytest.fixture(scope="module")
def trainer(model_cache_dir: Path) -> Trainer:
    return build_trainer(model_cache_dir, TrainerConfig())


@pytest.fixture(scope="module")
def chunked_trainer(model_cache_dir: Path) -> Trainer:
    """Three positions per lm_head chunk and micro-batches of at most 16 padded tokens."""
    return build_trainer(model_cache_dir, TrainerConfig(max_tokens_per_microbatch=16, logprob_chunk_size=3))


# -- helpers ---------------------------------------------------------------------------------------


def create_run(trainer: Trainer, lora_config: LoraConfig | None = None, perturb_seed: int | None = 100) -> str:
    """A new run; unless perturb_seed is None, B is set to seeded noise so the adapter changes the model."""
    model_id = f"run-{next(_model_ids)}"
    trainer.create_model(model_id, lora_config or LoraConfig(rank=RANK, seed=0))
    if perturb_seed is not None:
        generator = torch.Generator().manual_seed(perturb_seed)
        adapter = trainer.models[model_id].adapter
        with torch.no_grad():
            for name in sorted(adapter.lora_B):
                adapter.lora_B[name].copy_(torch.randn(adapter.lora_B[name].shape, generator=generator) * 0.05)
    return model_id


def sft_batch(seed: int, lengths: list[int], vocab_size: int, weights: str = "random") -> list[TrainingExample]:
    """Datums of the given lengths: next-token targets and random (signed) or constant weights."""
    generator = torch.Generator().manual_seed(seed)
    batch = []
    for length in lengths:
        tokens = torch.randint(0, vocab_size, (length + 1,), generator=generator)
        if weights == "random":
            weights_N = torch.randn(length, generator=generator)
        else:
            weights_N = torch.full((length,), float(weights))
        batch.append(TrainingExample(input_ids=tokens[:-1].tolist(),
                                     loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights_N}))
    return batch


def reference_logprobs(reference, adapter: LoraAdapter | None, example: TrainingExample) -> torch.Tensor:
    """log p(target) from one unpadded full HF forward: logits -> log_softmax -> gather."""
    base, slot = reference
    targets = example.loss_fn_inputs["target_tokens"]
    targets_NK = targets if targets.dim() == 2 else targets[:, None]
    with use_adapter(slot, adapter):
        logits_NV = base.model(input_ids=torch.tensor([example.input_ids])).logits[0]
    logprobs_NK = torch.log_softmax(logits_NV.float(), dim=-1).gather(-1, targets_NK)
    return logprobs_NK if targets.dim() == 2 else logprobs_NK[:, 0]


def gradients(trainer: Trainer, model_id: str) -> list[torch.Tensor]:
    """Copies of the accumulated gradients, in the adapter's parameter order."""
    return [p.grad.clone() for p in trainer.models[model_id].adapter.parameters()]


def parameters(trainer: Trainer, model_id: str) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.models[model_id].adapter.parameters()]


def assert_all_close(actual: list[torch.Tensor], expected: list[torch.Tensor], rtol: float, atol: float) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol)


def all_close(actual: list[torch.Tensor], expected: list[torch.Tensor], rtol: float, atol: float) -> bool:
    return all(torch.allclose(a, e, rtol=rtol, atol=atol) for a, e in zip(actual, expected, strict=True))


def reference_adamw(start: list[torch.Tensor], grads_per_step: list[list[torch.Tensor]],
                    params: AdamParams) -> list[torch.Tensor]:
    """torch.optim.AdamW (with clip_grad_norm_ first, if asked) on copies, fed the given gradients."""
    copies = [t.clone().requires_grad_(True) for t in start]
    optimizer = torch.optim.AdamW(copies, lr=params.learning_rate, betas=(params.beta1, params.beta2),
                                  eps=params.eps, weight_decay=params.weight_decay)
    for grads in grads_per_step:
        for copy, grad in zip(copies, grads, strict=True):
            copy.grad = grad.clone()
        if params.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(copies, params.grad_clip_norm)
        optimizer.step()
    return [c.detach() for c in copies]


def global_norm(grads: list[torch.Tensor]) -> float:
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))


def save(trainer: Trainer, model_id: str, directory: Path, with_optimizer: bool) -> int:
    """A training checkpoint (with_optimizer) or a sampler checkpoint, as the server writes them."""
    return checkpoint_io.save_state(directory, trainer.copy_state(model_id, with_optimizer))


def train_step(trainer: Trainer, model_id: str, batch: list[TrainingExample], params: AdamParams) -> dict[str, float]:
    trainer.forward_backward(model_id, batch, "cross_entropy", None, forward_only=False)
    return trainer.optim_step(model_id, params)


# -- forward_backward ------------------------------------------------------------------------------


def test_cross_entropy_loss_logprobs_and_gradients_equal_unpadded_hf_forwards_for_a_mixed_length_batch(
        trainer, reference):
    model_id = create_run(trainer)
    adapter = trainer.models[model_id].adapter
    batch = sft_batch(0, [9, 3, 14, 6], trainer.base.vocab_size)

    result = trainer.forward_backward(model_id, batch, "cross_entropy", None, forward_only=False)

    reference_loss = torch.zeros(())
    for example, output in zip(batch, result.outputs, strict=True):
        expected = reference_logprobs(reference, adapter, example)
        weights = example.loss_fn_inputs["weights"]
        assert output["logprobs"].dtype == np.float32
        assert output["logprobs"].shape == (len(example.input_ids),)
        torch.testing.assert_close(torch.from_numpy(output["logprobs"]), expected.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.from_numpy(output["elementwise_loss"]), -(expected * weights).detach(),
                                   rtol=0, atol=1e-5)
        reference_loss = reference_loss + (-(expected * weights)).sum()
    assert result.metrics["loss:sum"] == pytest.approx(float(reference_loss.detach()), abs=1e-4)

    expected_grads = torch.autograd.grad(reference_loss, adapter.parameters())
    assert_all_close(gradients(trainer, model_id), list(expected_grads), rtol=1e-4, atol=1e-5)
    # The adapter really changes the model, so the comparisons above see its contribution.
    base_logprobs = reference_logprobs(reference, None, batch[0])
    assert (torch.from_numpy(result.outputs[0]["logprobs"]) - base_logprobs).abs().max() > 1e-3


def test_top_k_cross_entropy_returns_logprobs_of_every_target_column(trainer, reference):
    model_id = create_run(trainer)
    generator = torch.Generator().manual_seed(5)
    num_positions, k = 7, 3
    targets_NK = torch.randint(0, trainer.base.vocab_size, (num_positions, k), generator=generator)
    weights_NK = torch.randn(num_positions, k, generator=generator)
    example = TrainingExample(input_ids=torch.randint(0, 500, (num_positions,), generator=generator).tolist(),
                              loss_fn_inputs={"target_tokens": targets_NK, "weights": weights_NK})

    result = trainer.forward_backward(model_id, [example], "cross_entropy", None, forward_only=True)

    expected_NK = reference_logprobs(reference, trainer.models[model_id].adapter, example).detach()
    assert result.outputs[0]["logprobs"].shape == (num_positions, k)
    torch.testing.assert_close(torch.from_numpy(result.outputs[0]["logprobs"]), expected_NK, rtol=0, atol=1e-5)
    assert result.metrics["loss:sum"] == pytest.approx(float(-(expected_NK * weights_NK).sum()), abs=1e-4)


def test_tiny_logprob_chunks_and_micro_batches_give_the_same_logprobs_and_gradients_as_the_defaults(
        trainer, chunked_trainer):
    batch = sft_batch(1, [9, 3, 14, 6, 2], trainer.base.vocab_size)
    # The chunked trainer really splits this batch; the default one runs it as one micro-batch.
    assert len(chunked_trainer._plan(batch)[0]) > 1
    assert len(trainer._plan(batch)[0]) == 1
    default_id, chunked_id = create_run(trainer), create_run(chunked_trainer)
    assert_all_close(parameters(chunked_trainer, chunked_id), parameters(trainer, default_id), rtol=0, atol=0)

    default = trainer.forward_backward(default_id, batch, "cross_entropy", None, forward_only=False)
    chunked = chunked_trainer.forward_backward(chunked_id, batch, "cross_entropy", None, forward_only=False)

    for a, b in zip(chunked.outputs, default.outputs, strict=True):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=0, atol=1e-5)
    assert chunked.metrics["loss:sum"] == pytest.approx(default.metrics["loss:sum"], abs=1e-4)
    assert_all_close(gradients(chunked_trainer, chunked_id), gradients(trainer, default_id), rtol=1e-4, atol=1e-5)


def test_gradients_of_two_calls_on_halves_of_a_batch_equal_one_call_on_the_whole_batch(trainer):
    batch = sft_batch(2, [5, 11, 4, 8], trainer.base.vocab_size)
    whole_id, halves_id = create_run(trainer), create_run(trainer)

    whole = trainer.forward_backward(whole_id, batch, "cross_entropy", None, forward_only=False)
    first = trainer.forward_backward(halves_id, batch[:2], "cross_entropy", None, forward_only=False)
    second = trainer.forward_backward(halves_id, batch[2:], "cross_entropy", None, forward_only=False)

    assert first.metrics["loss:sum"] + second.metrics["loss:sum"] == pytest.approx(whole.metrics["loss:sum"],
                                                                                   abs=1e-4)
    assert_all_close(gradients(trainer, halves_id), gradients(trainer, whole_id), rtol=1e-4, atol=1e-5)
    # Accumulation, not replacement: the second half alone gives other gradients.
    second_only_id = create_run(trainer)
    trainer.forward_backward(second_only_id, batch[2:], "cross_entropy", None, forward_only=False)
    assert not all_close(gradients(trainer, second_only_id), gradients(trainer, whole_id), rtol=1e-3, atol=1e-4)


def test_zero_weights_give_an_exactly_zero_gradient_and_forward_only_accumulates_nothing(trainer):
    model_id = create_run(trainer)
    batch = sft_batch(3, [6, 10], trainer.base.vocab_size, weights="0")

    result = trainer.forward_backward(model_id, batch, "cross_entropy", None, forward_only=False)

    assert result.metrics["loss:sum"] == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in gradients(trainer, model_id))
    forward_only_id = create_run(trainer)
    trainer.forward_backward(forward_only_id, sft_batch(3, [6, 10], trainer.base.vocab_size), "cross_entropy",
                             None, forward_only=True)
    assert all(p.grad is None for p in trainer.models[forward_only_id].adapter.parameters())


def test_gradients_do_not_depend_on_the_thread_that_runs_backward(trainer, monkeypatch):
    # On CUDA, autograd runs backward (and so checkpoint's recomputation of the lm_head chunks) on
    # its own device thread, where the training thread's active adapter is not set.
    batch = sft_batch(4, [7, 5], trainer.base.vocab_size)
    same_thread_id = create_run(trainer)
    trainer.forward_backward(same_thread_id, batch, "cross_entropy", None, forward_only=False)

    backward = torch.Tensor.backward

    def backward_on_another_thread(tensor, *args, **kwargs):
        errors = []

        def run():
            try:
                backward(tensor, *args, **kwargs)
            except BaseException as error:
                errors.append(error)

        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
        if errors:
            raise errors[0]

    monkeypatch.setattr(torch.Tensor, "backward", backward_on_another_thread)
    other_thread_id = create_run(trainer)
    trainer.forward_backward(other_thread_id, batch, "cross_entropy", None, forward_only=False)

    assert "lm_head" in trainer.models[other_thread_id].adapter.lora_A
    assert_all_close(gradients(trainer, other_thread_id), gradients(trainer, same_thread_id), rtol=1e-5, atol=1e-6)


def test_policy_losses_with_sampler_logprobs_equal_to_the_current_ones_see_unit_ratios(trainer):
    model_id = create_run(trainer)
    example = sft_batch(6, [8], trainer.base.vocab_size)[0]
    current = trainer.forward_backward(model_id, [example], "cross_entropy", None, forward_only=True)
    advantages_N = torch.randn(8, generator=torch.Generator().manual_seed(6))
    inputs = {"target_tokens": example.loss_fn_inputs["target_tokens"],
              "logprobs": torch.from_numpy(current.outputs[0]["logprobs"]), "advantages": advantages_N}
    policy_example = TrainingExample(input_ids=example.input_ids, loss_fn_inputs=inputs)

    # ratio 1: IS and PPO give -A per token; CISPO and DRO (no penalty) give -logp * A.
    for loss_fn, config, expected_N in [
        ("importance_sampling", None, -advantages_N),
        ("ppo", None, -advantages_N),
        ("cispo", None, -inputs["logprobs"] * advantages_N),
        ("dro", {"beta": 0.3}, -inputs["logprobs"] * advantages_N),
    ]:
        result = trainer.forward_backward(model_id, [policy_example], loss_fn, config, forward_only=True)
        np.testing.assert_allclose(result.outputs[0]["elementwise_loss"], expected_N.numpy(), rtol=1e-5, atol=1e-5,
                                   err_msg=loss_fn)
        np.testing.assert_allclose(result.outputs[0]["logprobs"], inputs["logprobs"].numpy(), rtol=0, atol=1e-6)
        assert result.metrics["loss:sum"] == pytest.approx(float(expected_N.sum()), abs=1e-4)


def policy_batch(trainer: Trainer, model_id: str, seed: int, lengths: list[int],
                 log_ratios: list[float]) -> list[TrainingExample]:
    """Datums whose first 3 positions are prompt (mask 0, advantage 0) and whose sampler logprobs sit, on
    average over the sampled positions, exactly `log_ratio` below the run's current logprobs."""
    batch = sft_batch(seed, lengths, trainer.base.vocab_size)
    current = trainer.forward_backward(model_id, batch, "cross_entropy", None, forward_only=True)
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for example, output, log_ratio in zip(batch, current.outputs, log_ratios, strict=True):
        length = len(example.input_ids)
        mask_N = torch.ones(length)
        mask_N[:3] = 0
        noise_N = torch.randn(length, generator=generator) * 0.2 * mask_N
        noise_N[3:] -= noise_N[3:].mean()
        advantages_N = torch.randn(length, generator=generator) * mask_N
        inputs = {"target_tokens": example.loss_fn_inputs["target_tokens"],
                  "logprobs": torch.from_numpy(output["logprobs"]) - log_ratio - noise_N,
                  "advantages": advantages_N, "sequence_ratio_mask": mask_N}
        examples.append(TrainingExample(input_ids=example.input_ids, loss_fn_inputs=inputs))
    return examples


def test_gspo_gives_each_datum_of_a_request_its_own_ratio_and_matches_a_plain_torch_reference(trainer, reference):
    model_id = create_run(trainer)
    adapter = trainer.models[model_id].adapter
    # One datum's sequence ratio is inside the clip, the other's far above it.
    batch = policy_batch(trainer, model_id, 30, [9, 12], [0.05, 0.6])

    result = trainer.forward_backward(model_id, batch, "gspo", None, forward_only=False)

    reference_loss = torch.zeros(())
    for example, output, s in zip(batch, result.outputs, [math.exp(0.05), math.exp(0.6)], strict=True):
        inputs = example.loss_fn_inputs
        logp = reference_logprobs(reference, adapter, example)
        masked = inputs["sequence_ratio_mask"] != 0
        log_s = (logp.detach()[masked] - inputs["logprobs"][masked]).mean()
        assert float(torch.exp(log_s)) == pytest.approx(s, rel=1e-4)
        ratio = torch.exp(log_s + logp - logp.detach())
        advantages = inputs["advantages"]
        elementwise = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
        torch.testing.assert_close(torch.from_numpy(output["elementwise_loss"]), elementwise.detach(),
                                   rtol=1e-4, atol=1e-5)
        reference_loss = reference_loss + elementwise.sum()
    assert result.metrics["loss:sum"] == pytest.approx(float(reference_loss.detach()), abs=1e-4)
    assert result.metrics["sequence_ratio:max"] == pytest.approx(math.exp(0.6), rel=1e-4)
    assert result.metrics["sequence_ratio:mean"] == pytest.approx((math.exp(0.05) + math.exp(0.6)) / 2, rel=1e-4)
    assert result.metrics["sequence_ratio_mask_missing:sum"] == 0
    expected_grads = torch.autograd.grad(reference_loss, adapter.parameters())
    assert_all_close(gradients(trainer, model_id), list(expected_grads), rtol=1e-4, atol=1e-5)


def test_gspo_gradients_are_the_same_in_one_call_in_two_calls_and_in_tiny_micro_batches(trainer, chunked_trainer):
    single_id, split_id, chunked_id = create_run(trainer), create_run(trainer), create_run(chunked_trainer)
    batch = policy_batch(trainer, single_id, 31, [9, 12, 5, 7], [0.05, 0.6, -0.5, 0.2])

    single = trainer.forward_backward(single_id, batch, "gspo", None, forward_only=False)
    first = trainer.forward_backward(split_id, batch[:1], "gspo", None, forward_only=False)
    second = trainer.forward_backward(split_id, batch[1:], "gspo", None, forward_only=False)
    chunked = chunked_trainer.forward_backward(chunked_id, batch, "gspo", None, forward_only=False)

    assert len(chunked_trainer._plan(batch)[0]) > 1
    assert first.metrics["loss:sum"] + second.metrics["loss:sum"] == pytest.approx(single.metrics["loss:sum"],
                                                                                   abs=1e-4)
    assert chunked.metrics["loss:sum"] == pytest.approx(single.metrics["loss:sum"], abs=1e-4)
    expected = gradients(trainer, single_id)
    # fp32 sums over other batch shapes round differently: relative to the gradients' own scale (about 40).
    atol = 2e-6 * max(float(g.abs().max()) for g in expected)
    assert_all_close(gradients(trainer, split_id), expected, rtol=1e-4, atol=atol)
    assert_all_close(gradients(chunked_trainer, chunked_id), expected, rtol=1e-4, atol=atol)


def test_stable_reinforce_gradients_match_a_plain_torch_reference_with_the_recorded_logprobs(trainer, reference):
    model_id = create_run(trainer)
    adapter = trainer.models[model_id].adapter
    batch = policy_batch(trainer, model_id, 32, [9, 12], [0.9, -0.3])
    for example in batch:
        inputs = example.loss_fn_inputs
        sampled = inputs.pop("sequence_ratio_mask")
        inputs[SAMPLED_MASK] = sampled
        inputs[RECORDED_LOGPROBS] = inputs["logprobs"] * sampled
        inputs["logprobs"] = torch.zeros_like(sampled)  # the client's copy is not what the loss uses

    result = trainer.forward_backward(model_id, batch, "stable_reinforce", {"kl_coeff": 0.3}, forward_only=False)

    reference_loss = torch.zeros(())
    for example in batch:
        inputs = example.loss_fn_inputs
        on = inputs[SAMPLED_MASK] != 0
        logp = reference_logprobs(reference, adapter, example)[on]
        recorded, advantages = inputs[RECORDED_LOGPROBS][on], inputs["advantages"][on]
        weight = torch.exp(logp.detach() - recorded).clamp(max=2.0)
        reference_loss = reference_loss + (-weight * advantages * logp + 0.15 * (logp - recorded) ** 2).sum()
    assert result.metrics["loss:sum"] == pytest.approx(float(reference_loss.detach()), abs=1e-4)
    assert result.metrics["sampled_tokens:sum"] == 9 + 12 - 6
    assert result.metrics["importance_ratio_capped:sum"] > 0
    assert result.metrics["sampler_logprobs_mismatched:sum"] == 9 + 12 - 6
    expected_grads = torch.autograd.grad(reference_loss, adapter.parameters())
    assert_all_close(gradients(trainer, model_id), list(expected_grads), rtol=1e-4, atol=1e-5)


# -- several runs in one pass ------------------------------------------------------------------------

# Different ranks and targets (one without the MLP, one without lm_head), each with its own loss; gspo's
# ratio is per datum (not elementwise), so its run takes the logprobs-first path inside the shared pass.
PASS_RUNS = [(LoraConfig(rank=RANK, seed=0), "cross_entropy"),
             (LoraConfig(rank=2 * RANK, seed=1, train_mlp=False), "ppo"),
             (LoraConfig(rank=RANK // 2, seed=2, train_unembed=False), "gspo")]


def pass_batches(trainer: Trainer, model_ids: list[str]) -> list[list[TrainingExample]]:
    vocab = trainer.base.vocab_size
    return [sft_batch(50, [9, 3, 14], vocab), policy_batch(trainer, model_ids[1], 51, [7, 12], [0.1, -0.2]),
            policy_batch(trainer, model_ids[2], 52, [10, 4, 6], [0.05, 0.6, -0.3])]


@pytest.mark.parametrize("forward_only", [False, True])
def test_a_pass_of_several_runs_gives_each_run_exactly_what_it_gets_alone(trainer, chunked_trainer, forward_only):
    alone_ids = [create_run(trainer, config, perturb_seed=60 + i) for i, (config, _) in enumerate(PASS_RUNS)]
    batches = pass_batches(trainer, alone_ids)
    alone = [trainer.forward_backward(model_id, batch, loss_fn, None, forward_only)
             for model_id, batch, (_, loss_fn) in zip(alone_ids, batches, PASS_RUNS)]
    # Together, on the default trainer (one micro-batch holds rows of every run) and on the chunked one
    # (micro-batches of 16 tokens, lm_head chunks of 3 positions that straddle datums of different runs).
    for together_trainer in (trainer, chunked_trainer):
        together_ids = [create_run(together_trainer, config, perturb_seed=60 + i)
                        for i, (config, _) in enumerate(PASS_RUNS)]
        together = together_trainer.forward_backward_pass([
            ForwardBackward(model_id, batch, loss_fn, None, forward_only)
            for model_id, batch, (_, loss_fn) in zip(together_ids, batches, PASS_RUNS)])
        for alone_result, together_result, alone_id, together_id in zip(alone, together, alone_ids, together_ids):
            for a, b in zip(together_result.outputs, alone_result.outputs, strict=True):
                np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=0, atol=1e-5)
                np.testing.assert_allclose(a["elementwise_loss"], b["elementwise_loss"], rtol=0, atol=1e-5)
            assert together_result.metrics.keys() == alone_result.metrics.keys()
            for key, value in alone_result.metrics.items():
                assert together_result.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-4), key
            if forward_only:
                assert all(p.grad is None for p in together_trainer.models[together_id].adapter.parameters())
            else:
                # Rows padded to another length change fp32 summation order (in fp64 the two agree to the
                # last bit of fp32), so the gradients are compared by norm, as a whole tensor.
                for a, e in zip(gradients(together_trainer, together_id), gradients(trainer, alone_id), strict=True):
                    assert (a - e).norm() <= 3e-5 * e.norm()


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_a_pass_of_several_runs_gives_each_run_the_logprobs_and_gradients_of_peft_with_its_adapter(trainer, tmp_path):
    # A reference outside the server's LoRA code: each run's adapter, saved, loaded into PEFT on the HF
    # model, every datum run alone through it; the pass stacks the three adapters per row.
    model_ids = [create_run(trainer, config, perturb_seed=110 + i) for i, (config, _) in enumerate(PASS_RUNS)]
    batches = [sft_batch(120 + i, lengths, trainer.base.vocab_size) for i, lengths in enumerate([[9, 3], [12], [5, 7]])]
    results = trainer.forward_backward_pass([ForwardBackward(model_id, batch, "cross_entropy", None, False)
                                             for model_id, batch in zip(model_ids, batches)])
    peft_model = AutoModelForCausalLM.from_pretrained(trainer.base.path)
    for model_id in model_ids:
        save(trainer, model_id, tmp_path / model_id, with_optimizer=False)
        if isinstance(peft_model, PeftModel):
            peft_model.load_adapter(tmp_path / model_id, adapter_name=model_id, is_trainable=True)
        else:
            peft_model = PeftModel.from_pretrained(peft_model, tmp_path / model_id, adapter_name=model_id,
                                                   is_trainable=True)
    for model_id, batch, result in zip(model_ids, batches, results, strict=True):
        peft_model.set_adapter(model_id)
        loss = torch.zeros(())
        for example, output in zip(batch, result.outputs, strict=True):
            logits_NV = peft_model(input_ids=torch.tensor([example.input_ids])).logits[0]
            logprobs_N = torch.log_softmax(logits_NV.float(), dim=-1).gather(
                -1, example.loss_fn_inputs["target_tokens"][:, None])[:, 0]
            np.testing.assert_allclose(output["logprobs"], logprobs_N.detach().numpy(), rtol=0, atol=1e-5)
            loss = loss - (logprobs_N * example.loss_fn_inputs["weights"]).sum()
        adapter = trainer.models[model_id].adapter
        names = sorted(adapter.lora_A)
        peft_parameters = dict(peft_model.named_parameters())
        expected = torch.autograd.grad(loss, [peft_parameters[f"base_model.model.{name}.lora_{part}.{model_id}.weight"]
                                              for name in names for part in "AB"])
        for actual, e in zip([t.grad for name in names for t in (adapter.lora_A[name], adapter.lora_B[name])],
                             expected, strict=True):
            assert (actual - e).norm() <= 3e-5 * e.norm()


def test_compiled_blocks_give_the_eager_pass_of_several_runs_and_compile_once_for_every_block(
        model_cache_dir, trainer, recompiles):
    # What --compile does on a GPU (torch.compile of each decoder block and of the unembedding chunks), here
    # with inductor's CPU code: a pass of three runs (other ranks, targets and losses) gives the eager pass's
    # logprobs and gradients, and the blocks share their compiled code: a guard on anything that differs
    # from block to block (a layer's name, its SharedInput) would compile each block again, and with 36
    # blocks run past dynamo's recompile limit into eager mode.
    compiled = build_trainer(model_cache_dir, TrainerConfig(compile=True))
    results = {}
    for name, each in (("eager", trainer), ("compiled", compiled)):
        model_ids = [create_run(each, config, perturb_seed=70 + i) for i, (config, _) in enumerate(PASS_RUNS)]
        batches = pass_batches(each, model_ids)
        outputs = each.forward_backward_pass([ForwardBackward(model_id, batch, loss_fn, None, False)
                                              for model_id, batch, (_, loss_fn) in zip(model_ids, batches, PASS_RUNS)])
        results[name] = outputs, [gradients(each, model_id) for model_id in model_ids]
    for eager_result, compiled_result in zip(results["eager"][0], results["compiled"][0], strict=True):
        for a, b in zip(compiled_result.outputs, eager_result.outputs, strict=True):
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=0, atol=1e-5)
    for compiled_grads, eager_grads in zip(results["compiled"][1], results["eager"][1], strict=True):
        for a, e in zip(compiled_grads, eager_grads, strict=True):
            assert (a - e).norm() <= 3e-5 * e.norm()
    # Passes of other runs (new adapter tensors) and other lengths: dynamo makes each variant's shapes
    # dynamic once it sees a second size, then compiles nothing more. No recompile is ever for a block.
    for seed in (80, 90):
        model_ids = [create_run(compiled, config, perturb_seed=seed + i) for i, (config, _) in enumerate(PASS_RUNS)]
        batches = [sft_batch(seed, [seed // 10 + i, 11, 7][: 2 + i % 2], compiled.base.vocab_size)
                   for i in range(len(model_ids))]
        graphs = counters["stats"]["unique_graphs"]
        compiled.forward_backward_pass([ForwardBackward(model_id, batch, "cross_entropy", None, False)
                                        for model_id, batch in zip(model_ids, batches)])
    assert counters["stats"]["unique_graphs"] == graphs, "the third pass compiled again"
    reasons = [line.strip() for message in recompiles.messages for line in message.splitlines()
               if re.match(r"- \d+/\d+: ", line.strip())]  # the failed guards, not their stack traces
    # Packed rows break each block's graph at the attention (it reads the datums' lengths on the host), so
    # dynamo also traces transformers' deprecate_kwarg wrapper, one code object that the decoder layer and
    # its attention call with two and one positional arguments: one entry for each, the same for every block.
    assert reasons and all(re.search(r"size mismatch|requires_grad mismatch|GLOBAL_STATE changed|len\(args\) == [12]",
                                     reason) for reason in reasons), reasons
    # Rows of one length (one batched attention call, no graph break) and a forward-only pass are variants
    # too; with those of the packed rows they pass dynamo's default limit of 8 on the shared wrapper's frame,
    # which then runs eager. No frame may reach the limit.
    model_id = create_run(compiled, PASS_RUNS[0][0], perturb_seed=95)
    equal = sft_batch(95, [6, 6, 6], compiled.base.vocab_size)
    compiled.forward_backward_pass([ForwardBackward(model_id, equal, "cross_entropy", None, False)])
    compiled.forward_backward_pass([ForwardBackward(model_id, equal[:2], "cross_entropy", None, True)])
    per_frame = Counter(re.search(r"Recompiling function (\S+ in \S+)", message).group(1)
                        for message in recompiles.messages if "Recompiling function" in message)
    assert max(per_frame.values()) < torch._dynamo.config.recompile_limit, per_frame


class RecordedLogs(logging.Handler):
    """Keeps the messages of the records it is handed."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def recompiles() -> Iterator[RecordedLogs]:
    """The messages of dynamo's recompiles (each with the guards that failed) while the test runs."""
    recorded = RecordedLogs()
    torch._logging.set_logs(recompiles=True)
    logger = logging.getLogger("torch._dynamo.guards.__recompiles")
    logger.addHandler(recorded)
    yield recorded
    logger.removeHandler(recorded)
    torch._logging.set_logs()


def test_a_request_run_over_two_passes_gives_what_one_pass_gives(trainer):
    batch = sft_batch(53, [5, 11, 4, 8, 6], trainer.base.vocab_size)
    whole_id, split_id = create_run(trainer), create_run(trainer)
    whole = trainer.forward_backward(whole_id, batch, "cross_entropy", None, forward_only=False)
    first, second = (trainer.forward_backward_pass([ForwardBackward(split_id, part, "cross_entropy", None, False)])[0]
                     for part in (batch[:2], batch[2:]))
    first.extend(second)
    for a, b in zip(first.outputs, whole.outputs, strict=True):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=0, atol=1e-5)
    assert first.metrics["loss:sum"] == pytest.approx(whole.metrics["loss:sum"], abs=1e-4)
    assert_all_close(gradients(trainer, split_id), gradients(trainer, whole_id), rtol=1e-4, atol=1e-5)


# -- optim_step -----------------------------------------------------------------------------------

ADAM = AdamParams(learning_rate=0.05, beta1=0.5, beta2=0.6, eps=0.5, weight_decay=0.3)


def test_two_optim_steps_equal_torch_adamw_with_every_adam_params_field(trainer):
    model_id = create_run(trainer)
    start = parameters(trainer, model_id)
    grads_per_step, reported = [], []
    for seed in (10, 11):
        trainer.forward_backward(model_id, sft_batch(seed, [7, 4], trainer.base.vocab_size), "cross_entropy", None,
                                 forward_only=False)
        grads_per_step.append(gradients(trainer, model_id))
        reported.append(trainer.optim_step(model_id, ADAM))
        assert all(p.grad is None for p in trainer.models[model_id].adapter.parameters())

    after = parameters(trainer, model_id)
    assert_all_close(after, reference_adamw(start, grads_per_step, ADAM), rtol=1e-5, atol=1e-6)
    for metrics, grads in zip(reported, grads_per_step, strict=True):
        assert metrics["grad_norm:mean"] == pytest.approx(global_norm(grads), rel=1e-5)
        assert metrics["learning_rate:mean"] == ADAM.learning_rate
    assert trainer.models[model_id].num_steps == 2
    # Each field matters on this data: ignoring any one of them would fail the comparison above.
    defaults = AdamParams()
    for field in ("learning_rate", "beta1", "beta2", "eps", "weight_decay"):
        ignored = ADAM.model_copy(update={field: getattr(defaults, field)})
        assert not all_close(after, reference_adamw(start, grads_per_step, ignored), rtol=1e-5, atol=1e-6), field


def test_a_non_finite_gradient_is_refused_and_leaves_weights_and_optimizer_state_as_they_were(trainer):
    model_id = create_run(trainer)
    trainer.forward_backward(model_id, sft_batch(13, [6], trainer.base.vocab_size), "cross_entropy", None,
                             forward_only=False)
    trainer.optim_step(model_id, ADAM)
    run = trainer.models[model_id]
    before = parameters(trainer, model_id)
    moments = [tensor.clone() for state in run.optimizer.state.values() for tensor in state.values()]
    trainer.forward_backward(model_id, sft_batch(14, [6], trainer.base.vocab_size), "cross_entropy", None,
                             forward_only=False)
    next(t for t in run.adapter.parameters() if t.grad is not None).grad[0] = float("nan")

    with pytest.raises(InvalidRequest, match="not finite.*not applied"):
        trainer.optim_step(model_id, ADAM)

    assert_all_close(parameters(trainer, model_id), before, rtol=0, atol=0)
    assert_all_close([t for state in run.optimizer.state.values() for t in state.values()], moments, rtol=0, atol=0)
    assert run.num_steps == 1 and all(p.grad is None for p in run.adapter.parameters())
    trainer.forward_backward(model_id, sft_batch(14, [6], trainer.base.vocab_size), "cross_entropy", None,
                             forward_only=False)
    assert np.isfinite(trainer.optim_step(model_id, ADAM)["grad_norm:mean"])  # the run goes on


def test_a_step_that_would_make_the_weights_non_finite_is_rolled_back_and_such_weights_are_never_copied_out(
        trainer, tmp_path):
    model_id = create_run(trainer)
    run = trainer.models[model_id]
    poisoned = trainer.copy_state(model_id, with_optimizer=False)  # as an older server may have saved it
    next(iter(poisoned.adapter.parameters())).data.view(-1)[0] = float("nan")
    checkpoint_io.save_state(tmp_path, poisoned)
    with pytest.raises(InvalidRequest, match="the checkpoint's weights are not finite"):
        trainer.load_state(model_id, tmp_path, with_optimizer=False)
    trainer.forward_backward(model_id, sft_batch(15, [6], trainer.base.vocab_size), "cross_entropy", None,
                             forward_only=False)
    trainer.optim_step(model_id, ADAM)
    poisoned = trainer.copy_state(model_id, with_optimizer=True)
    second_moment = next(key for key in poisoned.moments if key.endswith("exp_avg_sq"))
    poisoned.moments[second_moment].view(-1)[0] = float("inf")
    checkpoint_io.save_state(tmp_path / "moments", poisoned)
    with pytest.raises(InvalidRequest, match="the checkpoint's optimizer state is not finite"):
        trainer.load_state(model_id, tmp_path / "moments", with_optimizer=True)
    before = parameters(trainer, model_id)
    moments = [tensor.clone() for state in run.optimizer.state.values() for tensor in state.values()]
    trainer.forward_backward(model_id, sft_batch(16, [6], trainer.base.vocab_size), "cross_entropy", None,
                             forward_only=False)
    gradient = next(t for t in run.adapter.parameters() if t.grad is not None).grad
    gradient.view(-1)[0] = 0.0
    # eps = 0 slipped past the wire's check: 0 / (sqrt(0) + 0) is NaN where the gradient and moments are 0.
    unsafe = AdamParams.model_construct(**{**ADAM.model_dump(), "beta1": 0.0, "beta2": 0.0, "eps": 0.0})

    with pytest.raises(InvalidRequest, match="non-finite; it was not applied"):
        trainer.optim_step(model_id, unsafe)

    assert_all_close(parameters(trainer, model_id), before, rtol=0, atol=0)
    assert_all_close([t for state in run.optimizer.state.values() for t in state.values()], moments, rtol=0, atol=0)
    assert run.num_steps == 1 and all(p.grad is None for p in run.adapter.parameters())
    with torch.no_grad():
        next(iter(run.adapter.parameters())).view(-1)[0] = float("inf")
    for copy_out in (lambda: trainer.copy_state(model_id, True), lambda: trainer.snapshot(model_id)):
        with pytest.raises(InvalidRequest, match="not finite; they cannot be saved, sampled or trained"):
            copy_out()


def test_a_first_step_that_would_make_the_weights_non_finite_leaves_no_moments_and_the_next_step_works(trainer):
    model_id = create_run(trainer)
    run = trainer.models[model_id]
    before = parameters(trainer, model_id)
    trainer.forward_backward(model_id, sft_batch(17, [6], trainer.base.vocab_size), "cross_entropy", None,
                             forward_only=False)
    next(t for t in run.adapter.parameters() if t.grad is not None).grad.view(-1)[0] = 0.0
    unsafe = AdamParams.model_construct(**{**ADAM.model_dump(), "beta1": 0.0, "beta2": 0.0, "eps": 0.0})

    with pytest.raises(InvalidRequest, match="non-finite; it was not applied"):
        trainer.optim_step(model_id, unsafe)

    assert_all_close(parameters(trainer, model_id), before, rtol=0, atol=0)
    assert not run.optimizer.state and run.num_steps == 0
    trainer.forward_backward(model_id, sft_batch(17, [6], trainer.base.vocab_size), "cross_entropy", None,
                             forward_only=False)
    assert np.isfinite(trainer.optim_step(model_id, ADAM)["grad_norm:mean"])
    assert run.num_steps == 1 and all_finite(parameters(trainer, model_id))


def test_grad_clip_norm_clips_the_global_norm_and_the_reported_norm_is_the_pre_clip_one(trainer):
    model_id = create_run(trainer)
    start = parameters(trainer, model_id)
    trainer.forward_backward(model_id, sft_batch(12, [9, 5], trainer.base.vocab_size), "cross_entropy", None,
                             forward_only=False)
    grads = gradients(trainer, model_id)
    pre_clip_norm = global_norm(grads)
    params = ADAM.model_copy(update={"grad_clip_norm": pre_clip_norm / 4})

    metrics = trainer.optim_step(model_id, params)

    assert metrics["grad_norm:mean"] == pytest.approx(pre_clip_norm, rel=1e-5)
    after = parameters(trainer, model_id)
    assert_all_close(after, reference_adamw(start, [grads], params), rtol=1e-5, atol=1e-6)
    unclipped = reference_adamw(start, [grads], ADAM)
    assert not all_close(after, unclipped, rtol=1e-5, atol=1e-6)


# -- adapters -------------------------------------------------------------------------------------


def expected_targets(trainer: Trainer, train_attn: bool, train_mlp: bool, train_unembed: bool) -> set[str]:
    num_layers = trainer.base.model.config.num_hidden_layers
    names = set()
    for layer in range(num_layers):
        if train_attn:
            names |= {f"model.layers.{layer}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
        if train_mlp:
            names |= {f"model.layers.{layer}.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    return names | ({"lm_head"} if train_unembed else set())


@pytest.mark.parametrize(("train_attn", "train_mlp", "train_unembed"), [
    (True, False, False), (False, True, False), (False, False, True), (True, False, True), (True, True, True),
])
def test_train_flags_select_exactly_the_attention_mlp_and_unembedding_layers(trainer, train_attn, train_mlp,
                                                                             train_unembed):
    model_id = create_run(trainer, LoraConfig(rank=RANK, seed=0, train_attn=train_attn, train_mlp=train_mlp,
                                              train_unembed=train_unembed), perturb_seed=None)
    adapter = trainer.models[model_id].adapter

    assert set(adapter.lora_A) == expected_targets(trainer, train_attn, train_mlp, train_unembed)
    for name in adapter.lora_A:
        base_linear = trainer.base.model.get_submodule(name).base
        assert adapter.lora_A[name].shape == (RANK, base_linear.in_features)
        assert adapter.lora_B[name].shape == (base_linear.out_features, RANK)


def test_the_seed_makes_initialisation_deterministic_and_different_seeds_differ(trainer):
    first = trainer.models[create_run(trainer, LoraConfig(rank=RANK, seed=7), perturb_seed=None)].adapter
    again = trainer.models[create_run(trainer, LoraConfig(rank=RANK, seed=7), perturb_seed=None)].adapter
    other = trainer.models[create_run(trainer, LoraConfig(rank=RANK, seed=8), perturb_seed=None)].adapter

    for name in first.lora_A:
        assert torch.equal(first.lora_A[name], again.lora_A[name])
        assert not torch.equal(first.lora_A[name], other.lora_A[name])
        assert first.lora_A[name].abs().max() > 0


def test_a_fresh_adapter_has_zero_b_and_gives_the_base_model_logprobs(trainer, reference):
    model_id = create_run(trainer, LoraConfig(rank=RANK, seed=3), perturb_seed=None)
    adapter = trainer.models[model_id].adapter
    batch = sft_batch(7, [10, 4], trainer.base.vocab_size)

    result = trainer.forward_backward(model_id, batch, "cross_entropy", None, forward_only=True)

    assert all(torch.count_nonzero(b) == 0 for b in adapter.lora_B.values())
    for example, output in zip(batch, result.outputs, strict=True):
        with torch.no_grad():
            expected = reference_logprobs(reference, None, example)
        torch.testing.assert_close(torch.from_numpy(output["logprobs"]), expected, rtol=0, atol=1e-5)


# -- checkpoints ----------------------------------------------------------------------------------


def test_a_training_checkpoint_reproduces_the_next_update_in_another_trainer(trainer, chunked_trainer, tmp_path):
    vocab = trainer.base.vocab_size
    lora_config = LoraConfig(rank=RANK, seed=0, train_mlp=False)
    original_id = create_run(trainer, lora_config)
    for seed in (20, 21):
        train_step(trainer, original_id, sft_batch(seed, [6, 9], vocab), ADAM)
    save(trainer, original_id, tmp_path / "state", with_optimizer=True)
    saved = parameters(trainer, original_id)
    next_batch = sft_batch(22, [8, 5], vocab)
    train_step(trainer, original_id, next_batch, ADAM)
    expected = parameters(trainer, original_id)

    restored_id = "restored"
    assert trainer.create_model_from_checkpoint(restored_id, tmp_path / "state", with_optimizer=True) == lora_config
    assert trainer.models[restored_id].num_steps == 2
    assert_all_close(parameters(trainer, restored_id), saved, rtol=0, atol=0)
    train_step(trainer, restored_id, next_batch, ADAM)
    assert_all_close(parameters(trainer, restored_id), expected, rtol=1e-5, atol=1e-6)

    # load_state into an existing run of the same shape, on another trainer and base model copy.
    other_id = create_run(chunked_trainer, lora_config.model_copy(update={"seed": 99}))
    chunked_trainer.load_state(other_id, tmp_path / "state", with_optimizer=True)
    assert_all_close(parameters(chunked_trainer, other_id), saved, rtol=0, atol=0)
    train_step(chunked_trainer, other_id, next_batch, ADAM)
    assert_all_close(parameters(chunked_trainer, other_id), expected, rtol=1e-4, atol=1e-5)


def test_loading_a_checkpoint_without_the_optimizer_resets_the_adam_moments(trainer, tmp_path):
    vocab = trainer.base.vocab_size
    original_id = create_run(trainer)
    for seed in (30, 31):
        train_step(trainer, original_id, sft_batch(seed, [6, 9], vocab), ADAM)
    save(trainer, original_id, tmp_path / "state", with_optimizer=True)
    saved = parameters(trainer, original_id)
    next_batch = sft_batch(32, [7], vocab)

    fresh_id = "weights-only"
    trainer.create_model_from_checkpoint(fresh_id, tmp_path / "state", with_optimizer=False)
    assert trainer.models[fresh_id].optimizer.state_dict()["state"] == {}
    trainer.forward_backward(fresh_id, next_batch, "cross_entropy", None, forward_only=False)
    grads = gradients(trainer, fresh_id)
    trainer.optim_step(fresh_id, ADAM)
    # A first AdamW step from the saved weights, not a third step with the saved moments.
    assert_all_close(parameters(trainer, fresh_id), reference_adamw(saved, [grads], ADAM), rtol=1e-5, atol=1e-6)
    train_step(trainer, original_id, next_batch, ADAM)
    assert not all_close(parameters(trainer, fresh_id), parameters(trainer, original_id), rtol=1e-4, atol=1e-5)

    # load_state without the optimizer also drops the moments an existing run had.
    trainer.load_state(original_id, tmp_path / "state", with_optimizer=False)
    assert trainer.models[original_id].optimizer.state_dict()["state"] == {}
    assert_all_close(parameters(trainer, original_id), saved, rtol=0, atol=0)


def test_checkpoint_loads_that_cannot_work_are_refused(trainer, tmp_path):
    model_id = create_run(trainer)
    save(trainer, model_id, tmp_path / "sampler", with_optimizer=False)
    save(trainer, model_id, tmp_path / "state", with_optimizer=True)

    with pytest.raises(InvalidRequest, match="no optimizer state"):
        trainer.create_model_from_checkpoint("needs-optimizer", tmp_path / "sampler", with_optimizer=True)
    other_rank_id = create_run(trainer, LoraConfig(rank=RANK * 2, seed=0))
    with pytest.raises(InvalidRequest, match="rank"):
        trainer.load_state(other_rank_id, tmp_path / "state", with_optimizer=True)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_a_sampler_checkpoint_loads_in_peft_and_gives_the_trainer_logprobs(trainer, tmp_path):
    model_id = create_run(trainer)
    train_step(trainer, model_id, sft_batch(40, [6, 9], trainer.base.vocab_size), ADAM)
    batch = sft_batch(41, [12, 5], trainer.base.vocab_size)
    result = trainer.forward_backward(model_id, batch, "cross_entropy", None, forward_only=True)

    assert save(trainer, model_id, tmp_path / "sampler", with_optimizer=False) > 0
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trainer.base.path),
                                           tmp_path / "sampler").eval()

    for example, output in zip(batch, result.outputs, strict=True):
        targets = example.loss_fn_inputs["target_tokens"]
        with torch.no_grad():
            logits_NV = peft_model(input_ids=torch.tensor([example.input_ids])).logits[0]
        expected = torch.log_softmax(logits_NV.float(), dim=-1).gather(-1, targets[:, None])[:, 0]
        torch.testing.assert_close(torch.from_numpy(output["logprobs"]), expected, rtol=0, atol=1e-4)
    # The adapter really changes the model, so PEFT must apply it to match.
    with torch.no_grad(), peft_model.disable_adapter():
        base_logits_NV = peft_model(input_ids=torch.tensor([batch[0].input_ids])).logits[0]
    base_logprobs = torch.log_softmax(base_logits_NV.float(), dim=-1).gather(
        -1, batch[0].loss_fn_inputs["target_tokens"][:, None])[:, 0]
    assert (torch.from_numpy(result.outputs[0]["logprobs"]) - base_logprobs).abs().max() > 1e-3


@pytest.mark.parametrize("name,recomputes", [("tiny-qwen3-vl-moe", True), ("tiny-qwen3", False)])
def test_moe_families_recompute_their_decoder_blocks_without_being_asked(models_dir, name, recomputes):
    # Routed experts keep every (token, expert) pair's activations: a Qwen3-VL-30B-A3B micro-batch ran out of an
    # H200's memory without recomputation, so MoE families (and hybrid ones) always recompute.
    base = load_base_model(ModelConfig(base_model=f"builtin:{name}", model_path=None, model_cache_dir=models_dir))
    Trainer(base, TrainerConfig(), init_training_group(0, 1, "cpu", "127.0.0.1", free_port()))
    layers = base.model.get_submodule(base.family.language_model_prefix.rstrip("."))
    assert [isinstance(layer, CheckpointWrapper) for layer in layers] == [recomputes] * len(layers)


# -- invalid input --------------------------------------------------------------------------------
