#!/usr/bin/env python3
"""What one calibration write costs as the store grows (issue 34, item 6: "Writes cost O(new
rows), not O(store)"), on loopback against a `gpucast serve` started here (the adversarial
suite's Server, a fresh SQLite store). Stdlib only.

    cargo build --release --bin gpucast
    python3 scripts/write-cost.py target/release/gpucast [--rows 100000] [--writes 30]

Fills the store with `--rows` observations of the README job, 1,000 per key (the retention per
key) over 4 cards x 25 environments, in posts of 1,000; then times `--writes` posts of one
observation each to a key of its own (a0 on the A100 40 GB), one after another. Prints one JSON
object: the rows stored, and the write latency p50 / p90 / max in ms. The same posts on a store
of 1,000 rows give the baseline: a write that re-reads the store grows with it; one that reads
its key's rows does not.
"""

import argparse
import json
import statistics
import tempfile
import time

from adversarial import example_job
from harness import Server, call_json, free_port

CARDS = ["a100-40gb", "a100-80gb", "h100-sxm", "l40s"]


def observation(job, peak, gpu, environment):
    return {"gpu": gpu, "environment": environment, "job": job, "observed_peak_mib": peak}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("binary")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--writes", type=int, default=30)
    options = parser.parse_args()
    job = example_job()
    with tempfile.TemporaryDirectory(prefix="gpucast-write-cost-") as store:
        server = Server(options.binary, free_port(), data_dir=store)
        try:
            port = server.port
            _, answer = call_json(port, "POST", "/v1/estimate", job)
            figure = answer["memory"]["estimate_mib"]
            keys = [(card, f"fill-{e}") for card in CARDS for e in range(25)]
            filled, started = 0, time.perf_counter()
            for card, environment in keys:
                if filled >= options.rows:
                    break
                batch = [observation(job, figure * (1 + 0.001 * (i % 7)), card, environment) for i in range(1000)]
                status, problem = call_json(port, "POST", "/v1/calibration/observations", batch, timeout=300)
                if status != 200:
                    raise SystemExit(f"filling {card}/{environment}: {status} {problem}")
                filled += len(batch)
            fill_seconds = time.perf_counter() - started
            latencies = []
            for i in range(options.writes):
                body = observation(job, figure * (1 + 0.001 * (i % 5)), "a100-40gb", "a0")
                sent = time.perf_counter()
                status, problem = call_json(port, "POST", "/v1/calibration/observations", body)
                latencies.append((time.perf_counter() - sent) * 1000)
                if status != 200:
                    raise SystemExit(f"write {i}: {status} {problem}")
        finally:
            server.stop()
    latencies.sort()
    print(
        json.dumps(
            {
                "binary": options.binary,
                "rows_stored": filled,
                "fill_seconds": round(fill_seconds, 1),
                "writes": len(latencies),
                "write_p50_ms": round(statistics.median(latencies), 2),
                "write_p90_ms": round(latencies[int(0.9 * (len(latencies) - 1))], 2),
                "write_max_ms": round(latencies[-1], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
