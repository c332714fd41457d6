"""Load time and peak memory of a MoE checkpoint with per-expert tensors, as releases store them, against
its fused copy (server/models/expert_layout.py), on the CPU.

The model keeps Qwen3.6-35B-A3B's tensor count (40 layers x 256 experts: 30,720 per-expert tensors that
transformers fuses into 80 on load) and its expert width (moe_intermediate_size 512), with the built-in
tiny model's hidden size (128): 3.8 GiB. Each load runs in a fresh process; peak RSS is that process's (file pages of a
memory-mapped checkpoint count only once read).

    python benchmarks/moe_load.py --work-dir /tmp/moe-load
"""

import argparse
import json
import multiprocessing
import shutil
import sys
import time
from pathlib import Path

import torch
import transformers

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from server.config import ModelConfig  # noqa: E402
from server.models.loading import load_base_model  # noqa: E402
from server.models.tiny import build_tiny_model  # noqa: E402


def write_per_expert(out: Path, layers: int, experts: int, intermediate: int) -> None:
    """The tiny Qwen3.5-MoE widened to `experts` of `intermediate`, saved as transformers saves it (per expert)."""
    if (out / "model.safetensors.index.json").exists():
        return
    build_tiny_model("qwen3.5-moe", out)
    config = json.loads((out / "config.json").read_text())
    config["text_config"].update(num_hidden_layers=layers, num_experts=experts, moe_intermediate_size=intermediate,
                                 layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4))
    (out / "config.json").write_text(json.dumps(config))
    model = transformers.AutoModelForImageTextToText.from_config(transformers.AutoConfig.from_pretrained(out),
                                                                 dtype=torch.bfloat16)
    (out / "model.safetensors").unlink()
    model.save_pretrained(out, max_shard_size="4GB")


def load(how: str, path: Path, cache: Path) -> tuple[float, float]:
    """Seconds to load and this process's peak RSS in GiB."""
    start = time.perf_counter()
    if how == "transformers":
        transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16)
    else:
        load_base_model(ModelConfig(base_model="bench/moe", model_path=path, model_cache_dir=cache, dtype="bfloat16"),
                        blocks_on_host=how == "server, blocks on host")
    seconds = time.perf_counter() - start
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork and exec.
    peak_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    return seconds, peak_kib / 2**20


def _put(results, how, path, cache):
    results.put(load(how, path, cache))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/moe-load"))
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=512)
    args = parser.parse_args()
    path, cache = args.work_dir / "per-expert", args.work_dir / "cache"
    write_per_expert(path, args.layers, args.experts, args.intermediate)
    shutil.rmtree(cache, ignore_errors=True)  # the first server load writes the fused copy
    context = multiprocessing.get_context("spawn")
    print(f"{'load':40} {'seconds':>8} {'peak RSS GiB':>13}")
    for how in ("transformers", "server, first (writes the fused copy)", "server, fused copy",
                "server, blocks on host"):
        results = context.SimpleQueue()
        process = context.Process(target=_put, args=(results, how, path, cache))
        process.start()
        process.join()
        seconds, rss = results.get()
        print(f"{how:40} {seconds:8.1f} {rss:13.2f}", flush=True)


if __name__ == "__main__":
    main()
