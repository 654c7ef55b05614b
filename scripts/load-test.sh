#!/usr/bin/env bash
# Load test: builds the release binary, installs the oha load generator (crates.io, into
# .cache/tools), starts gpucast on 127.0.0.1 and writes load-tests/report.json.
#
#   scripts/load-test.sh                 the full run (about 2.5 minutes of load)
#   scripts/load-test.sh --scale 0.1     every duration x0.1: a quick check that it all works
#   scripts/load-test.sh --strict        exit 1 when a target is missed
#   (other options: python3 -m load-tests.run --help, from the repository root)
#
# All traffic goes to loopback; every run is bounded in time. See load-tests/README.md.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
OHA_VERSION="${OHA_VERSION:-1.16.0}"
TOOLS="$ROOT/.cache/tools"

if ! "$TOOLS/bin/oha" --version 2>/dev/null | grep -q "$OHA_VERSION"; then
    echo "installing oha $OHA_VERSION into $TOOLS (a few minutes, once)" >&2
    cargo install oha --locked --version "$OHA_VERSION" --root "$TOOLS"
fi
scripts/fetch-onnxruntime.sh
cargo build --release --locked --quiet --bin gpucast

# A module from the repository root: it imports the server harness as scripts.harness.
exec python3 -m load-tests.run \
    --binary "$ROOT/target/release/gpucast" \
    --models "$ROOT/models" \
    --ort-dylib "${ORT_DYLIB_PATH:-$ROOT/.cache/onnxruntime/libonnxruntime.so}" \
    --oha "$TOOLS/bin/oha" \
    --out "$ROOT/load-tests/report.json" \
    "$@"
