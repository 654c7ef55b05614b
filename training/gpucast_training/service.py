"""What the service reads of a job, from the service itself: `gpucast features --batch`.

Standard library only. The estimators' features (the aggregate features by name, among them the
analytic figures first_principles_mib, traced_first_principles_mib and horus_mib, the
simulation's figures, the layers' canonical kinds and raw token features) are computed by the
built binary, so the models learn from exactly what the service will feed them and no Python
copy of the rules has to be kept in step (issue 36). The binary is $GPUCAST_BINARY, else the
newer of target/release/gpucast and target/debug/gpucast (as the decisions stage picks it).
"""

import json
import os
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BATCH = 256  # the CLI's batch limit
MAX_BODY_BYTES = 2 * 1024 * 1024  # the CLI's input limit, the server's body limit


class InvalidJob(ValueError):
    """The service refused a job; the message is its problem's detail."""


def binary():
    """$GPUCAST_BINARY, else the newest build: an older one would read jobs with older code."""
    named = os.environ.get("GPUCAST_BINARY")
    if named:
        return named
    built = [p for p in [ROOT / "target/release/gpucast", ROOT / "target/debug/gpucast"] if p.exists()]
    if not built:
        raise SystemExit("build gpucast first: cargo build --release (or set $GPUCAST_BINARY)")
    return str(max(built, key=lambda p: p.stat().st_mtime))


def chunks(requests):
    """Batches the CLI takes: at most BATCH items and MAX_BODY_BYTES of JSON each."""
    batch, size = [], 16
    for request in requests:
        length = len(json.dumps(request)) + 2
        if batch and (len(batch) == BATCH or size + length > MAX_BODY_BYTES):
            yield batch
            batch, size = [], 16
        batch.append(request)
        size += length
    if batch:
        yield batch


def run_batch(subcommand, batch, extra=(), gpucast=None):
    """The `items` of `gpucast SUBCOMMAND --batch` over one batch (in order)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"items": batch}, f)
    try:
        command = [gpucast or binary(), subcommand, "--batch", f.name, *extra]
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        raise SystemExit(f"gpucast {subcommand} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads(done.stdout)["items"]


# Jobs read before in this process, by their JSON: the stages read one job's features more than
# once (fitting the normalisation, then encoding), and a call of the binary costs ~10 ms.
_CACHE = {}


def _key(job):
    return json.dumps(job, sort_keys=True, separators=(",", ":"))


def features(jobs, gpucast=None):
    """Each job's features, as `gpucast features` prints them: {"family", "aggregate" (name ->
    raw value), "kinds" (canonical, per layer), "token_features" (the columns' names), "tokens"
    (per layer, raw)}. A job the service refuses raises InvalidJob with its problem's detail."""
    jobs = list(jobs)
    keys = [_key(job) for job in jobs]
    missing = list(dict.fromkeys(key for key in keys if key not in _CACHE))
    for batch in chunks(missing):
        items = run_batch("features", [json.loads(key) for key in batch], gpucast=gpucast)
        for key, item in zip(batch, items):
            _CACHE[key] = item
    out = []
    for key in keys:
        item = _CACHE[key]
        if item["status"] != 200:
            raise InvalidJob(item["error"].get("detail") or item["error"].get("title"))
        out.append(item["features"])
    return out


def raw_aggregate(jobs, gpucast=None):
    """Each job's raw aggregate features, name -> value."""
    return [f["aggregate"] for f in features(jobs, gpucast)]


def raw_tokens(jobs, names, gpucast=None):
    """Each job's raw per-layer token features, one list per layer with the columns `names`."""
    out = []
    for f in features(jobs, gpucast):
        columns = [f["token_features"].index(name) for name in names]
        out.append([[token[c] for c in columns] for token in f["tokens"]])
    return out


def canonical(jobs, gpucast=None):
    """Copies of the jobs with each layer's kind as the service reads it (its canonical name)."""
    out = []
    for job, f in zip(jobs, features(jobs, gpucast)):
        layers = [dict(layer, kind=kind) for layer, kind in zip(job["layers"], f["kinds"])]
        out.append(dict(job, layers=layers))
    return out


def kind_ids(jobs, kind_vocab, gpucast=None):
    """Each job's layer kinds as 1 + their index in `kind_vocab` (a sequence model's vocabulary,
    as the manifest records it; 0 pads)."""
    index = {kind: i + 1 for i, kind in enumerate(kind_vocab)}
    return [[index[kind] for kind in f["kinds"]] for f in features(jobs, gpucast)]


def combine(fold_jobs, near, far, max_widen, gpucast=None):
    """Each fold job answered by the service's rule for a simulated job (`gpucast combine`):
    {"figure_mib", "upper_bound_mib", "far"} per job, in order. A fold job is the figures a
    stage has for a model it has not served yet (log_learned, simulated_mib, floor_mib,
    distance or None outside the domain's setups, typical_distance, learned_log_ratio,
    simulated_log_ratio, runs_on_card, capacity_mib, measured_range)."""
    out = []
    for batch in chunks(fold_jobs):
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"near": near, "far": far, "max_widen": max_widen, "items": batch}, f)
        try:
            done = subprocess.run([gpucast or binary(), "combine", f.name], capture_output=True, text=True, cwd=ROOT)
        finally:
            os.unlink(f.name)
        if done.returncode != 0:
            raise SystemExit(f"gpucast combine failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        out.extend(json.loads(done.stdout)["items"])
    return out
