#!/usr/bin/env bash
# Prints the path of a Python holding the client package alone (python/, no torch): the project
# venv .venv-client, the `client` group of the workspace lock (pyproject.toml, uv.lock), synced
# by scripts/uv-sync.sh (created once, then reused). The package is installed editable, so it is
# always the working tree's.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="$ROOT/.venv-client"
"$ROOT/scripts/uv-sync.sh" "$VENV" --group client
echo "$VENV/bin/python"
