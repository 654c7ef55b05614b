"""python -m gpucast_probe --minutes 10 --out rows.csv [--families mlp,cnn,transformer,real]
[--post http://host:8080 --gpu attached --token T]"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from typing import Optional

from .budget import Budget
from .generators import FAMILIES, generate, parse_families
from .post import environment_label, post_rows
from .runner import SubprocessExecutor, run_jobs
from .sampler import Nvml
from .schema import CsvWriter, row_for


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpucast_probe", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, required=True, help="hard budget for the whole run")
    p.add_argument("--out", required=True, help="CSV to append rows to (created with a header)")
    p.add_argument("--families", default="mlp,cnn,transformer,real", help=f"comma list of {', '.join(FAMILIES)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", type=int, default=0, help="NVML index of the GPU to use")
    p.add_argument("--train-seconds", type=float, default=60.0, help="training time per job")
    p.add_argument("--startup-seconds", type=float, default=60.0, help="allowance for imports and CUDA start-up")
    p.add_argument("--min-train-seconds", type=float, default=10.0, help="no job starts with less than this left")
    p.add_argument("--interval", type=float, default=0.2, help="seconds between memory readings")
    p.add_argument("--max-jobs", type=int, default=None)
    p.add_argument("--post", metavar="URL", help="gpucast base URL to send ok rows to as observations")
    p.add_argument("--gpu", default="attached", help="SKU the observations are for (`attached` or e.g. h100-80gb)")
    p.add_argument("--post-existing", action="store_true", help="run nothing: post the ok rows already in --out")
    p.add_argument("--token", default=os.environ.get("GPUCAST_TOKEN"), help="bearer token (env GPUCAST_TOKEN)")
    return p


def main(argv: Optional[list] = None) -> int:
    args = parser().parse_args(argv)
    try:
        families = parse_families(args.families)
        budget = Budget(args.minutes)
    except ValueError as e:
        print(f"gpucast_probe: {e}", file=sys.stderr)
        return 2
    if args.post_existing:
        if not args.post:
            print("gpucast_probe: --post-existing needs --post URL", file=sys.stderr)
            return 2
        return _post(args, read_rows(args.out), budget)
    nvml = Nvml.open()
    if nvml is None:
        print("gpucast_probe: NVML is not available (no driver, or nvidia-ml-py not installed)", file=sys.stderr)
        return 1
    info = nvml.device_info(args.device)
    print(f"probing {info['name']} (driver {info['driver']}, {info['total_mib']} MiB) for {args.minutes} min")
    execute = SubprocessExecutor(nvml, args.device, info["uuid"], args.interval)
    rows = []
    with CsvWriter(args.out) as writer:

        def record(spec, outcome):
            if outcome.layers:
                spec.layers = [tuple(layer) for layer in outcome.layers]
            row = row_for(
                spec,
                peak_mib=outcome.peak_mib,
                metrics=outcome.metrics,
                gpu_sku=info["name"],
                driver=info["driver"],
                status=outcome.status,
                process_peak_mib=outcome.process_peak_mib,
                train_seconds=outcome.train_seconds,
                step_time_ms=outcome.step_time_ms,
                environment=environment_label(outcome.environment),
            )
            writer.write(row)
            rows.append(row)
            print(f"{outcome.status:8} {outcome.peak_mib!s:>7} MiB  {spec.name}", flush=True)

        ran = run_jobs(
            generate(families, args.seed),
            budget,
            execute,
            record,
            args.train_seconds,
            args.startup_seconds,
            args.min_train_seconds,
            args.max_jobs,
        )
    print(f"{ran} jobs in {args.out}; {budget.remaining():.0f} s of the budget left")
    return _post(args, rows, budget) if args.post else 0


def _post(args, rows: list, budget: Budget) -> int:
    sent, skipped, errors = post_rows(args.post, rows, args.gpu, args.token, 5.0, budget.remaining)
    print(f"posted {sent} observations to {args.post} ({skipped} rows not usable or out of time)")
    for error in errors[:10]:
        print(f"  {error}", file=sys.stderr)
    return 1 if errors else 0


def read_rows(path: str) -> list:
    """Rows of a probe CSV, for posting an earlier run."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))
