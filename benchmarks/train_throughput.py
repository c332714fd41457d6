"""Training throughput of the server's data-parallel trainer, in-process and through the HTTP API, side by side.

Qwen3-VL-4B- and 8B-shaped models, and Qwen3.5-4B- and Qwen3.6-35B-A3B-shaped ones (hybrid linear
attention; the second a MoE), with random weights built from a config (no hub), LoRA rank 32 on
every linear layer of the language model (and every routed expert of a MoE), 32 sequences x 2048
tokens per step (or lengths drawn between --min-sequence-length and that), and per variant: `image`,
one new 448x448 image per sequence in every step (as an epoch over a data set sends them: the vision
tower runs in every step), `image-cached`, the same 32 images in every step (their features come from
the cache after the first step, so the timed steps do not run the vision tower), `text` only, or `rl`: what
an RL batch looks like, lengths spread log-uniformly between --min-sequence-length (default 200) and
--sequence-length (e.g. 4096), 0-4 images a sequence, each new in its step or one of a pool of 16 that
recur (cached; their vision FLOPs are not counted); `rl-sampled` is `rl` as an RL loop's training request
finds it, its images decoded when they were sampled (in the server's decoded-image cache; the trainer's vision
tower still encodes the new ones; in-process mode only). --layouts packed,padded measures both micro-batch
layouts (--microbatch-layout), each in processes of its own, and prints their ratio (--packed-attention varlen
runs packed rows as one varlen call per layer instead of one SDPA call per datum, the server's flag;
--base-sharding shard or replicate, how --gpus N ranks hold the frozen base, the server's flag too). For
each shape and variant it runs (a) the training backend called in-process (the trainer the server
builds, fed datums rendered exactly as the API renders them) and (b) the same steps through `python
-m server` driven by the tinker SDK, and prints tokens/s/GPU, MFU, peak memory, the spread of the
timed steps and the ratio (b)/(a). Each mode runs in a process of its own, so that (b) starts on a GPU
that (a) has wholly given back; with --repeats N the modes run N times each, in alternating order
(a b, b a, ...), and the ratio comes with its spread over the N pairs.
--phases also prints rank 0's seconds in each phase of a step (render, scatter, compute and each
micro-batch of it, gather, all-reduce, optimizer; in-process mode only).

FLOPs per token (LoRA: forward, plus backward to the activations only; the frozen base gets no
weight gradient): 4 x N_llm (every matmul parameter of the language model, the unembedding
included) + 6 x L x H x T for causal attention (L layers, H = heads x head_dim, T = sequence
length, per row), + 2 x N_vision per image patch in the steps where the vision tower runs (image
features are cached by content, so a repeated image is encoded once: `image-cached` counts none).
LoRA's own matmuls are not counted. Qwen3.5's full-attention layers count their gated query (q_proj
is twice as wide) and attention over the sequence as above; its Gated DeltaNet layers count their
projections in N_llm, plus 2 x 6 x d_k x d_v per value head and token for the recurrence (reading the
state with q and k and updating it: three d_k x d_v products forward, and as much again for the
backward to the activations). A MoE counts only the experts a token is routed to, and its shared expert (MFU by active parameters).

    python benchmarks/train_throughput.py --shapes 4b --variants image,image-cached,text --gpus 1
    python benchmarks/train_throughput.py --shapes 4b --variants rl,image-cached --sequence-length 4096 \
        --layouts packed,padded --modes inprocess                (RL-like lengths, both layouts)
    python benchmarks/train_throughput.py --shapes tiny --device cpu --dtype float32 --sequences 2 \
        --sequence-length 256 --image-size 64 --steps 2 --warmup 1        (a CPU trial)
"""

import argparse
import io
import json
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from torch.profiler import record_function

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.random_weights import random_state_dict  # noqa: E402
from tests.support.live_server import start_server  # noqa: E402
from server.config import ImageConfig, ModelConfig, ServerConfig, StoreConfig, TrainerConfig  # noqa: E402
from server.models.expert_layout import INDEX, write_safetensors  # noqa: E402
from server.models.image_processor import ImageProcessorSpec  # noqa: E402
from server.models.tiny import build_tiny_model, hub_expert_layout  # noqa: E402
from server.rendering.chunks import RenderContext  # noqa: E402
from server.rendering.images import ImagePreparer  # noqa: E402
from server.rendering.training import render_training_data  # noqa: E402
from server.training.parallel import free_port, init_training_group  # noqa: E402
from server.training.trainer import build_trainer  # noqa: E402
from server.training.workers import start_local_ranks  # noqa: E402
from server.wire.model_input import EncodedTextChunk, ImageChunk, ModelInput  # noqa: E402
from server.wire.models import LoraConfig  # noqa: E402
from server.wire.training import AdamParams, Datum  # noqa: E402

# Qwen3-VL's M-RoPE for head_dim 128 (the sections sum to head_dim / 2; vLLM checks it, HF does not).
QWEN3_VL_ROPE = dict(rope_type="default", rope_theta=5_000_000.0, mrope_section=[24, 20, 20], mrope_interleaved=True)
QWEN3_5_ROPE = dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                    mrope_section=[11, 11, 10], mrope_interleaved=True)
QWEN3_5_LINEAR = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                      linear_value_head_dim=128, linear_conv_kernel_dim=4)
SHAPES = {
    # Qwen3-VL-4B-Instruct and -8B-Instruct: language model and vision tower sizes.
    "4b": dict(text=dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_parameters=QWEN3_VL_ROPE),
               vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560,
                           deepstack_visual_indexes=[5, 11, 17], num_position_embeddings=2304),
               tie_word_embeddings=True),
    "8b": dict(text=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_parameters=QWEN3_VL_ROPE),
               vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                           deepstack_visual_indexes=[8, 16, 24], num_position_embeddings=2304),
               tie_word_embeddings=False),
    # Qwen3.5-4B (config.json of the release; the vision tower's sizes as Qwen3-VL-4B's).
    "qwen3.5-4b": dict(family="qwen3.5",
                       text=dict(hidden_size=2560, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16,
                                 num_key_value_heads=4, head_dim=256, vocab_size=248320,
                                 layer_types=["linear_attention"] * 3 + ["full_attention"], **QWEN3_5_LINEAR,
                                 rope_parameters=QWEN3_5_ROPE),
                       vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                                   out_hidden_size=2560, num_position_embeddings=2304),
                       tie_word_embeddings=True),
    # Qwen3.6-35B-A3B (and Qwen3.5-35B-A3B): 256 experts, 8 routed and one shared per token.
    "qwen3.6-35b-a3b": dict(family="qwen3.5-moe",
                            text=dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                                      num_key_value_heads=2, head_dim=256, vocab_size=248320, num_experts=256,
                                      num_experts_per_tok=8, moe_intermediate_size=512,
                                      shared_expert_intermediate_size=512,
                                      layer_types=["linear_attention"] * 3 + ["full_attention"], **QWEN3_5_LINEAR,
                                      rope_parameters=QWEN3_5_ROPE),
                            vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                                        out_hidden_size=2048, num_position_embeddings=2304),
                            tie_word_embeddings=False),
    # Qwen3-VL-30B-A3B-Instruct: 128 experts, 8 routed per token, no shared expert (vLLM 0.26 serves it).
    "qwen3-vl-30b-a3b": dict(family="qwen3-vl-moe",
                             text=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                       num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                       vocab_size=151936, num_experts=128, num_experts_per_tok=8,
                                       moe_intermediate_size=768, rope_parameters=QWEN3_VL_ROPE),
                             vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                                         out_hidden_size=2048, deepstack_visual_indexes=[8, 16, 24],
                                         num_position_embeddings=2304),
                             tie_word_embeddings=False),
    # For trying the script on a CPU: the same structure, tiny.
    "tiny": dict(text=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=64, vocab_size=4096),
                 vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                             deepstack_visual_indexes=[0], num_position_embeddings=64),
                 tie_word_embeddings=True),
    # The 35B-A3B's structure (hybrid layers, 256 experts, 8 routed), tiny: its path through --gpus 2 on a CPU.
    "tiny-moe": dict(family="qwen3.5-moe",
                     text=dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=64, vocab_size=4096, num_experts=256, num_experts_per_tok=8,
                               moe_intermediate_size=64, shared_expert_intermediate_size=64,
                               layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                               linear_conv_kernel_dim=4),
                     vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                                 num_position_embeddings=64),
                     tie_word_embeddings=False),
}
BASE_NAME = "bench/{shape}"
ADAM = AdamParams(learning_rate=1e-5, beta1=0.9, beta2=0.95, eps=1e-8)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4b", help="comma-separated: 4b, 8b, qwen3.5-4b, qwen3.6-35b-a3b, tiny, tiny-moe")
    parser.add_argument("--variants", default="image,text",
                        help="comma-separated: image (new images every step), image-cached (the same images every "
                             "step), text, rl (RL-like lengths and images, see above), rl-sampled (rl with its "
                             "images decoded before the step, as sampling them leaves them)")
    parser.add_argument("--modes", default="inprocess,api", help="comma-separated: inprocess, api")
    parser.add_argument("--layouts", default=TrainerConfig.microbatch_layout,
                        help="comma-separated micro-batch layouts: packed, padded")
    parser.add_argument("--packed-attention", choices=("auto", "varlen", "sdpa"), default=TrainerConfig.packed_attention,
                        help="a packed row's attention (the server's --packed-attention)")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--base-sharding", choices=("auto", "shard", "replicate"), default=TrainerConfig.base_sharding,
                        help="how the --gpus ranks hold the frozen base (the server's --base-sharding)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--write-device", default=None,
                        help="where the random weights are made, a module at a time (default --device)")
    parser.add_argument("--write-only", action="store_true",
                        help="write the shapes' model directories under --work-dir and stop (a later run reuses them)")
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--sequence-length", type=int, default=2048)
    parser.add_argument("--min-sequence-length", type=int, default=None,
                        help="rows of lengths drawn between this and --sequence-length (default: all of that "
                             "length; 200 for the rl variant)")
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=1,
                        help="processes per mode, the modes alternating (a b, b a, ...): the ratio's spread")
    parser.add_argument("--microbatch-tokens", type=int, default=TrainerConfig.max_tokens_per_microbatch)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of one GPU (H100 SXM)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/train-throughput"))
    parser.add_argument("--phases", action="store_true",
                        help="also time rank 0's phases of each step (render, scatter, load, compute and each "
                             "micro-batch of it, gather, all-reduce, the rest), the GPU synchronised at each "
                             "phase's end")
    parser.add_argument("--profile", action="store_true",
                        help="print the operations and kernels that took most GPU time, and those that took most host time, "
                             "in one in-process step")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    if "rl-sampled" in args.variants.split(",") and "api" in args.modes.split(","):
        parser.error("--variants rl-sampled runs in-process only (--modes inprocess)")
    return args


# -- model and data ------------------------------------------------------------------------------------


def write_model(shape: str, out: Path, device: str) -> Path:
    """A model directory of the shape's family: the built-in tokenizer and processor files, random weights
    made on `device` one module at a time (random_weights.py: a 35B in about the time its bytes take to
    write) with a MoE's experts fused as the model holds them (save_pretrained would split them per expert,
    as releases store them, and every rank would then fuse them again on load: minutes for a 35B)."""
    import transformers

    if (out / INDEX).exists():  # written last: the directory is complete
        return out
    spec = SHAPES[shape]
    build_tiny_model(spec.get("family", "qwen3-vl"), out)  # tokenizer, chat template, preprocessor config
    for weights in out.glob("model*.safetensors"):
        weights.unlink()
    tiny = json.loads((out / "config.json").read_text())
    config_class = transformers.AutoConfig.for_model(tiny["model_type"]).__class__
    # The shape's names through the config's aliases (Qwen3-VL-MoE calls num_experts num_local_experts).
    aliases = config_class.sub_configs["text_config"].attribute_map
    text = dict(tiny["text_config"], **{aliases.get(key, key): value for key, value in spec["text"].items()})
    if "layer_types" in text:  # the shape gives the repeating pattern
        text["layer_types"] = text["layer_types"] * (text["num_hidden_layers"] // len(text["layer_types"]))
    vision = dict(tiny["vision_config"], **spec["vision"])
    config = config_class(text_config=text, vision_config=vision, tie_word_embeddings=spec["tie_word_embeddings"],
                          **{k: tiny[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                  "vision_end_token_id")})
    start = time.perf_counter()
    with torch.device("meta"):  # names, shapes and dtypes only: the weights are made module by module
        model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.config.architectures = [type(model).__name__]  # as save_pretrained records it (vLLM reads it)
    model.config.save_pretrained(out)  # (the tiny model's generation_config.json stays: its end tokens)
    tensors = random_state_dict(model, device)
    if spec.get("family") == "qwen3-vl-moe":  # experts as the release stores them, which vLLM reads
        tensors = ((name, hub_expert_layout(name, tensor, text["hidden_size"], text["moe_intermediate_size"]))
                   for name, tensor in tensors)
    write_safetensors(tensors, out)
    print(f"wrote {out} in {time.perf_counter() - start:.0f} s", flush=True)
    if device == "cuda":
        torch.cuda.empty_cache()  # else this process keeps the model's memory from the server it starts next
    return out


def flops_per_token(shape: str, sequence_length: int) -> float:
    """Training FLOPs per token (the docstring above says what is counted), by active parameters."""
    text = SHAPES[shape]["text"]
    hidden, layers = text["hidden_size"], text["num_hidden_layers"]
    pattern = text.get("layer_types", ["full_attention"])
    linear_layers = layers * pattern.count("linear_attention") // len(pattern)
    full_layers = layers - linear_layers
    attention = text["num_attention_heads"] * text["head_dim"]
    kv = text["num_key_value_heads"] * text["head_dim"]
    gated = "layer_types" in text  # Qwen3.5's q_proj also gives the attention output's gate
    full_attention = hidden * ((2 if gated else 1) * attention + 2 * kv) + attention * hidden
    if "num_experts" in text:
        shared = text.get("shared_expert_intermediate_size", 0)  # with its gate (one more router output)
        mlp = (3 * hidden * (text["num_experts_per_tok"] * text["moe_intermediate_size"] + shared)
               + hidden * (text["num_experts"] + (1 if shared else 0)))
    else:
        mlp = 3 * hidden * text["intermediate_size"]
    matmul_params = full_layers * full_attention + layers * mlp + hidden * text["vocab_size"]  # + the unembedding
    flops = 4 * matmul_params + 6 * full_layers * attention * sequence_length
    if linear_layers:
        keys = text["linear_num_key_heads"] * text["linear_key_head_dim"]
        heads, values = text["linear_num_value_heads"], text["linear_num_value_heads"] * text["linear_value_head_dim"]
        projections = hidden * (2 * keys + 2 * values + 2 * heads) + values * hidden
        recurrence = 2 * 6 * text["linear_key_head_dim"] * text["linear_value_head_dim"] * heads
        flops += linear_layers * (4 * projections + recurrence)
    return flops


def vision_flops_per_image(shape: str, image_size: int) -> float:
    vision = SHAPES[shape]["vision"]
    width, patches = vision["hidden_size"], (image_size // 16) ** 2
    per_block = 4 * width * width + 2 * width * vision["intermediate_size"]
    return 2 * patches * vision["depth"] * per_block


def smooth_image(size: int, seed: int) -> bytes:
    """A photo-like JPEG: upsampled coarse noise (random noise would not compress like a real picture)."""
    coarse = np.random.default_rng(seed).integers(0, 256, (size // 32, size // 32, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(coarse).resize((size, size), Image.BICUBIC).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def build_steps(args, shape: str, variant: str, image_tokens: int, vision_start: int,
                vision_end: int) -> list[list[Datum]]:
    """Every step's datums, warm-up steps first: new ones each step, or step 0's again for image-cached."""
    steps = [build_datums(args, shape, variant, step, image_tokens, vision_start, vision_end)
             for step in range(1 if variant == "image-cached" else args.warmup + args.steps)]
    return steps * (args.warmup + args.steps) if variant == "image-cached" else steps


RL_IMAGE_POOL = 16
"""Images of the rl variant that recur from step to step (seeds 0-15); every other image is new."""


def rl_datum(args, rng, vocab: int, step: int, index: int, image_tokens: int, vision_start: int,
             vision_end: int) -> tuple[list, list[float], int]:
    """An RL-like sequence: a log-uniform length, 0-4 images (as many as fit), each new or from the pool."""
    low = args.min_sequence_length or 200
    length = int(np.exp(rng.uniform(np.log(low), np.log(args.sequence_length + 1))))
    num_images = min(int(rng.integers(0, 5)), (length - 16) // (image_tokens + 2))
    text = length - num_images * (image_tokens + 2)
    cuts = sorted(rng.integers(1, text, num_images).tolist())
    chunks, weights, start = [], [], 0
    for k, cut in enumerate(cuts):
        seed = int(rng.integers(RL_IMAGE_POOL)) if rng.random() < 0.5 else 1000 + (step * args.sequences + index) * 4 + k
        chunks += [EncodedTextChunk(tokens=rng.integers(1000, vocab, cut - start).tolist() + [vision_start]),
                   ImageChunk(data=smooth_image(args.image_size, seed=seed), format="jpeg",
                              expected_tokens=image_tokens),
                   EncodedTextChunk(tokens=[vision_end])]
        weights += [1.0] * (cut - start + 1) + [0.0] * image_tokens + [1.0]
        start = cut
    chunks.append(EncodedTextChunk(tokens=rng.integers(1000, vocab, text - start).tolist()))
    return chunks, weights + [1.0] * (text - start), length


def build_datums(args, shape: str, variant: str, step: int, image_tokens: int, vision_start: int,
                 vision_end: int) -> list[Datum]:
    """One step's sequences of random text ids (never a special token), an image after the first 64."""
    rng = np.random.default_rng(step)
    # The tokenizer's own tokens (special ones included) are below 1000; the rest of the vocabulary is plain.
    vocab = SHAPES[shape]["text"]["vocab_size"]
    data = []
    for index in range(args.sequences):
        length = int(rng.integers(args.min_sequence_length or args.sequence_length, args.sequence_length + 1))
        if variant.startswith("rl"):
            chunks, weights, length = rl_datum(args, rng, vocab, step, index, image_tokens, vision_start, vision_end)
        elif variant.startswith("image"):
            before = rng.integers(1000, vocab, 64).tolist() + [vision_start]
            after = [vision_end] + rng.integers(1000, vocab, length - 64 - 2 - image_tokens).tolist()
            chunks = [EncodedTextChunk(tokens=before),
                      ImageChunk(data=smooth_image(args.image_size, seed=step * args.sequences + index),
                                 format="jpeg", expected_tokens=image_tokens),
                      EncodedTextChunk(tokens=after)]
            weights = [1.0] * len(before) + [0.0] * image_tokens + [1.0] * len(after)
        else:
            chunks = [EncodedTextChunk(tokens=rng.integers(1000, vocab, length).tolist())]
            weights = [1.0] * length
        targets = rng.integers(1000, vocab, length).tolist()
        data.append(Datum(model_input=ModelInput(chunks=chunks),
                          loss_fn_inputs={"target_tokens": torch.tensor(targets), "weights": torch.tensor(weights)}))
    return data


def step_work(shape: str, variant: str, image_size: int, data: list[Datum]) -> tuple[int, float]:
    """A step's real tokens and FLOPs (the docstring above says what is counted); images count in `image`,
    and in `rl` those not from the recurring pool."""
    lengths = [len(datum.loss_fn_inputs["target_tokens"]) for datum in data]
    flops = sum(length * flops_per_token(shape, length) for length in lengths)
    if variant == "image":  # new images: the vision tower encodes each of them in this step
        flops += len(data) * vision_flops_per_image(shape, image_size)
    if variant.startswith("rl"):
        pool = {smooth_image(image_size, seed) for seed in range(RL_IMAGE_POOL)}
        new = sum(isinstance(chunk, ImageChunk) and chunk.data not in pool
                  for datum in data for chunk in datum.model_input.chunks)
        flops += new * vision_flops_per_image(shape, image_size)
    return sum(lengths), flops


# -- (a) in-process ------------------------------------------------------------------------------------


def run_inprocess(args, shape: str, model_dir: Path, variants: list[str]) -> dict[str, dict]:
    config = ServerConfig(
        model=ModelConfig(base_model=BASE_NAME.format(shape=shape), model_path=model_dir,
                          model_cache_dir=args.work_dir / "models", device=args.device, dtype=args.dtype),
        store=StoreConfig(database_url="sqlite://", checkpoint_dir=args.work_dir / "checkpoints"),
        trainer=TrainerConfig(local_ranks=args.gpus, world_size=args.gpus, master_port=free_port(),
                              max_tokens_per_microbatch=args.microbatch_tokens, microbatch_layout=args.layout,
                              packed_attention=args.packed_attention, base_sharding=args.base_sharding,
                              activation_checkpointing=args.activation_checkpointing, compile=args.compile))
    sync = torch.cuda.synchronize if args.device == "cuda" else None
    start = time.perf_counter()
    ranks = start_local_ranks(config)
    group = init_training_group(0, args.gpus, config.model.device_type, "127.0.0.1", config.trainer.master_port,
                                local_ranks=args.gpus)
    trainer = build_trainer(config.model, config.trainer, config.images.feature_cache_bytes, group)
    print(f"rank 0 loaded {shape} in {time.perf_counter() - start:.0f} s; base over {args.gpus} GPU(s): "
          f"{trainer.base_sharding}; packed rows' attention: {trainer.packed_attention}", flush=True)
    base = trainer.base
    # As the server's, but large enough to hold every step's images (rl-sampled decodes them all first).
    preparer = ImagePreparer(base.vision.processor, ImageConfig(decoded_cache_bytes=4 << 30),
                             host_pixel_values=args.device == "cpu")
    context = RenderContext.build(base, 1 << 20, preparer)
    image_tokens = base.vision.processor.num_tokens(args.image_size, args.image_size)
    token = base.tokenizer.convert_tokens_to_ids
    results = {}
    phases = PhaseTimer(trainer, sync) if args.phases else None
    try:
        for variant in variants:
            steps = build_steps(args, shape, variant, image_tokens, token("<|vision_start|>"), token("<|vision_end|>"))
            model_id = f"bench-{variant}"
            trainer.create_model(model_id, LoraConfig(rank=args.rank, seed=0))

            if phases is not None:
                phases.steps, phases.microbatches = [], []
            if variant == "rl-sampled":  # what sampling these episodes would have left in the decoded-image cache
                preparer.prepare_all([(chunk.data, "sampled") for data in steps for datum in data
                                      for chunk in datum.model_input.chunks if isinstance(chunk, ImageChunk)])

            def step(step_index: int):
                if phases is not None:
                    phases.start_step()
                with record_function("render"):  # named in --profile's trace
                    examples = phases.timed("render", render_training_data) if phases else render_training_data
                    examples = examples(steps[step_index], context, ("weights",))
                with record_function("forward_backward"):
                    trainer.forward_backward(model_id, examples, "cross_entropy", None, forward_only=False)
                with record_function("optim_step"):
                    trainer.optim_step(model_id, ADAM)
                if phases is not None:
                    phases.end_step()

            results[variant] = time_steps(args, step, sync=sync,
                                          peak_memory=peak_allocated if args.device == "cuda" else None)
            if phases is not None:
                results[variant]["phases"] = phases.steps[args.warmup:]
                results[variant]["microbatches"] = phases.microbatches[args.warmup:]
            results[variant]["work"] = [step_work(shape, variant, args.image_size, data)
                                        for data in steps[args.warmup:]]
            if args.profile and args.device == "cuda":
                # The last step's data again: its images' features are cached by now.
                profile_step(lambda: step(-1), args.work_dir / f"trace-{shape}-{variant}.json")
            trainer.unload(model_id)
    finally:
        trainer.stop_followers()
        for process in ranks:
            process.join(timeout=60)
        if dist.is_initialized():  # one rank: stop_followers had no group to leave
            dist.destroy_process_group()
    return results


class PhaseTimer:
    """Rank 0's seconds in each phase of a step (--phases), by wrapping the trainer's own calls; the device is
    synchronised at each phase's end, so a phase's time includes its GPU work. `gather` is mostly rank 0
    waiting for the slowest other rank; `micro-batch N` is the Nth micro-batch's part of `compute`; `forward other`
    is forward_backward's own Python (planning, the results' conversion), `optim other` the optimizer step and
    its checks, `rest` the step less all of these."""

    INNER = (("commands", "broadcast"), ("scatter", "scatter"), ("load", "_load"), ("compute", "_run_microbatch"),
             ("gather", "gather"), ("all-reduce", "_sum_gradients"))
    OUTER = (("forward_backward", "forward_backward_pass"), ("optim_step", "optim_step"))

    def __init__(self, trainer, sync):
        self.sync = sync
        self.steps: list[dict[str, float]] = []
        self.microbatches: list[list[dict]] = []
        """Each step's micro-batches on rank 0: seconds, images and row lengths (attention grows as their squares)."""
        self._inner: dict[str, float] = {}
        self._outer: str | None = None
        self._microbatches = 0
        self._began = 0.0
        for phase, name in self.INNER:
            owner = trainer if hasattr(trainer, name) else trainer.group
            setattr(owner, name, self._timed(phase, getattr(owner, name), outer=False))
        for phase, name in self.OUTER:
            setattr(trainer, name, self._timed(phase, getattr(trainer, name), outer=True))

    def timed(self, phase: str, function):
        return self._timed(phase, function, outer=False)

    def start_step(self) -> None:
        self.steps.append(dict.fromkeys(["render"] + [phase for phase, _ in self.INNER + self.OUTER], 0.0))
        self.microbatches.append([])
        self._inner = {phase: 0.0 for phase, _ in self.OUTER}
        self._microbatches = 0
        self._began = time.perf_counter()

    def end_step(self) -> None:
        if self.sync is not None:
            self.sync()
        last = self.steps[-1]
        last["rest"] = time.perf_counter() - self._began - last["render"]
        for phase, _ in self.OUTER:
            last["rest"] -= last[phase]
            last[f"{phase.split('_')[0]} other"] = last.pop(phase) - self._inner[phase]

    def _timed(self, phase: str, function, outer: bool):
        def timed_call(*args, **kwargs):
            start = time.perf_counter()
            if outer:
                self._outer = phase
            try:
                return function(*args, **kwargs)
            finally:
                if self.sync is not None:
                    self.sync()
                elapsed = time.perf_counter() - start
                if self.steps:
                    self.steps[-1][phase] += elapsed
                    if phase == "compute":  # each micro-batch's own too: does one of them take more than its tokens?
                        self._microbatches += 1
                        self.steps[-1][f"micro-batch {self._microbatches}"] = elapsed
                        batch = args[0]
                        self.microbatches[-1].append(dict(seconds=elapsed, images=len(batch.images),
                                                          rows=[d.stop - d.start for d in batch.datums]))
                    if outer:
                        self._outer = None
                    elif self._outer is not None:
                        self._inner[self._outer] += elapsed
        return timed_call


def time_steps(args, step, sync, peak_memory) -> dict:
    """Seconds of each step after the warm-up steps, and the peak memory (GiB) the callable reports."""
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step_index in range(args.warmup):
        step(step_index)
    times = []
    for step_index in range(args.warmup, args.warmup + args.steps):
        if sync is not None:
            sync()
        start = time.perf_counter()
        step(step_index)
        if sync is not None:
            sync()
        times.append(time.perf_counter() - start)
    return {"all_step_seconds": times, "peak_memory_gib": peak_memory() if peak_memory is not None else float("nan")}


def peak_allocated() -> float:
    """Rank 0's peak of memory held by tensors (the process's own allocations)."""
    return torch.cuda.max_memory_allocated() / 2**30


def device_memory_in_use() -> float:
    """Memory in use on GPU 0 by every process (the server's, seen from outside), at this moment."""
    free, total = torch.cuda.mem_get_info(0)
    return (total - free) / 2**30


def profile_step(step, trace: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        step()
        torch.cuda.synchronize()
    averages = profiler.key_averages()
    print(averages.table(sort_by="self_device_time_total", row_limit=45, max_name_column_width=90), flush=True)
    # Where the host's time goes: a micro-batch whose kernels take less than launching them is bound by this.
    print(averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=90), flush=True)
    profiler.export_chrome_trace(str(trace))
    print(f"Chrome trace of the step: {trace}", flush=True)


# -- (b) through the API -------------------------------------------------------------------------------


def run_api(args, shape: str, model_dir: Path, variants: list[str]) -> dict[str, dict]:
    from tinker import types

    data_dir = args.work_dir / f"server-{shape}"
    command = ["--model-path", str(model_dir), "--device", args.device, "--dtype", args.dtype, "--gpus", str(args.gpus),
               "--microbatch-tokens", str(args.microbatch_tokens), "--microbatch-layout", args.layout,
               "--packed-attention", args.packed_attention, "--base-sharding", args.base_sharding]
    if args.activation_checkpointing:
        command.append("--activation-checkpointing")
    if args.compile:
        command.append("--compile")
    server = start_server(data_dir, None, None, *command, base_model=BASE_NAME.format(shape=shape),
                          startup_seconds=900)
    try:
        service = server.service_client()
        results = {}
        for variant in variants:
            tc = service.create_lora_training_client(base_model=BASE_NAME.format(shape=shape), rank=args.rank,
                                                     seed=0).result()
            tokenizer = tc.get_tokenizer()
            image_tokens = ImageProcessorSpec.from_model_dir(model_dir).num_tokens(args.image_size, args.image_size)
            token = tokenizer.convert_tokens_to_ids
            wire = build_steps(args, shape, variant, image_tokens, token("<|vision_start|>"), token("<|vision_end|>"))
            steps = [[types.Datum(model_input=types.ModelInput.model_validate(d.model_input.model_dump(mode="json")),
                                  loss_fn_inputs={name: value.tolist() for name, value in d.loss_fn_inputs.items()})
                      for d in data] for data in wire]
            adam = types.AdamParams(**ADAM.model_dump())

            def step(step_index: int):
                forward_backward = tc.forward_backward(steps[step_index], "cross_entropy")
                optim = tc.optim_step(adam)
                forward_backward.result()
                optim.result()

            results[variant] = time_steps(args, step, sync=None,
                                          peak_memory=device_memory_in_use if args.device == "cuda" else None)
            results[variant]["work"] = [step_work(shape, variant, args.image_size, data) for data in wire[args.warmup:]]
        return results
    finally:
        server.stop(timeout=120)


# -- report --------------------------------------------------------------------------------------------


def measure_mode(args, mode: str, shape: str, model_dir: Path, variants: list[str]) -> dict[str, dict]:
    """`mode` is inprocess or api, and with several --layouts ":" and the micro-batch layout."""
    mode, _, layout = mode.partition(":")
    args = argparse.Namespace(**{**vars(args), "layout": layout or args.layouts})
    run = run_inprocess if mode == "inprocess" else run_api
    return run(args, shape, model_dir, variants)


def in_own_process(function, *args):
    """`function(*args)` in a fresh (spawned) process: whatever it held on the GPU is gone when it returns.

    A plain Process, not a Pool: its workers are daemons, which may not start the training ranks.
    """
    context = multiprocessing.get_context("spawn")
    results = context.SimpleQueue()
    process = context.Process(target=_put_result, args=(results, function, args))
    process.start()
    process.join()
    if process.exitcode != 0 or results.empty():
        raise RuntimeError(f"{function.__name__}{args[1:3]} failed (exit code {process.exitcode})")
    return results.get()


def _put_result(results, function, args) -> None:
    results.put(function(*args))


def main() -> None:
    args = parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    layouts = args.layouts.split(",")
    modes = [f"{mode}:{layout}" if len(layouts) > 1 else mode
             for layout in layouts for mode in args.modes.split(",")]
    for shape in args.shapes.split(","):
        # Written in a process of its own too: a model built on the GPU here would stay there (9.7 GiB
        # for 4B) while the modes measure.
        model_dir = args.work_dir / f"model-{shape}"
        if not (model_dir / INDEX).exists():  # (a process's start costs 15-20 s of imports on the GPU hosts)
            in_own_process(write_model, shape, model_dir, args.write_device or args.device)
        if args.write_only:
            continue
        variants = args.variants.split(",")
        measured = {mode: [] for mode in modes}  # one result per process (--repeats), the modes taking turns
        for repeat in range(args.repeats):
            for mode in modes if repeat % 2 == 0 else modes[::-1]:
                measured[mode].append(in_own_process(measure_mode, args, mode, shape, model_dir, variants))
        for variant in variants:
            by_mode, medians = {}, {}  # mode -> its row, and each of its processes' median tokens/s/GPU
            for mode, repeats in measured.items():
                seconds, rates, mfus = [], [], []
                for results in repeats:
                    result = results[variant]
                    seconds += result["all_step_seconds"]
                    rates.append([])
                    for step_seconds, (tokens, flops) in zip(result["all_step_seconds"], result["work"]):
                        rates[-1].append(tokens / step_seconds / args.gpus)
                        mfus.append(flops / step_seconds / args.gpus / (args.peak_tflops * 1e12))
                medians[mode] = [float(np.median(process_rates)) for process_rates in rates]
                by_mode[mode] = dict(shape=shape, variant=variant, mode=mode, gpus=args.gpus, processes=len(repeats),
                                     step_seconds=float(np.median(seconds)), all_step_seconds=seconds,
                                     tokens_per_s_per_gpu=float(np.median(sum(rates, []))),
                                     mfu=float(np.median(mfus)),
                                     peak_memory_gib=max(results[variant]["peak_memory_gib"] for results in repeats))
                phase_steps = [phases for results in repeats for phases in results[variant].get("phases", [])]
                if phase_steps:  # (a step with fewer micro-batches counts 0 s for the others)
                    names = dict.fromkeys(name for phases in phase_steps for name in phases)
                    by_mode[mode]["phases"] = {name: float(np.median([phases.get(name, 0.0) for phases in phase_steps]))
                                               for name in names}
                    by_mode[mode]["microbatches"] = [step for results in repeats
                                                     for step in results[variant]["microbatches"]]
                rows.append(by_mode[mode])
            # Process i of each mode ran next to the other's process i: their ratio, pair by pair.
            suffixes = [f":{layout}" for layout in layouts] if len(layouts) > 1 else [""]
            compared = [(f"api{suffix}", f"inprocess{suffix}") for suffix in suffixes]
            compared += [(f"{mode}:packed", f"{mode}:padded") for mode in args.modes.split(",")]
            for over, under in compared:
                if {over, under} <= measured.keys():
                    pairs = [a / b for a, b in zip(medians[over], medians[under])]
                    ratio = by_mode[over]["tokens_per_s_per_gpu"] / by_mode[under]["tokens_per_s_per_gpu"]
                    rows.append(dict(shape=shape, variant=variant, mode=f"{over}/{under}", ratio=ratio, pairs=pairs))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    lengths = (f"{args.min_sequence_length}-{args.sequence_length}" if args.min_sequence_length
               else str(args.sequence_length))
    print(f"\n{args.sequences} rows of {lengths} tokens per step (micro-batch layouts {args.layouts}, packed attention "
          f"{args.packed_attention}), LoRA rank {args.rank}, {args.gpus} GPU(s) (base sharding {args.base_sharding}), "
          f"micro-batch {args.microbatch_tokens} tokens, activation checkpointing {args.activation_checkpointing}, "
          f"compile {args.compile}; {args.warmup} warm-up and {args.steps} timed steps per process, {args.repeats} "
          f"process(es) per mode. image: new images every step (vision FLOPs counted); image-cached: the same "
          f"images every step (the feature cache serves them; not counted)")
    print(f"{'shape':6} {'variant':12} {'mode':22} {'step s':>8} {'step range':>13} {'tok/s/GPU':>10} {'MFU':>6} "
          f"{'peak GiB':>9}")
    for row in rows:
        if "ratio" in row:
            pairs = row["pairs"]
            spread = (f"pair by pair: median {np.median(pairs):.3f}, {min(pairs):.3f}-{max(pairs):.3f} over "
                      f"{len(pairs)} pairs" if len(pairs) > 1 else "one pair of processes: --repeats gives a spread")
            print(f"{row['shape']:6} {row['variant']:12} {row['mode']:22} ratio = {row['ratio']:.3f} "
                  f"({spread})")
        else:
            steps = row["all_step_seconds"]
            step_range = f"{min(steps):.2f}-{max(steps):.2f}"
            print(f"{row['shape']:6} {row['variant']:12} {row['mode']:22} {row['step_seconds']:8.2f} {step_range:>13} "
                  f"{row['tokens_per_s_per_gpu']:10.0f} {row['mfu']:6.1%} {row['peak_memory_gib']:9.1f}")
            if "phases" in row:
                print(" " * 8 + "rank 0's median seconds: " + ", ".join(f"{name} {seconds:.3f}"
                                                                      for name, seconds in row["phases"].items()))
                for number, step in enumerate(row["microbatches"], 1):
                    print(" " * 8 + f"step {number}'s micro-batches on rank 0: " + "; ".join(
                        f"{batch['seconds']:.3f} s for {sum(batch['rows'])} tokens ({len(batch['rows'])} rows, "
                        f"longest {max(batch['rows'])}, sum of squares {sum(n * n for n in batch['rows']) / 1e6:.1f}M, "
                        f"{batch['images']} images)" for batch in step))


if __name__ == "__main__":
    main()
