#!/usr/bin/env bash
# Prints the path of a Python that has describe's pinned test dependencies (torch, torchvision,
# timm, transformers from PyPI): the project venv .venv-describe, created once and reused while
# describe/requirements-test.txt is unchanged. GPUCAST_DESCRIBE_PYTHON overrides it.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [[ -n "${GPUCAST_DESCRIBE_PYTHON:-}" ]]; then
    echo "$GPUCAST_DESCRIBE_PYTHON"
    exit 0
fi
VENV="$ROOT/.venv-describe"
REQUIREMENTS="$ROOT/describe/requirements-test.txt"
STAMP="$VENV/.requirements.sha256"
WANT="$(sha256sum "$REQUIREMENTS" | cut -d' ' -f1)"
if [[ ! -x "$VENV/bin/python" || ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]]; then
    echo "describe: creating $VENV from $REQUIREMENTS (torch is ~3 GB; once)" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$REQUIREMENTS" >&2
    echo "$WANT" > "$STAMP"
fi
echo "$VENV/bin/python"
