#!/usr/bin/env python
"""One timm model per timm architecture module, for describe's tests; and a sweep that runs
describe (layer walk, saved-tensor trace, simulation) on models and lists the failures.

    # write describe/tests/timm_architectures.txt (the test's list)
    cd describe && python -m scripts.timm_architectures select [--out PATH]
    # describe + simulate models (the list's by default, --all: every timm model) at batch 2
    cd describe && python -m scripts.timm_architectures sweep [--all | --models a,b] [--batch-size 2]
        [--timeout-s 300] [--jsonl PATH]

``select``: for every module of ``timm.list_modules()`` (a model-entrypoint module:
``timm/models/<module>.py``), every model of ``timm.list_models(module=...)`` is built on the
meta device (no weights) and the one with the fewest parameters is kept (ties: fewer input
pixels, ``pretrained_cfg['input_size']``, then the name), the cheapest to walk and simulate
in practice. The list records the timm and torch versions; the test checks it covers every
module of the installed timm.

``sweep``: per model, what ``python -m gpucast_describe timm:<name> --batch-size B`` does
(walk at batch 1, saved tensors at batch 2 and 4, two simulated training steps at B, fp32
Adam), in this process, one model at a time, with a per-model time limit; a model fails when
it raises, or when its description lacks ``saved_tensors`` or ``simulation`` (describe leaves
those out with a warning rather than raising), or when its layers' params do not sum to the
model's. One line per model on stderr; ``--jsonl`` writes ``{"model", "module", "ok",
"reason", "seconds"}`` lines.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import platform
import shlex
import signal
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DEFAULT_LIST = HERE.parent / "tests" / "timm_architectures.txt"


class ModelTimeout(BaseException):
    """Not an Exception, so that describe's own fallbacks do not swallow it."""


def _on_alarm(signum, frame):
    raise ModelTimeout("time limit")


@contextlib.contextmanager
def time_limit(seconds: int):
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def model_modules() -> dict:
    """timm model name -> its entrypoint module."""
    import timm

    return {name: module for module in timm.list_modules() for name in timm.list_models(module=module)}


def read_list(path: Path = DEFAULT_LIST) -> list:
    """The (module, model) pairs of a list written by ``select``."""
    pairs = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            module, model = line.split()
            pairs.append((module, model))
    return pairs


def size_of(name: str) -> tuple:
    """(parameters, input pixels) of a timm model built on meta."""
    import timm

    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False)
    cfg = getattr(model, "pretrained_cfg", None) or {}
    pixels = math.prod(cfg.get("input_size") or (0,))
    return sum(p.numel() for p in model.parameters()), pixels


def select(out: Path, timeout_s: int) -> int:
    import timm

    command = "cd describe && python -m scripts.timm_architectures " + shlex.join(sys.argv[1:])
    chosen, unbuildable = [], []
    started = time.perf_counter()
    for module in sorted(timm.list_modules()):
        sizes = {}
        for name in timm.list_models(module=module):
            try:
                with time_limit(timeout_s):
                    sizes[name] = size_of(name)
            except (Exception, ModelTimeout) as exc:
                unbuildable.append(f"{name}: {type(exc).__name__}: {str(exc)[:120]}")
        if not sizes:
            print(f"{module}: no model builds on meta", file=sys.stderr, flush=True)
            continue
        best = min(sizes, key=lambda n: (*sizes[n], n))
        chosen.append((module, best, *sizes[best], len(sizes)))
        print(f"{module}: {best} ({sizes[best][0]:,} params, of {len(sizes)} models)", file=sys.stderr, flush=True)
    lines = [
        "# One timm model per timm architecture (model-entrypoint) module: the one with the",
        "# fewest parameters (ties: fewer input pixels, then the name), built on meta.",
        "# Read by tests/test_timm_architectures.py. Regenerate with:",
        f"#   {command}",
        f"# timm {timm.__version__}, torch {torch.__version__}, python "
        f"{platform.python_version()}: {len(chosen)} modules, "
        f"{sum(c[4] for c in chosen)} models; selection took "
        f"{time.perf_counter() - started:.0f} s",
        "# columns: module model  # parameters, input size",
    ]
    for module, best, params, pixels, _ in chosen:
        lines.append(f"{module} {best}  # {params:,} params, {pixels:,} input values")
    for entry in unbuildable:
        lines.append(f"# not built on meta: {entry}")
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}: {len(chosen)} modules", file=sys.stderr)
    return 0


def check(name: str, batch_size: int) -> str:
    """'' when timm:<name> describes and simulates at ``batch_size``, else the reason."""
    from gpucast_describe import describe_module, resolve_spec, total_params

    resolved = resolve_spec(f"timm:{name}")
    if resolved.default_input_shape is None:
        return "no input_size in the model's pretrained_cfg"
    captured = io.StringIO()
    with contextlib.redirect_stderr(captured):
        description = describe_module(resolved.module, resolved.default_input_shape, batch_size, name=resolved.spec)
    warnings = " | ".join(captured.getvalue().strip().splitlines())
    if "saved_tensors" not in description or "simulation" not in description:
        return warnings or "saved_tensors or simulation missing"
    layer_params = sum(layer["params"] for layer in description["layers"])
    if layer_params != total_params(resolved.module):
        return f"layer params sum to {layer_params}, the model has {total_params(resolved.module)}"
    return ""


def sweep(models: list, batch_size: int, timeout_s: int, jsonl) -> int:
    modules = model_modules()
    failures = 0
    started = time.perf_counter()
    for i, name in enumerate(models, 1):
        t0 = time.perf_counter()
        try:
            with time_limit(timeout_s):
                reason = check(name, batch_size)
        except ModelTimeout:
            reason = f"took more than {timeout_s} s"
        except Exception as exc:  # record and move on
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            reason = f"{type(exc).__name__}: {text}"
        seconds = time.perf_counter() - t0
        failures += bool(reason)
        print(
            f"[{i}/{len(models)}] {modules.get(name)} {name}: "
            f"{'FAILED ' + reason[:400] if reason else 'ok'} ({seconds:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
        if jsonl is not None:
            jsonl.write(
                json.dumps(
                    {
                        "model": name,
                        "module": modules.get(name),
                        "ok": not reason,
                        "reason": reason[:1000],
                        "seconds": round(seconds, 2),
                    }
                )
                + "\n"
            )
            jsonl.flush()
    print(f"{len(models)} models, {failures} failed, {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sel = sub.add_parser("select")
    sel.add_argument("--out", type=Path, default=DEFAULT_LIST)
    sel.add_argument("--timeout-s", type=int, default=120)
    run = sub.add_parser("sweep")
    run.add_argument("--list", type=Path, default=DEFAULT_LIST)
    run.add_argument("--all", action="store_true", help="every timm model")
    run.add_argument("--models", help="comma-separated model names")
    run.add_argument("--skip", help="comma-separated model names to leave out")
    run.add_argument("--batch-size", type=int, default=2)
    run.add_argument("--timeout-s", type=int, default=300)
    run.add_argument("--jsonl", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.command == "select":
        return select(args.out, args.timeout_s)
    if args.models:
        models = args.models.split(",")
    elif args.all:
        models = sorted(model_modules())
    else:
        models = [model for _, model in read_list(args.list)]
    if args.skip:
        skip = set(args.skip.split(","))
        models = [m for m in models if m not in skip]
    with open(args.jsonl, "a") if args.jsonl else contextlib.nullcontext() as jsonl:
        return sweep(models, args.batch_size, args.timeout_s, jsonl)


if __name__ == "__main__":
    sys.exit(main())
