#!/usr/bin/env bash
# Runs every test: Rust unit and integration tests (real server on ephemeral ports, committed
# models through ONNX Runtime), then the Python feature-parity and probe tests (stdlib only).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
scripts/fetch-onnxruntime.sh
export ORT_DYLIB_PATH="${ORT_DYLIB_PATH:-$ROOT/.cache/onnxruntime/libonnxruntime.so}"
cargo test --locked --all-targets
python3 -m unittest discover -s training/tests -v
python3 -m unittest discover -s probe/tests -t . -v
