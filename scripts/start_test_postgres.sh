#!/usr/bin/env bash
# Start a throwaway PostgreSQL cluster for the tests and print its URL as the last line of stdout.
#
#   scripts/start_test_postgres.sh [DATA_DIR]   start (or reuse, if already running) a cluster in DATA_DIR
#   scripts/start_test_postgres.sh --stop DATA_DIR
#
# DATA_DIR defaults to /tmp/tinker-test-postgres. Installs the postgresql package when no initdb is
# found. The cluster listens only on 127.0.0.1, trusts every local user, and runs with fsync off:
# test data only.
set -euo pipefail

DATABASE=tinker_test
SOCKET_DIR=/tmp

find_bin_dir() {
    if command -v initdb >/dev/null 2>&1; then
        # Resolve symlinks such as /usr/local/bin/initdb: psql and createdb sit beside the real one.
        dirname "$(readlink -f "$(command -v initdb)")"
    else
        # Debian keeps the server binaries off PATH, one directory per major version.
        ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1
    fi
}

# initdb and postgres refuse to run as root.
as_owner() {
    if [ "$(id -u)" = 0 ]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

BIN_DIR=$(find_bin_dir)
if [ -z "$BIN_DIR" ] || [ ! -x "$BIN_DIR/initdb" ]; then
    echo "no PostgreSQL server binaries; installing the postgresql package" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >&2
    BIN_DIR=$(find_bin_dir)
fi

if [ "${1:-}" = "--stop" ]; then
    data_dir=${2:?usage: $0 --stop DATA_DIR}
    if [ -f "$data_dir/postmaster.pid" ]; then
        as_owner "$BIN_DIR/pg_ctl" -D "$data_dir" -m immediate -w stop >&2
    fi
    exit 0
fi

DATA_DIR=${1:-/tmp/tinker-test-postgres}
mkdir -p "$DATA_DIR"
if [ "$(id -u)" = 0 ]; then
    chown postgres: "$DATA_DIR"
fi

if [ ! -f "$DATA_DIR/PG_VERSION" ]; then
    as_owner "$BIN_DIR/initdb" -D "$DATA_DIR" -U postgres --auth=trust --encoding=UTF8 --no-locale --no-sync >&2
fi

if as_owner "$BIN_DIR/pg_ctl" -D "$DATA_DIR" status >/dev/null 2>&1; then
    # Line 4 of postmaster.pid is the port of the running server.
    PORT=$(sed -n 4p "$DATA_DIR/postmaster.pid")
else
    PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    options="-p $PORT -k $SOCKET_DIR -c listen_addresses=127.0.0.1"
    options="$options -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
    if ! as_owner "$BIN_DIR/pg_ctl" -D "$DATA_DIR" -l "$DATA_DIR/server.log" -o "$options" -w -t 30 start >&2; then
        tail -n 20 "$DATA_DIR/server.log" >&2
        exit 1
    fi
fi

exists=$("$BIN_DIR/psql" -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -tAc \
    "SELECT 1 FROM pg_database WHERE datname = '$DATABASE'")
if [ "$exists" != 1 ]; then
    "$BIN_DIR/createdb" -h 127.0.0.1 -p "$PORT" -U postgres "$DATABASE"
fi

echo "postgresql+psycopg://postgres@127.0.0.1:$PORT/$DATABASE"
