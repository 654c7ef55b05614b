#!/usr/bin/env python3
"""The CPU time a `gpucast serve` spends on single hostile requests (issue 34's HIGH finding),
measured on loopback: the server's utime + stime (/proc/PID/stat) before the request and once
it has stopped growing after the answer (work the answer did not wait for counts too); a
request cheaper than a second is sent back to back for about 2 s and the CPU time divided
among the sends. The server is the adversarial suite's (scripts/adversarial.py). Stdlib only;
Linux.

    cargo build --release --bin gpucast
    python3 scripts/request-cpu.py target/release/gpucast [--runs 3] [--case NAME ...]

Cases:
- `names`: 512 linear layers with dotted names of ~3.2 KB (the 2 MB body limit's worth),
  `lora.modules_to_save` naming one 256-character module 256 times (only the last layer is
  inside it; every other name is made of near misses of it), `target_modules: all-linear`,
  ranked on 16 GPUs (`gpu` a list). tests/api/cost.rs sends the same body.
- `config`: a Llama-3-8B config.json (tests/fixtures/transformer_configs) with
  `modules_to_save: ["lm_head"] x 256`, LoRA on all-linear, ranked on 16 GPUs.
- `readme`: the README's first request (the Swagger example), for scale.

Prints one line per run (status, wall and CPU seconds a request) and a JSON summary (each
case's CPU seconds a request per run and their median) last.
"""

import json
import os
import statistics
import sys
import tempfile
import time

from adversarial import Server, call_json, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TICKS = os.sysconf("SC_CLK_TCK")
# 16 NVIDIA cards of the built-in catalogue (each one timed by the roofline).
GPUS = [
    "a100-40gb", "a100-80gb", "a100-80gb-pcie", "h100-80gb", "h100-pcie", "h100-nvl",
    "h200-141gb", "h20", "b200", "gb200", "l4", "l40", "l40s", "a10", "a10g", "a30",
]  # fmt: skip
BODY_LIMIT = 2 * 1024 * 1024


def names_body():
    """The hostile layer list: names as long as 512 layers fit in the 2 MB body limit."""
    module = "saved_" + "s" * 250  # as long as a list's name may be
    # Components that are the saved module's first 200 characters: near misses a substring
    # search must read to their end (the 44 s; `block<k>` components cost a quarter).
    parts = []
    while len(".".join(parts)) < 3200:
        parts.append(module[:200])
    stem = ".".join(parts)
    names = [f"model.layers.{i}.{stem}.proj" for i in range(511)] + [f"model.{stem}.{module}"]
    body = {
        "family": "transformer",
        "batch_size": 8,
        "precision": "bf16",
        "optimizer": "adamw",
        "layers": [{"kind": "linear", "output_size": 4096, "params": 4096 * 4096 + 4096, "name": n} for n in names],
        "lora": {"rank": 8, "target_modules": "all-linear", "modules_to_save": [module] * 256},
        "gpu": GPUS,
    }
    size = len(json.dumps(body).encode())
    assert size <= BODY_LIMIT, size
    return body


def config_body():
    path = os.path.join(ROOT, "tests", "fixtures", "transformer_configs", "public", "meta-llama__Meta-Llama-3-8B.json")
    with open(path) as f:
        config = json.load(f)
    return {
        "transformer_config": config,
        "seq_len": 2048,
        "batch_size": 8,
        "precision": "bf16",
        "optimizer": "adamw",
        "lora": {"rank": 16, "target_modules": "all-linear", "modules_to_save": ["lm_head"] * 256},
        "gpu": GPUS,
    }


def readme_body():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    start = readme.index("-d '") + len("-d '")
    return json.loads(readme[start : readme.index("}'", start) + 1])


CASES = {"names": names_body, "config": config_body, "readme": readme_body}


def cpu_seconds(pid):
    """The process's utime + stime (every thread's, exited ones' included), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # utime and stime: fields 14 and 15 of stat(5), 12 and 13 after the name.
    return (int(fields[11]) + int(fields[12])) / TICKS


def settled_cpu(pid, quiet=0.5):
    """The process's CPU seconds once two readings `quiet` s apart agree."""
    last = cpu_seconds(pid)
    while True:
        time.sleep(quiet)
        now = cpu_seconds(pid)
        if now == last:
            return now
        last = now


def measure(server, port, case, runs):
    body = CASES[case]()
    size = len(json.dumps(body).encode())
    pid = server.process.pid
    seconds = []
    # The clock ticks at 1/TICKS s: a cheap request is measured over as many back-to-back sends
    # as take about 2 s (at most 500), and its share reported.
    before = settled_cpu(pid)
    started = time.perf_counter()
    status, answer = call_json(port, "POST", "/v1/estimate", body, timeout=900)
    wall = time.perf_counter() - started
    cpu = settled_cpu(pid) - before
    repeat = 1 if cpu >= 1.0 else max(1, min(500, int(2.0 / max(wall, 1e-3))))
    for run in range(runs):
        if run > 0 or repeat > 1:
            before = settled_cpu(pid)
            started = time.perf_counter()
            for _ in range(repeat):
                status, answer = call_json(port, "POST", "/v1/estimate", body, timeout=900)
            wall = (time.perf_counter() - started) / repeat
            cpu = (settled_cpu(pid) - before) / repeat
        seconds.append(round(cpu, 5))
        detail = "" if status == 200 else f" ({(answer or {}).get('detail', '')[:160]})"
        print(
            f"{case} run {run + 1}: {status}, {wall:.4f} s wall and {cpu:.4f} s CPU a request "
            f"over {repeat} sends, {size} bytes{detail}",
            flush=True,
        )
    return {
        "body_bytes": size,
        "status": status,
        "sends_per_run": repeat,
        "cpu_seconds": seconds,
        "median_cpu_seconds": statistics.median(seconds),
    }


def main():
    args = sys.argv[1:]
    if not args or args[0].startswith("-"):
        raise SystemExit(__doc__)
    binary, runs, cases = os.path.abspath(args[0]), 3, []
    rest = args[1:]
    while rest:
        flag = rest.pop(0)
        if flag == "--runs":
            runs = int(rest.pop(0))
        elif flag == "--case":
            cases.append(rest.pop(0))
        else:
            raise SystemExit(f"unknown argument {flag}\n{__doc__}")
    summary = {"binary": binary, "cases": {}}
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="gpucast-request-cpu-") as store:
        # A request timeout of its own: the hostile body took 40 s before issue 34's change,
        # and it is the work that is measured, not the 503.
        server = Server(binary, port, data_dir=store, extra_args=("--request-timeout-secs", "900"))
        try:
            for case in cases or list(CASES):
                summary["cases"][case] = measure(server, port, case, runs)
        finally:
            server.stop()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
