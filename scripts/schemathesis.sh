#!/usr/bin/env bash
# Property-based API tests: schemathesis generates requests from the service's own OpenAPI
# document (GET /openapi.json) and checks every response against it (no 5xx, documented status
# codes, content types, headers and response schemas).
#
#   scripts/schemathesis.sh [max-examples-per-operation]   (default 50; SCHEMATHESIS_MAX_TIME=180)
#
# Starts the release build on 127.0.0.1 (a free port) and stops it afterwards. Reports land in
# .cache/schemathesis/report/ (JUnit XML and the NDJSON event stream). Exits non-zero when
# schemathesis finds a failure. Only PyPI is used (schemathesis into .cache/schemathesis/venv).
set -euo pipefail

MAX_EXAMPLES="${1:-50}"
MAX_TIME="${SCHEMATHESIS_MAX_TIME:-180}"
SEED="${SCHEMATHESIS_SEED:-20240501}"
VERSION="${SCHEMATHESIS_VERSION:-4.32.5}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
WORK="$ROOT/.cache/schemathesis"
VENV="$WORK/venv"
REPORT="$WORK/report"
mkdir -p "$WORK"

if [[ ! -x "$VENV/bin/schemathesis" ]] || ! "$VENV/bin/schemathesis" --version | grep -q "$VERSION"; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "schemathesis==$VERSION"
fi

scripts/fetch-onnxruntime.sh
cargo build --release --locked --quiet --bin gpucast
export ORT_DYLIB_PATH="${ORT_DYLIB_PATH:-$ROOT/.cache/onnxruntime/libonnxruntime.so}"

PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
BASE="http://127.0.0.1:$PORT"
LOG="$WORK/server.log"
# Calibration profiles go to a scratch directory: schemathesis posts observations.
PROFILES="$(mktemp -d)"
GPUCAST_LISTEN="127.0.0.1:$PORT" GPUCAST_STORE_DIR="$PROFILES" GPUCAST_NO_NVML=true target/release/gpucast serve --models "$ROOT/models" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; rm -rf "$PROFILES"' EXIT

for _ in $(seq 1 200); do
    if curl -fsS "$BASE/readyz" >/dev/null 2>&1; then break; fi
    if ! kill -0 "$SERVER" 2>/dev/null; then echo "gpucast exited; see $LOG" >&2; cat "$LOG" >&2; exit 1; fi
    sleep 0.05
done
curl -fsS "$BASE/readyz" >/dev/null || { echo "gpucast not ready after 10 s; see $LOG" >&2; exit 1; }

rm -rf "$REPORT"
status=0
# --checks all: every response is checked, including that invalid data is refused with a 4xx
# (negative_data_rejection) and that valid data is accepted (positive_data_acceptance).
# Run from .cache/schemathesis: hypothesis keeps its .hypothesis/ folder in the working directory.
(cd "$WORK" && "$VENV/bin/schemathesis" run "$BASE/openapi.json" \
    --checks all \
    --max-examples "$MAX_EXAMPLES" \
    --max-time "$MAX_TIME" \
    --seed "$SEED" \
    --workers 2 \
    --request-timeout 10 \
    --no-color \
    --generation-database none \
    --report junit,ndjson --report-dir "$REPORT") || status=$?

# The server must have survived the run.
curl -fsS "$BASE/healthz" >/dev/null || { echo "gpucast stopped answering during the run; see $LOG" >&2; status=1; }
echo "schemathesis exit status $status; reports in $REPORT, server log in $LOG" >&2
exit "$status"
