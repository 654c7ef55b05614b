#!/usr/bin/env bash
# Prints the path of a Python with describe's pinned test dependencies (torch, torchvision,
# timm, transformers; accelerate, peft and lightning for the client's trainer tests) and the
# workspace's four packages installed editable (describe, training, probe, the client): the
# project venv .venv-describe, the `describe` group of the workspace lock (pyproject.toml,
# uv.lock), synced by scripts/uv-sync.sh: created once (torch is ~3 GB), then reused and moved
# in place when the lock moves. --inexact keeps what the lock does not name for this group
# (training/retrain.sh adds the `retrain` group to the same venv). GPUCAST_DESCRIBE_PYTHON
# overrides it (an interpreter with those packages installed).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [[ -n "${GPUCAST_DESCRIBE_PYTHON:-}" ]]; then
    echo "$GPUCAST_DESCRIBE_PYTHON"
    exit 0
fi
VENV="$ROOT/.venv-describe"
"$ROOT/scripts/uv-sync.sh" "$VENV" --inexact --group describe "$@"
echo "$VENV/bin/python"
