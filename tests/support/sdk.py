"""Small builders shared by the SDK tests: data, reading logprobs back through the SDK, and PEFT's view."""

from pathlib import Path

import numpy as np
import tinker
import torch
from tinker import types

SENTENCES = [
    "What colour is the square? It is red.",
    "The blue circle is on the left of the picture.",
    "One two three four five six seven.",
    "Hello world, the model will learn this sentence.",
    "A small green square sits at the bottom.",
    "Which shape is big? The circle is big.",
]


def supervised_datum(tokenizer, text: str, weight: float = 1.0) -> types.Datum:
    """Next-token prediction on the whole text."""
    ids = tokenizer.encode(text)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [weight] * (len(ids) - 1)})


def forward_logprobs(training_client: tinker.TrainingClient, data: list[types.Datum]) -> list[np.ndarray]:
    out = training_client.forward(data, "cross_entropy").result()
    return [np.asarray(o["logprobs"].tolist(), dtype=np.float64) for o in out.loss_fn_outputs]


def prompt_of(datum: types.Datum) -> list[int]:
    """The datum's full token sequence (inputs plus the last target)."""
    tokens = datum.model_input.to_ints()
    return tokens + [int(datum.loss_fn_inputs["target_tokens"].tolist()[-1])]


def peft_logprobs(base_dir: Path, adapter_dir: Path, ids: list[int]) -> np.ndarray:
    """Next-token logprobs of `ids` from PEFT: the base model in `base_dir` with the adapter in `adapter_dir`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


def check_sampling_parameters(sampler: tinker.SamplingClient, tokenizer) -> None:
    """Greedy, top_k, seeds, num_samples, stop tokens and stop strings behave as Tinker defines them."""
    prompt = types.ModelInput.from_ints(tokenizer.encode("The blue circle"))

    def run(**params):
        return sampler.sample(prompt, num_samples=params.pop("num_samples", 1),
                              sampling_params=types.SamplingParams(**params)).result().sequences

    greedy = run(max_tokens=8, temperature=0.0, stop=[])
    assert len(greedy[0].tokens) == 8 and greedy[0].stop_reason == "length"
    assert [s.tokens for s in run(max_tokens=8, top_k=1, seed=1, stop=[])] == [greedy[0].tokens]
    seeded = run(max_tokens=8, seed=7, num_samples=3, stop=[])
    assert len(seeded) == 3 and len({tuple(s.tokens) for s in seeded}) > 1
    assert [s.tokens for s in run(max_tokens=8, seed=7, num_samples=3, stop=[])] == [s.tokens for s in seeded]
    assert [s.tokens for s in run(max_tokens=8, seed=8, num_samples=3, stop=[])] != [s.tokens for s in seeded]
    stop_token = greedy[0].tokens[3]
    stopped = run(max_tokens=8, temperature=0.0, stop=[stop_token])[0]
    assert stopped.stop_reason == "stop" and stopped.tokens[-1] == stop_token
    assert stopped.tokens == greedy[0].tokens[:greedy[0].tokens.index(stop_token) + 1]
    stop_text = tokenizer.decode(greedy[0].tokens[2:4])
    by_string = run(max_tokens=8, temperature=0.0, stop=[stop_text])[0]
    assert by_string.stop_reason == "stop" and stop_text in tokenizer.decode(by_string.tokens)
