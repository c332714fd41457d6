"""Getting trained weights out, unmodified: save_weights_external, the signed URLs the server serves,
`tinker checkpoint download`, push-hf's download step and the cookbook's weights.download(), with and
without age encryption; what comes out loads in PEFT and gives the trainer's logprobs."""

import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import httpx
import numpy as np
import pyrage
import pytest
import tinker
from tinker import types

from support.live_server import BASE_MODEL
from support.sdk import SENTENCES, forward_logprobs, peft_logprobs, prompt_of, supervised_datum

PEFT_FILES = ["adapter_config.json", "adapter_model.safetensors"]


@pytest.fixture(scope="module")
def trained(lifecycle_server):
    """A run trained for a few steps (so its adapter is not the zero-delta initial one), and its data."""
    service = lifecycle_server.service_client()
    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
    data = [supervised_datum(tc.get_tokenizer(), s) for s in SENTENCES[:2]]
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    yield tc, data
    service.close("success").result()


@pytest.fixture
def sdk_env(lifecycle_server, monkeypatch):
    """What the CLI and the cookbook read to find the server."""
    monkeypatch.setenv("TINKER_BASE_URL", lifecycle_server.url)
    monkeypatch.setenv("TINKER_API_KEY", lifecycle_server.api_key)
    return {"TINKER_BASE_URL": lifecycle_server.url, "TINKER_API_KEY": lifecycle_server.api_key}


def base_dir(server) -> Path:
    return server.data_dir / "models" / BASE_MODEL.removeprefix("builtin:")


def assert_peft_matches_trainer(server, adapter_dir: Path, tc, data) -> None:
    assert sorted(p.name for p in adapter_dir.iterdir() if not p.name.startswith(".")) == PEFT_FILES
    np.testing.assert_allclose(peft_logprobs(base_dir(server), adapter_dir, prompt_of(data[0])),
                               forward_logprobs(tc, data[:1])[0], atol=1e-4)


def test_external_weights_download_with_the_cookbook_and_load_in_peft(lifecycle_server, trained, sdk_env, tmp_path):
    from tinker_cookbook import weights

    tc, data = trained
    path = tc.save_weights_external("final").result().path
    assert path == f"tinker://{tc.model_id}/external_weights/final"
    rest = tinker.RestClient(base_url=lifecycle_server.url, api_key=lifecycle_server.api_key)
    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed[path].checkpoint_type == "external" and listed[path].size_bytes > 0
    weights.download(tinker_path=path, output_dir=str(tmp_path / "adapter"), base_url=lifecycle_server.url)
    assert_peft_matches_trainer(lifecycle_server, tmp_path / "adapter", tc, data)


def test_a_training_checkpoint_downloads_through_an_encrypted_export_with_the_cookbook(lifecycle_server, trained,
                                                                                       sdk_env, tmp_path):
    from tinker_cookbook import weights

    tc, data = trained
    state = tc.save_state("for-cookbook").result().path
    # The cookbook loads the checkpoint into a new run, exports it encrypted to a fresh age key, decrypts, deletes.
    weights.download(tinker_path=state, output_dir=str(tmp_path / "adapter"), base_url=lifecycle_server.url)
    assert_peft_matches_trainer(lifecycle_server, tmp_path / "adapter", tc, data)
    rest = tinker.RestClient(base_url=lifecycle_server.url, api_key=lifecycle_server.api_key)
    exports = [c for c in rest.list_user_checkpoints(limit=1000).result().checkpoints
               if c.checkpoint_type == "external" and c.checkpoint_id == "external_weights/download"]
    assert exports == []


def test_tinker_checkpoint_download_cli_and_the_push_hf_download_step(lifecycle_server, trained, sdk_env, tmp_path):
    from tinker.cli.commands.checkpoint import _download_checkpoint

    tc, data = trained
    state = tc.save_state("for-cli").result().path
    command = [sys.executable, "-m", "tinker.cli", "checkpoint", "download", state, "--output", str(tmp_path / "cli")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (downloaded,) = (tmp_path / "cli").iterdir()
    assert_peft_matches_trainer(lifecycle_server, downloaded, tc, data)
    # push-hf downloads with exactly this function before it uploads to the hub (not reachable here).
    rest = tinker.RestClient(base_url=lifecycle_server.url, api_key=lifecycle_server.api_key)
    _download_checkpoint(rest, state, tmp_path / "push-hf", show_progress=False, format="json")
    assert_peft_matches_trainer(lifecycle_server, tmp_path / "push-hf", tc, data)


def test_exports_encrypt_to_ssh_and_native_age_recipients(lifecycle_server, trained, tmp_path):
    tc, data = trained
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", tmp_path / "key"], check=True)
    native = pyrage.x25519.Identity.generate()
    ssh_identity = pyrage.ssh.Identity.from_buffer((tmp_path / "key").read_bytes())
    path = tc.save_weights_external("sealed", age_encryption_recipients=[
        (tmp_path / "key.pub").read_text().strip(), str(native.to_public())]).result().path
    rest = tinker.RestClient(base_url=lifecycle_server.url, api_key=lifecycle_server.api_key)
    urls = rest.get_external_weights_urls(path).result().urls
    assert sorted(urls) == [f"{name}.age" for name in PEFT_FILES]
    for identity, directory in ((native, tmp_path / "native"), (ssh_identity, tmp_path / "ssh")):
        directory.mkdir()
        for name, url in urls.items():
            with urllib.request.urlopen(url) as response:
                (directory / name.removesuffix(".age")).write_bytes(pyrage.decrypt(response.read(), [identity]))
        assert_peft_matches_trainer(lifecycle_server, directory, tc, data)
    with pytest.raises(tinker.BadRequestError, match="age-encrypted"):
        lifecycle_server.service_client().create_training_client_from_state(path).result()


def test_bad_recipients_are_a_400_and_the_run_goes_on(trained):
    tc, data = trained
    with pytest.raises(tinker.BadRequestError, match="is not an age recipient"):
        tc.save_weights_external("bad", age_encryption_recipients=["age1-not-a-key"]).result()
    assert tc.save_weights_external("after-bad").result().path.endswith("/external_weights/after-bad")


def test_signed_urls_need_their_signature_and_stop_working_when_the_checkpoint_is_deleted(lifecycle_server, trained):
    tc, data = trained
    path = tc.save_weights_external("short-lived").result().path
    rest = tinker.RestClient(base_url=lifecycle_server.url, api_key=lifecycle_server.api_key)
    response = rest.get_external_weights_urls(path).result()
    url = response.urls["adapter_config.json"]
    with urllib.request.urlopen(url) as download:  # no API key: the signature is the permission
        assert b'"peft_type": "LORA"' in download.read()
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qs(parts.query)
    tampered = [parts._replace(query=urllib.parse.urlencode({"expires": int(query["expires"][0]) + 60,
                                                             "signature": query["signature"][0]})),
                parts._replace(path=parts.path.replace("adapter_config.json", "adapter_model.safetensors"))]
    for bad in tampered:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.parse.urlunsplit(bad))
        assert refused.value.code == 403
    # The SDK only asks for URLs of external_weights paths; the server refuses the others itself.
    state = tc.save_state("not-external").result().path
    answer = httpx.get(f"{lifecycle_server.url}/api/v1/training_runs/{tc.model_id}/checkpoints/weights/not-external"
                       f"/external_weights_urls", headers=lifecycle_server.headers())
    assert answer.status_code == 400 and "not an external weights checkpoint" in answer.json()["detail"], state
    rest.delete_checkpoint_from_tinker_path(path).result()
    with pytest.raises(urllib.error.HTTPError) as gone:
        urllib.request.urlopen(url)
    assert gone.value.code == 404
