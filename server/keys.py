"""`python -m server keys create|list|revoke`: an operator issues and revokes tenants' API keys.

Works on the server's database (same --data-dir / --database-url), whether or not the server runs;
a revoked key is refused from the server's next request on.
"""

import sys

from server.config import KeysCommand
from server.store.db import has_server_database
from server.store.api_keys import issue_api_key
from server.store.store import Store


def run_keys_command(command: KeysCommand) -> int:
    """Carry out one keys command; returns the exit status."""
    if not command.new_database and not has_server_database(command.database_url):
        # A mistyped --data-dir would otherwise get a database of its own, and a key no server knows.
        where = command.data_dir if command.database_url.startswith("sqlite:") else "the --database-url"
        print(f"no server database in {where}: check --data-dir / --database-url (a server creates its "
              f"database on its first start; `keys create --new-database` creates it before)", file=sys.stderr)
        return 2
    if command.database_url.startswith("sqlite:"):
        command.data_dir.mkdir(parents=True, exist_ok=True)
    store = Store(command.database_url)
    try:
        if command.action == "create":
            key, record = issue_api_key(store, command.tenant, admin=command.admin, label=command.label)
            print(f"issued {record.key_id} for tenant {record.tenant!r}{' (admin)' if record.admin else ''}; "
                  f"the key is shown once, only its hash is stored:", file=sys.stderr)
            print(key)
            return 0
        if command.action == "list":
            print(f"{'key_id':<13} {'tenant':<24} {'admin':<5} {'created (UTC)':<19} {'revoked (UTC)':<19} label")
            for record in store.list_api_keys(command.tenant):
                revoked = f"{record.revoked_at:%Y-%m-%d %H:%M:%S}" if record.revoked_at else "-"
                print(f"{record.key_id:<13} {record.tenant:<24} {'yes' if record.admin else 'no':<5} "
                      f"{record.created_at:%Y-%m-%d %H:%M:%S} {revoked:<19} {record.label or ''}")
            return 0
        if store.revoke_api_key(command.key_id):
            print(f"revoked {command.key_id}", file=sys.stderr)
            return 0
        print(f"no unrevoked key {command.key_id} (see `python -m server keys list`)", file=sys.stderr)
        return 1
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    finally:
        store.close()
