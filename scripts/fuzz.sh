#!/usr/bin/env bash
# Fuzzes the request-parsing paths with cargo-fuzz (libFuzzer) for a bounded time per target.
#
#   scripts/fuzz.sh [seconds-per-target]      (default 60)   FUZZ_TARGETS="estimate_request" to pick
#
# cargo-fuzz needs nightly-only rustc flags (-Z sanitizer, -Z coverage options); on the stable
# toolchain RUSTC_BOOTSTRAP=1 unlocks them. cargo-fuzz itself is installed from crates.io into
# .cache/tools. Seeds come from the repository (the OpenAPI example, timm and MLP descriptions,
# the summary texts of src/parsers/tests.rs's tests). Any crash, timeout or out-of-memory input
# is copied into fuzz/regressions/<target>/, which tests/fuzz_regressions.rs replays; the
# script then exits 1.
set -euo pipefail

SECONDS_PER_TARGET="${1:-60}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
TOOLS="$ROOT/.cache/tools"
CARGO_FUZZ_VERSION="${CARGO_FUZZ_VERSION:-0.13.2}"
export PATH="$TOOLS/bin:$PATH"
export RUSTC_BOOTSTRAP=1
TARGETS=(${FUZZ_TARGETS:-estimate_request parse_summary})

if ! cargo fuzz --version 2>/dev/null | grep -q "$CARGO_FUZZ_VERSION"; then
    cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION" --root "$TOOLS"
fi

# Seed corpora (libFuzzer adds what it finds next to them; fuzz/corpus is not committed).
python3 - "$ROOT" <<'PY'
import gzip, json, re, sys
from pathlib import Path
root = Path(sys.argv[1])
corpus = root / "fuzz/corpus"
def put(target, name, data):
    d = corpus / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())
try:
    spec = json.loads((root / "openapi/openapi.json").read_text())
    put("estimate_request", "openapi_example", json.dumps(spec["components"]["schemas"]["EstimateRequest"]["example"]))
except (OSError, ValueError, KeyError) as e:
    print(f"no seed from openapi/openapi.json: {e}", file=sys.stderr)
with gzip.open(root / "data/timm/descriptions.jsonl.gz", "rt") as f:
    for i, line in enumerate(f):
        if i % 60 == 0:
            job = json.loads(line); job["batch_size"] = 32
            put("estimate_request", f"timm_{i}", json.dumps(job))
with gzip.open(root / "data/mlp/test.jsonl.gz", "rt") as f:
    for i, line in enumerate(f):
        if i % 100 == 0:
            put("estimate_request", f"mlp_{i}", json.dumps(json.loads(line)["job"]))
source = (root / "src/parsers/tests.rs").read_text()
texts = re.findall(r'const (\w+): &str = "\\\n(.*?)";\n', source, re.S)
for name, text in texts:
    table = "Layer (type)" in text
    put("parse_summary", name.lower(), bytes([0 if table else (1 | 2 | (16 << 2))]) + text.encode())
    fmt = "torchsummary" if table else "module_print"
    put("estimate_request", f"summary_{name.lower()}", json.dumps(
        {"batch_size": 16, "seq_len": 129, "summary": {"format": fmt, "text": text}}))
print(f"seeds: {len(texts)} summary texts", file=sys.stderr)
PY

status=0
for target in "${TARGETS[@]}"; do
    artifacts="$ROOT/fuzz/artifacts/$target"
    mkdir -p "$artifacts"
    echo "== $target: ${SECONDS_PER_TARGET}s" >&2
    # -rss_limit_mb: the service's own memory budget; -timeout: one input must not take seconds.
    cargo fuzz run --fuzz-dir fuzz "$target" "fuzz/corpus/$target" -- \
        -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=2048 -max_len=262144 \
        -print_final_stats=1 -artifact_prefix="$artifacts/" || status=$?
    shopt -s nullglob
    for crash in "$artifacts"/crash-* "$artifacts"/timeout-* "$artifacts"/oom-* "$artifacts"/slow-unit-*; do
        mkdir -p "fuzz/regressions/$target"
        cp "$crash" "fuzz/regressions/$target/"
        echo "saved fuzz/regressions/$target/$(basename "$crash")" >&2
        status=1
    done
    shopt -u nullglob
done
if [[ "$status" -ne 0 ]]; then
    echo "fuzzing found problems: see fuzz/regressions/ and run cargo test --test fuzz_regressions" >&2
fi
exit "$status"
