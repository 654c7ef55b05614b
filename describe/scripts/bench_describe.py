#!/usr/bin/env python
"""Time describe's layer walk (per-layer FLOPs included) and the whole description, per model
(a benchmark, not a test).

    python describe/scripts/bench_describe.py [--repeats 5]

For timm resnet50 (3x224x224) and Hugging Face GPT-2 small (1024 tokens): the model is built
once on the meta device (not timed), then the median of --repeats runs of `describe_module`
without the simulation (the layer walk and the saved-tensor trace) and with it (batch 32).
One thread, as the CLI runs. Time the whole CLI with `time python -m gpucast_describe ...`.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "examples"))

import torch  # noqa: E402

from gpucast_describe import describe_module  # noqa: E402


def resnet50():
    import timm
    return timm.create_model("resnet50"), [3, 224, 224], torch.float32


def gpt2_small():
    import hf_models
    return hf_models.gpt2_small(), [1024], torch.int64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | walk + saved tensors (s) | with simulation at 32 (s) | layers with flops |")
    print("| --- | --- | --- | --- |")
    for name, build in (("timm resnet50", resnet50), ("HF GPT-2 small", gpt2_small)):
        with torch.device("meta"):
            model, shape, dtype = build()
        figures = []
        for simulation in (False, True):
            describe_module(model, shape, 32, input_dtype=dtype, simulation=simulation)  # warm-up
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                desc = describe_module(model, shape, 32, input_dtype=dtype, simulation=simulation)
                times.append(time.perf_counter() - start)
            figures.append(statistics.median(times))
        counted = sum(1 for layer in desc["layers"] if layer.get("flops"))
        print(f"| {name} | {figures[0]:.3f} | {figures[1]:.3f} | {counted} |", flush=True)


if __name__ == "__main__":
    main()
