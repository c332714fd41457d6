"""Numerics of a served text model through the SDK, whatever engine samples: greedy sampling equals HF
`generate` on the same directory, and the sampler's logprobs equal the trainer's (fp32: mean absolute
difference under 1e-4, max under 1e-3), for the base model and for a trained adapter.
"""

from pathlib import Path

import numpy as np
import tinker
import torch
from tinker import types
from transformers import AutoModelForCausalLM

from support.sdk import forward_logprobs

CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "user", "content": "Write one sentence about a cat who likes the rain."}]]
MAX_TOKENS = 16


def assert_close_logprobs(computed, expected, where: str) -> None:
    difference = np.abs(np.asarray(computed, dtype=np.float64) - np.asarray(expected, dtype=np.float64))
    assert difference.mean() < 1e-4 and difference.max() < 1e-3, \
        f"{where}: mean {difference.mean():.2e}, max {difference.max():.2e}"


def hf_greedy(model_dir: Path, prompts: list[list[int]], eos_token_id: int) -> list[tuple[list[int], np.ndarray]]:
    """HF generate's greedy continuation of each prompt, with the logprob of each generated token."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    results = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=eos_token_id, output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        logprobs = [torch.log_softmax(logits[0].double(), -1)[token].item() for logits, token in zip(out.logits, tokens)]
        results.append((tokens, np.array(logprobs)))
    return results


def sequence_datum(prompt: list[int], completion: list[int]) -> types.Datum:
    tokens = prompt + completion
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def check_sampler_against_trainer(sampler: tinker.SamplingClient, training: tinker.TrainingClient,
                                  prompts: list[list[int]], where: str) -> None:
    """Sampled-token logprobs (seeded, temperature 1) and prompt logprobs equal the trainer's forward."""
    for prompt in prompts:
        sample = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1,
                                sampling_params=types.SamplingParams(max_tokens=8, seed=5, stop=[])).result()
        completion = sample.sequences[0].tokens
        expected = forward_logprobs(training, [sequence_datum(prompt, completion)])[0]
        assert_close_logprobs(sample.sequences[0].logprobs, expected[len(prompt) - 1:], f"{where} sampled tokens")
        prompt_logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + completion)).result()
        assert_close_logprobs(prompt_logprobs[1:], expected, f"{where} prompt logprobs")


def check_real_model_numerics(service: tinker.ServiceClient, base_model: str, model_dir: Path,
                              train_unembed: bool = True) -> None:
    training = service.create_lora_training_client(base_model=base_model, rank=8, seed=1,
                                                    train_unembed=train_unembed).result()
    tokenizer = training.get_tokenizer()
    prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in CHATS]
    prompts = [tokenizer.encode(text) for text in prompts]

    base = service.create_sampling_client(base_model=base_model).result()
    greedy = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=[tokenizer.eos_token_id])
    references = hf_greedy(model_dir, prompts, tokenizer.eos_token_id)
    assert tokenizer.decode(references[0][0]) == "The capital of France is Paris." + tokenizer.eos_token
    for prompt, (tokens, logprobs) in zip(prompts, references):
        sequence = base.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=greedy).result() \
            .sequences[0]
        assert sequence.tokens == tokens, (tokenizer.decode(sequence.tokens), tokenizer.decode(tokens))
        assert_close_logprobs(sequence.logprobs, logprobs, "greedy logprobs against HF")

    check_sampler_against_trainer(base, training, prompts, "base model")
    data = [sequence_datum(prompt, tokenizer.encode(" It rains, and the cat is happy.")) for prompt in prompts]
    for _ in range(2):
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    check_sampler_against_trainer(training.save_weights_and_get_sampling_client().result(), training, prompts,
                                  "trained adapter")
