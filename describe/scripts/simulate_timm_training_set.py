#!/usr/bin/env python
"""Simulate the training step of every timm model of the training CSV at each batch size it
was measured at (fp32, Adam, as the campaign ran), on the meta device.

    cd describe && python -m scripts.simulate_timm_training_set [--workers 2] [--limit N] [--models a,b]
        [--simulate 8,128]

Only the batch sizes of ``--simulate`` (default the smallest and largest of the CSV, 8 and 128)
are simulated; the others are interpolated between them (``interpolated: true``), which keeps
the whole set within ~15 minutes on two cores.

Writes data/timm/simulations.jsonl.gz: one line per model, sorted by name,
``{"model": "timm:<name>", "simulations": {"<batch>": <simulation field>, ...}}``, and
data/timm/SIMULATIONS.md (command, versions, timings, failures). Each worker process builds a
model once and simulates every batch size; a model that takes longer than the timeout or cannot
train on meta tensors is recorded as failed.
"""

from __future__ import annotations

import argparse
import csv
import os
import gzip
import hashlib
import json
import multiprocessing
import platform
import shlex
import signal
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
# The measured data beside the repository (read-only; ../shared/data/README.md).
DEFAULT_CSV = str(REPO.parent / "shared" / "data" / "timm_a100_train.csv")
PER_MODEL_TIMEOUT_S = 300


class ModelTimeout(BaseException):
    pass


def _on_alarm(signum, frame):
    raise ModelTimeout(f"took more than {PER_MODEL_TIMEOUT_S} s")


def batches_by_model(csv_path: Path) -> dict:
    found: dict = {}
    with open(csv_path, newline="") as handle:
        for row in csv.DictReader(handle):
            found.setdefault(row["model"], set()).add(int(row["batch_size"]))
    return {model: sorted(batches) for model, batches in sorted(found.items())}


def simulate_model(item: tuple) -> tuple:
    name, batch_sizes, simulated = item
    import torch
    from gpucast_describe import SimulationError, resolve_spec, simulate_step
    from gpucast_describe.simulate import interpolate_simulation

    torch.set_num_threads(1)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(PER_MODEL_TIMEOUT_S)
    started = time.perf_counter()
    try:
        resolved = resolve_spec(f"timm:{name}")
        runs = {
            batch: simulate_step(resolved.module, resolved.default_input_shape, batch)
            for batch in sorted(set(simulated) | {min(batch_sizes), max(batch_sizes)})
        }
        simulations = {}
        for batch in batch_sizes:
            if batch in runs:
                simulations[str(batch)] = runs[batch]
                continue
            low = max(b for b in runs if b < batch)
            high = min(b for b in runs if b > batch)
            simulations[str(batch)] = interpolate_simulation(runs[low], runs[high], batch)
        return name, simulations, None, time.perf_counter() - started
    except (SimulationError, ModelTimeout, Exception) as exc:  # recorded, not fatal
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return name, None, f"{type(exc).__name__}: {message}"[:300], time.perf_counter() - started
    finally:
        signal.alarm(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--csv", type=Path, default=Path(DEFAULT_CSV))
    parser.add_argument("--out", type=Path, default=REPO / "data" / "timm")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--limit", type=int)
    parser.add_argument("--models")
    parser.add_argument("--simulate", default="8,128", help="batch sizes simulated; the others are interpolated")
    args = parser.parse_args()
    command = "cd describe && python -m scripts.simulate_timm_training_set " + shlex.join(sys.argv[1:])
    todo = batches_by_model(args.csv)
    if args.models:
        wanted = set(args.models.split(","))
        todo = {m: b for m, b in todo.items() if m in wanted}
    if args.limit:
        todo = dict(list(todo.items())[: args.limit])
    simulated = [int(b) for b in args.simulate.split(",")]
    items = [(name, batches, simulated) for name, batches in todo.items()]
    started = time.perf_counter()
    results, failures, timings = {}, {}, {}
    with multiprocessing.get_context("fork").Pool(args.workers, maxtasksperchild=20) as pool:
        for i, (name, sims, error, seconds) in enumerate(pool.imap_unordered(simulate_model, items)):
            timings[name] = seconds
            if error:
                failures[name] = error
            else:
                results[name] = sims
            print(f"[{i + 1}/{len(todo)}] {name} {seconds:.1f} s {error or ''}", flush=True)
    wall = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "simulations.jsonl.gz"
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as handle:
        for name in sorted(results):
            line = {"model": f"timm:{name}", "simulations": results[name]}
            handle.write((json.dumps(line, separators=(",", ":")) + "\n").encode())
    import timm
    import torch

    sha = hashlib.sha256(args.csv.read_bytes()).hexdigest()
    per_batch = [t / len(todo[n]) for n, t in timings.items() if n in results]
    lines = [
        "# data/timm/simulations.jsonl.gz: provenance",
        "",
        "The `simulation` field of every timm model of the training CSV at each batch size it was",
        "measured at (batch sizes " + args.simulate + " simulated, the others interpolated",
        "between them, marked `interpolated: true`): two training steps (fp32, Adam as its foreach implementation, cross-entropy",
        "on the class logits) on the meta device, replayed through gpucast_describe's model of the",
        "CUDA caching allocator (see describe/README.md). Same figures as",
        "`python -m gpucast_describe timm:<name> --batch-size <b>`.",
        "",
        "```",
        command,
        "```",
        "",
        f"- generated: {datetime.now(timezone.utc).replace(microsecond=0).isoformat()}",
        f"- source: `{os.path.basename(args.csv)}` (../shared/data), sha256 `{sha}`",
        f"- python {platform.python_version()}, torch {torch.__version__}, timm {timm.__version__}",
        f"- models: {len(todo)}, simulated: {len(results)}, failed: {len(failures)}",
        f"- wall: {wall / 60:.1f} min with {args.workers} worker processes (one thread each)",
    ]
    if per_batch:
        per_batch.sort()
        lines.append(
            f"- seconds per model and batch size (build included): median "
            f"{statistics.median(per_batch):.2f}, p90 "
            f"{per_batch[int(0.9 * (len(per_batch) - 1))]:.2f}, max {per_batch[-1]:.2f}"
        )
    lines += ["", "## Failures", ""]
    lines += [f"- `{n}`: {r}" for n, r in sorted(failures.items())] or ["None."]
    (args.out / "SIMULATIONS.md").write_text("\n".join(lines) + "\n")
    print(f"{len(results)} simulated, {len(failures)} failed, {wall / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
