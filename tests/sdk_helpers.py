"""Small builders shared by the SDK tests: data, and reading logprobs back through the SDK."""

import numpy as np
import tinker
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
