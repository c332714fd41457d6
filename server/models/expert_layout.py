"""Checkpoints of a mixture of experts in the layout transformers loads without converting: fused experts.

Releases of Qwen MoE models store every routed expert's projections as tensors of their own
(`...experts.7.gate_proj.weight`: 30,720 of them for a 40-layer, 256-expert model), while transformers
keeps two fused parameters per layer (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I])
and rebuilds them on every load: stacking and concatenating in host memory, about twice the model's
bytes and ten times the time of a plain load, in every process that loads it (every training rank).
A checkpoint in the fused layout loads memory-mapped, in seconds. This module writes that layout (the
benchmark's random checkpoints, and a fused copy of a per-expert release, made once under the model
cache directory). Knows nothing about training or sharding.
"""

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<projection>gate_proj|up_proj|down_proj)"
                        r"\.weight$")
INDEX = "model.safetensors.index.json"
SHARD_BYTES = 4 << 30
# What transformers needs beside the weights to build the model; the tokenizer and processor files are
# read from the original directory.
CONFIG_FILES = ("config.json", "generation_config.json")


def write_safetensors(tensors: Iterable[tuple[str, torch.Tensor]], out: Path, shard_bytes: int = SHARD_BYTES) -> None:
    """Write named tensors as safetensors shards of about `shard_bytes` and their index, one shard in
    memory at a time."""
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}  # tensor name -> shard file
    shard: dict[str, torch.Tensor] = {}
    shard_size = total_size = 0
    for name, tensor in tensors:
        shard[name] = tensor.detach().to("cpu").contiguous()
        shard_size += tensor.numel() * tensor.element_size()
        if shard_size >= shard_bytes:
            total_size += _write_shard(shard, out, files)
            shard, shard_size = {}, 0
    if shard:
        total_size += _write_shard(shard, out, files)
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": files}, indent=1))


def _write_shard(shard: dict[str, torch.Tensor], out: Path, files: dict[str, str]) -> int:
    """Write one shard file, note where its tensors are; its size in bytes."""
    name = f"model-{len(set(files.values())) + 1:05d}.safetensors"
    save_file(shard, out / name, metadata={"format": "pt"})
    files.update(dict.fromkeys(shard, name))
    return sum(tensor.numel() * tensor.element_size() for tensor in shard.values())


def weight_map(path: Path) -> dict[str, str]:
    """Every tensor name of a safetensors checkpoint directory, with the file that holds it."""
    if (path / INDEX).exists():
        return json.loads((path / INDEX).read_text())["weight_map"]
    if (path / "model.safetensors").exists():
        with safe_open(path / "model.safetensors", "pt") as handle:
            return dict.fromkeys(handle.keys(), "model.safetensors")
    return {}


def fused_weights_dir(path: Path, cache_dir: Path, parameter_shapes: Callable[[], dict[str, torch.Size]]) -> Path:
    """Where to load `path`'s weights from: `path` itself, or, if it stores per-expert tensors, a fused
    copy under `cache_dir` (written once, by whichever process gets there first; the others wait for it).

    Args:
        parameter_shapes: the model's parameters, name -> shape (called only for a per-expert checkpoint).
    """
    files = weight_map(path)
    if not any(PER_EXPERT.match(name) for name in files):
        return path
    stamp = hashlib.sha256(str(path.resolve()).encode())
    for name in sorted(set(files.values())):
        stat = (path / name).stat()
        stamp.update(f"{name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    target = cache_dir / "fused-experts" / f"{path.name}-{stamp.hexdigest()[:16]}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not (target / INDEX).exists():
            expected = parameter_shapes()
            if not any(f"{prefix}.gate_up_proj" in expected for prefix in _experts(files)):
                logger.warning("%s: no per-expert tensors match the model's fused experts by name; transformers "
                               "converts them on every load (slow for a large model)", path)
                return path
            partial = target.parent / f"{target.name}.partial-{os.getpid()}"
            shutil.rmtree(partial, ignore_errors=True)
            logger.info("fusing the per-expert tensors of %s into %s (once)", path, target)
            write_safetensors(_fused_tensors(path, files, expected), partial)
            for name in CONFIG_FILES:
                if (path / name).exists():
                    shutil.copy(path / name, partial / name)
            partial.rename(target)
    return target


def _fused_tensors(path: Path, files: dict[str, str], expected: dict[str, torch.Size]):
    """The checkpoint's tensors with each layer's experts fused as transformers fuses them on load
    (gate_up_proj = [stacked gate_proj, stacked up_proj] along dim 1; down_proj stacked). Experts the
    model has no parameter for (a multi-token-prediction head) are left out, as a load would ignore them."""
    handles = {}

    def tensor(name: str) -> torch.Tensor:
        file = files[name]
        if file not in handles:
            handles[file] = safe_open(path / file, "pt")
        return handles[file].get_tensor(name)

    for name in files:
        if not PER_EXPERT.match(name):
            yield name, tensor(name)
    for prefix, projections in _experts(files).items():
        if f"{prefix}.gate_up_proj" not in expected:
            continue

        def stacked(projection: str) -> torch.Tensor:
            names = projections[projection]
            return torch.stack([tensor(names[index]) for index in range(len(names))])

        fused = {f"{prefix}.gate_up_proj": torch.cat([stacked("gate_proj"), stacked("up_proj")], dim=1),
                 f"{prefix}.down_proj": stacked("down_proj")}
        for name, value in fused.items():
            if value.shape != expected[name]:
                raise ValueError(f"{path}: the experts of {prefix} fuse into {name} of shape {tuple(value.shape)}, "
                                 f"but the model's is {tuple(expected[name])}")
            yield name, value


def _experts(files: dict[str, str]) -> dict[str, dict[str, dict[int, str]]]:
    """Per-expert tensor names by experts module, then projection, then expert index."""
    experts: dict[str, dict[str, dict[int, str]]] = defaultdict(lambda: defaultdict(dict))
    for name in files:
        if match := PER_EXPERT.match(name):
            experts[match["experts"]][match["projection"]][int(match["expert"])] = name
    return experts
