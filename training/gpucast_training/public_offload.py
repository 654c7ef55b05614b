"""data/public/offload_jobs.jsonl.gz: the published runs that public-setups left out for CPU
offload alone, now that the request contract expresses it (`offload`), as jobs built from their
model's config.json (tests/fixtures/transformer_configs/public). Stdlib only.

    python -m gpucast_training public-offload

Each row's setup is read by the rules in ROWS, and each rule first checks that the row still
says what the rule read from it (`says`): a changed CSV stops the stage instead of silently
scoring another setup. The measured quantity is public-setups' own reading of the row's
measure kind. Rows whose model has no committed config (bloomz-7b1, Llama-3-70B) or whose offload
is of activations (torchtune's `enable_activation_offloading`) or of a timm model stay out.
"""

import csv
import json
from pathlib import Path

from .data import REPO, write_jsonl_gz
from .public_setups import parse_compare

OUT = ("data", "public", "offload_jobs.jsonl.gz")
CONFIGS = Path(REPO) / "tests" / "fixtures" / "transformer_configs" / "public"

# PEFT's defaults for T5-family LoRA (q, v); the fsdp_qlora train.py defaults (r 64, alpha 16,
# dropout 0.1 on k, q, v, up, down, gate; FSDP activation checkpointing; AdamW; bf16).
T5_LORA = {"rank": 8, "alpha": 32, "dropout": 0.1, "target_modules": ["q", "v"]}
FSDP_QLORA_TARGETS = ["k_proj", "q_proj", "v_proj", "up_proj", "down_proj", "gate_proj"]


def _zero3_offload_t5(config):
    # Accelerate's DeepSpeed example: ZeRO-3 offloading parameters and optimizer on one GPU,
    # fp32, batch 8 of short tweets padded to at most 64 tokens (the bound is taken).
    return {
        "config": config,
        "says": ["ZeRO-3", "offload params+optimizer", "1 GPU", "fp32"],
        "gpu": "a100-80gb",
        "job": {
            "batch_size": 8,
            "seq_len": 64,
            "precision": "fp32",
            "optimizer": "adamw",
            "lora": T5_LORA,
            "parallelism": {"strategy": "zero3", "world_size": 1},
            "offload": {"parameters": True},
        },
        "notes": "sequence length at its bound (64, dynamic padding)",
    }


def _fsdp_qlora(config, batch, seq, base, gpu):
    return {
        "config": config,
        "says": ["FSDP full_shard + CPU offload of params x2", "qlora" if base == "nf4" else "--train_type lora"],
        "gpu": gpu,
        "job": {
            "batch_size": batch,
            "seq_len": seq,
            "precision": "bf16",
            "optimizer": "adamw",
            "activation_checkpointing": "full",
            "lora": {
                "rank": 64,
                "alpha": 16,
                "dropout": 0.1,
                "target_modules": FSDP_QLORA_TARGETS,
                "base_weights": base,
            },
            "parallelism": {"strategy": "fsdp", "world_size": 2},
            "offload": {"parameters": True},
        },
        "notes": "train.py defaults (r 64, alpha 16, dropout 0.1; FSDP checkpointing)",
    }


ROWS = {
    228: _zero3_offload_t5("bigscience__T0_3B"),
    230: _zero3_offload_t5("bigscience__mt0-xxl"),
    312: _fsdp_qlora("01-ai__Yi-34B", 4, 2048, "nf4", "rtx-3090"),
    313: _fsdp_qlora("meta-llama__Llama-2-70b-hf", 2, 2048, "nf4", "rtx-3090"),
    314: _fsdp_qlora("meta-llama__Llama-2-7b-hf", 10, 2048, "same", "rtx-4090"),
    315: _fsdp_qlora("meta-llama__Llama-2-7b-hf", 12, 2048, "nf4", "rtx-4090"),
    316: _fsdp_qlora("mistral-community__Mistral-7B-v0.2", 12, 2048, "nf4", "rtx-4090"),
    317: _fsdp_qlora("mistral-community__Mistral-7B-v0.2", 1, 24576, "nf4", "rtx-4090"),
}


def jobs(csv_path):
    """The rows of ROWS as jobs, each checked against what its CSV row says."""
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    out = []
    for index, rule in sorted(ROWS.items()):
        row = rows[index]
        text = " ".join(row.values()).lower()
        missing = [phrase for phrase in rule["says"] if phrase.lower() not in text]
        if missing:
            raise SystemExit(f"row {index} no longer says {missing}: its rule needs reading again")
        compare, assumed = parse_compare(row["measure_kind"])
        config = json.loads((CONFIGS / f"{rule['config']}.json").read_text())
        job = dict(rule["job"], transformer_config=config, gpu=rule["gpu"])
        notes = [rule["notes"]] + ([f"compare {compare!r} assumed from the measure kind"] if assumed else [])
        out.append(
            {
                "row": index,
                "model": row["model"],
                "gpu": row["gpu"],
                "measured_mib": float(row["measured_mib"]),
                "compare": compare,
                "families": [
                    "offload",
                    "lora" if job["lora"].get("base_weights", "same") == "same" else "qlora",
                    "fsdp_zero",
                ],
                "architecture": rule["config"].replace("__", "/"),
                "notes": "; ".join(notes),
                "job": job,
            }
        )
    return out


def run(layout, threads=None, **_):
    lines = jobs(layout.public_csv)
    write_jsonl_gz(str(Path(REPO).joinpath(*OUT)), lines)
    print(f"{len(lines)} offload rows -> {'/'.join(OUT)}")
