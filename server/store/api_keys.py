"""API keys: how they are made, named and recognised.

A key is `tml-` (the prefix the SDK insists on) followed by 256 random bits. Only its SHA-256 is
stored: with that much entropy a fast hash cannot be reversed by guessing, and a request's key is
found by one indexed lookup. Knows nothing about HTTP; `server/api/deps.py` checks keys per request.
"""

import hashlib
import re
import secrets

from server.store.store import ApiKeyRecord, Store

KEY_PREFIX = "tml-"
BOOTSTRAP_TENANT = "default"
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
