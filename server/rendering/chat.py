"""OpenAI-style prompts -> the sampling renderer's input: chat messages through the model's chat template,
and text completion prompts through its tokenizer.

Chat messages are written by the tokenizer's own chat template (with the generation prompt); each
`image_url` part (a data: URL) becomes an image chunk where the template writes the image pad, so the
prompt is rendered exactly as a `ModelInput` of text and image chunks would be (`render_model_input`:
vocabulary, placeholders, image limits, length). Knows nothing about engines, adapters or HTTP.
"""

import base64
import binascii
import re

from transformers import PreTrainedTokenizerBase

from server.errors import InvalidRequest
from server.rendering.chunks import RenderContext, RenderedInput, render_model_input
from server.wire.model_input import EncodedTextChunk, ImageChunk, ModelInput
from server.wire.openai import ChatMessage, ImagePart

_DATA_URL = re.compile(r"data:image/(png|jpeg|jpg);base64,(.*)", re.DOTALL)


def render_chat(messages: list[ChatMessage], tokenizer: PreTrainedTokenizerBase,
                context: RenderContext) -> RenderedInput:
    """The conversation as the chat template writes it, ending in the generation prompt."""
    images: list[ImageChunk] = []
    templated = []
    for i, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role
        if isinstance(message.content, str):
            templated.append({"role": role, "content": message.content})
            continue
        parts = []
        for j, part in enumerate(message.content):
            if isinstance(part, ImagePart):
                if context.vision is None:
                    raise InvalidRequest(f"messages[{i}].content[{j}]: this model takes no images")
                images.append(_image_chunk(part.image_url.url, context, f"messages[{i}].content[{j}].image_url"))
                parts.append({"type": "image"})
            else:
                parts.append({"type": "text", "text": part.text})
        if context.vision is None:  # text-only templates take a string
            templated.append({"role": role, "content": "".join(p["text"] for p in parts)})
        else:
            templated.append({"role": role, "content": parts})
    try:
        text = tokenizer.apply_chat_template(templated, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # the template's own refusal (raise_exception), e.g. roles out of order
        raise InvalidRequest(f"the model's chat template refused these messages: {error}") from None
    pieces = text.split(context.vision.spec.image_token) if context.vision is not None else [text]
    if len(pieces) != len(images) + 1:
        raise InvalidRequest(f"the messages hold {len(images)} images but the chat template wrote "
                             f"{len(pieces) - 1} image placeholders (is one in a text part?)")
    chunks: list[EncodedTextChunk | ImageChunk] = []
    for piece, image in zip(pieces, [*images, None]):
        if piece:
            chunks.append(EncodedTextChunk(tokens=tokenizer.encode(piece, add_special_tokens=False)))
        if image is not None:
            chunks.append(image)
    return render_model_input(ModelInput(chunks=chunks), context, "messages")


def render_text_prompt(prompt: str | list[int], tokenizer: PreTrainedTokenizerBase, context: RenderContext,
                       where: str) -> RenderedInput:
    """A completion prompt: text (tokenized as the tokenizer does by default) or token ids."""
    tokens = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    return render_model_input(ModelInput(chunks=[EncodedTextChunk(tokens=tokens)]), context, where)


def _image_chunk(url: str, context: RenderContext, where: str) -> ImageChunk:
    """The image of a data: URL, decoded now so that a bad one is named by its place in the messages."""
    found = _DATA_URL.fullmatch(url.strip())
    if found is None:
        shown = url if len(url) <= 40 else url[:40] + "..."
        raise InvalidRequest(f"{where}: {shown!r} is not a data:image/png or data:image/jpeg base64 URL (this "
                             f"server fetches no images from the network)")
    try:
        data = base64.b64decode(found.group(2), validate=True)
    except binascii.Error as error:
        raise InvalidRequest(f"{where}: the data URL is not valid base64 ({error})") from None
    context.images.prepare(data, where)  # cached by content: rendering finds it again
    return ImageChunk(data=data, format="png" if found.group(1) == "png" else "jpeg")
