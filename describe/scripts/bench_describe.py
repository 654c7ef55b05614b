#!/usr/bin/env python
"""Time describe's layer walk (per-layer FLOPs included) and the whole description, per model
(a benchmark, not a test).

    cd describe && python -m scripts.bench_describe [--repeats 5]

For timm resnet50 (3x224x224) and Hugging Face GPT-2 small (1024 tokens): the model is built
once on the meta device (not timed), then medians of --repeats runs: the bare layer walk
without and with the per-layer FLOP counter (interleaved in this process, so a busy machine
slows both alike: the difference is the counter's cost), `describe_module` without the
simulation (walk and saved-tensor trace) and with it (batch 32). One thread, as the CLI runs.
Time the whole CLI with `time python -m gpucast_describe ...`.
"""

import argparse
import contextlib
import statistics
import time

import torch

from gpucast_describe import describe_module, walker


def walk_seconds(model, shape, dtype, repeats):
    """Median seconds of the bare layer walk without and with the FLOP counter."""
    example = torch.empty([1, *shape], dtype=dtype, device="meta")
    times = {False: [], True: []}
    for _ in range(repeats + 1):
        for flops in (False, True):
            start = time.perf_counter()
            with (
                walker._Recorder(model) as recorder,
                walker._LayerFlopCounter(recorder) if flops else contextlib.nullcontext(),
                torch.no_grad(),
            ):
                model(example)
            times[flops].append(time.perf_counter() - start)
    return statistics.median(times[False][1:]), statistics.median(times[True][1:])


def resnet50():
    import timm

    return timm.create_model("resnet50"), [3, 224, 224], torch.float32


def gpt2_small():
    from examples import hf_models  # describe/examples, from describe/ (the working directory)

    return hf_models.gpt2_small(), [1024], torch.int64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        "| model | walk without flops (s) | walk with flops (s) | walk + saved tensors (s) "
        "| with simulation at 32 (s) | layers with flops |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, build in (("timm resnet50", resnet50), ("HF GPT-2 small", gpt2_small)):
        with torch.device("meta"):
            model, shape, dtype = build()
        figures = list(walk_seconds(model, shape, dtype, args.repeats))
        for simulation in (False, True):
            describe_module(model, shape, 32, input_dtype=dtype, simulation=simulation)  # warm-up
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                desc = describe_module(model, shape, 32, input_dtype=dtype, simulation=simulation)
                times.append(time.perf_counter() - start)
            figures.append(statistics.median(times))
        counted = sum(1 for layer in desc["layers"] if layer.get("flops"))
        print(f"| {name} | " + " | ".join(f"{f:.3f}" for f in figures) + f" | {counted} |", flush=True)


if __name__ == "__main__":
    main()
