#!/usr/bin/env bash
# Latency of the admission webhook (POST /v1/kubernetes/admission) as the API server calls it:
# a Pod annotated with GPT-2 medium's job (bf16 autocast, batch 8 x 1,024), placed against every
# catalogued product, for 10 s at 1 and at 8 concurrent callers with oha.
#
#   scripts/admission-bench.sh target/release/gpucast
#
# Needs oha (`cargo install oha --locked`; .cache/tools/bin/oha is used when there).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BIN="${1:?usage: scripts/admission-bench.sh BINARY}"
OHA="$ROOT/.cache/tools/bin/oha"
[[ -x "$OHA" ]] || OHA=oha
export ORT_DYLIB_PATH="${ORT_DYLIB_PATH:-$ROOT/.cache/onnxruntime/libonnxruntime.so}"
WORK="$(mktemp -d)"
PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
python3 - "$WORK/review.json" <<'PY'
import json, sys
job = {"transformer_config": {"model_type": "gpt2", "n_embd": 1024, "n_layer": 24, "n_head": 16,
       "vocab_size": 50257, "n_positions": 1024}, "seq_len": 1024, "batch_size": 8, "precision": "amp_bf16"}
pod = {"apiVersion": "v1", "kind": "Pod",
       "metadata": {"name": "train", "namespace": "team-a", "annotations": {"gpucast.dev/job": json.dumps(job)}},
       "spec": {"containers": [{"name": "trainer", "image": "trainer:1",
                                "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}
kind = {"group": "", "version": "v1", "kind": "Pod"}
review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
          "request": {"uid": "705ab4f5-6393-11e8-b7cc-42010a800002", "kind": kind, "requestKind": kind,
                      "resource": {"group": "", "version": "v1", "resource": "pods"}, "operation": "CREATE",
                      "namespace": "team-a", "userInfo": {"username": "alice"}, "object": pod, "dryRun": False}}
json.dump(review, open(sys.argv[1], "w"))
PY
"$BIN" serve --listen "127.0.0.1:$PORT" --admission --data-dir "$WORK" --models "$ROOT/models" >"$WORK/log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; rm -rf "$WORK"' EXIT
for _ in $(seq 100); do curl -sf "127.0.0.1:$PORT/readyz" >/dev/null && break; sleep 0.2; done
URL="http://127.0.0.1:$PORT/v1/kubernetes/admission"
curl -s -XPOST "$URL" -H 'content-type: application/json' --data-binary @"$WORK/review.json" |
    python3 -c "import json, sys; r = json.load(sys.stdin)['response']; print('allowed:', r['allowed'], '| patched:', 'patch' in r)"
for c in 1 8; do
    echo "concurrency $c:"
    "$OHA" -z 10s -c "$c" --no-tui -m POST -H 'content-type: application/json' -D "$WORK/review.json" "$URL" |
        grep -E "Success rate|Requests/sec|50.00% in|99.00% in"
done
