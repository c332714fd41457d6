"""API keys: how they are made, named and recognised.

A key is `tml-` (the prefix the SDK insists on) followed by 256 random bits. Only its SHA-256 is
stored: with that much entropy a fast hash cannot be reversed by guessing, and a request's key is
found by one indexed lookup, which `KnownKeys` spares the requests that follow within a second.
Knows nothing about HTTP; `server/api/deps.py` checks keys per request.
"""

import hashlib
import re
import secrets
import threading
import time
from collections import OrderedDict

from server.store.store import ApiKeyRecord, Store

KEY_PREFIX = "tml-"
BOOTSTRAP_TENANT = "default"
KNOWN_KEY_SECONDS = 1.0
"""How long a key found valid is trusted without asking the journal again: a revocation (which the
`keys` command writes to the journal from another process) takes effect within this time."""
MAX_KNOWN_KEYS = 4096
_TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def validate_tenant_name(tenant: str) -> str:
    if not _TENANT_NAME.match(tenant):
        raise ValueError(f"tenant name {tenant!r} must be 1-64 letters, digits or _.@- (starting with a letter "
                         f"or digit)")
    return tenant


def issue_api_key(store: Store, tenant: str, *, admin: bool = False,
                  label: str | None = None) -> tuple[str, ApiKeyRecord]:
    """Create a key for `tenant`; returns the key itself (shown once, never stored) and its record."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    record = ApiKeyRecord(key_id="key-" + secrets.token_hex(4), key_hash=hash_api_key(key),
                          tenant=validate_tenant_name(tenant), admin=admin, label=label)
    store.add_api_key(record)
    return key, record


class KnownKeys:
    """Keys found valid lately, so that the requests of a busy client cost a dictionary lookup, not a query.

    Only valid keys are kept (an unknown or revoked key is looked up every time), each for
    KNOWN_KEY_SECONDS, at most MAX_KNOWN_KEYS of them, least recently used out first.
    """

    def __init__(self, store: Store):
        self.store = store
        self._known: OrderedDict[str, tuple[float, ApiKeyRecord]] = OrderedDict()
        self._lock = threading.Lock()

    def known(self, key_hash: str) -> ApiKeyRecord | None:
        """The key's record if it was found valid within KNOWN_KEY_SECONDS (never reads the journal)."""
        with self._lock:
            entry = self._known.get(key_hash)
            if entry is None or time.monotonic() - entry[0] > KNOWN_KEY_SECONDS:
                return None
            self._known.move_to_end(key_hash)
            return entry[1]

    def find(self, key_hash: str) -> ApiKeyRecord | None:
        """The unrevoked key's record, from the journal (blocking); remembered when found."""
        record = self.store.find_api_key(key_hash)
        with self._lock:
            if record is None:
                self._known.pop(key_hash, None)
                return None
            self._known[key_hash] = (time.monotonic(), record)
            self._known.move_to_end(key_hash)
            while len(self._known) > MAX_KNOWN_KEYS:
                self._known.popitem(last=False)
        return record
