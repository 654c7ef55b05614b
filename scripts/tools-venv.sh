#!/usr/bin/env bash
# Prints the bin directory of a venv holding the project's pinned Python tools (ruff, for the
# format and lint gate of scripts/test.sh; scripts/requirements-tools.txt): the project venv
# .venv-tools, created once from PyPI and reused while that file is unchanged.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="$ROOT/.venv-tools"
REQUIREMENTS="$ROOT/scripts/requirements-tools.txt"
STAMP="$VENV/.requirements.sha256"
WANT="$(sha256sum "$REQUIREMENTS" | cut -d' ' -f1)"
if [[ ! -x "$VENV/bin/python" || ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]]; then
    echo "tools: creating $VENV from $REQUIREMENTS" >&2
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$REQUIREMENTS" >&2
    echo "$WANT" > "$STAMP"
fi
echo "$VENV/bin"
