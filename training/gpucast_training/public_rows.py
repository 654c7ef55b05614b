"""Describe (with the simulated training step) every row of public_training_memory.csv whose
setup gpucast can express: one GPU (or DDP, flagged), fp32 or autocast mixed precision, SGD /
momentum / Adam / AdamW, no adapters, no activation checkpointing, no gradient accumulation,
and a model that can be built here without downloading anything (timm, torchvision, or a
Hugging Face transformers class built from its published configuration).

    python -m gpucast_training public-rows [--public-csv CSV]   (from training/; default
        <data dir>/public_training_memory.csv, see data.py; in .venv-describe: gpucast_describe and transformers)

Writes data/public/jobs.jsonl.gz: one line per row, with the CSV row index, what was measured
and how (`compare`: `allocated` = torch.cuda.max_memory_allocated, `allocated_minus_weights`
= TorchTracemalloc's peak minus the memory held when training began (the weights), `device`
= nvidia-smi/NVML used, the CUDA context included), the setup as gpucast expresses it and the
job description (the body of POST /v1/estimate) with its `simulation`. The rows of the CSV
that are left out, and why, are counted in data/public/PROVENANCE.md.
"""

import csv
import os
import time

import torch
from torch import nn

from gpucast_describe import describe_module

from . import manifest as mf
from .data import write_jsonl_gz

THREADS = 1


class LossOf(nn.Module):
    """Wraps a Hugging Face model that computes its own loss from `labels` (as the Trainer and
    these sources' scripts run it): forward(ids or pixels) -> the loss."""

    def __init__(self, model, labels):
        super().__init__()
        self.model = model
        self.labels = labels  # batch -> labels tensor (meta)

    def forward(self, inputs):
        return self.model(inputs, labels=self.labels(inputs)).loss


class Seq2SeqLoss(nn.Module):
    """T5: encoder ids in, a short label sequence for the decoder, the model's own loss."""

    def __init__(self, model, label_len):
        super().__init__()
        self.model = model
        self.label_len = label_len

    def forward(self, ids):
        labels = torch.zeros(ids.shape[0], self.label_len, dtype=torch.int64, device=ids.device)
        return self.model(input_ids=ids, labels=labels).loss


def bert_large_classifier():
    import transformers

    config = transformers.BertConfig(
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        vocab_size=30522,
        num_labels=2,
    )
    return transformers.BertForSequenceClassification(config)


def t0_3b(label_len=4):
    import transformers

    # bigscience/T0_3B = google/t5-xl-lm-adapt (T5 v1.1 XL): gated GELU, untied head.
    config = transformers.T5Config(
        d_model=2048,
        d_ff=5120,
        d_kv=64,
        num_heads=32,
        num_layers=24,
        num_decoder_layers=24,
        vocab_size=32128,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return Seq2SeqLoss(transformers.T5ForConditionalGeneration(config), label_len)


SEGFORMER = {  # mmseg / HF SegFormer MiT-B0..B5
    "B0": ([32, 64, 160, 256], [2, 2, 2, 2], 256),
    "B1": ([64, 128, 320, 512], [2, 2, 2, 2], 256),
    "B2": ([64, 128, 320, 512], [3, 4, 6, 3], 768),
    "B3": ([64, 128, 320, 512], [3, 4, 18, 3], 768),
    "B4": ([64, 128, 320, 512], [3, 8, 27, 3], 768),
    "B5": ([64, 128, 320, 512], [3, 6, 40, 3], 768),
}


def segformer(variant, num_labels):
    import transformers

    hidden, depths, decoder = SEGFORMER[variant]
    config = transformers.SegformerConfig(
        hidden_sizes=hidden, depths=depths, decoder_hidden_size=decoder, num_labels=num_labels
    )
    model = transformers.SegformerForSemanticSegmentation(config)
    return LossOf(
        model, lambda pixels: torch.zeros(pixels.shape[0], *pixels.shape[2:], dtype=torch.int64, device=pixels.device)
    )


def timm_model(name, **kwargs):
    import timm

    return timm.create_model(name, pretrained=False, **kwargs)


def torchvision_model(name):
    import torchvision

    return torchvision.models.get_model(name, weights=None)


def precision_of(text):
    text = text.lower()
    if text.startswith("fp32"):
        return "fp32"
    if "amp" in text or "autocast" in text or "mixed" in text:
        return "mixed16"
    return None


def optimizer_of(text):
    text = text.lower()
    if any(
        word in text
        for word in (
            "8-bit",
            "8bit",
            "4-bit",
            "adafactor",
            "paged",
            "fp8",
            "galore",
            "muon",
            "lion",
            "in_bwd",
            "fused into backward",
            "lisa",
            "offload",
        )
    ):
        return None
    if "adamw" in text:
        return "adamw"
    if "adam" in text:
        return "adam"
    if "sgd" in text and "momentum" in text:
        return "momentum"
    if "sgd" in text:
        return "sgd"
    return None


def compare_of(kind):
    kind = kind.lower()
    if "tracemalloc" in kind:
        return "allocated_minus_weights"
    if "max_memory_allocated" in kind or "peak allocated" in kind:
        return "allocated"
    if "max_memory_reserved" in kind or "reserved" in kind:
        return "reserved"
    if "nvml" in kind or "nvidia-smi" in kind:
        return "device"
    return None


def expressible(row):
    """The gpucast setup of a row, or the reason it cannot be expressed today."""
    if row["peft"] and not row["peft"].lower().startswith("none"):
        return None, "adapters (LoRA/QLoRA/prompt tuning)"
    checkpointing = row["grad_checkpointing"].lower()
    if checkpointing and not (checkpointing.startswith("off") or checkpointing in ("false", "no")):
        return None, "activation checkpointing"
    if row["grad_accum"] not in ("", "1"):
        return None, "gradient accumulation"
    parallelism = row["parallelism"].lower()
    ddp = parallelism.startswith("ddp")
    if not (parallelism.startswith("single") or ddp):
        return None, "sharded or model-parallel training"
    precision = precision_of(row["precision"])
    if precision is None:
        return None, "pure bf16/fp16 or quantised weights"
    optimizer = optimizer_of(row["optimizer"])
    if optimizer is None:
        return None, "optimizer gpucast does not model (8-bit, Adafactor, fused into backward...)"
    compare = compare_of(row["measure_kind"])
    if compare is None:
        return None, "measurement method not stated"
    return {"precision": precision, "optimizer": optimizer, "compare": compare, "ddp": ddp}, None


def builder_of(row):
    """(factory, input_shape, input dtype, batch, loss, note, attention) for the rows we can
    build, else None. Matched on the model column as the CSV writes it; the attention kernel is
    the one the source's software ran (eager before transformers had SDPA, and for models that
    write their attention out)."""
    model, micro = row["model"], int(row["micro_batch_size"] or row["batch_size"])
    if model.startswith("bert-large-uncased") and "SequenceClassification" in row["head_or_task"]:
        return (
            bert_large_classifier,
            [int(row["seq_len"])],
            torch.int64,
            micro,
            "auto",
            "eager attention (transformers 4.16-4.21 had no SDPA)",
            "eager",
        )
    if model.startswith("bigscience/T0_3B"):
        return (
            t0_3b,
            [64],
            torch.int64,
            micro,
            "auto",
            "inputs padded to 64 tokens (the example's max_length), 4 label tokens",
            "eager",
        )
    if model.startswith("timm vit_huge_patch14_224"):
        return (
            lambda: timm_model("vit_huge_patch14_224", num_classes=45),
            [3, 224, 224],
            torch.float32,
            micro,
            "auto",
            "fused AdamW run as foreach; torch.compile not modelled",
            "efficient",
        )
    if model.startswith("torchvision vit_l_16"):
        return (
            lambda: torchvision_model("vit_l_16"),
            [3, 224, 224],
            torch.float32,
            micro,
            "sum",
            "loss = logits.sum() as in the source",
            "efficient",
        )
    if model.startswith("SegFormer MIT-"):
        variant = model.split("MIT-")[1][:2]
        ade = "ADE20K" in row["head_or_task"]
        size = 1024 if "1024" in row["image_size"] else (640 if "640" in row["image_size"] else 512)
        labels = 150 if ade else 19
        return (
            lambda: segformer(variant, labels),
            [3, size, size],
            torch.float32,
            micro,
            "auto",
            "HF SegFormer (same MiT encoder and all-MLP head as mmseg); loss on logits upsampled to the label size",
            "eager",
        )
    return None


def run(layout, threads=None):
    torch.set_num_threads(threads or THREADS)
    csv_path = layout.public_csv
    with open(csv_path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    reasons, lines, timings = {}, [], []
    for index, row in enumerate(rows):
        setup, reason = expressible(row)
        if setup is None:
            reasons[reason] = reasons.get(reason, 0) + 1
            continue
        built = builder_of(row)
        if built is None:
            reasons["model cannot be built here (mmdet/mmcv detection models)"] = (
                reasons.get("model cannot be built here (mmdet/mmcv detection models)", 0) + 1
            )
            continue
        factory, shape, dtype, batch, loss, note, attention = built
        started = time.perf_counter()
        with torch.device("meta"):
            module = factory()
        description = describe_module(
            module,
            shape,
            batch,
            name=row["model"].split(" (")[0],
            input_dtype=dtype,
            optimizer=setup["optimizer"],
            precision=setup["precision"],
            loss=loss,
            attention=attention,
        )
        timings.append(time.perf_counter() - started)
        if "simulation" not in description:
            reasons["simulation failed"] = reasons.get("simulation failed", 0) + 1
            continue
        lines.append(
            {
                "row": index,
                "model": row["model"],
                "gpu": row["gpu"],
                "measured_mib": float(row["measured_mib"]),
                "compare": setup["compare"],
                "ddp": setup["ddp"],
                "confidence": row["notes"].split(";")[0],
                "note": note,
                "job": description,
            }
        )
        print(f"row {index}: {row['model'][:50]} {timings[-1]:.1f} s", flush=True)
    write_jsonl_gz(layout.out("data", "public", "jobs.jsonl.gz"), lines)
    sha = mf.sha256_of(csv_path)
    import transformers

    text = [
        "# data/public/jobs.jsonl.gz: provenance",
        "",
        "The rows of `public_training_memory.csv` whose setup gpucast can express, described by",
        "`gpucast_describe` with the simulated training step (see training/gpucast_training/public_rows.py",
        "for the rules and the model builders).",
        "",
        "```",
        "cd training && python -m gpucast_training public-rows",
        "```",
        "",
        f"- generated: {mf.utc_now()}",
        f"- source: `{os.path.basename(csv_path)}` (../shared/data), sha256 `{sha}`, {len(rows)} rows",
        f"- torch {torch.__version__}, transformers {transformers.__version__}",
        f"- rows described: {len(lines)} ({sum(l['ddp'] for l in lines)} of them DDP: one GPU's "
        "step simulated, DDP's gradient buckets not modelled)",
        "",
        "## Rows left out",
        "",
    ] + [f"- {count}: {reason}" for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1])]
    with open(layout.out("data", "public", "PROVENANCE.md"), "w") as handle:
        handle.write("\n".join(text) + "\n")
    print(f"{len(lines)} rows described; left out: {reasons}")
