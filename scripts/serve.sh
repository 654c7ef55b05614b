#!/usr/bin/env bash
# Starts gpucast on the committed models (http://127.0.0.1:8080, Swagger UI at /docs).
# Extra arguments go to `gpucast serve` (see `--help`).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
scripts/fetch-onnxruntime.sh
export ORT_DYLIB_PATH="${ORT_DYLIB_PATH:-$ROOT/.cache/onnxruntime/libonnxruntime.so}"
exec cargo run --release --locked --bin gpucast -- serve --models "$ROOT/models" "$@"
