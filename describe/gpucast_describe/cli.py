"""Command line: print gpucast job descriptions as JSON Lines.

    python -m gpucast_describe timm:resnet50 --batch-size 32
    python -m gpucast_describe torchvision:resnet18 timm:vit_small_patch16_224 --batch-size 8 16 32
    python -m gpucast_describe module:my_models:build --batch-size 64 --input-shape 3,32,32
    python -m gpucast_describe module:my_models:tiny_bert --batch-size 8 --seq-len 128

One line per (spec, batch size), spec-major: each line is the body of `POST /v1/estimate`.
With --batch-body, one body for `POST /v1/estimate/batch` instead: {"items": [those lines]}.
Each spec is described once; the description does not depend on the batch size. Errors go to
stderr and make the exit status non-zero.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from .simulate import ATTENTIONS, LOSSES, OPTIMIZERS, PRECISIONS
from .specs import SpecError, describe_spec_batches


def _shape(text: str) -> List[int]:
    try:
        dims = [int(part) for part in text.replace("x", ",").split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad shape {text!r}: expected e.g. 3,224,224")
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"bad shape {text!r}: expected positive dimensions")
    return dims


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gpucast_describe",
        description="Describe PyTorch models as gpucast job descriptions (JSON Lines on stdout).")
    parser.add_argument("specs", nargs="+", metavar="SPEC",
                        help="timm:<name>, torchvision:<name> or module:<python.path:factory>")
    parser.add_argument("--batch-size", nargs="+", type=_positive, required=True, metavar="N",
                        help="one or more batch sizes")
    inputs = parser.add_mutually_exclusive_group()
    inputs.add_argument("--input-shape", type=_shape, metavar="C,H,W",
                        help="per-sample input shape (default: the model's own; "
                             "torchvision 3,224,224)")
    inputs.add_argument("--seq-len", type=_positive, metavar="L",
                        help="token model: the input is int64 ids of shape [1, L]")
    parser.add_argument("--family", choices=["mlp", "cnn", "transformer"],
                        help="override the inferred family")
    step = parser.add_argument_group(
        "training-step simulation (two steps on meta tensors, replayed through a model of "
        "the CUDA caching allocator; emitted as `simulation`, one per batch size)")
    step.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                      help="the job's optimizer, run as its foreach implementation (default adam)")
    step.add_argument("--precision", choices=PRECISIONS, default="fp32",
                      help="fp32, or mixed16 (CUDA autocast to fp16, fp32 weights)")
    step.add_argument("--loss", choices=LOSSES, default="auto",
                      help="auto: cross-entropy on class or token logits, else the outputs' sum")
    step.add_argument("--attention", choices=ATTENTIONS, default="efficient",
                      help="kernel of F.scaled_dot_product_attention: the GPU's memory-"
                           "efficient one (default), the math path (keeps N x N), or eager "
                           "(math, and Hugging Face models on their eager attention)")
    parser.add_argument("--batch-body", action="store_true",
                        help="print one body for POST /v1/estimate/batch ({\"items\": [...]}) "
                             "instead of one line per job for POST /v1/estimate")
    step.add_argument("--no-simulation", dest="simulation", action="store_false",
                      help="skip the simulation (layers and saved tensors only)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    import torch  # after argument parsing, so that --help is quick

    torch.set_num_threads(1)  # nothing is computed on the meta device
    failures = 0
    items = []
    for spec in args.specs:
        try:
            descriptions = describe_spec_batches(
                spec, args.batch_size, input_shape=args.input_shape, seq_len=args.seq_len,
                family=args.family, simulation=args.simulation, optimizer=args.optimizer,
                precision=args.precision, loss=args.loss, attention=args.attention)
        except SpecError as exc:
            print(f"error: {exc}", file=sys.stderr)
            failures += 1
            continue
        except Exception as exc:  # a model that cannot be built or run on meta
            print(f"error: {spec}: {type(exc).__name__}: {exc}", file=sys.stderr)
            failures += 1
            continue
        if args.batch_body:
            items.extend(descriptions)
            continue
        for description in descriptions:
            sys.stdout.write(json.dumps(description, separators=(",", ":")) + "\n")
        sys.stdout.flush()
    if args.batch_body and items:
        sys.stdout.write(json.dumps({"items": items}, separators=(",", ":")) + "\n")
        sys.stdout.flush()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
