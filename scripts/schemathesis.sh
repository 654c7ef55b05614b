#!/usr/bin/env bash
# Property-based tests of the HTTP API from the committed OpenAPI document
# (openapi/openapi.json, which tests/api/docs.rs holds equal to the served one): schemathesis
# (pinned in the workspace lock, in .venv-tools) generates valid and invalid
# requests for every operation and checks every answer (--checks all --mode all): no 5xx, only
# documented statuses, content types and headers, bodies matching their schemas, invalid data
# refused, valid data accepted. scripts/schemathesis.toml holds the exceptions, each with why.
#
#   scripts/schemathesis.sh   (SCHEMATHESIS_MAX_EXAMPLES=25, SCHEMATHESIS_SEED=35, GPUCAST_BINARY)
#
# Starts target/debug/gpucast (cargo build first) on a free loopback port, as
# scripts/client-test.sh does, with its calibration store in a temporary directory and a
# bearer token, so that the write route POST /v1/calibration/observations is exercised (and
# ignored_auth checks that it refuses a request without the token); stops it afterwards.
# Exits non-zero on any failure, or when the server stopped answering during the run.
# ORT_DYLIB_PATH must name ONNX Runtime (scripts/test.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
MAX_EXAMPLES="${SCHEMATHESIS_MAX_EXAMPLES:-25}"
SEED="${SCHEMATHESIS_SEED:-35}"
if [[ -z "${GPUCAST_BINARY:-}" ]]; then
    cargo build --locked --quiet  # a no-op after scripts/test.sh's cargo test
fi
BINARY="${GPUCAST_BINARY:-$ROOT/target/debug/gpucast}"
TOOLS="$(scripts/tools-venv.sh)"
DATA="$(mktemp -d)"
TOKEN="schemathesis-$RANDOM$RANDOM"
PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$BINARY" serve --listen "127.0.0.1:$PORT" --no-nvml --admission --data-dir "$DATA" --models "$ROOT/models" \
    --token "$TOKEN" >"$DATA/serve.log" 2>&1 &
SERVER=$!
stop() {
    kill "$SERVER" 2>/dev/null || true
    wait "$SERVER" 2>/dev/null || true
    rm -rf "$DATA"
}
trap stop EXIT
BASE="http://127.0.0.1:$PORT"
for _ in $(seq 600); do
    if python3 -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=1)" \
        "$BASE/readyz" 2>/dev/null; then
        break
    fi
    if ! kill -0 "$SERVER" 2>/dev/null; then
        cat "$DATA/serve.log" >&2
        echo "error: the service exited before it was ready" >&2
        exit 1
    fi
    sleep 0.1
done
status=0
# Run in the temporary directory: hypothesis would otherwise leave .hypothesis/ in the repository.
(cd "$DATA" && "$TOOLS/schemathesis" --config-file "$ROOT/scripts/schemathesis.toml" \
    run "$ROOT/openapi/openapi.json" --url "$BASE" \
    --checks all --mode all \
    --max-examples "$MAX_EXAMPLES" --seed "$SEED" \
    --header "Authorization: Bearer $TOKEN" \
    --generation-database none \
    --request-timeout 20 \
    --no-color) || status=$?
# The server must have survived the run.
if ! python3 -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=5)" \
    "$BASE/healthz" 2>/dev/null; then
    echo "error: gpucast stopped answering during the run" >&2
    tail -n 50 "$DATA/serve.log" >&2
    status=1
fi
exit "$status"
