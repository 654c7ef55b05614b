#!/usr/bin/env python
"""Check the simulated training step against a real GPU (run it where `device` lends one).

    cd describe && python3 -m scripts.gpu_check --out "$OUT"         # on the GPU machine, ~3 min
    cd describe && python -m scripts.gpu_check --dry-run --only 19   # here: code paths on the CPU

From describe/, so that gpucast_describe and examples/hf_models.py import without installing
anything (the device image has neither).

The device image's python3 has torch, torchvision, timm and transformers (other versions than
the workspace lock (uv.lock) pins: say which in the results). The dry run of all 20 jobs
passes here except GPT-2 XL, whose real fp32 Adam step needs ~25 GB of host memory.

For each job of JOBS, in a fresh subprocess (a clean allocator and its own CUDA context): the
model is built on the GPU with random weights and trained for the simulation's two steps
(forward, the same loss, backward, the same foreach optimizer step, zero_grad, under CUDA
autocast for mixed16), then torch.cuda.max_memory_allocated / max_memory_reserved and the
device's used memory (nvidia-smi) are read. The same job is simulated by gpucast_describe on
meta tensors. Writes <out>/gpu_check.jsonl (one line a job) and <out>/gpu_check.md (the table:
simulated vs measured allocated and reserved peaks, and the device total against reserved +
the context that gpucast's manifest fitted). --dry-run runs the same steps on the CPU with
tiny batches and no memory readings, to check that every job builds and trains.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (name, builder spec, per-sample input shape or seq len, batch, optimizer, precision, attention)
JOBS = [
    ("timm resnet50", "timm:resnet50", [3, 224, 224], 64, "adam", "fp32", "efficient"),
    ("timm resnet18", "timm:resnet18", [3, 224, 224], 128, "adam", "fp32", "efficient"),
    ("timm vit_base_patch16_224", "timm:vit_base_patch16_224", [3, 224, 224], 32, "adam", "fp32", "efficient"),
    ("timm convnext_tiny", "timm:convnext_tiny", [3, 224, 224], 32, "adam", "fp32", "efficient"),
    ("timm efficientnet_b0", "timm:efficientnet_b0", [3, 224, 224], 64, "adam", "fp32", "efficient"),
    ("timm mobilenetv3_large_100", "timm:mobilenetv3_large_100", [3, 224, 224], 128, "adam", "fp32", "efficient"),
    (
        "timm swin_tiny_patch4_window7_224",
        "timm:swin_tiny_patch4_window7_224",
        [3, 224, 224],
        32,
        "adam",
        "fp32",
        "efficient",
    ),
    ("timm deit_small_patch16_224", "timm:deit_small_patch16_224", [3, 224, 224], 64, "adam", "fp32", "efficient"),
    ("timm densenet121", "timm:densenet121", [3, 224, 224], 32, "adam", "fp32", "efficient"),
    ("timm regnety_016", "timm:regnety_016", [3, 224, 224], 64, "adam", "fp32", "efficient"),
    ("torchvision vgg16", "torchvision:vgg16", [3, 224, 224], 64, "adam", "fp32", "efficient"),
    ("torchvision resnet50 sgd", "torchvision:resnet50", [3, 224, 224], 32, "sgd", "fp32", "efficient"),
    (
        "torchvision resnet50 momentum mixed16",
        "torchvision:resnet50",
        [3, 224, 224],
        64,
        "momentum",
        "mixed16",
        "efficient",
    ),
    ("torchvision vit_l_16", "torchvision:vit_l_16", [3, 224, 224], 8, "adamw", "fp32", "efficient"),
    ("HF BERT-base MLM 128 tokens", "module:hf_models:bert_base_mlm", [128], 32, "adamw", "fp32", "efficient"),
    ("HF BERT-base MLM 128 tokens eager", "module:hf_models:bert_base_mlm", [128], 32, "adamw", "fp32", "eager"),
    ("HF BERT-base MLM mixed16", "module:hf_models:bert_base_mlm", [128], 32, "adamw", "mixed16", "efficient"),
    (
        "HF BERT-large classifier 512 tokens",
        "module:hf_models:bert_large_classifier",
        [512],
        4,
        "adamw",
        "fp32",
        "efficient",
    ),
    ("HF GPT-2 small 512 tokens", "module:hf_models:gpt2_small", [512], 8, "adamw", "fp32", "efficient"),
    ("HF GPT-2 XL 512 tokens", "module:hf_models:gpt2_xl", [512], 2, "adam", "fp32", "efficient"),
    ("HF TinyLlama 1.1B 1024 tokens mixed16", "module:hf_models:tinyllama", [1024], 4, "adamw", "mixed16", "efficient"),
    ("HF T5-small 512 tokens", "module:hf_models:t5_small", [512], 16, "adamw", "fp32", "efficient"),
]


def measure(index, device, dry_run):
    """One job trained for real (in this process); returns the readings."""
    import torch
    from gpucast_describe.simulate import default_loss, make_optimizer

    name, spec, shape, batch, optimizer, precision, attention = JOBS[index]
    if dry_run:
        batch = 2
    tokens = len(shape) == 1
    with torch.device(device):
        model = _build_real(spec)
    model.train()
    if attention == "eager":
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "_attn_implementation"):
                config._attn_implementation = "eager"
    opt = make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(2):
        if tokens:
            inputs = torch.randint(0, 1000, [batch, *shape], device=device)
        else:
            inputs = torch.randn([batch, *shape], device=device)
        with torch.autocast(
            device_type=device,
            dtype=torch.float16 if device == "cuda" else torch.bfloat16,
            enabled=precision == "mixed16",
        ):
            loss = default_loss(model(inputs))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss, inputs
    result = {"seconds": round(time.perf_counter() - started, 2)}
    if device == "cuda":
        torch.cuda.synchronize()
        result["max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        result["max_reserved_bytes"] = torch.cuda.max_memory_reserved()
        used = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=memory.used",
                "--format=csv,noheader,nounits",
                "-i",
                os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
            ],
            capture_output=True,
            text=True,
        )
        result["nvidia_smi_used_mib"] = float(used.stdout.strip().splitlines()[0]) if used.returncode == 0 else None
        result["gpu"] = torch.cuda.get_device_name(0)
    return result


def baseline(device):
    """The environment and what a bare CUDA context costs (one 1-byte tensor, read by nvidia-smi)."""
    import torch

    versions = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
    }
    for name in ("timm", "torchvision", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except Exception as error:  # a missing package is a reading too
            versions[name] = "missing: %s" % error
    result = {"versions": versions}
    if device == "cuda":
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,memory.used,driver_version", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
        )
        result["nvidia_smi"] = smi.stdout.strip()
        result["gpu"] = torch.cuda.get_device_name(0)
    return result


def _build_real(spec):
    prefix, _, rest = spec.partition(":")
    if prefix == "timm":
        import timm

        return timm.create_model(rest, pretrained=False)
    if prefix == "torchvision":
        import torchvision

        return torchvision.models.get_model(rest, weights=None)
    return _example(spec)()


def _example(spec):
    """The factory a `module:hf_models:<name>` spec names: describe/examples/hf_models.py, imported
    from describe/ (the working directory) as examples.hf_models; the spec keeps the name that
    `cd describe/examples && python -m gpucast_describe` resolves."""
    from examples import hf_models

    module_path, _, attr = spec.partition(":")[2].partition(":")
    if module_path != "hf_models":
        raise ValueError(f"not an example model: {spec}")
    return getattr(hf_models, attr)


def simulate(index):
    import torch
    from gpucast_describe import resolve_spec, simulate_step

    name, spec, shape, batch, optimizer, precision, attention = JOBS[index]
    if spec.startswith("module:"):
        with torch.device("meta"):  # as resolve_spec builds a module: factory
            module = _example(spec)()
    else:
        module = resolve_spec(spec).module
    dtype = torch.int64 if len(shape) == 1 else torch.float32
    return simulate_step(module, shape, batch, dtype, optimizer=optimizer, precision=precision, attention=attention)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--only", type=int, help="the first N jobs")
    parser.add_argument("--job", type=int, help=argparse.SUPPRESS)  # the child's job index
    parser.add_argument(
        "--context-mib", type=float, default=None, help="CUDA context for the device column (default: the manifest's)"
    )
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if args.job is not None:  # child: train one job and print its readings
        print(json.dumps(measure(args.job, device, args.dry_run) if args.job >= 0 else baseline(device)))
        return 0
    context = args.context_mib
    if context is None:
        manifest = json.loads((HERE.parent.parent / "models" / "manifest.json").read_text())
        context = manifest.get("simulated", {}).get("cuda_context_mib", 0.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    child = subprocess.run(
        [sys.executable, "-m", __spec__.name, "--job", "-1"] + (["--dry-run"] if args.dry_run else []),
        capture_output=True,
        text=True,
        timeout=300,
    )
    environment = (
        json.loads(child.stdout.strip().splitlines()[-1])
        if child.returncode == 0
        else {"error": (child.stderr.strip().splitlines() or ["?"])[-1][:300]}
    )
    print(json.dumps({"environment": environment}), flush=True)
    (out / "gpu_environment.json").write_text(json.dumps(environment, indent=1) + "\n")
    jobs = range(len(JOBS) if args.only is None else min(args.only, len(JOBS)))
    for index in jobs:
        name = JOBS[index][0]
        child = subprocess.run(
            [sys.executable, "-m", __spec__.name, "--job", str(index)] + (["--dry-run"] if args.dry_run else []),
            capture_output=True,
            text=True,
            timeout=600,
        )
        if child.returncode != 0:
            measured = {"error": (child.stderr.strip().splitlines() or ["?"])[-1][:300]}
        else:
            measured = json.loads(child.stdout.strip().splitlines()[-1])
        try:  # the device's torch may differ from the pinned one: the readings still count
            simulated = simulate(index)
        except Exception as error:
            simulated = {"error": repr(error)[:300]}
        line = {
            "job": name,
            "spec": JOBS[index][1],
            "batch": JOBS[index][3],
            "optimizer": JOBS[index][4],
            "precision": JOBS[index][5],
            "attention": JOBS[index][6],
            "measured": measured,
            "simulation": simulated,
        }
        lines.append(line)
        print(json.dumps(line), flush=True)
        with open(out / "gpu_check.jsonl", "a" if index else "w") as handle:  # kept if a later job hangs
            handle.write(json.dumps(line) + "\n")
    mib = 2**20
    table = [
        "| job | batch | allocated: simulated / measured | reserved: simulated / measured | "
        "device: reserved + %.0f context / nvidia-smi |" % context,
        "| --- | --- | --- | --- | --- |",
    ]
    for line in lines:
        m, s = line["measured"], line["simulation"]
        if "max_allocated_bytes" not in m or "allocated_peak_bytes" not in s:
            table.append(
                "| %s | %d | %s | | |" % (line["job"], line["batch"], m.get("error") or s.get("error") or "dry run")
            )
            continue
        table.append(
            "| %s | %d | %.0f / %.0f (%+.1f %%) | %.0f / %.0f (%+.1f %%) | %.0f / %s |"
            % (
                line["job"],
                line["batch"],
                s["allocated_peak_bytes"] / mib,
                m["max_allocated_bytes"] / mib,
                100 * (s["allocated_peak_bytes"] / m["max_allocated_bytes"] - 1),
                s["reserved_peak_bytes"] / mib,
                m["max_reserved_bytes"] / mib,
                100 * (s["reserved_peak_bytes"] / m["max_reserved_bytes"] - 1),
                s["reserved_peak_bytes"] / mib + context,
                m.get("nvidia_smi_used_mib"),
            )
        )
    (out / "gpu_check.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
