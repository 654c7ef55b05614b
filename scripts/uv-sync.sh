#!/usr/bin/env bash
# Makes the project venv VENV hold what the workspace lock (uv.lock, pyproject.toml at the root)
# pins for the given dependency groups: `scripts/uv-sync.sh VENV [uv sync options] --group G`.
# Created once with the system python3 when missing, then synced in place by uv (a no-op in about
# a second when nothing changed; what a changed lock moves is installed, nothing else is
# touched). uv is the one the tools venv holds (scripts/tools-venv.sh bootstraps it from PyPI).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="$1"
shift
UV="$ROOT/.venv-tools/bin/uv"
if [[ ! -x "$UV" ]]; then
    "$ROOT/scripts/tools-venv.sh" >/dev/null
fi
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "creating $VENV from uv.lock" >&2
    python3 -m venv "$VENV"
fi
# --locked: a pyproject.toml edited without `uv lock` is an error, not a silent re-resolution.
# UV_PYTHON_DOWNLOADS=never: the venv's interpreter is the system python3, never a download.
UV_PROJECT_ENVIRONMENT="$VENV" UV_PYTHON_DOWNLOADS=never \
    "$UV" sync --project "$ROOT" --locked --no-default-groups --quiet "$@" >&2
