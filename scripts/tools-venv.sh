#!/usr/bin/env bash
# Prints the bin directory of a venv holding the project's pinned Python tools: ruff (the format
# and lint gate of scripts/test.sh), schemathesis (scripts/schemathesis.sh) and uv, the
# workspace's installer: the project venv .venv-tools, the `tools` group of the workspace lock
# (pyproject.toml, uv.lock). uv itself is bootstrapped from PyPI with pip at the version that
# group pins, then syncs the venv from the lock (created once, reused, moved in place when the
# lock moves).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="$ROOT/.venv-tools"
UV_VERSION="$(sed -n 's/^ *"uv==\([^"]*\)".*/\1/p' "$ROOT/pyproject.toml")"
if [[ ! -x "$VENV/bin/uv" || "$("$VENV/bin/uv" --version 2>/dev/null | cut -d' ' -f2)" != "$UV_VERSION" ]]; then
    echo "tools: bootstrapping uv $UV_VERSION into $VENV from PyPI" >&2
    [[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION" >&2
fi
"$ROOT/scripts/uv-sync.sh" "$VENV" --group tools
echo "$VENV/bin"
