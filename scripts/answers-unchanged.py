#!/usr/bin/env python3
"""Whether two builds of gpucast answer the same: a corpus of committed jobs answered by both
through `gpucast estimate --batch`, compared field by field with `latency_us` left out (it is
the only part of an answer that may change when only speed work landed).

The corpus: every published run (data/public: plain, setups, offload), the first 150 timm
held-out jobs with and 150 without their simulation, the first 200 MLP test jobs, and every
committed hub config (tests/fixtures/transformer_configs) under six setups (QLoRA on an RTX
4090, checkpointed mixed precision on an H100, ZeRO-3 over 8 GPUs, DDP with pipeline stages,
fp32 SGD with accumulation, LoRA on named modules).

    git stash; cargo build --release --bin gpucast; cp target/release/gpucast /tmp/before
    git stash pop; cargo build --release --bin gpucast
    python3 scripts/answers-unchanged.py /tmp/before target/release/gpucast

With `--alone`, each build serves on loopback and answers every job in a request of its own
(as a caller sending one job at a time sees it) instead of in batches. With `--alone --again`,
each job is sent twice in a row and the second answer compared: a build that keeps answers
(`--answer-memo-mib`) gives its kept one.

Stdlib only. Exits 1 when any answer differs, and prints the first few differences. With
`--within-rounding`, a number that moved by at most one unit of its last significant digit (a sum
of float32 products taken in another order: 926.9 against 927.0) is counted and shown but not
failed; any other difference (a decision, a class, a text, a larger move) still exits 1.
"""

import glob
import gzip
import json
import re
import os
import subprocess
import sys
import tempfile

from harness import Server, call_json, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK = 40
SETUPS = [
    {
        "precision": "bf16",
        "optimizer": "adamw",
        "lora": {"rank": 16, "target_modules": "all-linear", "base_weights": "nf4"},
        "gpu": "rtx-4090",
    },
    {"precision": "amp_bf16", "optimizer": "adamw", "activation_checkpointing": "full", "gpu": "h100"},
    {
        "precision": "amp_bf16",
        "optimizer": "adamw",
        "parallelism": {"strategy": "zero3", "world_size": 8},
        "gpu": "a100-80gb",
    },
    {
        "precision": "amp_fp16",
        "optimizer": "adam",
        "parallelism": {"strategy": "ddp", "world_size": 4, "pipeline_parallel": 2},
        "gpu": "a100-40gb",
    },
    {"precision": "fp32", "optimizer": "sgd", "gradient_accumulation_steps": 4, "batch_size": 8},
    {
        "precision": "bf16",
        "optimizer": "adamw",
        "lora": {"rank": 8, "target_modules": ["q_proj", "v_proj"]},
        "activation_checkpointing": "full",
        "gpu": "l4",
    },
]


def jobs(path, limit=None):
    with gzip.open(os.path.join(ROOT, path), "rt") as f:
        for index, line in enumerate(f):
            if limit is not None and index >= limit:
                return
            yield json.loads(line)["job"]


def corpus():
    items = []
    for path in ("data/public/jobs.jsonl.gz", "data/public/setup_jobs.jsonl.gz", "data/public/offload_jobs.jsonl.gz"):
        items.extend(jobs(path))
    items.extend(jobs("data/timm/test_simulated.jsonl.gz", 150))
    items.extend(jobs("data/timm/test.jsonl.gz", 150))
    items.extend(jobs("data/mlp/test.jsonl.gz", 200))
    pattern = os.path.join(ROOT, "tests", "fixtures", "transformer_configs", "**", "*.json")
    for path in sorted(glob.glob(pattern, recursive=True)):
        if path.endswith("simulations.json"):
            continue
        with open(path) as f:
            config = json.load(f)
        for setup in SETUPS:
            items.append({"transformer_config": config, "batch_size": 2, "seq_len": 512, **setup})
    return items


def answers(binary, batches):
    """Every item's answer (or problem) from `binary`, in order."""
    out = []
    for batch in batches:
        done = subprocess.run(
            [binary, "estimate", "--max-body-bytes", str(64 << 20), "--batch", batch],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if done.returncode not in (0, 2):
            raise SystemExit(f"{binary} failed on {batch}: {done.stderr.strip()}")
        out.extend(json.loads(done.stdout)["items"])
    return out


def answers_alone(binary, items, again=False):
    """Every item's answer (or problem) from `binary` serving on loopback, one request each: what
    a caller that sends one job at a time gets; `again`: the answer to the same request sent a
    second time."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="gpucast-alone-") as store:
        service = Server(binary, port, data_dir=store)
        try:
            out = []
            for item in items:
                status, answer = call_json(port, "POST", "/v1/estimate", item)
                if again:
                    status, answer = call_json(port, "POST", "/v1/estimate", item)
                out.append({"estimate": answer} if status == 200 else {"error": answer})
            return out
        finally:
            service.stop()


def without_latency(value):
    if isinstance(value, dict):
        return {k: without_latency(v) for k, v in value.items() if k != "latency_us"}
    if isinstance(value, list):
        return [without_latency(v) for v in value]
    return value


def leaf_differences(a, b, path=""):
    """Every (path, a, b) where the two answers differ, down to their leaves."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            yield from leaf_differences(a.get(key), b.get(key), f"{path}.{key}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from leaf_differences(x, y, f"{path}[{i}]")
    elif a != b:
        yield path, a, b


def first_difference(a, b):
    path, x, y = next(leaf_differences(a, b))
    return f"{path}: {json.dumps(x)[:120]} vs {json.dumps(y)[:120]}"


def last_digit(number):
    """One unit of the last significant digit of a JSON number: 0.1 for 926.9, 1 for 9599.0 (a
    bound rounded up to a whole MiB)."""
    text = json.dumps(number)
    if "e" in text or "E" in text:
        mantissa, exponent = text.lower().split("e")
        return last_digit(float(mantissa)) * 10.0 ** int(exponent)
    fraction = text.split(".")[1].rstrip("0") if "." in text else ""
    return 10.0 ** -len(fraction)


def within_rounding(a, b):
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
    return numbers and abs(a - b) <= max(last_digit(a), last_digit(b)) * 1.000001


def main():
    args = sys.argv[1:]
    tolerate = "--within-rounding" in args
    alone = "--alone" in args
    again = "--again" in args
    args = [a for a in args if a not in ("--within-rounding", "--alone", "--again")]
    if len(args) != 2:
        raise SystemExit(__doc__)
    before, after = args
    items = corpus()
    with tempfile.TemporaryDirectory(prefix="gpucast-answers-") as scratch:
        batches = []
        for start in range(0, len(items), CHUNK):
            path = os.path.join(scratch, f"batch{start // CHUNK:03d}.json")
            with open(path, "w") as f:
                json.dump({"items": items[start : start + CHUNK]}, f)
            batches.append(path)
        if alone:
            old, new = answers_alone(before, items, again), answers_alone(after, items, again)
        else:
            old, new = answers(before, batches), answers(after, batches)
    stripped = [(without_latency(a), without_latency(b)) for a, b in zip(old, new)]
    differ = [(i, first_difference(a, b)) for i, (a, b) in enumerate(stripped) if a != b]
    refused = sum(1 for a, b in zip(old, new) if "error" in a or "error" in b)
    print(f"{len(items)} jobs ({refused} refused by either), {len(differ)} answers differ (latency_us aside)")
    for index, where in differ[:5]:
        print(f"  item {index}: {where}")
    leaves = [(i, leaf) for i, (a, b) in enumerate(stripped) if a != b for leaf in leaf_differences(a, b)]
    beyond = [(i, leaf) for i, leaf in leaves if not within_rounding(leaf[1], leaf[2])]
    print(
        f"{len(leaves)} figures differ in {len(differ)} answers; {len(beyond)} of them by more than "
        "one unit of their last significant digit"
    )
    for index, (where, a, b) in beyond[:5]:
        print(f"  item {index}: {where}: {json.dumps(a)[:120]} vs {json.dumps(b)[:120]}")
    # Which fields moved, list positions aside (`.estimate.warnings[]`: 176 answers).
    fields = {}
    for _, (where, _, _) in leaves:
        field = re.sub(r"\[\d+\]", "[]", where)
        fields[field] = fields.get(field, 0) + 1
    for field, count in sorted(fields.items(), key=lambda kv: -kv[1]):
        print(f"  {field}: {count}")
    if len(old) != len(new) or beyond or (differ and not tolerate):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
