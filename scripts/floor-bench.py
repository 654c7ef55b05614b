#!/usr/bin/env python3
"""The service's speed against its floor, written to docs/reports/performance.md:

1. the service against an empty axum JSON handler (examples/json_floor.rs) that reads the same
   body and writes a reply of the same bytes, under the same load in the same run, at c=1 and
   c=32, for three jobs: the README's MLP example, a describe job with its simulation (a timm
   held-out model), and a config job (Llama-3-8B QLoRA). Each job twice: asked again of a
   service that keeps answers (the default: the body's kept answer, as a scheduler re-asking
   about a pending job gets it), and computed, by a second service with `--answer-memo-mib 0`
   (what every first ask of a job costs);
2. where one estimate's time goes in process, stage by stage (examples/stage_timings.rs);
3. requests that arrive alone (a quarter of a second apart), computed, timed by the server's own
   latency_us: the cold path a scheduler's occasional calls take;
4. a legitimate single estimate while 8 clients flood POST /v1/estimate/batch with 256 jobs
   each, against the same estimate on a quiet server;
5. the batch rate: estimates a second of POST /v1/estimate/batch as the load test posts it
   (load-tests/run.py: the README job 256 times, and 256 distinct MLP test jobs; 4 clients).

Stdlib only; needs `oha` (cargo install oha --locked).

    cargo build --locked --release --bin gpucast --example json_floor --example stage_timings
    python3 scripts/floor-bench.py [--seconds 5]

Ratios are the service over the floor: p50 latency (how many times slower) and requests per
second (what share of the floor's throughput). One run, one machine: compare ratios, not the
absolute figures of another run.
"""

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

from harness import commit, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_ready(port, path):
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1)
            return
        except urllib.error.HTTPError:
            return  # answering (405 for a GET on a POST route)
        except Exception:
            time.sleep(0.1)
    raise SystemExit(f"nothing answered on port {port}")


def jobs():
    with open(os.path.join(ROOT, "openapi", "openapi.json")) as f:
        schema = json.load(f)["components"]["schemas"]["EstimateRequest"]
    mlp = schema.get("example") or schema["allOf"][0]["example"]
    with gzip.open(os.path.join(ROOT, "data", "timm", "test_simulated.jsonl.gz"), "rt") as f:
        simulated = json.loads(f.readline())["job"]
    path = os.path.join(ROOT, "tests", "fixtures", "transformer_configs", "public", "meta-llama__Meta-Llama-3-8B.json")
    with open(path) as f:
        config = {
            "transformer_config": json.load(f),
            "batch_size": 1,
            "seq_len": 2048,
            "precision": "bf16",
            "optimizer": "adamw",
            "lora": {"rank": 16, "alpha": 32, "target_modules": "all-linear", "base_weights": "nf4"},
            "gpu": "rtx-4090",
        }
    return [
        ("README MLP job", mlp),
        ("describe job with its simulation", simulated),
        ("config job (Llama-3-8B QLoRA)", config),
    ]


def post(port, body):
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/estimate", data=body, method="POST", headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read()


def oha_command(oha, port, body_file, concurrency, seconds, route="/v1/estimate"):
    return [
        oha,
        "-z",
        f"{seconds}s",
        "-c",
        str(concurrency),
        "-m",
        "POST",
        "-T",
        "application/json",
        "-D",
        body_file,
        "--no-tui",
        "--output-format",
        "json",
        f"http://127.0.0.1:{port}{route}",
    ]


def figures(report):
    """(p50 ms, p99 ms, requests per second, non-200 answers) of an oha report."""
    statuses = report.get("statusCodeDistribution", {})
    failed = sum(n for code, n in statuses.items() if code != "200")
    percentiles = report["latencyPercentiles"]
    return (percentiles["p50"] * 1000, percentiles["p99"] * 1000, report["summary"]["requestsPerSec"], failed)


def run_oha(oha, port, body_file, concurrency, seconds, route="/v1/estimate"):
    """(p50 ms, p99 ms, requests per second, non-200 answers) of `seconds` of load."""
    done = subprocess.run(
        oha_command(oha, port, body_file, concurrency, seconds, route), capture_output=True, text=True, check=True
    )
    return figures(json.loads(done.stdout))


def load(oha, port, body_file, concurrency, seconds):
    """(p50 ms, requests per second, non-200 answers) of `seconds` of load."""
    p50, _, rps, failed = run_oha(oha, port, body_file, concurrency, seconds)
    return p50, rps, failed


STAGES = ["parse", "validate", "estimators_and_physics", "roofline", "answer", "serialise", "in_process_total"]


def stage_figures(stages_binary, body_files):
    """[(job name, {stage: (p50 us, p90 us)})] from examples/stage_timings."""
    done = subprocess.run(
        [stages_binary, "--runs", "2000"] + [path for _, path in body_files],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    by_file, models = {}, {}
    for line in done.stdout.splitlines():
        row = json.loads(line)
        if "model" in row:
            models.setdefault(row["file"], {})[row["model"]] = (row["p50_us"], row["p90_us"])
        else:
            by_file.setdefault(row["file"], {})[row["stage"]] = (row["p50_us"], row["p90_us"])
    return [(name, by_file[path], models.get(path, {})) for name, path in body_files]


ISOLATED_REQUESTS = 20
ISOLATED_GAP_S = 0.25


def isolated_figures(port, floor_port, body):
    """(floor client p50 us, service client p50 us, service server p50 us, p90 us, {model: p50 us})
    of requests that arrive alone, as a scheduler's usually do: ISOLATED_REQUESTS to each of the
    floor and the service, alternating, ISOLATED_GAP_S apart, each on a new connection; timed by
    the client, and for the service also by the answer's own latency_us (the server's time)."""
    floor_times, service_times, totals, by_model = [], [], [], {}
    for _ in range(ISOLATED_REQUESTS):
        for target in (floor_port, port):
            time.sleep(ISOLATED_GAP_S)
            started = time.perf_counter()
            reply = post(target, body)
            elapsed = (time.perf_counter() - started) * 1e6
            if target == floor_port:
                floor_times.append(elapsed)
                continue
            service_times.append(elapsed)
            latency = json.loads(reply)["latency_us"]
            totals.append(latency.pop("total"))
            for model, us in latency.items():
                by_model.setdefault(model, []).append(us)

    def p50(values):
        return sorted(values)[len(values) // 2]

    models = {m: p50(v) for m, v in by_model.items() if p50(v) >= 1.0}
    return p50(floor_times), p50(service_times), p50(totals), sorted(totals)[len(totals) * 9 // 10], models


def flood_figures(args, port, scratch, single_body):
    """The single job quiet, then under 8 clients flooding the batch route with 256 MLP jobs:
    (quiet figures, flooded figures, (batches per second, non-200 batches))."""
    quiet = run_oha(args.oha, port, single_body, 1, args.seconds)
    with gzip.open(os.path.join(ROOT, "data", "mlp", "test.jsonl.gz"), "rt") as f:
        items = [json.loads(line)["job"] for _, line in zip(range(256), f)]
    batch_file = os.path.join(scratch, "batch.json")
    with open(batch_file, "w") as f:
        json.dump({"items": items}, f)
    flood = subprocess.Popen(
        oha_command(args.oha, port, batch_file, 8, args.seconds + 2, "/v1/estimate/batch"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        time.sleep(1)
        flooded = run_oha(args.oha, port, single_body, 1, args.seconds)
    finally:
        out, _ = flood.communicate(timeout=args.seconds + 120)
    batches = figures(json.loads(out))
    return quiet, flooded, (batches[2], batches[3])


BATCH_ITEMS = 256
BATCH_CLIENTS = 4


def batch_figures(args, ports, scratch, mlp):
    """[(name, answer, batches per second, estimates per second, p50 ms, non-200 answers)] of
    the load test's two MLP batches (load-tests/run.py's batch_example_256 and batch_mlp_256),
    each posted by BATCH_CLIENTS clients without pause for `args.seconds`, to each of `ports`
    ([(answer, port)])."""
    with gzip.open(os.path.join(ROOT, "data", "mlp", "test.jsonl.gz"), "rt") as f:
        distinct = [json.loads(line)["job"] for _, line in zip(range(BATCH_ITEMS), f)]
    rows = []
    for name, items in (
        ("the README MLP job 256 times (batch_example_256)", [mlp] * BATCH_ITEMS),
        ("256 distinct MLP test jobs (batch_mlp_256)", distinct),
    ):
        path = os.path.join(scratch, f"batch{len(rows)}.json")
        with open(path, "w") as f:
            json.dump({"items": items}, f, separators=(",", ":"))
        for answered, port in ports:
            p50, _, rps, failed = run_oha(args.oha, port, path, BATCH_CLIENTS, args.seconds, "/v1/estimate/batch")
            rows.append((name, answered, rps, rps * len(items), p50, failed))
            print(rows[-1], flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--gpucast", default=os.path.join(ROOT, "target", "release", "gpucast"))
    parser.add_argument("--floor", default=os.path.join(ROOT, "target", "release", "examples", "json_floor"))
    parser.add_argument("--oha", default=shutil.which("oha") or os.path.expanduser("~/.cargo/bin/oha"))
    parser.add_argument("--stages", default=os.path.join(ROOT, "target", "release", "examples", "stage_timings"))
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "reports", "performance.md"))
    args = parser.parse_args()
    for path in (args.gpucast, args.floor, args.stages, args.oha):
        if not os.path.exists(path):
            raise SystemExit(
                f"{path} is missing: cargo build --locked --release --bin gpucast "
                "--example json_floor --example stage_timings; cargo install oha --locked"
            )
    load_before = os.getloadavg()
    scratch = tempfile.mkdtemp(prefix="gpucast-floor-")

    def serve(name, *flags):
        port = free_port()
        process = subprocess.Popen(
            [
                args.gpucast,
                "serve",
                "--listen",
                f"127.0.0.1:{port}",
                "--no-nvml",
                "--data-dir",
                os.path.join(scratch, name),
                *flags,
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return port, process

    # The service as deployed (answers kept), and one that computes every answer.
    kept_port, kept = serve("kept")
    port, service = serve("computed", "--answer-memo-mib", "0")
    rows = []
    body_files = []
    isolated = []
    try:
        wait_ready(kept_port, "/readyz")
        wait_ready(port, "/readyz")
        for index, (name, job) in enumerate(jobs()):
            body = json.dumps(job).encode()
            body_file = os.path.join(scratch, f"body{index}.json")
            with open(body_file, "wb") as f:
                f.write(body)
            body_files.append((name, body_file))
            reply = post(port, body)
            reply_file = os.path.join(scratch, "reply.json")
            with open(reply_file, "wb") as f:
                f.write(reply)
            floor_port = free_port()
            floor = subprocess.Popen(
                [args.floor, str(floor_port), reply_file], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            try:
                wait_ready(floor_port, "/v1/estimate")
                for concurrency in (1, 32):
                    # Alternate the floor and the service under load so a slow spell of the
                    # machine hits both; the floor is measured before each.
                    for answered, target in (("asked again (kept)", kept_port), ("computed", port)):
                        floor_figures = load(args.oha, floor_port, body_file, concurrency, args.seconds)
                        service_figures = load(args.oha, target, body_file, concurrency, args.seconds)
                        rows.append(
                            (name, answered, len(body), len(reply), concurrency, floor_figures, service_figures)
                        )
                        print(rows[-1], flush=True)
                isolated.append((name, *isolated_figures(port, floor_port, body)))
            finally:
                floor.terminate()
                floor.wait(timeout=30)
        batches = batch_figures(args, [("asked again (kept)", kept_port), ("computed", port)], scratch, jobs()[0][1])
        flood = flood_figures(args, port, scratch, body_files[0][1])
        stages = stage_figures(args.stages, body_files)
    finally:
        for process in (kept, service):
            process.terminate()
            process.wait(timeout=60)
        shutil.rmtree(scratch, ignore_errors=True)

    load_after = os.getloadavg()
    lines = [
        "# The service's speed: against its floor, by stage, under a flood",
        "",
        f"Written by `python3 scripts/floor-bench.py --seconds {args.seconds}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} at commit `{commit()}` "
        f"({os.cpu_count()} cores, load average {load_before[0]:.1f} before and {load_after[0]:.1f} after "
        "the run, other work included; release builds of "
        "the service and of examples/json_floor.rs, which reads the same body and writes a reply of the "
        "same bytes, with the service's allocator). Do not edit by hand. oha, "
        f"{args.seconds} s of load per cell, the floor and the service alternating. Each job is "
        "answered twice: asked again of the service as deployed, which keeps answers by their "
        "request's bytes (a scheduler re-asking about a pending job), and computed, by a service "
        "with `--answer-memo-mib 0` (every first ask of a job). The other sections are computed. "
        "Speed work is held to change no answer beyond rounding by `scripts/answers-unchanged.py "
        "[--within-rounding] BEFORE AFTER`.",
        "",
        "| job | answer | body / reply bytes | c | floor p50 ms | gpucast p50 ms | p50 ratio | floor req/s | "
        "gpucast req/s | throughput share | non-200 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, answered, body_bytes, reply_bytes, c, (f_p50, f_rps, f_bad), (s_p50, s_rps, s_bad) in rows:
        lines.append(
            f"| {name} | {answered} | {body_bytes:,} / {reply_bytes:,} | {c} | {f_p50:.3f} | {s_p50:.3f} | "
            f"{s_p50 / f_p50:.1f}x | {f_rps:,.0f} | {s_rps:,.0f} | {s_rps / f_rps:.2f} | "
            f"{f_bad + s_bad} |"
        )
    lines += [
        "",
        "## Batches",
        "",
        f"POST /v1/estimate/batch as the load test posts it (load-tests/run.py), {BATCH_CLIENTS} clients "
        f"without pause for {args.seconds} s each: estimates a second are items x batches a second. "
        "Asked again (kept): every item's answer is kept after the first batch, read and priced, not "
        "answered again; computed: every distinct item answered each time (a repeated item of one "
        "batch is answered once either way).",
        "",
        "| batch | answer | batches/s | estimates/s | p50 ms | non-200 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, answered, rps, eps, p50, bad in batches:
        lines.append(f"| {name} | {answered} | {rps:,.1f} | {eps:,.0f} | {p50:.3f} | {bad} |")
    lines += [
        "",
        "## Where one estimate's time goes, in process",
        "",
        "`examples/stage_timings.rs`, release build, the same three request bodies, each stage run "
        "2,000 times (median and 90th percentile, microseconds): parse the body, validate it into a job, "
        "the estimators with physics, the roofline alone, the whole answer (estimators, physics, roofline, "
        "placement, the wire answer), serialise it; and the total of parse, validate, answer and serialise.",
        "",
        "| job | " + " | ".join(STAGES) + " |",
        "| --- |" + " --- |" * len(STAGES),
    ]
    for name, by_stage, _ in stages:
        cells = [f"{by_stage[s][0]:.1f} / {by_stage[s][1]:.1f}" for s in STAGES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Each model and formula inside the estimators stage, as the estimate times it (median / 90th "
        "percentile, microseconds). The aggregate models are evaluated in process "
        "(src/estimators/feedforward.rs); ONNX Runtime runs only the sequence classifiers, which answer "
        '`estimators: "all"`.',
        "",
        "| job | model: p50 / p90 us |",
        "| --- | --- |",
    ]
    for name, _, models in stages:
        cells = ", ".join(f"{m} {p50:.1f} / {p90:.1f}" for m, (p50, p90) in sorted(models.items()))
        lines.append(f"| {name} | {cells} |")
    lines += [
        "",
        "## Requests that arrive alone",
        "",
        f"{ISOLATED_REQUESTS} requests of each job to the floor and to the service, alternating, "
        f"{ISOLATED_GAP_S} s apart, each on a new connection (p50): timed by the client, and for the "
        "service also by the answer's own `latency_us` (the server's time: total, and each model or "
        "step that took 1 us or more). Between requests the CPU's caches go to other work, and both "
        "pay for reloading them.",
        "",
        "| job | floor, client us | gpucast, client us | ratio | gpucast server total us (p50 / p90) | "
        "by model, server p50 us |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, floor_us, service_us, p50, p90, models in isolated:
        by_model = ", ".join(f"{m} {us:.0f}" for m, us in sorted(models.items()))
        lines.append(
            f"| {name} | {floor_us:.0f} | {service_us:.0f} | {service_us / floor_us:.2f}x | {p50:.0f} / {p90:.0f} "
            f"| {by_model} |"
        )
    (q50, q99, q_rps, q_bad), (l50, l99, l_rps, l_bad), (b_rps, b_bad) = flood
    lines += [
        "",
        "## A legitimate estimate under a batch flood",
        "",
        f"The README MLP job, one client at a time for {args.seconds} s, on a quiet server and while 8 "
        "clients post batches of 256 MLP jobs (the test split) to /v1/estimate/batch without pause "
        "(`--max-concurrent-batches` 1: batches take one core, queued ones wait their turn).",
        "",
        "| | p50 ms | p99 ms | req/s | non-200 |",
        "| --- | --- | --- | --- | --- |",
        f"| quiet | {q50:.3f} | {q99:.3f} | {q_rps:,.0f} | {q_bad} |",
        f"| under the flood | {l50:.3f} | {l99:.3f} | {l_rps:,.0f} | {l_bad} |",
        f"| the flood's batches | | | {b_rps:,.1f} | {b_bad} |",
    ]
    text = "\n".join(lines) + "\n"
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
