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

Stdlib only. Exits 1 when any answer differs, and prints the first few differences.
"""

import glob
import gzip
import json
import os
import subprocess
import sys
import tempfile

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


def without_latency(value):
    if isinstance(value, dict):
        return {k: without_latency(v) for k, v in value.items() if k != "latency_us"}
    if isinstance(value, list):
        return [without_latency(v) for v in value]
    return value


def first_difference(a, b, path=""):
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return first_difference(a.get(key), b.get(key), f"{path}.{key}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return first_difference(x, y, f"{path}[{i}]")
    return f"{path}: {json.dumps(a)[:120]} vs {json.dumps(b)[:120]}"


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    before, after = sys.argv[1:]
    items = corpus()
    with tempfile.TemporaryDirectory(prefix="gpucast-answers-") as scratch:
        batches = []
        for start in range(0, len(items), CHUNK):
            path = os.path.join(scratch, f"batch{start // CHUNK:03d}.json")
            with open(path, "w") as f:
                json.dump({"items": items[start : start + CHUNK]}, f)
            batches.append(path)
        old, new = answers(before, batches), answers(after, batches)
    stripped = [(without_latency(a), without_latency(b)) for a, b in zip(old, new)]
    differ = [(i, first_difference(a, b)) for i, (a, b) in enumerate(stripped) if a != b]
    refused = sum(1 for a, b in zip(old, new) if "error" in a or "error" in b)
    print(f"{len(items)} jobs ({refused} refused by either), {len(differ)} answers differ (latency_us aside)")
    for index, where in differ[:5]:
        print(f"  item {index}: {where}")
    return 1 if differ or len(old) != len(new) else 0


if __name__ == "__main__":
    sys.exit(main())
