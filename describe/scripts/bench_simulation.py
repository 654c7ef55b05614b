#!/usr/bin/env python
"""Time the training-step simulation per model and batch size (a benchmark, not a test).

    cd describe && python -m scripts.bench_simulation [--repeats 3]
    cd describe && python -m scripts.bench_simulation --llama-8b [--repeats 3]

For each model: built once on the meta device (not timed), one warm-up simulation, then the
median of --repeats simulations at the batch size shown (two training steps, the allocator
replay and the min-capacity search included; torch import and model build excluded), with the
allocated and reserved peaks. One thread, as the CLI runs. Prints a Markdown table.

--llama-8b: Llama-3-8B (transformers' LlamaConfig: hidden 4096, 32 layers, 32 heads, 8 KV
heads, intermediate 14336, vocabulary 128256, untied) at 2048 tokens, micro-batch 1, in the
training setups people run it with (pure bf16 and amp_bf16 AdamW, with and without gradient
accumulation, activation checkpointing, LoRA, QLoRA): the issue's budget is 2 s a job. The
seconds are wall-clock (also the process's CPU seconds: on a loaded machine the wall-clock
time includes waiting for a core).
"""

import argparse
import statistics
import time

import torch

from gpucast_describe import simulate_step


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


def llama_3_8b():
    import transformers

    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            vocab_size=128256,
            tie_word_embeddings=False,
            max_position_embeddings=8192,
        )
    )


LORA = {"rank": 16, "alpha": 32, "target_modules": "all-linear"}
LLAMA_SETUPS = [
    ("fp32 adamw", dict(precision="fp32", optimizer="adamw")),
    ("bf16 adamw", dict(precision="bf16", optimizer="adamw")),
    ("amp_bf16 adamw", dict(precision="amp_bf16", optimizer="adamw")),
    ("bf16 adamw, accumulation 4", dict(precision="bf16", optimizer="adamw", gradient_accumulation_steps=4)),
    ("amp_bf16 adamw, accumulation 4", dict(precision="amp_bf16", optimizer="adamw", gradient_accumulation_steps=4)),
    ("bf16 adamw, checkpointing full", dict(precision="bf16", optimizer="adamw", activation_checkpointing="full")),
    (
        "amp_bf16 adamw, checkpointing full",
        dict(precision="amp_bf16", optimizer="adamw", activation_checkpointing="full"),
    ),
    ("bf16 LoRA r16 all-linear, adamw", dict(precision="bf16", optimizer="adamw", lora=LORA)),
    (
        "bf16 QLoRA nf4 r16, checkpointing full, paged_adamw",
        dict(
            precision="bf16",
            optimizer="paged_adamw",
            activation_checkpointing="full",
            lora={**LORA, "base_weights": "nf4"},
        ),
    ),
    (
        "amp_bf16 adamw_8bit, accumulation 4, checkpointing full",
        dict(
            precision="amp_bf16", optimizer="adamw_8bit", gradient_accumulation_steps=4, activation_checkpointing="full"
        ),
    ),
]


def bench_llama(repeats):
    with torch.device("meta"):
        model = llama_3_8b()
    params = sum(p.numel() for p in model.parameters())
    print(
        "Llama-3-8B (%.2f B parameters), 2048 tokens, micro-batch 1, %d repeats after a "
        "warm-up\n" % (params / 1e9, repeats)
    )
    print("| setup | simulation (median) | CPU (median) | allocated peak | reserved peak | trainable |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, setup in LLAMA_SETUPS:
        simulate_step(model, [2048], 1, torch.int64, **setup)
        times, cpu, sim = [], [], None
        for _ in range(repeats):
            started, started_cpu = time.perf_counter(), time.process_time()
            sim = simulate_step(model, [2048], 1, torch.int64, **setup)
            times.append(time.perf_counter() - started)
            cpu.append(time.process_time() - started_cpu)
        print(
            "| %s | %.2f s | %.2f s | %.0f MiB | %.0f MiB | %d |"
            % (
                name,
                statistics.median(times),
                statistics.median(cpu),
                sim["allocated_peak_bytes"] / 2**20,
                sim["reserved_peak_bytes"] / 2**20,
                sim["trainable_params"],
            ),
            flush=True,
        )


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
    parser.add_argument(
        "--llama-8b", action="store_true", help="Llama-3-8B in the training setups instead of the model list"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.llama_8b:
        bench_llama(args.repeats)
        return
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
        print(
            "| %s | %d | %.0f M | %.2f s | %.0f MiB | %.0f MiB |"
            % (
                name,
                batch,
                params / 1e6,
                statistics.median(times),
                sim["allocated_peak_bytes"] / 2**20,
                sim["reserved_peak_bytes"] / 2**20,
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
