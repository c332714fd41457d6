"""What the vLLM engine reads from vLLM's generate answers, on answers of the shapes vLLM 0.26 and 0.32 give."""

from server.sampling.vllm import _images_dropped

# Two images of 64 pads each, sent collapsed to one pad each among 20 token ids: 146 positions.
SENT, EXPANDED = 20, 146


def test_an_answer_on_the_collapsed_prompt_dropped_its_images():
    # vLLM 0.26 ignores content_parts and runs the 20 ids as text; 0.32 expands each pad from its image.
    assert _images_dropped({"usage": {"prompt_tokens": SENT}}, EXPANDED)
    assert not _images_dropped({"usage": {"prompt_tokens": EXPANDED}}, EXPANDED)
    assert not _images_dropped({"choices": []}, EXPANDED)  # no usage reported: nothing to judge by
