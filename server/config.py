"""One settings tree for the whole server, parsed once from the command line (and env for secrets).

Only this module reads `os.environ`. Every component receives its own sub-config object;
nothing re-reads flags later.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
"""Where scripts/install_vllm.sh builds the vLLM venv (in the checkout, wherever the server starts)."""
REPLICATE_SHARE = 0.35
"""--base-sharding auto replicates a base of at most this share of a training device's memory: the 8B (about 18 GB
in bf16, a fifth of an 80 GB GPU) trains in 60 GiB on one GPU, so a whole copy per rank fits; the 35B-A3B (70 GB)
does not."""
# vLLM's --max-lora-rank only accepts these values.
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class StoreConfig:
    database_url: str
    """SQLAlchemy URL of the journal: SQLite under the data dir by default, or PostgreSQL."""
    checkpoint_dir: Path
    """Where checkpoint files (adapter + optimizer, PEFT sampler adapters) are written."""
    future_retention_seconds: float = 24 * 3600
    """Finished futures older than this are deleted from the journal, so it stays bounded."""
    checkpoint_sweep_seconds: float = 60.0
    """How often checkpoints past their TTL are looked for and deleted (files and rows)."""

    def __post_init__(self):
        if self.checkpoint_sweep_seconds <= 0:
            raise ValueError(f"checkpoint_sweep_seconds must be positive, got {self.checkpoint_sweep_seconds}")


@dataclass(frozen=True)
class ModelConfig:
    base_model: str
    """Name clients use: a hub-style name (`Qwen/Qwen3-VL-4B-Instruct`) or `builtin:tiny-...`."""
    model_path: Path | None
    """Directory holding the model; None means the built-in builder or the local hub cache."""
    model_cache_dir: Path
    """Where built-in tiny models are built on first use, and the fused copy of a MoE checkpoint that stores
    per-expert tensors is written (once; models/expert_layout.py)."""
    device: str = "cpu"
    dtype: str = "float32"

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


@dataclass(frozen=True)
class TrainerConfig:
    max_tokens_per_microbatch: int = 8192
    """Datums are grouped into micro-batches of at most this many tokens (padded tokens in the padded layout). 8,192 keeps a 4B or 8B
    model's step within 80 GB in eager mode (measured: 54 GiB for 4B); with --compile a 4B model fits
    16,384 (72 GiB, about 5 % faster), see benchmarks/RESULTS.md."""
    max_tokens_per_pass: int = 65536
    """Tokens of forward_backward work one training pass takes, shared fairly among the runs that have
    some ready (several runs' rows in one pass); a request over its share goes on in the next pass."""
    max_runs_per_pass: int | None = None
    """At most this many runs' forward_backward work in one pass (None: no limit); 1 runs the runs one
    at a time, in turn (the baseline benchmarks/tenants.py compares batching with)."""
    logprob_chunk_size: int = 1024
    """Positions per lm_head chunk: full-vocabulary logits never exist for a whole batch."""
    lora_alpha: float = 32.0
    """LoRA scale numerator (scale = alpha / rank), reported in every saved adapter_config.json."""
    local_ranks: int = 1
    """Training processes on this node, one per GPU (the server's own process is rank 0)."""
    training_devices: tuple[int, ...] | None = None
    """The GPU of each local rank, as indices among the GPUs the server sees (None: rank r on GPU r)."""
    world_size: int = 1
    """Training ranks on all nodes (more than local_ranks when torchrun starts ranks on other nodes)."""
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    """Rendezvous of the training ranks; 0 picks a free port (single node)."""
    activation_checkpointing: bool = False
    """Recompute each decoder block in backward instead of keeping its activations."""
    microbatch_layout: str = "packed"
    """packed: a micro-batch's datums end to end in one row, attention and rope positions kept within each
    datum (no padding, no new padded length per batch); padded: one right-padded row per datum. Hybrid
    families (Qwen3.5's linear attention) always use padded rows, see training/packing.py."""
    packed_attention: str = "auto"
    """The attention of a packed row: varlen, one causal call per layer of PyTorch's varlen flash kernel over
    the whole row (CUDA, compute capability 8.0 or more, bf16 or fp16); sdpa, one causal SDPA call per datum and
    layer; auto, varlen where it runs, else sdpa."""
    base_sharding: str = "auto"
    """How ranks hold the frozen base at world size > 1: shard, FSDP2 over the ranks (each block gathered in every
    forward and backward); replicate, a whole copy on each rank (no gathers; the base's bytes on every device);
    auto, replicate when the base's parameters take at most REPLICATE_SHARE of the smallest training device's
    memory (on CPUs: of a local rank's share of the host's memory), else shard."""
    compile: bool = False
    """torch.compile each decoder block and the unembedding chunks (fuses the many small element-wise
    kernels of norms, rotary embeddings, activations and LoRA; the first steps of each shape compile)."""

    def __post_init__(self):
        if not 1 <= self.local_ranks <= self.world_size:
            raise ValueError(f"need 1 <= local_ranks ({self.local_ranks}) <= world_size ({self.world_size})")
        if self.training_devices is not None:
            _check_device_list("--training-devices", self.training_devices)
            if len(self.training_devices) != self.local_ranks:
                raise ValueError(f"--training-devices names {len(self.training_devices)} GPUs for "
                                 f"{self.local_ranks} local training ranks (--local-ranks): one GPU per rank")
        if self.max_tokens_per_pass < 1:
            raise ValueError(f"max_tokens_per_pass must be positive, got {self.max_tokens_per_pass}")
        if self.microbatch_layout not in ("packed", "padded"):
            raise ValueError(f"microbatch_layout must be packed or padded, got {self.microbatch_layout!r}")
        if self.packed_attention not in ("auto", "varlen", "sdpa"):
            raise ValueError(f"packed_attention must be auto, varlen or sdpa, got {self.packed_attention!r}")
        if self.max_runs_per_pass is not None and self.max_runs_per_pass < 1:
            raise ValueError(f"max_runs_per_pass must be positive, got {self.max_runs_per_pass}")
        if self.base_sharding not in ("auto", "shard", "replicate"):
            raise ValueError(f"base_sharding must be auto, shard or replicate, got {self.base_sharding!r}")


@dataclass(frozen=True)
class VLLMConfig:
    """How to run the vLLM sampling engine; the model directory and dtype come from the base model."""

    python: Path | None = None
    """Interpreter of the vLLM venv (scripts/install_vllm.sh builds one, with the server's vLLM plugin);
    None: use the vLLMs already running at `urls`."""
    urls: tuple[str, ...] = ()
    """Base URLs of running vLLMs (replicas of one model), started with the flags of vllm_command()
    (sampling/vllm_process.py) from a venv with the server's vLLM plugin; the fields that follow must
    then describe them."""
    replicas: int = 1
    """vLLM servers the server starts, each a process of its own on its own GPUs; requests go to the one
    with the fewest in flight."""
    tensor_parallel_size: int = 1
    """GPUs of one replica (vLLM's --tensor-parallel-size)."""
    devices: tuple[int, ...] | None = None
    """The GPUs of the replicas, tensor_parallel_size each in turn, as indices among the GPUs the server
    sees (None: every replica inherits the server's GPUs)."""
    max_model_len: int = 8192
    """Longest prompt + completion, in expanded tokens (image pads included). vLLM cuts a completion
    short there instead of refusing the request, so the sampler refuses it."""
    max_num_seqs: int = 256
    """Sequences vLLM decodes at once (vLLM's --max-num-seqs); a request for more samples is split into
    several. RL rounds send hundreds of sequences at once: fewer would leave a GPU decoding in waves."""
    max_loras: int = 4
    """Adapters that may share one batch; 0 starts vLLM without LoRA (e.g. Qwen3-VL-MoE on CPU)."""
    max_lora_rank: int = 32
    max_cpu_loras: int = 16
    """Adapters vLLM keeps loaded (LRU); an evicted one is reloaded from its path by vLLM itself."""
    max_logprobs: int = 20
    """Largest k for top-k prompt logprobs."""
    kv_cache_space_gib: int = 4
    """KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE); GPUs size theirs with --gpu-memory-utilization."""
    enforce_eager: bool = False
    """Skip torch.compile and CUDA graphs: much faster start, slower decoding on GPU."""
    chunked_prefill: bool = True
    """Split long prefills over steps. Turn it off on CPU: there a seeded request whose prefill was
    split draws extra random numbers (CPU generators cannot rewind), so its samples would depend on
    the load. Hybrid models (Qwen3.5) keep it on: vLLM serves their linear attention only so."""
    startup_timeout_s: float = 600.0
    max_restarts: int = 3
    """Crashes after which the supervisor stops restarting and every request fails with a 503."""
    extra_args: tuple[str, ...] = ()
    """More `vllm serve` flags, e.g. ("--gpu-memory-utilization", "0.5")."""

    def __post_init__(self):
        if (self.python is None) == (not self.urls):
            raise ValueError("give exactly one of python (start vLLM) or urls (use running vLLMs)")
        if self.replicas < 1 or self.tensor_parallel_size < 1:
            raise ValueError(f"--vllm-replicas ({self.replicas}) and --vllm-tensor-parallel-size "
                             f"({self.tensor_parallel_size}) must be positive")
        if self.urls and (self.replicas > 1 or self.tensor_parallel_size > 1 or self.devices is not None):
            raise ValueError("--vllm-replicas, --vllm-tensor-parallel-size and --vllm-devices place the vLLMs "
                             "the server starts; with --vllm-url each URL is a replica, placed by whoever runs it")
        if self.devices is not None:
            _check_device_list("--vllm-devices", self.devices)
            wanted = self.replicas * self.tensor_parallel_size
            if len(self.devices) != wanted:
                raise ValueError(f"--vllm-devices names {len(self.devices)} GPUs; {self.replicas} replicas x "
                                 f"tensor parallel size {self.tensor_parallel_size} need {wanted}")
        if self.max_loras and self.max_lora_rank not in _LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {_LORA_RANKS}, got {self.max_lora_rank}")
        if self.max_loras and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")



@dataclass(frozen=True)
class SamplerConfig:
    engine: str = "embedded"
    """embedded (HF transformers in this process) or vllm (a supervised vLLM server)."""
    vllm: VLLMConfig | None = None
    """How to run vLLM when engine is vllm."""
    max_new_tokens_default: int = 128
    """max_tokens when the client leaves it unset."""
    max_ephemeral_per_model: int = 8
    """Sampler snapshots kept in memory per training run by save_weights_and_get_sampling_client."""
    max_loaded_adapters: int = 16
    """Saved sampler adapters kept loaded (least recently used ones are reloaded on demand)."""
    max_images_per_prompt: int = 16
    """Images one sampling prompt may hold, on every engine (vLLM is started with this limit; it also
    sizes vLLM's encoder-cache profiling). Multi-turn VLM episodes add an image per turn."""
    max_batch_tokens: int = 65536
    """Cache positions the embedded engine's running batch may hold (rows x padded length)."""
    own_process: bool = False
    """Run the embedded engine in a process of its own, so that its Python never waits on the HTTP front's
    (and the other way round); worth it on a GPU, where the engine's time is mostly Python."""
    prefix_cache_bytes: int = 2 << 30
    """Keys and values of earlier prompts and conversations the embedded engine keeps, so that a prompt that
    starts like one of them (a conversation's next turn) runs only from where they part; 0 keeps none."""
    cuda_graphs: bool = True
    """On a CUDA device, the embedded engine replays its decode steps as CUDA graphs (over a static cache, for
    models of full attention only); off, the same steps run eagerly."""

    def __post_init__(self):
        if self.max_images_per_prompt < 1 or self.max_batch_tokens < 1:
            raise ValueError("max_images_per_prompt and max_batch_tokens must be positive")
        if self.prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0, got {self.prefix_cache_bytes}")
        if self.engine not in ("embedded", "vllm"):
            raise ValueError(f"sampler engine must be embedded or vllm, got {self.engine!r}")
        if (self.engine == "vllm") != (self.vllm is not None):
            raise ValueError("the vllm engine needs its VLLMConfig, and only it")


@dataclass(frozen=True)
class LimitsConfig:
    """What one request or one tenant may ask for; each refusal is a 400 that names its limit."""

    max_sequence_length: int = 32768
    """Longest rendered sequence accepted for training or sampling."""
    max_request_bytes: int = 256 * 1024 * 1024
    """Largest request body as it arrives."""
    max_decompressed_bytes: int = 1 << 30
    """Largest forward_backward body once inflated: a zstd body that inflates past this is refused with a 413
    (a decompression bomb)."""
    max_sample_tokens: int = 8192
    """Largest max_tokens a sampling request may ask for."""
    max_num_samples: int = 256
    """Largest num_samples of one sampling request."""
    session_timeout_seconds: float = 600.0
    """A session without a heartbeat for this long is finished and its runs leave memory (the SDK
    heartbeats every 10 s; a client that exits without closing its ServiceClient stops)."""
    max_lora_rank: int = 128
    """Largest LoRA rank a training run may ask for."""
    max_sampled_tokens_per_request: int = 65536
    """num_samples x max_tokens of one sampling request, so one request cannot hold the sampler for long."""
    max_runs_per_tenant: int = 64
    """Training runs a tenant may keep in memory at once (runs of open sessions)."""
    max_stored_bytes_per_tenant: int = 100 << 30
    """Bytes of checkpoint files and journal rows (sessions, runs, results) a tenant may keep."""
    seq_gap_timeout_seconds: float = 120.0
    """A run whose next seq_id has not arrived this long after it went idle fails the requests queued
    behind the gap (the SDK sends a call's chunks at once; a missing one was refused unreadable or lost)."""
    max_datums_per_request: int = 4096
    """Datums of one forward_backward request (the SDK sends 1024 at most, unless --fwdbwd-max-chunk-len says more)."""
    header_timeout_seconds: float = 10.0
    """A request's headers must arrive within this long of its first byte, else the connection is closed."""
    body_timeout_seconds: float = 30.0
    """A request's body may pause at most this long between two reads, else the connection is closed."""
    max_connections_per_client: int = 4096
    """Connections one client address may keep open (an SDK client opens up to 1000 for concurrent requests,
    and one process may run several)."""

    def __post_init__(self):
        for name in ("session_timeout_seconds", "seq_gap_timeout_seconds", "max_lora_rank", "max_sample_tokens",
                     "max_num_samples", "max_sampled_tokens_per_request", "max_runs_per_tenant",
                     "max_stored_bytes_per_tenant", "max_datums_per_request", "header_timeout_seconds",
                     "body_timeout_seconds", "max_connections_per_client", "max_decompressed_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class ImageConfig:
    max_image_bytes: int = 20 * 1024 * 1024
    """Largest encoded image (PNG/JPEG) accepted in a chunk."""
    max_image_pixels: int = 40_000_000
    """Largest decoded image (width x height): bigger ones are refused before decoding (decompression bombs)."""
    image_root: Path | None = None
    """Directory that image_asset_pointer chunks may read from; None refuses them."""
    decoded_cache_bytes: int = 512 * 1024 * 1024
    """Decoded, preprocessed images kept by content hash (least recently used ones are dropped)."""
    feature_cache_bytes: int = 1024 * 1024 * 1024
    """Vision-tower outputs kept by content hash, so a repeated image is encoded once."""


@dataclass(frozen=True)
class ClientFlagsConfig:
    """Feature flags sent to every SDK client through client/config."""

    proto_compress_fwdbwd: bool = True
    """Clients zstd-compress forward_backward bodies."""
    fwdbwd_max_chunk_len: int | None = None
    """Datums per forward_backward request the SDK sends (None: the SDK's default, 1024)."""


@dataclass(frozen=True)
class ServerConfig:
    model: ModelConfig
    store: StoreConfig
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Path("./data")
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    images: ImageConfig = field(default_factory=ImageConfig)
    client: ClientFlagsConfig = field(default_factory=ClientFlagsConfig)
    auth: str = "keys"
    """keys (every route but healthz needs an issued API key) or none (one tenant, loopback only)."""
    shutdown_timeout_seconds: float = 30.0
    """On SIGTERM, running requests get this long to finish; then they are failed and the server exits."""
    debug: bool = False
    """A start-up refused for what the operator gave (a model, a directory, a device) prints its traceback
    too, not only its one-line reason."""

    def __post_init__(self):
        if self.auth not in ("keys", "none"):
            raise ValueError(f"auth must be keys or none, got {self.auth!r}")
        if self.auth == "none" and not is_loopback(self.host):
            raise ValueError(f"--auth none would let anyone who reaches {self.host} train and read every result; "
                             f"it is only allowed on a loopback --host (127.0.0.1, ::1, localhost)")
        _check_placement(self.model, self.trainer, self.sampler)
        _check_vllm_dtype(self.model, self.sampler)
        chunk = self.client.fwdbwd_max_chunk_len
        if chunk is not None and chunk > self.limits.max_datums_per_request:
            raise ValueError(f"--fwdbwd-max-chunk-len {chunk} is over --max-datums-per-request "
                             f"{self.limits.max_datums_per_request}: clients would send requests the server refuses")


def _check_device_list(flag: str, devices: tuple[int, ...]) -> None:
    if not devices or min(devices) < 0 or len(set(devices)) != len(devices):
        raise ValueError(f"{flag} must list distinct GPU indices (0, 1, ...), got {','.join(map(str, devices))}")


def _check_placement(model: ModelConfig, trainer: TrainerConfig, sampler: SamplerConfig) -> None:
    """Training and vLLM either share exactly the same GPUs (colocated) or have GPUs of their own."""
    vllm = sampler.vllm
    placed = trainer.training_devices is not None or (vllm is not None and vllm.devices is not None)
    if model.device_type != "cuda":
        if placed:
            raise ValueError("--training-devices and --vllm-devices place work on GPUs: they need --device cuda")
        return
    if vllm is None or vllm.urls:
        return
    if vllm.replicas > 1 and vllm.devices is None:
        raise ValueError(f"--vllm-replicas {vllm.replicas} on GPUs needs --vllm-devices: each replica gets GPUs "
                         f"of its own ({vllm.replicas} x {vllm.tensor_parallel_size})")
    if vllm.devices is None:
        return  # vLLM inherits the server's GPUs, as one colocated replica
    training = set(trainer.training_devices if trainer.training_devices is not None else range(trainer.local_ranks))
    shared = training & set(vllm.devices)
    if shared and shared != training | set(vllm.devices):
        raise ValueError(f"--vllm-devices {_listed(vllm.devices)} and the training GPUs {_listed(sorted(training))} "
                         f"share GPU(s) {_listed(sorted(shared))} but not all: give vLLM GPUs of its own, or "
                         f"exactly the training GPUs to colocate (then lower vLLM's memory share, e.g. "
                         f"--vllm-extra-args '--gpu-memory-utilization 0.3')")


def _check_vllm_dtype(model: ModelConfig, sampler: SamplerConfig) -> None:
    """A vLLM the server starts on GPUs runs in --dtype; with adapters it must be a 16-bit one."""
    vllm = sampler.vllm
    if vllm is None or vllm.urls or not vllm.max_loras or model.device_type != "cuda" or model.dtype != "float32":
        return
    # vLLM's LoRA kernels on a GPU (its punica Triton ops) take only fp16/bf16: in float32 its engine dies on
    # the first request with an adapter, failing every request it holds (seen with vLLM 0.26 on an H100).
    raise ValueError("--sampler vllm on a GPU with --dtype float32: vLLM's LoRA kernels on GPUs take bfloat16 or "
                     "float16 only, and a float32 vLLM dies on its first request with an adapter; use --dtype "
                     "bfloat16, or --vllm-max-loras 0 (adapters then sample on the embedded engine), or the "
                     "embedded sampler")


def _listed(devices) -> str:
    return ",".join(map(str, devices))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default: the value, "off" for a switch, or the help's own words
    ("default: ...") where the default is derived (None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or action.required or not action.option_strings:
            return text
        if action.default is False:
            return f"{text} (default: off)"
        return super()._get_help_string(action)


def build_arg_parser() -> argparse.ArgumentParser:
    """The CLI of `python -m server` (frozen by tests/unit/test_cli.py)."""
    parser = argparse.ArgumentParser(
        prog="python -m server", formatter_class=HelpWithDefaults,
        description="Tinker-compatible training service: point the tinker SDK at it (TINKER_BASE_URL) with an "
                    "API key it issued (TINKER_API_KEY). Runs in the foreground; `python -m server keys -h` "
                    "manages API keys.")
    parser.add_argument("--base-model", required=True,
                        help="model name clients use, e.g. Qwen/Qwen3-VL-4B-Instruct or builtin:tiny-qwen2-vl "
                             "(required)")
    parser.add_argument("--model-path", type=Path, default=None,
                        help="directory holding the model's files (default: built-in models are built under "
                             "--data-dir, other names are looked up in the local hub cache)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0: every interface, e.g. in a container)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    _add_store_flags(parser)
    parser.add_argument("--auth", choices=["keys", "none"], default="keys",
                        help="keys: every route but healthz needs an API key (`python -m server keys create`); "
                             "none: no keys, one tenant, loopback --host only")
    parser.add_argument("--device", default="cpu", help="torch device for training and the embedded sampler")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="dtype of the frozen base weights (LoRA weights and optimizer state stay float32)")
    parser.add_argument("--fwdbwd-max-chunk-len", "--fwdbwd-chunk-len", type=int, default=None,
                        help="datums per forward_backward request that clients send (default: the SDK's, 1024)")
    parser.add_argument("--image-root", type=Path, default=None,
                        help="directory that image_asset_pointer chunks may name files in (default: none, such "
                             "chunks are refused)")
    parser.add_argument("--decoded-cache-mb", "--image-cache-mb",
                        type=int, default=ImageConfig.decoded_cache_bytes >> 20,
                        help="decoded images kept by content hash (least recently used ones are dropped)")
    parser.add_argument("--feature-cache-mb", type=int, default=ImageConfig.feature_cache_bytes >> 20,
                        help="vision-tower outputs kept by content hash, per model copy")
    parser.add_argument("--session-timeout-seconds", "--session-timeout",
                        type=float, default=LimitsConfig.session_timeout_seconds,
                        help="seconds without a heartbeat after which a session is finished and its runs unloaded")
    parser.add_argument("--checkpoint-sweep-seconds", "--checkpoint-sweep-interval",
                        type=float, default=StoreConfig.checkpoint_sweep_seconds,
                        help="seconds between looks for checkpoints past their TTL, which are then deleted")
    parser.add_argument("--max-lora-rank", type=int, default=LimitsConfig.max_lora_rank,
                        help="largest LoRA rank a training run may ask for")
    parser.add_argument("--max-sample-tokens", type=int, default=LimitsConfig.max_sample_tokens,
                        help="largest max_tokens of one sampling request")
    parser.add_argument("--max-num-samples", type=int, default=LimitsConfig.max_num_samples,
                        help="largest num_samples of one sampling request")
    parser.add_argument("--max-sampled-tokens-per-request", type=int,
                        default=LimitsConfig.max_sampled_tokens_per_request,
                        help="num_samples x max_tokens of one sampling request")
    parser.add_argument("--max-runs-per-tenant", type=int, default=LimitsConfig.max_runs_per_tenant,
                        help="training runs of open sessions a tenant may have at once")
    parser.add_argument("--max-stored-gb-per-tenant", type=float,
                        default=LimitsConfig.max_stored_bytes_per_tenant / (1 << 30),
                        help="GiB of checkpoint files and journal rows (sessions, runs, results) a tenant may keep")
    parser.add_argument("--seq-gap-timeout-seconds", "--seq-gap-timeout",
                        type=float, default=LimitsConfig.seq_gap_timeout_seconds,
                        help="seconds a run waits for a missing seq_id before failing the requests queued behind it")
    parser.add_argument("--max-datums-per-request", type=int, default=LimitsConfig.max_datums_per_request,
                        help="datums of one forward_backward request")
    parser.add_argument("--header-timeout-seconds", "--header-timeout",
                        type=float, default=LimitsConfig.header_timeout_seconds,
                        help="seconds a request's headers may take to arrive before its connection is closed")
    parser.add_argument("--body-timeout-seconds", "--body-timeout",
                        type=float, default=LimitsConfig.body_timeout_seconds,
                        help="seconds a request's body may pause between two reads before its connection is closed")
    parser.add_argument("--max-connections-per-client", type=int, default=LimitsConfig.max_connections_per_client,
                        help="connections one client address may keep open; one more is answered 503 and closed")
    parser.add_argument("--shutdown-timeout-seconds", "--shutdown-timeout",
                        type=float, default=ServerConfig.shutdown_timeout_seconds,
                        help="seconds running requests get to finish on SIGTERM before they are failed")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of a refused start-up too, not only its one-line reason")
    parser.add_argument("--local-ranks", "--gpus", type=int, default=None,
                        help="training processes on this node, one per GPU (with --device cpu: CPU processes) "
                             "(default: as many as --training-devices names, else 1)")
    parser.add_argument("--training-devices", type=_device_list, default=None,
                        help="the GPUs training runs on, e.g. 0,1: local rank r on the r-th (indices among the "
                             "GPUs the server sees) (default: ranks 0..N-1 on GPUs 0..N-1)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each decoder block in backward (less memory, about a third more compute; "
                             "always on for Qwen3.5 / Qwen3.6 and MoE families)")
    parser.add_argument("--max-tokens-per-microbatch", "--microbatch-tokens",
                        type=int, default=TrainerConfig.max_tokens_per_microbatch,
                        help="tokens per forward/backward pass on each training rank (padded ones too, padded)")
    parser.add_argument("--microbatch-layout", choices=("packed", "padded"), default=TrainerConfig.microbatch_layout,
                        help="packed: each micro-batch's datums end to end in one row, attention within each datum; "
                             "padded: one right-padded row per datum (hybrid Qwen3.5 models always)")
    parser.add_argument("--packed-attention", choices=("auto", "varlen", "sdpa"), default=TrainerConfig.packed_attention,
                        help="attention of a packed row: varlen, one flash varlen call per layer (CUDA, bf16/fp16); "
                             "sdpa, one SDPA call per datum; auto: varlen where it runs, else sdpa")
    parser.add_argument("--base-sharding", choices=("auto", "shard", "replicate"), default=TrainerConfig.base_sharding,
                        help="over several training ranks: shard the frozen base (FSDP2) or keep a whole copy on each "
                             "rank (no all-gathers, the base's memory on every GPU); auto: replicate when the base "
                             f"takes at most {REPLICATE_SHARE * 100:.0f}%% of a training device's memory")
    parser.add_argument("--max-tokens-per-pass", type=int, default=TrainerConfig.max_tokens_per_pass,
                        help="forward_backward tokens per training pass, shared fairly among the runs with work")
    parser.add_argument("--max-runs-per-pass", type=int, default=None,
                        help="runs whose forward_backward work may share one training pass (default: no limit; "
                             "1: one run at a time, in turn)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the decoder blocks and the unembedding (faster GPU steps after warm-up)")
    parser.add_argument("--sampler-engine", "--sampler", choices=["embedded", "vllm"], default="embedded",
                        help="sampling engine: HF transformers in this process, or a vLLM server it supervises")
    parser.add_argument("--max-images-per-prompt", type=int, default=SamplerConfig.max_images_per_prompt,
                        help="images one sampling prompt may hold (on every engine; also vLLM's limit)")
    parser.add_argument("--sampler-max-batch-tokens", type=int, default=SamplerConfig.max_batch_tokens,
                        help="cache positions (rows x length) the embedded sampler's running batch may hold")
    parser.add_argument("--sampler-own-process", "--sampler-process", choices=["auto", "on", "off"], default="auto",
                        help="run the embedded sampler in a process of its own (auto: on with a CUDA --device)")
    parser.add_argument("--prefix-cache-gb", type=float, default=SamplerConfig.prefix_cache_bytes / (1 << 30),
                        help="GiB of earlier prompts' keys and values the embedded sampler keeps on its device, so "
                             "that a conversation's next turn runs only its new tokens (0: none)")
    parser.add_argument("--sampler-cuda-graphs", choices=["on", "off"],
                        default="on" if SamplerConfig.cuda_graphs else "off",
                        help="on a CUDA device, replay the embedded sampler's decode steps as CUDA graphs "
                             "(off: the same steps, eagerly)")
    parser.add_argument("--vllm-python", type=Path, default=None,
                        help=f"interpreter of the vLLM venv (default: the one scripts/install_vllm.sh builds, "
                             f"{DEFAULT_VLLM_PYTHON})")
    parser.add_argument("--vllm-urls", "--vllm-url", nargs="+", action="extend", default=None, metavar="URL",
                        help="use vLLMs already running at these URLs instead of starting them, one replica each "
                             "(default: start them)")
    parser.add_argument("--vllm-replicas", type=int, default=VLLMConfig.replicas,
                        help="vLLM servers to start, each on its own GPUs; requests go to the least busy one")
    parser.add_argument("--vllm-tensor-parallel-size", type=int, default=VLLMConfig.tensor_parallel_size,
                        help="GPUs of each vLLM replica (vLLM's --tensor-parallel-size)")
    parser.add_argument("--vllm-devices", "--sampler-devices", type=_device_list, default=None,
                        help="the GPUs of the vLLM replicas, e.g. 2,3 (tensor parallel size GPUs each, in turn); "
                             "the training GPUs to colocate (default: every replica on the server's GPUs)")
    parser.add_argument("--vllm-max-num-seqs", type=int, default=VLLMConfig.max_num_seqs,
                        help="sequences vLLM decodes at once")
    parser.add_argument("--vllm-max-loras", type=int, default=VLLMConfig.max_loras,
                        help="adapters that may share one vLLM batch")
    parser.add_argument("--vllm-max-lora-rank", type=int, default=VLLMConfig.max_lora_rank,
                        help="largest LoRA rank vLLM serves (8, 16, 32, 64, ...)")
    parser.add_argument("--vllm-max-cpu-loras", type=int, default=VLLMConfig.max_cpu_loras,
                        help="adapters vLLM keeps loaded (least recently used ones are reloaded from disk)")
    parser.add_argument("--vllm-extra-args", "--vllm-args", default="",
                        help="more flags for the vLLM server, e.g. '--gpu-memory-utilization 0.4'; JSON values "
                             "pass intact, quoted or not: '--hf-overrides {\"a\": 1}' (default: none)")
    return parser


def _device_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of GPU indices, e.g. 0,1; got {text!r}") from None


def _add_store_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", type=Path, default=Path("./data"),
                        help="SQLite journal, checkpoints and built-in models live here (default: ./data, "
                             "under the directory the command runs in)")
    parser.add_argument("--database-url", default=None,
                        help="SQLAlchemy URL (e.g. postgresql+psycopg://...); env TINKER_SERVER_DATABASE_URL; "
                             "default: SQLite under --data-dir")


def _database_url(args: argparse.Namespace, data_dir: Path) -> str:
    return args.database_url or os.environ.get("TINKER_SERVER_DATABASE_URL") or f"sqlite:///{data_dir / 'server.db'}"


def parse_config(argv: list[str] | None = None) -> ServerConfig:
    """Parse flags (and env for the database URL) into the settings tree."""
    args = build_arg_parser().parse_args(argv)
    data_dir = args.data_dir.resolve()
    database_url = _database_url(args, data_dir)
    local_ranks = args.local_ranks or (len(args.training_devices) if args.training_devices else 1)
    return ServerConfig(
        model=ModelConfig(base_model=args.base_model, model_path=args.model_path,
                          model_cache_dir=data_dir / "models", device=args.device, dtype=args.dtype),
        store=StoreConfig(database_url=database_url, checkpoint_dir=data_dir / "checkpoints",
                          checkpoint_sweep_seconds=args.checkpoint_sweep_seconds),
        host=args.host, port=args.port, data_dir=data_dir,
        images=ImageConfig(image_root=args.image_root.resolve() if args.image_root else None,
                           decoded_cache_bytes=args.decoded_cache_mb << 20,
                           feature_cache_bytes=args.feature_cache_mb << 20),
        limits=LimitsConfig(session_timeout_seconds=args.session_timeout_seconds, max_lora_rank=args.max_lora_rank,
                            max_sample_tokens=args.max_sample_tokens, max_num_samples=args.max_num_samples,
                            max_sampled_tokens_per_request=args.max_sampled_tokens_per_request,
                            max_runs_per_tenant=args.max_runs_per_tenant,
                            max_stored_bytes_per_tenant=int(args.max_stored_gb_per_tenant * (1 << 30)),
                            seq_gap_timeout_seconds=args.seq_gap_timeout_seconds,
                            max_datums_per_request=args.max_datums_per_request,
                            header_timeout_seconds=args.header_timeout_seconds,
                            body_timeout_seconds=args.body_timeout_seconds,
                            max_connections_per_client=args.max_connections_per_client),
        auth=args.auth, shutdown_timeout_seconds=args.shutdown_timeout_seconds, debug=args.debug,
        trainer=TrainerConfig(local_ranks=local_ranks, training_devices=args.training_devices,
                              activation_checkpointing=args.activation_checkpointing,
                              max_tokens_per_microbatch=args.max_tokens_per_microbatch,
                              microbatch_layout=args.microbatch_layout, packed_attention=args.packed_attention,
                              base_sharding=args.base_sharding, compile=args.compile,
                              max_tokens_per_pass=args.max_tokens_per_pass,
                              max_runs_per_pass=args.max_runs_per_pass,
                              # torchrun's variables when ranks on other nodes join (see the README)
                              world_size=int(os.environ.get("WORLD_SIZE", local_ranks)),
                              master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                              master_port=int(os.environ.get("MASTER_PORT", 0))),
        sampler=SamplerConfig(engine=args.sampler_engine,
                              vllm=_vllm_config(args) if args.sampler_engine == "vllm" else None,
                              max_images_per_prompt=args.max_images_per_prompt,
                              max_batch_tokens=args.sampler_max_batch_tokens,
                              own_process=args.sampler_own_process == "on" or (args.sampler_own_process == "auto"
                                                                                and args.device.startswith("cuda")),
                              prefix_cache_bytes=int(args.prefix_cache_gb * (1 << 30)),
                              cuda_graphs=args.sampler_cuda_graphs == "on"),
        client=ClientFlagsConfig(fwdbwd_max_chunk_len=args.fwdbwd_max_chunk_len))


@dataclass(frozen=True)
class KeysCommand:
    """`python -m server keys create|list|revoke ...`: an operator's key management."""

    action: str
    database_url: str
    data_dir: Path
    tenant: str | None = None
    admin: bool = False
    label: str | None = None
    key_id: str | None = None
    new_database: bool = False
    """Create the server's database where there is none yet (else such a --data-dir is refused as a typo)."""


def build_keys_arg_parser() -> argparse.ArgumentParser:
    """The CLI of `python -m server keys` (frozen by tests/unit/test_cli.py)."""
    parser = argparse.ArgumentParser(prog="python -m server keys", formatter_class=HelpWithDefaults,
                                     description="issue, list and revoke API keys (only their hashes are stored)")
    actions = parser.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="issue a key for a tenant and print it (once)",
                                formatter_class=HelpWithDefaults)
    create.add_argument("--tenant", required=True, help="who the key's requests belong to (required)")
    create.add_argument("--admin", action="store_true", help="may also read server-wide data (/metrics)")
    create.add_argument("--label", default=None, help="a note shown by `keys list` (default: none)")
    create.add_argument("--new-database", action="store_true",
                        help="create the server's database if the data directory has none yet (before a "
                             "server's first start); without it a directory with no database is refused")
    listing = actions.add_parser("list", help="every key: id, tenant, created, revoked",
                                 formatter_class=HelpWithDefaults)
    listing.add_argument("--tenant", default=None, help="only this tenant's keys (default: every tenant's)")
    revoke = actions.add_parser("revoke", help="revoke a key by its id (from `keys list`)",
                                formatter_class=HelpWithDefaults)
    revoke.add_argument("key_id", help="the key's id, e.g. key-1a2b3c4d")
    for sub in (create, listing, revoke):
        _add_store_flags(sub)
    return parser


def parse_keys_command(argv: list[str]) -> KeysCommand:
    args = build_keys_arg_parser().parse_args(argv)
    data_dir = args.data_dir.resolve()
    return KeysCommand(action=args.action, database_url=_database_url(args, data_dir), data_dir=data_dir,
                       tenant=args.tenant if args.action != "revoke" else None, admin=getattr(args, "admin", False),
                       label=getattr(args, "label", None), key_id=getattr(args, "key_id", None),
                       new_database=getattr(args, "new_database", False))


@dataclass(frozen=True)
class AdaptersCommand:
    """`python -m server adapters import PATH --tenant NAME`: an operator imports a PEFT LoRA adapter."""

    path: Path
    """A folder with adapter_config.json and adapter_model.safetensors."""
    tenant: str
    name: str
    """The checkpoints' name (weights/NAME and sampler_weights/NAME)."""
    model: ModelConfig
    """The server's base model, whose LoRA targets the adapter must fit."""
    max_lora_rank: int
    database_url: str
    checkpoint_dir: Path


def build_adapters_arg_parser() -> argparse.ArgumentParser:
    """The CLI of `python -m server adapters` (frozen by tests/unit/test_cli.py)."""
    parser = argparse.ArgumentParser(prog="python -m server adapters", formatter_class=HelpWithDefaults,
                                     description="import LoRA adapters made elsewhere into a tenant")
    actions = parser.add_subparsers(dest="action", required=True)
    imports = actions.add_parser("import", formatter_class=HelpWithDefaults,
                                 help="import a PEFT LoRA adapter folder (adapter_config.json, "
                                      "adapter_model.safetensors) for the served base model")
    imports.add_argument("path", type=Path, help="the adapter's folder")
    imports.add_argument("--tenant", required=True, help="whose checkpoints the import makes (required)")
    imports.add_argument("--name", default=None, help="the checkpoints' name (default: the folder's name)")
    imports.add_argument("--base-model", required=True, help="the server's --base-model (required)")
    imports.add_argument("--model-path", type=Path, default=None, help="the server's --model-path (default: none)")
    imports.add_argument("--max-lora-rank", type=int, default=LimitsConfig.max_lora_rank,
                         help="the server's --max-lora-rank")
    _add_store_flags(imports)
    return parser


def parse_adapters_command(argv: list[str]) -> AdaptersCommand:
    args = build_adapters_arg_parser().parse_args(argv)
    data_dir = args.data_dir.resolve()
    return AdaptersCommand(path=args.path, tenant=args.tenant, name=args.name or args.path.resolve().name,
                           model=ModelConfig(base_model=args.base_model, model_path=args.model_path,
                                             model_cache_dir=data_dir / "models"),
                           max_lora_rank=args.max_lora_rank, database_url=_database_url(args, data_dir),
                           checkpoint_dir=data_dir / "checkpoints")


@dataclass(frozen=True)
class ExportCommand:
    """`python -m server export --merged tinker://... --out DIR`: an operator writes base model plus adapter."""

    merged: str
    """The checkpoint's tinker:// path."""
    out: Path
    model_path: Path | None
    """The server's --model-path; None: the checkpoint's base model is found as the server finds it."""
    model_cache_dir: Path
    database_url: str


def build_export_arg_parser() -> argparse.ArgumentParser:
    """The CLI of `python -m server export` (frozen by tests/unit/test_cli.py)."""
    parser = argparse.ArgumentParser(prog="python -m server export", formatter_class=HelpWithDefaults,
                                     description="write a checkpoint merged into its base model as a Hugging "
                                                 "Face model folder (transformers and vLLM load it)")
    parser.add_argument("--merged", required=True, metavar="TINKER_PATH",
                        help="the checkpoint (tinker://RUN/weights/NAME or .../sampler_weights/NAME) (required)")
    parser.add_argument("--out", type=Path, required=True, help="a new directory for the model (required)")
    parser.add_argument("--model-path", type=Path, default=None,
                        help="the server's --model-path (default: the base model is found as the server finds it)")
    _add_store_flags(parser)
    return parser


def parse_export_command(argv: list[str]) -> ExportCommand:
    args = build_export_arg_parser().parse_args(argv)
    data_dir = args.data_dir.resolve()
    return ExportCommand(merged=args.merged, out=args.out, model_path=args.model_path,
                         model_cache_dir=data_dir / "models", database_url=_database_url(args, data_dir))


def _vllm_config(args: argparse.Namespace) -> VLLMConfig:
    python = None
    if not args.vllm_urls:
        python = (args.vllm_python or DEFAULT_VLLM_PYTHON).absolute()
        if not python.exists():
            raise SystemExit(f"--sampler-engine vllm: no vLLM interpreter at {python}. Build the venv with "
                             f"`bash {REPO_ROOT / 'scripts' / 'install_vllm.sh'}` (it goes to {DEFAULT_VLLM_PYTHON}), "
                             f"or pass --vllm-python PATH (a venv with vLLM and the server's plugin) or "
                             f"--vllm-url URL (a vLLM already running)")
    return VLLMConfig(
        python=python, urls=tuple(args.vllm_urls or ()), replicas=args.vllm_replicas,
        tensor_parallel_size=args.vllm_tensor_parallel_size, devices=args.vllm_devices, max_num_seqs=args.vllm_max_num_seqs,
        max_loras=args.vllm_max_loras, max_lora_rank=args.vllm_max_lora_rank, max_cpu_loras=args.vllm_max_cpu_loras,
        # On CPUs a seeded request whose prefill is split draws extra random numbers (see VLLMConfig).
        chunked_prefill=args.device != "cpu", extra_args=split_command_line(args.vllm_extra_args))


def split_command_line(text: str) -> tuple[str, ...]:
    """Words split on whitespace outside quotes and outside JSON brackets, with JSON values intact.

    shlex drops the quotes inside `{"image": 16}`, which vLLM then cannot parse. Here quotes and
    brackets only group: a word that is wholly quoted loses its outer quotes, any other keeps its text.
    """
    words, word, depth, quote = [], "", 0, None
    for char in text:
        if quote is not None:
            quote = None if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char.isspace() and depth <= 0:
            if word:
                words.append(word)
            word = ""
            continue
        word += char
    if quote is not None or depth != 0:
        raise SystemExit(f"--vllm-extra-args: unbalanced quotes or brackets in {text!r}")
    if word:
        words.append(word)
    return tuple(w[1:-1] if len(w) >= 2 and w[0] == w[-1] and w[0] in "\"'" else w for w in words)


def rank_from_environment() -> int:
    """This process's training rank, as torchrun sets it."""
    return int(os.environ["RANK"])
