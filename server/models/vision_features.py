"""The frozen vision tower's output per image, computed once per content hash and shared by trainer and sampler.

LoRA never adapts the vision tower, so an image's features depend on its pixels alone: an image
repeated across a batch, across samples or across training steps is encoded once. Entries are the
per-image slices of what the model's `get_image_features` returns (merged patch embeddings, and
Qwen3-VL's deepstack features), kept in a byte-bounded LRU on the model's device and joined back
into the model's own output type for `mm_encoder_outputs`. Knows nothing about tokens or requests.
"""

import threading
from collections import OrderedDict

import torch
from transformers.utils import ModelOutput

from server.models.image_processor import PreparedImage

# Per image, each field of the vision output: a tensor, or one tensor per deepstack layer.
ImageFeatures = dict[str, torch.Tensor | list[torch.Tensor]]
# What a cached tensor costs besides its data (the Python object, its TensorImpl and storage, the
# entry's dict): counted so that a small model's tiny features are bounded by what they really hold.
TENSOR_OVERHEAD_BYTES = 1024


class VisionEncoder:
    def __init__(self, model: torch.nn.Module, cache_bytes: int):
        # The HF *ForConditionalGeneration model; its inner model computes image features.
        self.backbone = model.model
        self.device = next(model.parameters()).device
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, ImageFeatures] = OrderedDict()
        self._cached_bytes = 0
        self._output_type: type[ModelOutput] | None = None

    def encoder_outputs(self, images: list[PreparedImage]) -> dict[str, ModelOutput]:
        """`mm_encoder_outputs` for a sequence (or batch) holding these images, in order."""
        features = self._lookup(images)
        missing = {image.sha256: image for image, found in zip(images, features) if found is None}
        if missing:
            computed = self._compute(list(missing.values()))
            features = [found if found is not None else computed[image.sha256]
                        for image, found in zip(images, features)]
        first = features[0]
        joined = {name: [tuple(f[name][layer] for f in features) for layer in range(len(value))]
                  if isinstance(value, list) else tuple(f[name] for f in features)
                  for name, value in first.items()}
        return {"image": self._output_type(**joined)}

    def _lookup(self, images: list[PreparedImage]) -> list[ImageFeatures | None]:
        with self._lock:
            found = [self._cache.get(image.sha256) for image in images]
            for image, entry in zip(images, found):
                if entry is not None:
                    self._cache.move_to_end(image.sha256)
        return found

    @torch.no_grad()
    def _compute(self, images: list[PreparedImage]) -> dict[str, ImageFeatures]:
        pixel_values = torch.cat([image.pixel_values_on(self.device) for image in images])
        grid_thw = torch.tensor([image.grid_thw for image in images], dtype=torch.long, device=self.device)
        output = self.backbone.get_image_features(pixel_values, grid_thw, return_dict=True)
        self._output_type = type(output)
        per_image: list[ImageFeatures] = [{} for _ in images]
        for name, value in output.items():
            # Split fields come back as one tuple per image, or a list (per layer) of such tuples;
            # the rest (pre-merge hidden states) is not needed to run the language model.
            if isinstance(value, tuple) and len(value) == len(images):
                for index, tensor in enumerate(value):
                    per_image[index][name] = tensor.clone()  # a view would keep the whole batch alive
            elif isinstance(value, list) and all(isinstance(v, tuple) and len(v) == len(images) for v in value):
                for index in range(len(images)):
                    per_image[index][name] = [layer[index].clone() for layer in value]
        computed = {image.sha256: features for image, features in zip(images, per_image)}
        with self._lock:
            for sha256, features in computed.items():
                if sha256 not in self._cache:
                    self._cache[sha256] = features
                    self._cached_bytes += _nbytes(features)
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                _, evicted = self._cache.popitem(last=False)
                self._cached_bytes -= _nbytes(evicted)
        return computed


def _nbytes(features: ImageFeatures) -> int:
    tensors = [t for value in features.values() for t in (value if isinstance(value, list) else [value])]
    return sum(t.numel() * t.element_size() + TENSOR_OVERHEAD_BYTES for t in tensors)
