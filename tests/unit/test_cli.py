"""Freezes the command line of `python -m server` and how it becomes the settings tree.

Adding, renaming or removing a flag must be a deliberate edit of CLI_OPTIONS below.
"""

import dataclasses
import json
from pathlib import Path

import pytest

from server.config import (DEFAULT_VLLM_PYTHON, REPO_ROOT, ClientFlagsConfig, ImageConfig, LimitsConfig, ModelConfig,
                           SamplerConfig, ServerConfig, StoreConfig, TrainerConfig, VLLMConfig, build_adapters_arg_parser,
                           build_arg_parser, build_export_arg_parser, build_keys_arg_parser, parse_config,
                           parse_keys_command)
from server.keys import run_keys_command
from server.sampling.vllm_process import ServedModel, vllm_command

CLI_OPTIONS = {
    "-h", "--help",
    "--base-model",
    "--model-path",
    "--host",
    "--port",
    "--data-dir",
    "--database-url",
    "--device",
    "--dtype",
    "--fwdbwd-max-chunk-len", "--fwdbwd-chunk-len",
    "--image-root",
    "--decoded-cache-mb", "--image-cache-mb",
    "--feature-cache-mb",
    "--session-timeout-seconds", "--session-timeout",
    "--checkpoint-sweep-seconds", "--checkpoint-sweep-interval",
    "--auth",
    "--max-lora-rank",
    "--max-sample-tokens",
    "--max-num-samples",
    "--max-sampled-tokens-per-request",
    "--max-runs-per-tenant",
    "--max-stored-gb-per-tenant",
    "--seq-gap-timeout-seconds", "--seq-gap-timeout",
    "--max-datums-per-request",
    "--header-timeout-seconds", "--header-timeout",
    "--body-timeout-seconds", "--body-timeout",
    "--max-connections-per-client",
    "--shutdown-timeout-seconds", "--shutdown-timeout",
    "--debug",
    "--local-ranks", "--gpus",
    "--training-devices",
    "--activation-checkpointing",
    "--max-tokens-per-microbatch", "--microbatch-tokens",
    "--microbatch-layout",
    "--packed-attention",
    "--base-sharding",
    "--max-tokens-per-pass",
    "--max-runs-per-pass",
    "--compile",
    "--sampler-engine", "--sampler",
    "--max-images-per-prompt",
    "--sampler-max-batch-tokens",
    "--sampler-own-process", "--sampler-process",
    "--prefix-cache-gb",
    "--sampler-cuda-graphs",
    "--vllm-python",
    "--vllm-urls", "--vllm-url",
    "--vllm-replicas",
    "--vllm-tensor-parallel-size",
    "--vllm-devices", "--sampler-devices",
    "--vllm-max-num-seqs",
    "--vllm-max-loras",
    "--vllm-max-lora-rank",
    "--vllm-max-cpu-loras",
    "--vllm-extra-args", "--vllm-args",
}
KEYS_CLI_OPTIONS = {
    "create": {"-h", "--help", "--tenant", "--admin", "--label", "--new-database", "--data-dir", "--database-url"},
    "list": {"-h", "--help", "--tenant", "--data-dir", "--database-url"},
    "revoke": {"-h", "--help", "--data-dir", "--database-url"},
}
ADAPTERS_CLI_OPTIONS = {
    "import": {"-h", "--help", "--tenant", "--name", "--base-model", "--model-path", "--max-lora-rank", "--data-dir",
               "--database-url"},
}
EXPORT_CLI_OPTIONS = {"-h", "--help", "--merged", "--out", "--model-path", "--data-dir", "--database-url"}
DATABASE_URL_ENV = "TINKER_SERVER_DATABASE_URL"


def test_the_cli_has_exactly_the_frozen_set_of_options():
    for parser, frozen in ((build_arg_parser(), CLI_OPTIONS), (build_export_arg_parser(), EXPORT_CLI_OPTIONS)):
        assert {option for action in parser._actions for option in action.option_strings} == frozen


def test_every_flag_is_named_after_the_setting_it_fills():
    """A flag is its setting's name (with its section in front for sampler and vLLM settings, and MiB or GiB
    in the name where the setting counts bytes); an earlier spelling may follow it as an alias."""
    sections = {"sampler_": [SamplerConfig], "vllm_": [VLLMConfig]}
    everywhere = [ServerConfig, ModelConfig, StoreConfig, TrainerConfig, SamplerConfig, LimitsConfig, ImageConfig,
                  ClientFlagsConfig]
    unnamed = []
    for action in build_arg_parser()._actions:
        if action.dest == "help":
            continue
        assert action.option_strings[0] == "--" + action.dest.replace("_", "-")
        name = action.dest.replace("_mb", "_bytes").replace("_gb", "_bytes")
        prefix = next((prefix for prefix in sections if name.startswith(prefix)), None)
        classes = sections[prefix] if prefix else everywhere
        name = name.removeprefix(prefix) if prefix else name
        if not any(name in {f.name for f in dataclasses.fields(cls)} for cls in classes):
            unnamed.append(action.option_strings[0])
    assert unnamed == []


def test_the_keys_and_adapters_clis_have_exactly_the_frozen_commands_and_options():
    for parser, frozen in ((build_keys_arg_parser(), KEYS_CLI_OPTIONS),
                           (build_adapters_arg_parser(), ADAPTERS_CLI_OPTIONS)):
        actions = next(a for a in parser._actions if a.dest == "action")
        assert {name: {o for a in sub._actions for o in a.option_strings}
                for name, sub in actions.choices.items()} == frozen


def test_keys_commands_find_the_servers_database_like_the_server(tmp_path, monkeypatch):
    monkeypatch.delenv(DATABASE_URL_ENV, raising=False)
    command = parse_keys_command(["create", "--tenant", "alice", "--admin", "--data-dir", str(tmp_path)])
    assert (command.action, command.tenant, command.admin) == ("create", "alice", True)
    assert command.database_url == parse_config(["--base-model", "m", "--data-dir", str(tmp_path)]).store.database_url
    assert parse_keys_command(["revoke", "key-1234"]).key_id == "key-1234"


def test_limits_and_lifecycle_flags_reach_the_config():
    config = parse_config(["--base-model", "m", "--max-lora-rank", "16", "--max-sampled-tokens-per-request", "99",
                           "--max-runs-per-tenant", "3", "--max-stored-gb-per-tenant", "0.5", "--seq-gap-timeout",
                           "7", "--shutdown-timeout", "9", "--max-datums-per-request", "64", "--header-timeout", "2",
                           "--body-timeout", "3", "--max-connections-per-client", "5"])
    limits = config.limits
    assert (limits.max_lora_rank, limits.max_sampled_tokens_per_request, limits.max_runs_per_tenant) == (16, 99, 3)
    assert (limits.max_stored_bytes_per_tenant, limits.seq_gap_timeout_seconds) == (1 << 29, 7)
    assert (config.auth, config.shutdown_timeout_seconds) == ("keys", 9)
    assert (limits.max_datums_per_request, limits.header_timeout_seconds, limits.body_timeout_seconds,
            limits.max_connections_per_client) == (64, 2, 3, 5)
    with pytest.raises(ValueError, match="--fwdbwd-max-chunk-len 128 is over --max-datums-per-request 64"):
        parse_config(["--base-model", "m", "--max-datums-per-request", "64", "--fwdbwd-chunk-len", "128"])


def test_the_training_pass_budget_and_run_limit_reach_the_trainer_config():
    assert parse_config(["--base-model", "m", "--max-tokens-per-pass", "4096"]).trainer.max_tokens_per_pass == 4096
    with pytest.raises(ValueError, match="max_tokens_per_pass"):
        parse_config(["--base-model", "m", "--max-tokens-per-pass", "0"])
    assert parse_config(["--base-model", "m"]).trainer.max_runs_per_pass is None
    assert parse_config(["--base-model", "m", "--max-runs-per-pass", "1"]).trainer.max_runs_per_pass == 1
    with pytest.raises(ValueError, match="max_runs_per_pass"):
        parse_config(["--base-model", "m", "--max-runs-per-pass", "0"])


def test_auth_none_is_refused_on_a_host_others_can_reach():
    assert parse_config(["--base-model", "m", "--auth", "none"]).auth == "none"
    assert parse_config(["--base-model", "m", "--auth", "none", "--host", "::1"]).auth == "none"
    with pytest.raises(ValueError, match="loopback"):
        parse_config(["--base-model", "m", "--auth", "none", "--host", "0.0.0.0"])


def test_base_model_is_the_only_required_flag(capsys):
    with pytest.raises(SystemExit):
        parse_config([])
    assert "--base-model" in capsys.readouterr().err
    config = parse_config(["--base-model", "builtin:tiny-qwen3"])
    assert config.model.base_model == "builtin:tiny-qwen3"
    assert (config.host, config.port, config.model.device, config.model.dtype) == ("127.0.0.1", 8000, "cpu",
                                                                                    "float32")


def test_without_a_url_the_journal_is_sqlite_under_the_data_dir(tmp_path, monkeypatch):
    monkeypatch.delenv(DATABASE_URL_ENV, raising=False)
    monkeypatch.chdir(tmp_path)

    config = parse_config(["--base-model", "builtin:tiny-qwen3", "--data-dir", "relative/data"])

    data_dir = tmp_path / "relative" / "data"
    assert config.data_dir == data_dir
    assert config.store.database_url == f"sqlite:///{data_dir}/server.db"
    assert config.store.checkpoint_dir == data_dir / "checkpoints"
    assert config.model.model_cache_dir == data_dir / "models"


def test_the_database_url_comes_from_the_environment_unless_the_flag_is_given(tmp_path, monkeypatch):
    env_url = "postgresql+psycopg://env-user@db.example/journal"
    flag_url = "postgresql+psycopg://flag-user@db.example/journal"
    monkeypatch.setenv(DATABASE_URL_ENV, env_url)
    common = ["--base-model", "builtin:tiny-qwen3", "--data-dir", str(tmp_path)]

    assert parse_config(common).store.database_url == env_url
    assert parse_config([*common, "--database-url", flag_url]).store.database_url == flag_url
    monkeypatch.delenv(DATABASE_URL_ENV)
    assert parse_config([*common, "--database-url", flag_url]).store.database_url == flag_url


def test_flags_reach_their_sub_configs(tmp_path, monkeypatch):
    monkeypatch.delenv(DATABASE_URL_ENV, raising=False)
    config = parse_config(["--base-model", "Qwen/Qwen3-VL-4B-Instruct", "--model-path", str(tmp_path / "model"),
                           "--host", "0.0.0.0", "--port", "9001", "--device", "cuda:1", "--dtype", "bfloat16",
                           "--fwdbwd-chunk-len", "64", "--session-timeout", "90"])

    assert config.model.model_path == tmp_path / "model"
    assert (config.host, config.port) == ("0.0.0.0", 9001)
    assert (config.model.device, config.model.dtype) == ("cuda:1", "bfloat16")
    assert config.client.fwdbwd_max_chunk_len == 64
    assert config.limits.session_timeout_seconds == 90


def test_a_bad_dtype_is_rejected_by_the_cli_and_by_the_model_config(capsys, tmp_path):
    with pytest.raises(SystemExit):
        parse_config(["--base-model", "builtin:tiny-qwen3", "--dtype", "float64"])
    assert "--dtype" in capsys.readouterr().err
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(base_model="builtin:tiny-qwen3", model_path=None, model_cache_dir=Path(tmp_path), dtype="int8")


def test_image_cache_sizes_are_given_in_mebibytes():
    config = parse_config(["--base-model", "builtin:tiny-qwen2-vl", "--image-cache-mb", "64",
                           "--feature-cache-mb", "16"])
    assert (config.images.decoded_cache_bytes, config.images.feature_cache_bytes) == (64 << 20, 16 << 20)


def test_sampling_limits_reach_the_sampler_config():
    config = parse_config(["--base-model", "builtin:tiny-qwen2-vl", "--max-images-per-prompt", "32",
                           "--sampler-max-batch-tokens", "4096"])
    assert (config.sampler.max_images_per_prompt, config.sampler.max_batch_tokens) == (32, 4096)
    assert parse_config(["--base-model", "builtin:tiny-qwen2-vl"]).sampler.max_images_per_prompt >= 16


def test_vllm_args_keep_json_values_intact_quoted_or_not(tmp_path):
    common = ["--base-model", "builtin:tiny-qwen2-vl", "--sampler", "vllm", "--vllm-url", "http://127.0.0.1:1"]
    for flags in ['--limit-mm-per-prompt {"image": 32} --seed 3', "--limit-mm-per-prompt '{\"image\": 32}' --seed 3"]:
        extra = parse_config([*common, "--vllm-args", flags]).sampler.vllm.extra_args
        assert extra == ("--limit-mm-per-prompt", '{"image": 32}', "--seed", "3")
    assert parse_config([*common, "--vllm-args", '--x "a b"']).sampler.vllm.extra_args == ("--x", "a b")


def test_the_vllm_batch_size_is_a_flag_that_reaches_vllm_and_the_servers_splitting(tmp_path):
    common = ["--base-model", "builtin:tiny-qwen2-vl", "--sampler", "vllm", "--vllm-url", "http://127.0.0.1:1"]
    assert parse_config(common).sampler.vllm.max_num_seqs == 256  # an RL round's sequences in one wave
    config = parse_config([*common, "--vllm-max-num-seqs", "32"]).sampler.vllm
    assert config.max_num_seqs == 32  # what VLLMEngine splits larger requests by
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2VLForConditionalGeneration"]}))
    served = ServedModel(directory=tmp_path, name="m", dtype="float32", refused_token_ids=frozenset())
    command = vllm_command(dataclasses.replace(config, python=Path("python"), urls=()), served, port=8100)
    assert command[command.index("--max-num-seqs") + 1] == "32"


def test_the_vllm_venv_is_found_wherever_the_server_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    if DEFAULT_VLLM_PYTHON.exists():
        config = parse_config(["--base-model", "builtin:tiny-qwen2-vl", "--sampler", "vllm"])
        assert config.sampler.vllm.python == DEFAULT_VLLM_PYTHON
    missing = tmp_path / "no-venv" / "bin" / "python"
    with pytest.raises(SystemExit, match="install_vllm.sh") as error:
        parse_config(["--base-model", "builtin:tiny-qwen2-vl", "--sampler", "vllm", "--vllm-python", str(missing)])
    assert str(missing) in str(error.value) and str(REPO_ROOT / "scripts" / "install_vllm.sh") in str(error.value)


def _option_help_lines(parser) -> dict[str, str]:
    """Each option's help as `--help` prints it (one line, whitespace collapsed)."""
    formatter = parser._get_formatter()
    return {action.option_strings[0]: " ".join(formatter._expand_help(action).split())
            for action in parser._actions if action.option_strings and action.dest != "help"}


def test_every_flag_has_a_help_text_that_names_its_default():
    subcommands = [parser for cli in (build_keys_arg_parser(), build_adapters_arg_parser())
                   for parser in next(a for a in cli._actions if a.dest == "action").choices.values()]
    for parser in (build_arg_parser(), build_export_arg_parser(), *subcommands):
        for option, text in _option_help_lines(parser).items():
            assert len(text) > 20 and ("default" in text or "required" in text), (option, text)


def test_help_shows_the_values_of_the_defaults(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: 127.0.0.1)", "(default: 8000)", "(default: ./data,", "(default: embedded)",
                  "(default: keys)", "(default: off)", "(default: 8192)"):
        assert shown in text


def test_keys_commands_refuse_a_data_dir_without_a_server_database_unless_asked_to_create_it(tmp_path, monkeypatch,
                                                                                               capsys):
    monkeypatch.delenv(DATABASE_URL_ENV, raising=False)
    typo = tmp_path / "dta"
    for argv in (["create", "--tenant", "alice"], ["list"], ["revoke", "key-1234"]):
        assert run_keys_command(parse_keys_command([*argv, "--data-dir", str(typo)])) == 2
        assert "no server database in" in capsys.readouterr().err
    assert not typo.exists()  # nothing was created
    created = parse_keys_command(["create", "--tenant", "alice", "--new-database", "--data-dir", str(typo)])
    assert run_keys_command(created) == 0 and capsys.readouterr().out.startswith("tml-")
    # A database a server (or --new-database) made is found without the flag.
    assert run_keys_command(parse_keys_command(["list", "--data-dir", str(typo)])) == 0
    assert "alice" in capsys.readouterr().out
