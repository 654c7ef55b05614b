#!/usr/bin/env bash
# Puts ONNX Runtime's shared library at .cache/onnxruntime/libonnxruntime.so, taken from the
# PyPI wheel `onnxruntime` (a registry package: nothing is fetched from anywhere else).
set -euo pipefail

VERSION=1.31.1
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$ROOT/.cache/onnxruntime"
LIB="$DEST/libonnxruntime.so"

if [[ -f "$LIB" ]]; then
    exit 0
fi
mkdir -p "$DEST"
WHEELS="$(mktemp -d)"
trap 'rm -rf "$WHEELS"' EXIT
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    "onnxruntime==$VERSION" -d "$WHEELS"
python3 - "$WHEELS" "$LIB" "$VERSION" <<'PY'
import glob, shutil, sys, zipfile
wheels, lib, version = sys.argv[1:]
[wheel] = glob.glob(f"{wheels}/onnxruntime-*.whl")
member = f"onnxruntime/capi/libonnxruntime.so.{version}"
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(lib + ".tmp", "wb") as dst:
    shutil.copyfileobj(src, dst)
shutil.move(lib + ".tmp", lib)
PY
echo "ONNX Runtime $VERSION: $LIB" >&2
