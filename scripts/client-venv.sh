#!/usr/bin/env bash
# Prints the path of a Python holding the client package (python/, `pip install ./python`, no
# torch): the project venv .venv-client, created once and reused while python/pyproject.toml is
# unchanged. The package itself is reinstalled on every call (seconds), so it is always the
# working tree's.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="$ROOT/.venv-client"
STAMP="$VENV/.pyproject.sha256"
WANT="$(sha256sum "$ROOT/python/pyproject.toml" | cut -d' ' -f1)"
if [[ ! -x "$VENV/bin/python" || ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]]; then
    echo "client: creating $VENV from python/pyproject.toml" >&2
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    echo "$WANT" > "$STAMP"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "$ROOT/python" >&2
echo "$VENV/bin/python"
