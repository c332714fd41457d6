"""Resolve the served base model to a directory and load it (weights frozen) with its tokenizer.

Knows the three places a model can come from: a built-in model (built on first use), an
explicit `--model-path` directory, or the local hub cache. Never touches the network.
"""

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from packaging.version import Version

from server.config import ModelConfig
from server.models.attention import use_varlen_vision_attention
from server.models.image_processor import ImageProcessorSpec
from server.models.registry import ModelFamily, VisionSpec, family_for
from server.models.builtin import builtin_name, ensure_builtin_model, register_in_hub_cache, served_name
from server.models.expert_layout import fused_weights_dir
from server.progress import Progress, on_terminal

logger = logging.getLogger(__name__)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not on_terminal():
    # Their bars, redrawn with carriage returns, only garble a log file; Progress logs lines instead.
    transformers.utils.logging.disable_progress_bar()


@dataclass(frozen=True)
class LoadedVision:
    """What rendering needs to put images into this checkpoint's sequences."""

    spec: VisionSpec
    processor: ImageProcessorSpec
    image_token_id: int
    reserved_token_ids: frozenset[int]
    """The image pad and the other media placeholders: never accepted inside a client's text."""


@dataclass
class LoadedModel:
    name: str
    """The name clients use (`base_model`); a built-in's hub-style one (`builtin/tiny-qwen3`)."""
    path: Path
    family: ModelFamily
    model: torch.nn.Module
    tokenizer: transformers.PreTrainedTokenizerBase
    vocab_size: int
    """Rows of the embedding matrix: token ids must be below this."""
    eos_token_ids: tuple[int, ...]
    vision: LoadedVision | None
    """None for a text-only model."""


def resolve_model_dir(config: ModelConfig) -> Path:
    """Where the base model's files are: --model-path, the built-in builder (registered in the local hub cache
    for the SDK's tokenizer lookup), or the local hub cache."""
    if config.model_path is not None:
        if not (config.model_path / "config.json").exists():
            raise ValueError(f"--model-path {config.model_path} has no config.json")
        return config.model_path.resolve()
    if (name := builtin_name(config.base_model)) is not None:
        path = ensure_builtin_model(name, config.model_cache_dir)
        register_in_hub_cache(name, path)
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(config.base_model, local_files_only=True))
    except Exception as exc:
        raise ValueError(f"{config.base_model!r} is neither builtin:... nor in the local hub cache; "
                         f"pass --model-path DIR") from exc


def load_base_model(config: ModelConfig, device: torch.device | str | None = None,
                    blocks_on_host: bool = False) -> LoadedModel:
    """Load the frozen base model in `config.dtype` on `device` (default `config.device`).

    Args:
        blocks_on_host: leave the decoder blocks where the load put them (memory-mapped from the
            checkpoint when its dtype is `config.dtype`) for FSDP to move block by block while it
            shards them: a rank then never holds the whole model, on its device or in its own memory
            (or, replicated, for the trainer to move whole once the ranks have chosen).
    """
    device = device if device is not None else config.device
    with Progress("model_load", f"Loading {config.base_model}", logger, base_model=config.base_model,
                  device=device, dtype=config.dtype) as step:
        path = resolve_model_dir(config)
        step.note(f"weights from {path}")
        hf_config = transformers.AutoConfig.from_pretrained(path)
        family = family_for(hf_config.model_type)
        if family.hybrid:
            _check_linear_attention_kernels(torch.device(device))
        auto_class = getattr(transformers, family.auto_class)
        weights = fused_weights_dir(path, config.model_cache_dir, lambda: _parameter_shapes(auto_class, hf_config))
        if weights != path:
            step.note(f"fused experts from {weights}")
        model = auto_class.from_pretrained(weights, dtype=getattr(torch, config.dtype), attn_implementation="sdpa")
        step.note(f"moving to {device}")
        if blocks_on_host:
            _move_all_but(model, family.language_model_prefix.rstrip("."), device)
        else:
            model.to(device)
        model.eval().requires_grad_(False)
        if family.vision is not None:
            use_varlen_vision_attention(model.get_submodule(family.vision.tower_module))
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    eos = model.generation_config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else (tokenizer.eos_token_id,))
    return LoadedModel(name=served_name(config.base_model), path=path, family=family, model=model, tokenizer=tokenizer,
                       vocab_size=model.get_input_embeddings().num_embeddings, eos_token_ids=eos_ids,
                       vision=_load_vision(family.vision, path, hf_config, tokenizer))


def _check_linear_attention_kernels(device: torch.device) -> None:
    """Refuse at start-up what would fail at the first backward: flash-linear-attention, which transformers uses
    for Qwen3.5's linear attention whenever it imports, with a Triton its backward refuses on this GPU."""
    if device.type != "cuda" or importlib.util.find_spec("fla") is None:
        return
    import triton

    problem = linear_attention_kernels_problem(torch.cuda.get_device_capability(device), triton.__version__)
    if problem:
        raise ValueError(problem)


def linear_attention_kernels_problem(capability: tuple[int, int], triton_version: str) -> str | None:
    """Why flash-linear-attention cannot train on a GPU of this compute capability with this Triton, if it cannot.

    On Hopper (9.x) its gated backward refuses Triton 3.4.0 up to 3.7.0: those give wrong gradients there.
    """
    version = Version(triton_version)
    if capability[0] == 9 and Version("3.4.0") <= version < Version("3.7.1"):
        return (f"flash-linear-attention is installed, and on this Hopper GPU its backward for Qwen3.5's linear "
                f"attention refuses Triton {triton_version} (3.4.0 to 3.7.0 compute wrong gradients there): install "
                f"Triton 3.7.1 or newer (`pip install triton==3.7.1`), or uninstall flash-linear-attention and "
                f"fla-core to train with transformers' slower PyTorch path")
    return None


def _parameter_shapes(auto_class, hf_config) -> dict[str, torch.Size]:
    """The model's parameters and buffers by name and shape, from a skeleton that allocates nothing."""
    with torch.device("meta"):
        skeleton = auto_class.from_config(hf_config)
    return {name: tensor.shape for name, tensor in skeleton.state_dict().items()}


def _move_all_but(model: torch.nn.Module, blocks: str, device: torch.device | str) -> None:
    """Move every parameter and buffer to `device` except those of the module list `blocks`."""
    parent, _, leaf = blocks.rpartition(".")
    holder = model.get_submodule(parent)
    kept = getattr(holder, leaf)
    setattr(holder, leaf, torch.nn.ModuleList())
    try:
        model.to(device)
    finally:
        setattr(holder, leaf, kept)


def _load_vision(spec: VisionSpec | None, path: Path, hf_config, tokenizer) -> LoadedVision | None:
    if spec is None:
        return None
    image_token_id = tokenizer.convert_tokens_to_ids(spec.image_token)
    if image_token_id != hf_config.image_token_id:
        raise ValueError(f"the tokenizer's {spec.image_token} is {image_token_id} but config.json says "
                         f"image_token_id {hf_config.image_token_id}")
    reserved = {image_token_id, *(tokenizer.convert_tokens_to_ids(t) for t in spec.reserved_tokens)}
    return LoadedVision(spec=spec, processor=ImageProcessorSpec.from_model_dir(path), image_token_id=image_token_id,
                        reserved_token_ids=frozenset(reserved))
