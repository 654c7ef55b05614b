#!/usr/bin/env python
"""Describe every distinct timm model of the training CSV, once, on the meta device.

    cd describe && python -m scripts.describe_timm_training_set \
        [--csv ../shared/data/timm_a100_train.csv] [--out data/timm] [--limit N] [--models a,b]

Writes <out>/descriptions.jsonl.gz (one job description per line, batch_size 1, sorted by model
name; the description does not depend on the batch size; ``saved_tensors`` is per sample plus a
fixed part) and <out>/PROVENANCE.md (command, versions, sha256 of the CSV, counts, failures,
models without ``saved_tensors``, timings). Models that cannot be built or run on the meta
device are recorded and skipped; a model whose saved tensors cannot be traced keeps its
description without the field, and the reason is recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import gzip
import io
import hashlib
import json
import platform
import shlex
import signal
import statistics
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch

from gpucast_describe import describe_module, resolve_spec, total_params

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
# The measured data beside the repository (read-only; ../shared/data/README.md).
DEFAULT_CSV = str(REPO.parent / "shared" / "data" / "timm_a100_train.csv")
PER_MODEL_TIMEOUT_S = 600


class ModelTimeout(BaseException):
    """Not an Exception, so that the saved-tensor trace's fallback does not swallow it."""


def _on_alarm(signum, frame):
    raise ModelTimeout(f"took more than {PER_MODEL_TIMEOUT_S} s")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def distinct_models(csv_path: Path) -> list:
    with open(csv_path, newline="") as handle:
        return sorted({row["model"] for row in csv.DictReader(handle)})


def describe_one(name: str) -> tuple:
    """The description of timm:<name> at batch size 1, with its parameter count checked, and
    what ``describe_module`` wrote to stderr (the reason when ``saved_tensors`` is missing).

    Same result as ``python -m gpucast_describe timm:<name> --batch-size 1``.
    """
    resolved = resolve_spec(f"timm:{name}")
    if resolved.default_input_shape is None:
        raise ValueError("no input_size in the model's pretrained_cfg")
    captured = io.StringIO()
    with contextlib.redirect_stderr(captured):
        description = describe_module(resolved.module, resolved.default_input_shape, 1, name=resolved.spec)
    warnings = captured.getvalue().strip()
    if warnings:
        print(warnings, file=sys.stderr, flush=True)
    # The invariant the service relies on: the layers' params sum to the model's total.
    model_total = total_params(resolved.module)
    layer_total = sum(layer["params"] for layer in description["layers"])
    if layer_total != model_total:
        raise AssertionError(f"layer params sum to {layer_total}, model has {model_total}")
    return description, warnings


def write_provenance(
    path: Path,
    *,
    command: str,
    csv_path: Path,
    csv_sha: str,
    n_models: int,
    described: dict,
    failures: dict,
    untraced: dict,
    timings: dict,
    wall_s: float,
) -> None:
    import timm

    times = sorted(timings.values())
    slowest = sorted(timings.items(), key=lambda kv: -kv[1])[:5]
    families: dict = {}
    for description in described.values():
        families[description["family"]] = families.get(description["family"], 0) + 1
    n_layers = [len(d["layers"]) for d in described.values()]
    lines = [
        "# data/timm/descriptions.jsonl.gz: provenance",
        "",
        "Job descriptions (the body of `POST /v1/estimate`, `batch_size` set to 1) of every",
        f"distinct model of `{csv_path.name}`, produced by the `gpucast_describe` package on the",
        "meta device (no weights, no GPU). One JSON object per line, sorted by model name; the",
        "`model` field is `timm:<name>`. Descriptions do not depend on the batch size: set",
        "`batch_size` to the CSV row's value to get that row's request.",
        "",
        "## How it was made",
        "",
        "```",
        command,
        "```",
        "",
        f"- generated: {datetime.now(timezone.utc).replace(microsecond=0).isoformat()}",
        f"- source: `{os.path.basename(csv_path)}` (../shared/data), sha256 `{csv_sha}`",
        f"- python {platform.python_version()}, torch {torch.__version__}, timm {timm.__version__}",
        "- input: each model's `pretrained_cfg['input_size']`, one meta tensor `[1, *input_size]`,",
        "  one forward pass in training mode (batch norms in eval mode) under `torch.no_grad()`",
        "  for the layers",
        "- `saved_tensors` (`per_sample_bytes`, `fixed_bytes`): the bytes of the tensors autograd",
        "  saves for backward in one training-mode forward pass (batch norms in eval mode), fp32,",
        "  parameters and buffers left out, each storage once; two more meta forward passes with",
        "  autograd and a `saved_tensors_hooks` pack hook, at batch 2 and 4: `per_sample_bytes =",
        "  round((saved(4) - saved(2)) / 2)`, `fixed_bytes = max(0, saved(2) - 2 * per_sample_bytes)`,",
        "  so `saved(B) = fixed_bytes + per_sample_bytes * B`; in those passes",
        "  `F.scaled_dot_product_attention` runs as a GPU runs it in fp32, as the memory-efficient",
        "  kernel (`aten._scaled_dot_product_efficient_attention`: q, k, v, output, log-sum-exp,",
        "  nothing N x N), except for inputs that kernel refuses (5-D, fewer k/v heads, unaligned",
        "  head dims), which keep the math path; attention written out by hand keeps its N x N",
        "  tensors (see describe/README.md)",
        "- same output as `python -m gpucast_describe timm:<name> --batch-size 1`",
        "",
        "## Result",
        "",
        f"- distinct models in the CSV: {n_models}",
        f"- described: {len(described)}",
        f"- failed: {len(failures)}",
        "- families: " + ", ".join(f"{k} {v}" for k, v in sorted(families.items())),
    ]
    if n_layers:
        lines.append(
            f"- layers per model: min {min(n_layers)}, median {int(statistics.median(n_layers))}, max {max(n_layers)}"
        )
    lines.append("- every description's layer `params` sum to the model's parameter count (checked per model)")
    traced = [d["saved_tensors"] for d in described.values() if "saved_tensors" in d]
    lines.append(
        f"- `saved_tensors`: in {len(traced)} of {len(described)} descriptions"
        + (f" ({len(untraced)} without, see below)" if untraced else "")
    )
    if traced:
        mib = 2**20
        per_sample = sorted(t["per_sample_bytes"] / mib for t in traced)
        fixed = sorted(t["fixed_bytes"] / mib for t in traced)
        lines.append(
            f"  - per_sample_bytes: min {per_sample[0]:.1f} MiB, median "
            f"{statistics.median(per_sample):.1f} MiB, max {per_sample[-1]:.1f} MiB"
        )
        lines.append(
            f"  - fixed_bytes: above 1 MiB in {sum(f > 1 for f in fixed)} models, "
            f"median {statistics.median(fixed):.2f} MiB, max {fixed[-1]:.1f} MiB "
            "(e.g. weights standardised in the forward pass)"
        )
    if times:
        lines += [
            f"- time per model (build + layer walk + saved-tensor trace + check, 1 CPU "
            f"thread): median "
            f"{statistics.median(times):.2f} s, mean {statistics.mean(times):.2f} s, max "
            f"{times[-1]:.2f} s; total wall {wall_s / 60:.1f} min",
            "- slowest: " + ", ".join(f"{name} {secs:.1f} s" for name, secs in slowest),
        ]
    lines += ["", "## Failures", ""]
    if failures:
        lines += [f"- `{name}`: {reason}" for name, reason in sorted(failures.items())]
    else:
        lines.append("None.")
    lines += ["", "## Descriptions without saved_tensors", ""]
    if untraced:
        lines += [f"- `{name}`: {reason}" for name, reason in sorted(untraced.items())]
    else:
        lines.append("None.")
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--csv", type=Path, default=Path(DEFAULT_CSV))
    parser.add_argument("--out", type=Path, default=REPO / "data" / "timm")
    parser.add_argument("--limit", type=int, help="only the first N models (for a quick try)")
    parser.add_argument("--models", help="comma-separated subset of model names")
    args = parser.parse_args()

    torch.set_num_threads(1)
    signal.signal(signal.SIGALRM, _on_alarm)
    command = "cd describe && python -m scripts.describe_timm_training_set " + shlex.join(sys.argv[1:])

    models = distinct_models(args.csv)
    n_models = len(models)
    if args.models:
        wanted = set(args.models.split(","))
        models = [m for m in models if m in wanted]
    if args.limit:
        models = models[: args.limit]

    described, failures, untraced, timings = {}, {}, {}, {}
    started = time.perf_counter()
    for i, name in enumerate(models, 1):
        t0 = time.perf_counter()
        signal.alarm(PER_MODEL_TIMEOUT_S)
        try:
            described[name], warnings = describe_one(name)
            status = f"{len(described[name]['layers'])} layers"
            if "saved_tensors" in described[name]:
                saved = described[name]["saved_tensors"]
                status += (
                    f", saved {saved['per_sample_bytes'] / 2**20:.1f} MiB/sample"
                    f" + {saved['fixed_bytes'] / 2**20:.1f} MiB"
                )
            else:
                untraced[name] = (warnings.splitlines()[-1] if warnings else "no saved_tensors")[:300]
                status += ", no saved_tensors"
        except (Exception, ModelTimeout) as exc:  # record and move on
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            failures[name] = reason[:300]
            status = "FAILED " + failures[name]
            traceback.print_exc(file=sys.stderr)
        finally:
            signal.alarm(0)
        timings[name] = time.perf_counter() - t0
        print(f"[{i}/{len(models)}] {name}: {status} ({timings[name]:.2f} s)", file=sys.stderr, flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    out_file = args.out / "descriptions.jsonl.gz"
    with open(out_file, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as handle:
        for name in sorted(described):
            handle.write((json.dumps(described[name], separators=(",", ":")) + "\n").encode())
    write_provenance(
        args.out / "PROVENANCE.md",
        command=command,
        csv_path=args.csv,
        csv_sha=sha256_of(args.csv),
        n_models=n_models,
        described=described,
        failures=failures,
        untraced=untraced,
        timings=timings,
        wall_s=time.perf_counter() - started,
    )
    print(
        f"wrote {out_file}: {len(described)} described, {len(failures)} failed, {len(untraced)} without saved_tensors",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
