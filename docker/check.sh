#!/usr/bin/env bash
# Checks what can be checked of docker/ and deploy/ without a Docker engine:
#   1. JSON and YAML files parse (compose, Prometheus, Grafana provisioning and dashboard, deploy/);
#   2. every COPY source of the Dockerfile exists and survives Dockerfile.dockerignore;
#   3. every gpucast_* metric the dashboard queries is defined in src/metrics.rs (warns otherwise);
#   4. the release binary runs from the image's layout: binary, ONNX Runtime and models copied
#      into a temporary root at the image's paths, started as uid 10001 with the image's ENV,
#      /healthz and /readyz answered, and docker/healthcheck.sh (the HEALTHCHECK) passes.
# Exits non-zero on the first failure. Only loopback is used.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY=python3
if ! $PY -c 'import yaml' 2>/dev/null; then
    python3 -m venv .cache/check-venv && .cache/check-venv/bin/pip install --quiet pyyaml
    PY=.cache/check-venv/bin/python
fi

echo "== 1-3: syntax, Dockerfile sources, dashboard metrics" >&2
$PY - "$ROOT" <<'PY'
import fnmatch, json, re, sys
from pathlib import Path
import yaml
root = Path(sys.argv[1])
failures, warnings = [], []

for path in sorted((root / "docker").rglob("*.json")):
    try:
        json.loads(path.read_text())
    except ValueError as e:
        failures.append(f"{path}: {e}")
yaml_files = sorted(list((root / "docker").rglob("*.y*ml")) + list((root / "deploy").rglob("*.y*ml")))
for path in yaml_files:
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as e:
        failures.append(f"{path}: {e}")
        continue
    if path.parent.name == "deploy" and path.name != "kustomization.yaml":
        for d in docs:
            for key in ("apiVersion", "kind", "metadata"):
                if key not in d:
                    failures.append(f"{path}: a {d.get('kind', 'document')} without {key}")
print(f"parsed {len(yaml_files)} YAML files and the JSON files", file=sys.stderr)

# kustomization lists only files that exist.
kustomization = yaml.safe_load((root / "deploy/kustomization.yaml").read_text())
for resource in kustomization.get("resources", []):
    if not (root / "deploy" / resource).exists():
        failures.append(f"deploy/kustomization.yaml names {resource}, which does not exist")

# The Deployment's probes and mounts match the image.
deployment = yaml.safe_load((root / "deploy/deployment.yaml").read_text())
container = deployment["spec"]["template"]["spec"]["containers"][0]
assert container["readinessProbe"]["httpGet"]["path"] == "/readyz", "readiness probe is /readyz"
assert container["livenessProbe"]["httpGet"]["path"] == "/healthz", "liveness probe is /healthz"
database = [e for e in container["env"] if e["name"] == "GPUCAST_DATABASE_URL"]
if not (database and "secretKeyRef" in database[0].get("valueFrom", {})):
    failures.append("deployment.yaml: GPUCAST_DATABASE_URL does not come from a Secret")
component = yaml.safe_load((root / "deploy/postgres/kustomization.yaml").read_text())
for resource in component.get("resources", []):
    if not (root / "deploy/postgres" / resource).exists():
        failures.append(f"deploy/postgres/kustomization.yaml names {resource}, which does not exist")

# COPY sources exist and the ignore file lets them through (last matching pattern wins).
dockerfile = (root / "docker/Dockerfile").read_text()
ignore = [l.strip() for l in (root / "docker/Dockerfile.dockerignore").read_text().splitlines() if l.strip() and not l.startswith("#")]
def ignored(rel):
    verdict = False
    for pattern in ignore:
        negate = pattern.startswith("!")
        p = pattern[1:] if negate else pattern
        if fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(rel, p.rstrip("*").rstrip("/")) or p == "**":
            verdict = not negate
    return verdict
copies = 0
for line in dockerfile.splitlines():
    parts = line.split()
    if not parts or parts[0] != "COPY" or any(p.startswith("--from") for p in parts):
        continue
    for source in [p for p in parts[1:-1] if not p.startswith("--")]:
        copies += 1
        path = root / source
        if not path.exists():
            failures.append(f"Dockerfile copies {source}, which does not exist")
            continue
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
        for f in files:
            rel = str(f.relative_to(root))
            if ignored(rel):
                failures.append(f"Dockerfile copies {rel}, but Dockerfile.dockerignore excludes it")
print(f"checked {copies} COPY sources", file=sys.stderr)

# Metrics the dashboard queries.
defined = {"gpucast_" + m for m in re.findall(r'Opts::new\(\s*"(\w+)"', (root / "src/metrics.rs").read_text())}
dashboard = (root / "deploy/grafana/gpucast.json").read_text()
for name in sorted(set(re.findall(r"gpucast_\w+", dashboard))):
    base = re.sub(r"_(bucket|count|sum)$", "", name)
    if base not in defined:
        warnings.append(f"the dashboard queries {name}, which src/metrics.rs does not define (yet)")

for w in warnings:
    print("warning:", w, file=sys.stderr)
for f in failures:
    print("FAIL:", f, file=sys.stderr)
sys.exit(1 if failures else 0)
PY

echo "== 4: the binary in the image's layout" >&2
scripts/fetch-onnxruntime.sh
if [[ "${SKIP_BUILD:-0}" != 1 ]]; then cargo build --release --locked --quiet --bin gpucast; fi
IMAGE="$(mktemp -d)"
chmod 755 "$IMAGE"
LOG="$IMAGE/server.log"
cleanup() { [[ -n "${SERVER:-}" ]] && kill "$SERVER" 2>/dev/null; wait 2>/dev/null; rm -rf "$IMAGE"; }
trap cleanup EXIT
install -D -m 0755 target/release/gpucast "$IMAGE/usr/local/bin/gpucast"
install -D -m 0644 .cache/onnxruntime/libonnxruntime.so "$IMAGE/usr/local/lib/gpucast/libonnxruntime.so"
mkdir -p "$IMAGE/usr/share/gpucast" "$IMAGE/var/lib/gpucast/data"
cp -r models "$IMAGE/usr/share/gpucast/models"
install -D -m 0755 docker/healthcheck.sh "$IMAGE/usr/local/bin/gpucast-healthcheck"
chmod -R a+rX "$IMAGE/usr"
chown -R 10001:10001 "$IMAGE/var/lib/gpucast"
echo "image layout: $(du -sh "$IMAGE/usr" | cut -f1) (binary $(du -h "$IMAGE/usr/local/bin/gpucast" | cut -f1), onnxruntime $(du -h "$IMAGE/usr/local/lib/gpucast/libonnxruntime.so" | cut -f1))" >&2
echo "onnxruntime needs: $(ldd "$IMAGE/usr/local/lib/gpucast/libonnxruntime.so" | awk '{print $1}' | tr '\n' ' ')" >&2

PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
# The image's ENV, with its paths under the temporary root and a loopback port.
env -i PATH=/usr/bin:/bin HOME=/var/lib/gpucast \
    GPUCAST_LISTEN="127.0.0.1:$PORT" \
    GPUCAST_MODELS="$IMAGE/usr/share/gpucast/models" \
    ORT_DYLIB_PATH="$IMAGE/usr/local/lib/gpucast/libonnxruntime.so" \
    GPUCAST_STORE_DIR="$IMAGE/var/lib/gpucast/data" \
    GPUCAST_LOG_FORMAT=json RUST_LOG=info \
    setpriv --reuid 10001 --regid 10001 --clear-groups \
    "$IMAGE/usr/local/bin/gpucast" serve >"$LOG" 2>&1 &
SERVER=$!
for _ in $(seq 1 100); do
    curl -fsS "http://127.0.0.1:$PORT/readyz" >/dev/null 2>&1 && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$LOG" >&2; echo "FAIL: the binary exited in the image layout" >&2; exit 1; }
    sleep 0.1
done
curl -fsS "http://127.0.0.1:$PORT/healthz" >&2 && echo >&2
curl -fsS "http://127.0.0.1:$PORT/readyz" >&2 && echo >&2
GPUCAST_LISTEN="0.0.0.0:$PORT" setpriv --reuid 10001 --regid 10001 --clear-groups bash "$IMAGE/usr/local/bin/gpucast-healthcheck" \
    || { echo "FAIL: the HEALTHCHECK script does not pass" >&2; exit 1; }
echo "HEALTHCHECK passes; the process runs as uid $(awk '/^Uid/{print $2}' /proc/$SERVER/status)" >&2
# And fails when nothing listens.
if GPUCAST_LISTEN="127.0.0.1:1" bash "$IMAGE/usr/local/bin/gpucast-healthcheck" 2>/dev/null; then
    echo "FAIL: the HEALTHCHECK passes with nothing listening" >&2; exit 1
fi
kill -TERM "$SERVER"; wait "$SERVER" || true; SERVER=
grep -q '"ready"' "$LOG" && echo "JSON logs: $(grep -c . "$LOG") lines" >&2
echo "docker/check.sh: all checks passed" >&2
