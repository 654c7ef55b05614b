"""The measured data the roofline performance model (src/physics/perf/) is fitted and checked on.
Standard library only.

Writes, under data/perf/:

- mlp_train_utilization.jsonl.gz: the TRAIN rows of the MLP split (data/mlp/splits.json) with
  their measured mean SMACT and SMOCC and their architecture shape (pyramid, uniform, bottleneck,
  gradual, from the Filename), one JSON line each: `row` (CSV index), `id`, `group`, `shape`,
  `job`, `smact`, `smocc`. The held-out rows stay in data/mlp/test.jsonl.gz.
- step_times.json: published throughputs of public_training_memory.csv (rows 0-8, 39-45, 317)
  as step times, with the quote from `notes` they come from and the job of
  data/public/setup_jobs.jsonl.gz (by row) that describes the run, where there is one.
- PROVENANCE.md: sources, checksums, the command.

    cd training && python -m gpucast_training perf-data
"""

import csv
import datetime
import hashlib
import json
import os
import re

from .data import load_mlp_records, log, read_jsonl_gz, write_jsonl_gz

SHAPES = ("pyramid", "uniform", "bottleneck", "gradual")
STEP_TIME_ROWS = list(range(0, 9)) + list(range(39, 46)) + [317]
THROUGHPUT = re.compile(r"([\d][\d,]*(?:\.\d+)?)\s*(samples/s|tokens/sec|tokens/s)")


def shape_of(filename):
    match = re.search(r"_arch:([a-z]+)", filename)
    if not match or match.group(1) not in SHAPES:
        raise ValueError("no architecture shape in %r" % filename)
    return match.group(1)


def sha256(path):
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def train_rows(layout):
    with open(layout.read("data", "mlp", "splits.json")) as handle:
        splits = json.load(handle)
    records = load_mlp_records(layout.mlp_csv)
    rows = []
    for index in splits["train_rows"]:
        r = records[index]
        rows.append(
            {
                "row": index,
                "id": r["id"],
                "group": r["group"],
                "shape": shape_of(r["id"]),
                "job": r["job"],
                "smact": r["smact"],
                "smocc": r["smocc"],
            }
        )
    return rows


def least_flops_per_token(params):
    """The least work a training step does per token: the forward pass and the input gradients
    of backward, 2 FLOPs per parameter each (no weight gradients, no recomputation)."""
    return 4.0 * params


def peak_tflops(gpu_text, gpus):
    """The highest dense 16-bit tensor peak of the catalogued cards whose name carries the
    row's model number ("A100 (40/80GB not stated)" -> the A100s): the generous reading."""
    match = re.search(r"\b[A-Z]?\d{3,4}\b", gpu_text)
    if not match:
        raise ValueError("no card model in %r" % gpu_text)
    peaks = [
        max(g["fp16_tflops"], g["bf16_tflops"] or 0.0) for g in gpus if re.search(r"\b%s\b" % match.group(0), g["name"])
    ]
    if not peaks:
        raise ValueError("no catalogued card for %r" % gpu_text)
    return max(peaks)


def step_times(layout):
    with open(layout.public_csv, newline="") as handle:
        csv_rows = list(csv.DictReader(handle))
    with open(layout.read("data", "gpus.json")) as handle:
        gpus = json.load(handle)["gpus"]
    jobs = {line["row"]: line for line in read_jsonl_gz(layout.read("data", "public", "setup_jobs.jsonl.gz"))}
    out = []
    for index in STEP_TIME_ROWS:
        row = csv_rows[index]
        notes = row["notes"]
        match = THROUGHPUT.search(notes)
        if not match:
            raise ValueError("row %d: no throughput in notes" % index)
        value = float(match.group(1).replace(",", ""))
        unit = "samples/s" if match.group(2) == "samples/s" else "tokens/s"
        # The quote: the throughput with its clause of the notes.
        clause = [part.strip() for part in notes.split(";") if match.group(0) in part][0]

        # Leading integers ("1 per GPU x 2 GPUs" is 1 per GPU; "24576 (24K)").
        def lead(text):
            return int(re.match(r"\d+", text.replace(",", "")).group(0)) if re.match(r"\d", text or "") else None

        batch = lead(row["batch_size"])
        seq = lead(row["seq_len"])
        entry = {
            "row": index,
            "model": row["model"],
            "gpu": row["gpu"],
            "n_gpus": row["n_gpus"],
            "throughput": value,
            "unit": unit,
            "quote": clause,
            "batch_size": row["batch_size"],
            "seq_len": row["seq_len"],
            "in_setup_jobs": index in jobs,
        }
        # One optimizer step of one GPU: its batch (micro-batch x accumulation) of samples, or
        # of samples x sequence length tokens. A multi-GPU row's throughput is taken as one
        # GPU's unless that is physically impossible (below): then it is the cluster's.
        per_step = batch if unit == "samples/s" else (batch * seq if batch and seq else None)
        entry["step_time_ms"] = round(1000.0 * per_step / value, 3) if per_step else None
        if index in jobs:
            job = jobs[index]["job"]
            per_step = job["batch_size"] if unit == "samples/s" else job["batch_size"] * job["input_shape"][0]
            entry["step_time_ms"] = round(1000.0 * per_step / value, 3)
        n_gpus = lead(row["n_gpus"]) or 1
        entry["throughput_of"] = "one GPU"
        if index in jobs and unit == "tokens/s" and n_gpus > 1:
            params = sum(layer.get("params", 0) for layer in jobs[index]["job"]["layers"])
            peak = peak_tflops(row["gpu"], gpus)
            if least_flops_per_token(params) * value > peak * 1e12:
                # One GPU cannot do that many tokens' least work a second: the cluster did.
                entry["throughput_of"] = (
                    "all %d GPUs (one GPU's reading needs %.0f TFLOP/s; the card's peak is %.0f)"
                    % (n_gpus, least_flops_per_token(params) * value / 1e12, peak)
                )
                entry["step_time_ms"] = round(entry["step_time_ms"] * n_gpus, 3)
        out.append(entry)
    return out


def run(layout, threads=None):
    del threads
    rows = train_rows(layout)
    path = layout.out("data", "perf", "mlp_train_utilization.jsonl.gz")
    write_jsonl_gz(path, rows, one_write=True)
    log("%d MLP train rows -> %s" % (len(rows), path))
    times = step_times(layout)
    with open(layout.out("data", "perf", "step_times.json"), "w") as handle:
        json.dump(times, handle, indent=1)
        handle.write("\n")
    log("%d step-time rows" % len(times))
    counts = {s: sum(1 for r in rows if r["shape"] == s) for s in SHAPES}
    lines = [
        "# data/perf: provenance",
        "",
        "Made by `cd training && python -m gpucast_training perf-data` (training/gpucast_training/perf_data.py)"
        " from the read-only measured data; the roofline performance model (src/physics/perf/,"
        " docs/design/roofline.md) is fitted on the first file and checked on both.",
        "",
        "- generated: %s" % datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
        "- `mlp_train_utilization.jsonl.gz`: the %d TRAIN rows of `data/mlp/splits.json` (never its test rows)"
        " of `%s`, sha256 `%s`; shapes: %s"
        % (
            len(rows),
            os.path.basename(layout.mlp_csv),
            sha256(layout.mlp_csv),
            ", ".join("%s %d" % kv for kv in counts.items()),
        ),
        "- `step_times.json`: rows %s of `%s`, sha256 `%s`: the throughput quoted in `notes`, as the time"
        " of one optimizer step of one GPU (batch_size samples, or batch_size x seq_len tokens); a"
        " multi-GPU row's tokens/s is one GPU's unless one GPU could not do that many tokens' least"
        " work (4 FLOPs per parameter per token) at the card's dense 16-bit peak, then all n_gpus'"
        " (`throughput_of` says which)"
        % (", ".join(map(str, STEP_TIME_ROWS)), os.path.basename(layout.public_csv), sha256(layout.public_csv)),
        "",
    ]
    with open(layout.out("data", "perf", "PROVENANCE.md"), "w") as handle:
        handle.write("\n".join(lines))
