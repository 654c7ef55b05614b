#!/usr/bin/env bash
# The Python client's tests (python/tests) against the real service: starts target/debug/gpucast
# (cargo build first) on a free loopback port with a throw-away calibration store, waits for
# /readyz, runs the client tests in .venv-client (scripts/client-venv.sh: the package without
# torch) and the trainer/callback tests in describe's venv (torch, transformers, peft,
# lightning: scripts/describe-venv.sh; the package editable there, from the workspace lock), then stops it.
# GPUCAST_BINARY overrides the binary. ORT_DYLIB_PATH must name ONNX Runtime (scripts/test.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
if [[ -z "${GPUCAST_BINARY:-}" ]]; then
    cargo build --locked --quiet  # a no-op after scripts/test.sh's cargo test
fi
BINARY="${GPUCAST_BINARY:-$ROOT/target/debug/gpucast}"
CLIENT_PYTHON="$(scripts/client-venv.sh)"
DESCRIBE_PYTHON="$(scripts/describe-venv.sh)"
if [[ -n "${GPUCAST_DESCRIBE_PYTHON:-}" ]]; then
    # describe's venv holds the client editable (the workspace lock); an interpreter given
    # instead gets the working tree's package.
    "$DESCRIBE_PYTHON" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps ./python >&2
fi
DATA="$(mktemp -d)"
PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$BINARY" serve --listen "127.0.0.1:$PORT" --no-nvml --data-dir "$DATA" --models "$ROOT/models" \
    >"$DATA/serve.log" 2>&1 &
SERVER=$!
stop() {
    kill "$SERVER" 2>/dev/null || true
    wait "$SERVER" 2>/dev/null || true
    rm -rf "$DATA"
}
trap stop EXIT
export GPUCAST_URL="http://127.0.0.1:$PORT"
for _ in $(seq 600); do
    if python3 -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=1)" \
        "$GPUCAST_URL/readyz" 2>/dev/null; then
        break
    fi
    if ! kill -0 "$SERVER" 2>/dev/null; then
        cat "$DATA/serve.log" >&2
        echo "error: the service exited before it was ready" >&2
        exit 1
    fi
    sleep 0.1
done
# The tests find openapi/openapi.json from the working directory (the repository root).
export GPUCAST_OPENAPI="$ROOT/openapi/openapi.json"
"$CLIENT_PYTHON" -m unittest discover -s python/tests -p 'test_client*.py' -v
"$DESCRIBE_PYTHON" -m unittest discover -s python/tests -p 'test_frameworks*.py' -v
