#!/usr/bin/env bash
# Runs a command against a throw-away PostgreSQL server:
#   scripts/postgres-test.sh cargo test --test api store
# initdb's a cluster in a temporary directory, starts it on a free loopback port (TCP only, no
# Unix socket outside the directory), exports GPUCAST_TEST_DATABASE_URL for the command, and
# stops and removes the cluster afterwards, whatever the command's outcome. PostgreSQL refuses
# to run as root: as root the cluster belongs to the `postgres` user (Debian's package creates
# it) or, failing that, to `nobody`.
set -euo pipefail
if ! command -v initdb >/dev/null 2>&1; then
    for dir in /usr/lib/postgresql/*/bin; do
        [ -x "$dir/initdb" ] && PATH="$dir:$PATH"
    done
fi
command -v initdb >/dev/null && command -v pg_ctl >/dev/null \
    || { echo "postgres-test.sh: initdb/pg_ctl not found (apt-get install postgresql)" >&2; exit 1; }

TMP="$(mktemp -d /tmp/gpucast-pg.XXXXXX)"
RUN=()
if [ "$(id -u)" = 0 ]; then
    USER_NAME=postgres
    id "$USER_NAME" >/dev/null 2>&1 || USER_NAME=nobody
    chown -R "$USER_NAME" "$TMP"
    RUN=(runuser -u "$USER_NAME" --)
fi
PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
stop() {
    "${RUN[@]}" pg_ctl -D "$TMP/data" -m immediate stop >/dev/null 2>&1 || true
    rm -rf "$TMP"
}
trap stop EXIT
"${RUN[@]}" initdb -D "$TMP/data" -U gpucast --auth=trust -E UTF8 >"$TMP/initdb.log" 2>&1 \
    || { cat "$TMP/initdb.log" >&2; exit 1; }
"${RUN[@]}" pg_ctl -D "$TMP/data" -l "$TMP/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $PORT -k $TMP -c fsync=off -c max_connections=200" start >/dev/null \
    || { cat "$TMP/server.log" >&2; exit 1; }
export GPUCAST_TEST_DATABASE_URL="postgres://gpucast@127.0.0.1:$PORT/postgres"
echo "postgres-test.sh: PostgreSQL on 127.0.0.1:$PORT" >&2
"$@"
