"""Command line: print gpucast job descriptions as JSON Lines.

    python -m gpucast_describe timm:resnet50 --batch-size 32
    python -m gpucast_describe torchvision:resnet18 timm:vit_small_patch16_224 --batch-size 8 16 32
    python -m gpucast_describe module:my_models:build --batch-size 64 --input-shape 3,32,32
    python -m gpucast_describe module:my_models:tiny_bert --batch-size 8 --seq-len 128
    python -m gpucast_describe hf:./my-llama --batch-size 2 --seq-len 512

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

from .adapters import BASE_WEIGHTS as LORA_BASE_WEIGHTS
from .adapters import PEFT_DEFAULT_ALPHA as LORA_DEFAULT_ALPHA
from .simulate import ATTENTIONS, LOSSES, OPTIMIZER_IMPLEMENTATIONS, OPTIMIZERS, PRECISIONS
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


def _names(text: str) -> List[str]:
    names = [part.strip() for part in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"bad name list {text!r}: expected name,name,...")
    return names


def _checkpointing(text: str):
    return text if text in ("none", "full") else _names(text)


def _lora_targets(text: str):
    return text if text == "all-linear" else _names(text)


def _positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return int(value) if value.is_integer() else value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gpucast_describe",
        description="Describe PyTorch models as gpucast job descriptions (JSON Lines on stdout).",
    )
    parser.add_argument(
        "specs",
        nargs="+",
        metavar="SPEC",
        help="timm:<name>, torchvision:<name>, module:<python.path:factory> "
        "or hf:<model id or folder> (its config.json, from the folder or "
        "the local Hugging Face cache; never downloaded)",
    )
    parser.add_argument(
        "--batch-size", nargs="+", type=_positive, required=True, metavar="N", help="one or more batch sizes"
    )
    inputs = parser.add_mutually_exclusive_group()
    inputs.add_argument(
        "--input-shape",
        type=_shape,
        metavar="C,H,W",
        help="per-sample input shape (default: the model's own; torchvision 3,224,224)",
    )
    inputs.add_argument(
        "--seq-len", type=_positive, metavar="L", help="token model: the input is int64 ids of shape [1, L]"
    )
    parser.add_argument("--family", choices=["mlp", "cnn", "transformer"], help="override the inferred family")
    step = parser.add_argument_group(
        "training-step simulation (two steps on meta tensors, replayed through a model of "
        "the CUDA caching allocator; emitted as `simulation`, one per batch size)"
    )
    step.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adam",
        help="the job's optimizer (default adam); adam_8bit, adamw_8bit, "
        "paged_adamw, paged_adamw_8bit: bitsandbytes' (emulated)",
    )
    step.add_argument(
        "--optimizer-implementation",
        choices=OPTIMIZER_IMPLEMENTATIONS,
        default="foreach",
        help="PyTorch optimizers' implementation (default foreach, the GPU default; fused; for_loop)",
    )
    step.add_argument(
        "--precision",
        choices=PRECISIONS + ("mixed16",),
        default="fp32",
        help="fp32; tf32 (fp32 memory); amp_fp16 / amp_bf16 (CUDA autocast, fp32 "
        "weights; mixed16 = amp_fp16); bf16 / fp16 (pure: the model in 16 "
        "bits; fp16 with a loss scaler)",
    )
    step.add_argument(
        "--gradient-accumulation-steps",
        type=_positive,
        default=1,
        metavar="K",
        help="micro-batches per optimizer step: --batch-size is then the "
        "micro-batch, the job's batch_size K times it (default 1)",
    )
    step.add_argument(
        "--activation-checkpointing",
        type=_checkpointing,
        default="none",
        metavar="none|full|NAME,NAME",
        help="none (default), full (every block of the model's repeated blocks) or module names",
    )
    step.add_argument(
        "--lora-rank",
        type=_positive,
        metavar="R",
        help="LoRA adapters of rank R on the --lora-targets (the base frozen)",
    )
    step.add_argument(
        "--lora-alpha", type=_positive_number, metavar="A", help=f"LoRA alpha (default {LORA_DEFAULT_ALPHA}, PEFT's)"
    )
    step.add_argument(
        "--lora-targets",
        type=_lora_targets,
        metavar="NAME,NAME|all-linear",
        help="the LoRA target modules (default all-linear: every linear layer but the output head)",
    )
    step.add_argument(
        "--lora-dropout",
        type=float,
        metavar="P",
        help="PEFT's lora_dropout (default 0): above 0 each adapted layer keeps its dropped input for backward",
    )
    step.add_argument(
        "--lora-base",
        choices=LORA_BASE_WEIGHTS,
        help="the frozen base's weights: same (default), int8 (LLM.int8) or nf4 (QLoRA)",
    )
    step.add_argument(
        "--trainable",
        type=_names,
        metavar="NAME,NAME",
        help="train only these modules (name prefixes), the rest frozen",
    )
    step.add_argument(
        "--loss",
        choices=LOSSES,
        default="auto",
        help="auto: cross-entropy on class or token logits, else the outputs' sum",
    )
    step.add_argument(
        "--attention",
        choices=ATTENTIONS,
        default="efficient",
        help="kernel of F.scaled_dot_product_attention: the GPU's memory-"
        "efficient one (default), the math path (keeps N x N), or eager "
        "(math, and Hugging Face models on their eager attention)",
    )
    parser.add_argument(
        "--batch-body",
        action="store_true",
        help='print one body for POST /v1/estimate/batch ({"items": [...]}) '
        "instead of one line per job for POST /v1/estimate",
    )
    step.add_argument(
        "--no-simulation",
        dest="simulation",
        action="store_false",
        help="skip the simulation (layers and saved tensors only)",
    )
    return parser


def _lora(args: argparse.Namespace, parser: argparse.ArgumentParser):
    if args.lora_rank is None:
        given = [
            flag
            for flag, value in (
                ("--lora-alpha", args.lora_alpha),
                ("--lora-targets", args.lora_targets),
                ("--lora-dropout", args.lora_dropout),
                ("--lora-base", args.lora_base),
            )
            if value is not None
        ]
        if given:
            parser.error(f"{', '.join(given)} without --lora-rank")
        return None
    lora = {
        "rank": args.lora_rank,
        "target_modules": args.lora_targets or "all-linear",
        "base_weights": args.lora_base or "same",
    }
    if args.lora_alpha is not None:
        lora["alpha"] = args.lora_alpha
    if args.lora_dropout:
        lora["dropout"] = args.lora_dropout
    return lora


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    lora = _lora(args, parser)
    from .simulate import normalise_setup

    try:  # the setup is the same for every spec: checked once (names: per model)
        normalise_setup(
            optimizer=args.optimizer,
            precision=args.precision,
            optimizer_implementation=args.optimizer_implementation,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            activation_checkpointing=args.activation_checkpointing,
            lora=lora,
            trainable=args.trainable,
        )
    except ValueError as exc:
        parser.error(str(exc))
    import torch  # after argument parsing, so that --help is quick

    torch.set_num_threads(1)  # nothing is computed on the meta device
    failures = 0
    items = []
    for spec in args.specs:
        try:
            descriptions = describe_spec_batches(
                spec,
                args.batch_size,
                input_shape=args.input_shape,
                seq_len=args.seq_len,
                family=args.family,
                simulation=args.simulation,
                optimizer=args.optimizer,
                precision=args.precision,
                loss=args.loss,
                attention=args.attention,
                optimizer_implementation=args.optimizer_implementation,
                gradient_accumulation_steps=args.gradient_accumulation_steps,
                activation_checkpointing=args.activation_checkpointing,
                lora=lora,
                trainable=args.trainable,
            )
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
