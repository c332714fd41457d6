"""External weights: age encryption (decrypted for real with pyrage, the cookbook's age implementation) and the
signatures of download URLs and weights access tokens."""

import subprocess

import pyrage
import pytest

from server.errors import InvalidRequest
from server.store.exports import Signer, encrypt_files, parse_age_recipients


@pytest.fixture(scope="module")
def ssh_key(tmp_path_factory) -> tuple[str, bytes]:
    """An ed25519 SSH key pair made by ssh-keygen: (public line, private key file)."""
    directory = tmp_path_factory.mktemp("ssh")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "someone@host", "-f", directory / "key"],
                   check=True)
    return (directory / "key.pub").read_text().strip(), (directory / "key").read_bytes()


def test_every_file_is_replaced_by_its_age_encryption_for_every_recipient(tmp_path, ssh_key):
    files = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": bytes(range(256)) * 50}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    native = pyrage.x25519.Identity.generate()
    recipients = parse_age_recipients([str(native.to_public()), ssh_key[0]])
    size = encrypt_files(tmp_path, recipients)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{name}.age" for name in sorted(files)]
    assert size == sum(p.stat().st_size for p in tmp_path.iterdir())
    ssh_identity = pyrage.ssh.Identity.from_buffer(ssh_key[1])
    for name, data in files.items():
        encrypted = (tmp_path / f"{name}.age").read_bytes()
        assert pyrage.decrypt(encrypted, [native]) == data
        assert pyrage.decrypt(encrypted, [ssh_identity]) == data
        with pytest.raises(pyrage.DecryptError):
            pyrage.decrypt(encrypted, [pyrage.x25519.Identity.generate()])


@pytest.mark.parametrize("recipients, message", [
    (["age1notbech32"], "is not an age recipient"),
    (["ssh-ed25519 AAAAnot-a-key"], "is not an age recipient"),
    (["hello"], "is not an age recipient"),
    ([], "give 1 to 10"),
    ([str(pyrage.x25519.Identity.generate().to_public())] * 11, "give 1 to 10"),
])  # fmt: skip
def test_bad_recipients_are_refused_with_a_reason(recipients, message):
    with pytest.raises(InvalidRequest, match=message):
        parse_age_recipients(recipients)


def test_a_download_signature_holds_for_its_resource_until_it_expires(tmp_path):
    signer = Signer.from_data_dir(tmp_path)
    signature = signer.download_signature("tinker://R/external_weights/n/a.json", 1000)
    assert signer.valid_download("tinker://R/external_weights/n/a.json", 1000, signature, now=999.0)
    assert not signer.valid_download("tinker://R/external_weights/n/a.json", 1000, signature, now=1000.0)
    assert not signer.valid_download("tinker://R/external_weights/n/b.json", 1000, signature, now=999.0)
    assert not signer.valid_download("tinker://R/external_weights/n/a.json", 2000, signature, now=999.0)
    tampered = signature[:-1] + ("B" if signature.endswith("A") else "A")  # the key is random: so is the last character
    assert not signer.valid_download("tinker://R/external_weights/n/a.json", 1000, tampered, now=9.0)
    # Whatever a client puts in the URL or header is a refusal, never an error.
    assert not signer.valid_download("tinker://R/external_weights/n/a.json", 1000, "\x80é\udcff", now=9.0)
    assert not signer.valid_weights_access_token("wat-é", "tinker://R/weights/n", "v1")


def test_replicas_sharing_a_data_dir_share_the_key_and_other_keys_do_not_verify(tmp_path):
    first, second = Signer.from_data_dir(tmp_path), Signer.from_data_dir(tmp_path)
    signature = first.download_signature("x", 10)
    assert second.valid_download("x", 10, signature, now=0.0)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert not Signer.from_data_dir(elsewhere).valid_download("x", 10, signature, now=0.0)
    assert oct((tmp_path / "url_signing.key").stat().st_mode & 0o777) == "0o600"


def test_a_weights_access_token_is_bound_to_one_version_of_one_checkpoint(tmp_path):
    signer = Signer.from_data_dir(tmp_path)
    token = signer.weights_access_token("tinker://R/weights/a", "2026-01-01T00:00:00+00:00")
    assert signer.valid_weights_access_token(token, "tinker://R/weights/a", "2026-01-01T00:00:00+00:00")
    assert not signer.valid_weights_access_token(token, "tinker://R/weights/b", "2026-01-01T00:00:00+00:00")
    assert not signer.valid_weights_access_token(token, "tinker://R/weights/a", "2026-01-02T00:00:00+00:00")
    # A download signature is no access token, though both come from the one key.
    assert not signer.valid_weights_access_token(signer.download_signature("tinker://R/weights/a", 1),
                                                 "tinker://R/weights/a", "1")
