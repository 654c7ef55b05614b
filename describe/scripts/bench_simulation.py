#!/usr/bin/env python
"""Time the training-step simulation per model and batch size (a benchmark, not a test).

    python describe/scripts/bench_simulation.py [--repeats 3]

For each model: built once on the meta device (not timed), one warm-up simulation, then the
median of --repeats simulations at the batch size shown (two training steps, the allocator
replay and the min-capacity search included; torch import and model build excluded), with the
allocated and reserved peaks. One thread, as the CLI runs. Prints a Markdown table.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from gpucast_describe import simulate_step  # noqa: E402


def timm(name):
    import timm as t
    return lambda: t.create_model(name)


def gpt2(layers, width, heads):
    def build():
        import transformers
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads))
    return build


def bert_base():
    import transformers
    return transformers.BertForMaskedLM(transformers.BertConfig())


CASES = [
    ("timm resnet50", timm("resnet50"), [3, 224, 224], torch.float32, 64),
    ("timm vit_base_patch16_224", timm("vit_base_patch16_224"), [3, 224, 224], torch.float32, 32),
    ("timm convnext_base", timm("convnext_base"), [3, 224, 224], torch.float32, 32),
    ("HF BERT-base MLM, 128 tokens", bert_base, [128], torch.int64, 32),
    ("HF GPT-2 small, 1024 tokens", gpt2(12, 768, 12), [1024], torch.int64, 8),
    ("HF GPT-2 XL (1.56 B), 512 tokens", gpt2(48, 1600, 25), [512], torch.int64, 2),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | batch | parameters | simulation (median) | allocated peak | reserved peak |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, build, shape, dtype, batch in CASES:
        with torch.device("meta"):
            model = build()
        params = sum(p.numel() for p in model.parameters())
        simulate_step(model, shape, batch, dtype)
        times, sim = [], None
        for _ in range(args.repeats):
            started = time.perf_counter()
            sim = simulate_step(model, shape, batch, dtype)
            times.append(time.perf_counter() - started)
        print("| %s | %d | %.0f M | %.2f s | %.0f MiB | %.0f MiB |" % (
            name, batch, params / 1e6, statistics.median(times), sim["allocated_peak_bytes"] / 2 ** 20,
            sim["reserved_peak_bytes"] / 2 ** 20), flush=True)


if __name__ == "__main__":
    main()
