#!/usr/bin/env bash
# The adversarial suite (scripts/adversarial.py): builds the service, attacks it on loopback
# with a legitimate client running, writes load-tests/adversarial.json.
#   scripts/adversarial.sh            # debug build (what the tests use)
#   PROFILE=release scripts/adversarial.sh
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
scripts/fetch-onnxruntime.sh
export ORT_DYLIB_PATH="${ORT_DYLIB_PATH:-$ROOT/.cache/onnxruntime/libonnxruntime.so}"
PROFILE="${PROFILE:-debug}"
if [[ "$PROFILE" == release ]]; then cargo build --locked --release; else cargo build --locked; fi
exec python3 scripts/adversarial.py "target/$PROFILE/gpucast" "${1:-load-tests/adversarial.json}"
