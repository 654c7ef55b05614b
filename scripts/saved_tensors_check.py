#!/usr/bin/env python3
"""Calibration check of src/physics/saved.rs against describe's traced saved tensors.

A Python mirror of the Rust rule, run over data/timm/descriptions.jsonl.gz without the 100 test
models of data/timm/test.jsonl.gz. Each discrete alternative of the rule's constants is scored
by the median |log(derived / traced)|; every architecture family (the model name up to the
first `_` or digit) is held out in turn, the best alternative on the other families chosen and
scored on it. Prints the held-out figure per family and derived / traced per model family.
Needs numpy. Usage: python scripts/saved_tensors_check.py
"""

import collections
import gzip
import itertools
import json
import math
import re
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
KEEPS_INPUT = {
    "linear",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose2d",
    "batch_norm",
    "layer_norm",
    "group_norm",
    "instance_norm",
    "rms_norm",
    "gelu",
    "silu",
    "mish",
    "softplus",
    "elu",
    "selu",
    "hardswish",
    "hardsigmoid",
    "prelu",
    "max_pool",
    "avg_pool",
    "adaptive_avg_pool",
    "adaptive_max_pool",
}
KEEPS_OUTPUT = {"relu", "sigmoid", "tanh", "softmax"}
NORMS = {"batch_norm", "layer_norm", "group_norm", "instance_norm", "rms_norm"}
PASSES_ON = {"identity", "flatten", "dropout", "drop_path"}


def derive(layers, input_elements, c):
    """Elements per sample kept for backward (c: the constants)."""
    keeps_in = KEEPS_INPUT | {k for k in ("relu6", "leaky_relu") if c[k] == "input"}
    keeps_out = KEEPS_OUTPUT | {k for k in ("relu6", "leaky_relu") if c[k] == "output"}
    sizes, kept, extra = [], set(), 0
    cur = trunk = None
    gate = False

    def push(n):
        sizes.append(n)
        return len(sizes) - 1

    holders = 0
    prev_kind = None
    for layer in layers:
        kind, out_size, params = layer["kind"], layer["output_size"], layer["params"]
        if out_size == 0:
            if params > 0 and cur is not None:
                holders += params
            continue
        if holders and c["holder"]:
            if c["holder"] == "vectors" and kind in NORMS and params > 0:
                # A norm's weight and bias give the width: the holder's vectors of that width.
                extra += max(1, min(4, round(holders / (params / 2)))) * out_size
            else:
                extra += (1 if c["holder"] == "vectors" else c["holder"]) * out_size
        holders = 0
        if cur is None:
            cur = trunk = push(input_elements or out_size)
        if kind == "attention":
            extra += c["attention"] * out_size
            continue
        if kind in PASSES_ON and sizes[cur] == out_size:
            continue
        if kind == "other" and sizes[cur] == out_size:
            extra += c["other_with_params"] * out_size if params > 0 else 0
            continue
        if c["gate"] and gate and kind in keeps_in and sizes[trunk] >= 4 * sizes[cur]:
            kept |= {trunk, cur}
            cur = push(sizes[trunk])
        gate = kind in ("sigmoid", "hardsigmoid")
        # A convolution or norm right after a norm, as wide as it, starts a parallel branch
        # (a downsample shortcut, a RepVGG branch) on the block input, which is already kept.
        branch = (
            c["branch"]
            and prev_kind in NORMS
            and sizes[cur] == out_size
            and (kind in NORMS or kind in ("conv1d", "conv2d", "conv3d"))
        )
        prev_kind = kind
        new = push(out_size)
        if kind in keeps_in and not branch:
            kept.add(cur)
        if kind in keeps_out:
            kept.add(new)
        if kind == "max_pool":
            extra += c["max_pool_indices"] * out_size
        if out_size * 16 > sizes[trunk]:
            trunk = new
        cur = new
    return sum(sizes[i] for i in kept) + extra


CHOSEN = dict(
    attention=3,
    max_pool_indices=2,
    other_with_params=1,
    gate=True,
    relu6="input",
    leaky_relu="output",
    holder="vectors",
    branch=True,
)
GRID = [
    dict(attention=a, max_pool_indices=i, other_with_params=o, gate=g, relu6=r, leaky_relu=l, holder=h, branch=b)
    for a, i, o, g, r, l, h, b in itertools.product(
        [2, 3, 4],
        [0, 2],
        [0, 1, 2],
        [True, False],
        ["input", "output"],
        ["input", "output"],
        [0, 1, 2, "vectors"],
        [False, True],
    )
]


def family_of(model):
    return re.split(r"[_0-9]", model.split(":", 1)[1])[0]


def main():
    descriptions = [json.loads(l) for l in gzip.open(ROOT / "data/timm/descriptions.jsonl.gz")]
    test = {json.loads(l)["job"]["model"] for l in gzip.open(ROOT / "data/timm/test.jsonl.gz")}
    train = [d for d in descriptions if d["model"] not in test]

    def log_errors(c, models):
        return np.array(
            [
                abs(
                    math.log(
                        4 * derive(m["layers"], math.prod(m["input_shape"]), c) / m["saved_tensors"]["per_sample_bytes"]
                    )
                )
                for m in models
            ]
        )

    errors = np.array([log_errors(c, train) for c in GRID])
    groups = collections.defaultdict(list)
    for i, m in enumerate(train):
        groups[family_of(m["model"])].append(i)
    held_out = np.zeros(len(train))
    for idxs in groups.values():
        mask = np.ones(len(train), bool)
        mask[idxs] = False
        best = int(np.argmin(np.median(errors[:, mask], axis=1)))
        held_out[idxs] = errors[best, idxs]
    best_all = GRID[int(np.argmin(np.median(errors, axis=1)))]
    print(f"{len(train)} training descriptions, {len(groups)} architecture families")
    print(f"best alternative on all of them: {best_all}; chosen in saved.rs: {CHOSEN}")
    kinds = np.array([m["family"] for m in train])
    for family in ("cnn", "transformer"):
        sel = kinds == family
        print(
            f"{family}: held out by architecture family, median |log ratio| "
            f"{np.median(held_out[sel]):.4f}, p90 {np.percentile(held_out[sel], 90):.4f}"
        )
    for name, models in (("training", train), ("test (not tuned on)", [d for d in descriptions if d["model"] in test])):
        for family in ("cnn", "transformer"):
            ratios = np.array(
                [
                    4
                    * derive(m["layers"], math.prod(m["input_shape"]), CHOSEN)
                    / m["saved_tensors"]["per_sample_bytes"]
                    for m in models
                    if m["family"] == family
                ]
            )
            print(
                f"{name} {family} ({len(ratios)}): derived / traced median {np.median(ratios):.3f}, "
                f"p10 {np.percentile(ratios, 10):.3f}, p90 {np.percentile(ratios, 90):.3f}"
            )


if __name__ == "__main__":
    main()
