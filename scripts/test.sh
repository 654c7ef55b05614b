#!/usr/bin/env bash
# Runs every test: Rust unit and integration tests (real server on ephemeral ports, committed
# models through ONNX Runtime), the Python feature-parity and probe tests (stdlib only), then
# describe's tests (model walk, training-step simulation, allocator model) in a project venv
# with pinned torch/timm/transformers (scripts/describe-venv.sh: created once, then reused).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
scripts/fetch-onnxruntime.sh
export ORT_DYLIB_PATH="${ORT_DYLIB_PATH:-$ROOT/.cache/onnxruntime/libonnxruntime.so}"
cargo test --locked --all-targets
python3 -m unittest discover -s training/tests -v
python3 -m unittest discover -s probe/tests -t . -v
DESCRIBE_PYTHON="$(scripts/describe-venv.sh)"
(cd describe && "$DESCRIBE_PYTHON" -m unittest discover -s tests -v)
