"""Sampling renderer (the VLLMRenderer): a prompt ModelInput -> what an inference engine takes.

An engine that expands image placeholders itself (vLLM, and the embedded engine the same way) must
get exactly ONE <|image_pad|> per image plus the images: vLLM silently expands pre-expanded ids a
second time. So the prompt stays collapsed here; its `num_positions` is the client's (expanded)
length, which prompt logprobs are reported against. Text-only prompts are their token ids and
never reach the image code. Knows nothing about engines, adapters or HTTP.
"""

from server.rendering.chunks import RenderContext, RenderedInput, render_model_input
from server.wire.model_input import ModelInput


class VLLMRenderer:
    def __init__(self, context: RenderContext):
        self.context = context

    def render(self, prompt: ModelInput) -> RenderedInput:
        """Validate the prompt and prepare its images (image chunks or local image_asset_pointers)."""
        return render_model_input(prompt, self.context, "prompt", allow_asset_pointers=True)
