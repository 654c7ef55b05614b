#!/usr/bin/env bash
# Runs every test: the format and lint gates (cargo fmt --check, clippy with warnings as errors,
# ruff check and ruff format --check on the Python: ruff.toml),
# Rust unit and integration tests (real server on ephemeral ports, committed
# models through ONNX Runtime; the calibration store on SQLite and on a throw-away PostgreSQL), the Python
# client against the real service (scripts/client-test.sh), schemathesis against the real
# service from the OpenAPI document (scripts/schemathesis.sh), the training and probe tests (stdlib only), then
# describe's tests (model walk, training-step simulation, allocator model) in a project venv
# with pinned torch/timm/transformers (scripts/describe-venv.sh: the workspace lock's `describe`
# group, created once, then reused).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
scripts/fetch-onnxruntime.sh
export ORT_DYLIB_PATH="${ORT_DYLIB_PATH:-$ROOT/.cache/onnxruntime/libonnxruntime.so}"
# The gates need rustup's rustfmt and clippy components (in its default profile); a toolchain
# without them and without a way to add them skips the gate and says so.
if cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt >/dev/null 2>&1; then
    cargo fmt --check
else
    echo "warning: rustfmt unavailable: format gate skipped" >&2
fi
if cargo clippy --version >/dev/null 2>&1 || rustup component add clippy >/dev/null 2>&1; then
    cargo clippy --locked --all-targets -- -D warnings
else
    echo "warning: clippy unavailable: lint gate skipped" >&2
fi
# The Python gate: ruff pinned in the workspace lock (pyproject.toml's `tools` group, uv.lock), from
# PyPI into the project venv .venv-tools (scripts/tools-venv.sh: created once, then reused);
# ruff.toml says what it covers.
TOOLS="$(scripts/tools-venv.sh)"
"$TOOLS/ruff" check
"$TOOLS/ruff" format --check
# The calibration store's tests run against SQLite and a real PostgreSQL (Debian's package,
# installed here when missing: CI runs as root on a fresh Debian machine), started on a
# loopback port in a temporary directory by scripts/postgres-test.sh.
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    else
        echo "error: PostgreSQL binaries missing (apt-get install postgresql)" >&2
        exit 1
    fi
fi
scripts/postgres-test.sh cargo test --locked --all-targets
# Property-based tests of the HTTP API from openapi/openapi.json (scripts/schemathesis.sh:
# schemathesis from .venv-tools, --checks all --mode all, bounded and seeded, against
# target/debug/gpucast with its store in a temporary directory; about 2 minutes on 2 cores).
scripts/schemathesis.sh
# The Python client (python/) against the service cargo just built (target/debug/gpucast on a
# loopback port): its own venv without torch (.venv-client), then the trainer and callback tests
# in describe's venv (scripts/client-test.sh).
scripts/client-test.sh
GPUCAST_BINARY="$PWD/target/debug/gpucast" python3 -m unittest discover -s training/tests -t training -v
python3 -m unittest discover -s probe/tests -t . -v
DESCRIBE_PYTHON="$(scripts/describe-venv.sh)"
(cd describe && "$DESCRIBE_PYTHON" -m unittest discover -s tests -v)
