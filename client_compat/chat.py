"""Chat messages -> the token and image chunks of a `tinker.ModelInput`, with the model's own chat template.

`ChatRenderer` renders a whole conversation (`render`) or only the messages that follow an assistant
turn (`bridge`): the second is what a multi-turn rollout appends after the sampled tokens, so the
history is never re-rendered or re-tokenised. It also knows the template's end-of-turn tokens (what
it writes right after an assistant message) and which token stops sampling. Messages are in the
Hugging Face format: `{"role": ..., "content": str | [{"type": "text", "text": ...},
{"type": "image", "image": PIL.Image}]}`. Images become chunks through `ImageChunker`, the same bytes
for the same image. Knows nothing about sampling, rewards or losses.
"""

import hashlib
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from PIL import Image
from tinker import types
from transformers import AutoTokenizer

from client_compat.images import ImageChunker

Message = dict[str, Any]
Chunk = types.EncodedTextChunk | types.ImageChunk

# Stand-ins for the turn before the new messages: only what the template writes after them is kept.
_BEFORE = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
_MARKER = "\x00end-of-content\x00"
RECENT_IMAGES = 256
"""Image chunks kept for reuse (PNG encoding is deterministic, so an evicted image still gets the same bytes)."""
RECENT_TEXTS = 1024
"""Bridged texts whose tokens are kept for reuse."""


class ChatRenderer:
    """Renders messages for one model: `ChatRenderer.from_model_dir(get_info().model_data.tokenizer_id)`."""

    def __init__(self, tokenizer, chunker: ImageChunker | None = None, image_placeholder: str = "<|image_pad|>",
                 template_kwargs: dict[str, Any] | None = None):
        """
        Args:
            image_placeholder: what the chat template writes for an image part (one per image); the
                chunk list carries the image chunk there instead, and never the placeholder token.
            template_kwargs: passed to apply_chat_template (e.g. enable_thinking=False).
        """
        self.tokenizer = tokenizer
        self.chunker = chunker
        self.image_placeholder = image_placeholder
        self.template_kwargs = template_kwargs or {}
        self._images: OrderedDict[str, types.ImageChunk] = OrderedDict()
        self._lock = threading.Lock()
        after_assistant = self._template([{"role": "user", "content": "."},
                                          {"role": "assistant", "content": _MARKER}], generation_prompt=False)
        self.end_of_turn = self._encode(after_assistant.split(_MARKER)[-1])
        """Tokens the template writes right after an assistant message (e.g. <|im_end|> and a newline)."""
        if not self.end_of_turn or self.end_of_turn[0] not in tokenizer.all_special_ids:
            raise ValueError(f"the chat template does not end an assistant turn with a special token "
                             f"({after_assistant.split(_MARKER)[-1]!r}); this renderer needs one to stop on")
        self.stop_tokens = [self.end_of_turn[0]]
        """What sampling stops on: the first end-of-turn token (Qwen's <|im_end|>)."""
        # The stand-in turn, as the template writes it, and whether it ends with the end-of-turn tokens (else
        # nothing can be appended after a sampled turn: every turn renders the whole conversation).
        self._before = self._template(_BEFORE, generation_prompt=False)
        self._before_tokens = self._encode(self._before)
        self._appends = self._before.endswith(self.tokenizer.decode(self.end_of_turn))
        self._bridges: OrderedDict[str, list[list[int]] | None] = OrderedDict()

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, **kwargs) -> "ChatRenderer":
        """Tokenizer and chat template from a model directory; images too if it has a preprocessor config."""
        chunker = ImageChunker(model_dir) if (Path(model_dir) / "preprocessor_config.json").exists() else None
        return cls(AutoTokenizer.from_pretrained(model_dir), chunker, **kwargs)

    def render(self, messages: list[Message], generation_prompt: bool = True) -> list[Chunk]:
        """The whole conversation, as the template writes it (ending in the generation prompt)."""
        return self._chunks(self._template(messages, generation_prompt), messages)

    def bridge(self, messages: list[Message]) -> list[Chunk] | None:
        """What the template writes for `messages` after an assistant turn and its end-of-turn tokens,
        up to and including the next generation prompt; None if the template does not simply append
        them there (it rewrites what came before) or the tokens at the seam would change."""
        if not self._appends:
            return None
        after = self._template(_BEFORE + messages, generation_prompt=True)
        if not after.startswith(self._before):
            return None
        pieces = self._bridge_pieces(after[len(self._before):])
        return None if pieces is None else self._with_images(pieces, messages)

    def _bridge_pieces(self, delta: str) -> list[list[int]] | None:
        """The tokens of `delta` (what follows the stand-in turn) between its image placeholders, or None where
        tokenising it after that turn gives other tokens at the seam. Remembered for recent texts: a multi-turn
        environment's observations repeat their wording, and every turn would tokenise it three times."""
        with self._lock:
            if delta in self._bridges:
                self._bridges.move_to_end(delta)
                return self._bridges[delta]
        joined = self._encode(self._before + delta) == self._before_tokens + self._encode(delta)
        pieces = self._pieces(delta) if joined else None
        with self._lock:
            self._bridges[delta] = pieces
            if len(self._bridges) > RECENT_TEXTS:
                self._bridges.popitem(last=False)
        return pieces

    def decode(self, tokens: list[int]) -> str:
        """Text of sampled tokens, without the stop token they end with."""
        if tokens and tokens[-1] in self.stop_tokens:
            tokens = tokens[:-1]
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def image_chunk(self, image: Image.Image) -> types.ImageChunk:
        """The image's chunk: the same bytes for the same pixels, one object while it is among the recent ones."""
        if self.chunker is None:
            raise ValueError("this model takes no images (its directory has no preprocessor_config.json)")
        key = hashlib.sha256(f"{image.mode}{image.size}".encode() + image.tobytes()).hexdigest()
        with self._lock:  # the envs of a group render on several threads
            chunk = self._images.pop(key, None)
        chunk = chunk or self.chunker.chunk(image)
        with self._lock:
            self._images[key] = self._images.get(key, chunk)
            if len(self._images) > RECENT_IMAGES:
                self._images.popitem(last=False)
            return self._images[key]

    def _template(self, messages: list[Message], generation_prompt: bool) -> str:
        plain = [{**m, "content": [{"type": "image"} if _is_image(part) else part for part in m["content"]]}
                 if isinstance(m["content"], list) else m for m in messages]
        return self.tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **self.template_kwargs)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _chunks(self, text: str, messages: list[Message]) -> list[Chunk]:
        """Text split at each image placeholder, the messages' images (in order) put in between."""
        return self._with_images(self._pieces(text), messages)

    def _pieces(self, text: str) -> list[list[int]]:
        """The tokens of the text between image placeholders (one more piece than placeholders)."""
        return [self._encode(piece) for piece in text.split(self.image_placeholder)]

    def _with_images(self, pieces: list[list[int]], messages: list[Message]) -> list[Chunk]:
        """The pieces' tokens with the messages' images (in order) in between."""
        images = [part["image"] for m in messages if isinstance(m["content"], list)
                  for part in m["content"] if _is_image(part)]
        if len(pieces) != len(images) + 1:
            raise ValueError(f"the chat template wrote {len(pieces) - 1} image placeholders "
                             f"({self.image_placeholder!r}) for {len(images)} images")
        chunks: list[Chunk] = []
        for index, tokens in enumerate(pieces):
            if tokens:
                chunks.append(types.EncodedTextChunk(tokens=list(tokens)))
            if index < len(images):
                chunks.append(self.image_chunk(images[index]))
        return chunks


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and (part.get("type") == "image" or "image" in part)
