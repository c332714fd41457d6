"""External weights: age encryption of an export's files, and the signatures behind its download URLs.

An export (save_weights_external) is a PEFT adapter directory; with recipients, each file is replaced
by `NAME.age`, encrypted to all of them (what `age -d` and the cookbook's pyrage decrypt). Download
URLs and weights access tokens are HMAC-SHA256 signatures with one server secret kept in the data
directory, so every replica sharing it accepts them. Knows nothing about HTTP routes or the database.
"""

import base64
import hashlib
import hmac
import os
import secrets
from pathlib import Path

from server.errors import InvalidRequest

try:  # optional: pip install 'tinker-vlm-server[age]'
    import pyrage
except ImportError:
    pyrage = None

AGE_SUFFIX = ".age"
MAX_AGE_RECIPIENTS = 10
SIGNING_KEY_FILE = "url_signing.key"


def parse_age_recipients(recipients: list[str]) -> list:
    """age recipients from their text: native `age1...` keys or SSH public keys; 400 for anything else."""
    if pyrage is None:
        raise InvalidRequest("age encryption needs pyrage on the server (pip install 'tinker-vlm-server[age]')")
    if not 1 <= len(recipients) <= MAX_AGE_RECIPIENTS:
        raise InvalidRequest(f"give 1 to {MAX_AGE_RECIPIENTS} age_encryption_recipients, got {len(recipients)}")
    parsed = []
    for text in recipients:
        kind = pyrage.ssh if text.startswith("ssh-") else pyrage.x25519
        try:
            parsed.append(kind.Recipient.from_str(text.strip()))
        except pyrage.RecipientError as error:
            raise InvalidRequest(f"{text[:80]!r} is not an age recipient (age1... or an SSH public key): "
                                 f"{error}") from None
    return parsed


def encrypt_files(directory: Path, recipients: list) -> int:
    """Replace every file of `directory` by `NAME.age`, encrypted to `recipients`; returns the new total size."""
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        pyrage.encrypt_file(str(path), str(path.with_name(path.name + AGE_SUFFIX)), recipients)
        path.unlink()
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


class Signer:
    """HMAC-SHA256 signatures for download URLs and weights access tokens, one purpose per prefix."""

    def __init__(self, key: bytes):
        self._key = key

    @classmethod
    def from_data_dir(cls, data_dir: Path) -> "Signer":
        """The key in `data_dir`, created (by exactly one process) on first use."""
        path = data_dir / SIGNING_KEY_FILE
        if not path.exists():
            # Written aside, then linked into place: a replica starting at the same time reads a whole key.
            staged = data_dir / f".{SIGNING_KEY_FILE}.{secrets.token_hex(8)}"
            descriptor = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as file:
                file.write(secrets.token_bytes(32).hex())
            try:
                os.link(staged, path)
            except FileExistsError:
                pass
            finally:
                staged.unlink()
        return cls(bytes.fromhex(path.read_text().strip()))

    def _mac(self, purpose: str, *parts: str) -> str:
        message = "\n".join((purpose, *parts)).encode()
        return base64.urlsafe_b64encode(hmac.new(self._key, message, hashlib.sha256).digest()).decode().rstrip("=")

    def download_signature(self, resource: str, expires: int) -> str:
        """Signature of a download URL for `resource` valid until `expires` (unix seconds)."""
        return self._mac("download", resource, str(expires))

    def valid_download(self, resource: str, expires: int, signature: str, now: float) -> bool:
        return now < expires and _same(signature, self.download_signature(resource, expires))

    def weights_access_token(self, tinker_path: str, version: str) -> str:
        """A token that lets its holder read one checkpoint (this version of it: a re-save revokes it)."""
        return "wat-" + self._mac("weights-access", tinker_path, version)

    def valid_weights_access_token(self, token: str, tinker_path: str, version: str) -> bool:
        return _same(token, self.weights_access_token(tinker_path, version))


def _same(given: str, expected: str) -> bool:
    """A constant-time comparison that any string a client sends can reach (str needs ASCII)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode())
