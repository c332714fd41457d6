"""What the server tells its operator on start-up: the banner (once the model is loaded) and the ready line.

The banner says where the server listens, what it serves, on which engines, where its data lives,
where to look next, and on a first start the bootstrap admin key (shown this once). The ready line
comes only when the socket really accepts requests. Knows nothing about how any of it is built.
"""

from pathlib import Path

from sqlalchemy.engine import make_url

from server.config import ServerConfig, is_loopback

RULE = "=" * 78


def server_url(config: ServerConfig) -> str:
    """The URL clients on this machine use (a wildcard bind is reached through loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(config.host, config.host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{config.port}"


def start_banner(config: ServerConfig, model_path: Path, model_type: str, bootstrap_key: str | None,
                 bootstrap_tenant: str, base_sharding: str) -> str:
    url = server_url(config)
    lines = [
        RULE,
        f"  Tinker-compatible training service: {config.model.base_model}",
        f"  Address:    {url}" + ("" if is_loopback(config.host) else f"   (bound to {config.host})"),
        f"  Model:      {model_path}  ({model_type}, {config.model.dtype})",
        f"  Training:   LoRA on {config.model.device}, {config.trainer.world_size} rank(s)"
        + (f", base {'sharded (FSDP2)' if base_sharding == 'shard' else 'replicated'}"
           if config.trainer.world_size > 1 else "")
        + (", torch.compile" if config.trainer.compile else ""),
        f"  Sampling:   {_sampling_engine(config)}",
        f"  Data:       {config.data_dir}  (journal: {_journal(config.store.database_url)})",
        f"  Dashboard:  {url}/dashboard   Health: {url}/api/v1/healthz   API docs: {url}/docs",
    ]
    if config.auth == "none":
        lines.append("  API keys:   off (--auth none): every client is tenant 'default'")
    elif bootstrap_key is not None:
        lines += [
            f"  API key of tenant {bootstrap_tenant!r} (admin), shown only this once (only its hash is stored):",
            f"      {bootstrap_key}",
            f"  Use it:     export TINKER_BASE_URL={url} TINKER_API_KEY={bootstrap_key}",
            "  More keys:  python -m server keys create --tenant NAME   (list, revoke: python -m server keys -h)",
        ]
    else:
        lines.append("  API keys:   python -m server keys create --tenant NAME   (list, revoke: python -m server keys -h)")
    lines.append(RULE)
    return "\n".join(lines)


def ready_line(config: ServerConfig, seconds: float) -> str:
    return (f"Ready: serving {config.model.base_model} at {server_url(config)} (started in {seconds:.1f} s). "
            f"This command stays in the foreground; Ctrl-C stops it.")


def _sampling_engine(config: ServerConfig) -> str:
    sampler = config.sampler
    if sampler.engine == "embedded":
        return "embedded (HF transformers in this process; its model copy loads on the first sampling request)"
    vllm = sampler.vllm
    if vllm.urls:
        return f"vLLM at {', '.join(vllm.urls)} (run by someone else)"
    logs = config.data_dir / ("vllm.log" if vllm.replicas == 1 else "vllm-*.log")
    placement = "" if vllm.devices is None else f" on GPUs {','.join(map(str, vllm.devices))}"
    return (f"vLLM started and supervised by this server, {vllm.replicas} replica(s) of "
            f"{vllm.tensor_parallel_size} GPU(s){placement} ({vllm.python}; log {logs})")


def _journal(database_url: str) -> str:
    return make_url(database_url).render_as_string(hide_password=True)
