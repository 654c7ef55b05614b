"""Every row of public_training_memory.csv whose training setup the request contract of
docs/user/setups.md can express, as a gpucast job with that setup, plus three model-state baselines.

    python -m gpucast_training public-setups [--public-csv CSV] [--threads N] [--simulate]
        (from training/, in .venv-describe: gpucast_describe and transformers/timm/torchvision; the baselines need
        deepspeed and accelerate, evaluation-only packages, never dependencies of the service)

Writes data/public/setup_jobs.jsonl.gz, one line per expressible row:

    {"row", "model", "gpu", "measured_mib", "compare", "confidence", "families", "job",
     "baselines", "notes", "unmodelled", ...}

- `job` is the body of POST /v1/estimate: the layers and saved tensors of `describe_module`
  (the model built on the meta device from its published configuration, nothing downloaded;
  saved tensors traced in fp32, the service scales them by precision) and the setup fields of
  docs/user/setups.md (precision, optimizer, optimizer_implementation, activation_checkpointing,
  micro_batch_size, gradient_accumulation_steps, parallelism, lora / trainable).
- `compare` says what the figure is: `allocated` (torch.cuda.max_memory_allocated),
  `reserved` (max_memory_reserved), `active` (torchtune's peak active bytes), `device`
  (nvidia-smi / NVML / a device monitor: the CUDA context included), `allocated_minus_weights`
  / `reserved_minus_weights` (the peak minus what was held before training began: the weights).
- `baselines`: what DeepSpeed's `estimate_zero2/3_model_states_mem_needs` (the functions the
  `_all_cold` printers call, with cpu_offload False) and accelerate's `estimate-memory`
  ("Training using Adam": `estimate_training_usage` on `calculate_maximum_sizes` of the built
  model) give, in MiB per GPU. Model states only, whatever the setup.
- `unmodelled`: what the run had that no contract field says (torch.compile, chunked
  cross-entropy, an evaluation phase inside the peak...), for readers who want to filter.

Rows left out, each with its reasons, go to data/public/setup_left_out.json, and the counts, the
command, the CSV's sha256 and the versions to data/public/SETUPS.md.

The parsing (one function per CSV column, below) is standard library only; torch and the model
libraries are imported by the builders. `--simulate` (off by default) asks describe for the
training-step simulation with the row's setup: see `describe_row`.
"""

import csv
import json
import os
import re
import time

from .data import write_jsonl_gz

THREADS = 1
OUT_JOBS = ("data", "public", "setup_jobs.jsonl.gz")
OUT_LEFT = ("data", "public", "setup_left_out.json")
OUT_DOC = ("data", "public", "SETUPS.md")
# What an accelerate dtype name is for each contract precision (its "Training using Adam" row).
ACCELERATE_DTYPE = {
    "fp32": "float32",
    "tf32": "float32",
    "amp_fp16": "float16",
    "fp16": "float16",
    "amp_bf16": "bfloat16",
    "bf16": "bfloat16",
}
GPUS_PER_NODE = 8


class Out(Exception):
    """A row the contract cannot express: `reason` (one of REASONS) and a `detail`."""

    def __init__(self, reason, detail=""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


# The reasons a row is left out, in the order a row's first (primary) reason is taken.
MODEL = "model not built here"
MEASURE = "measured quantity not stated"
OFFLOAD = "CPU offload (optimizer, parameters or activations): not modelled"
LOW_PRECISION = "float8 / MXFP8 / NVFP4 training"
SELECTIVE = "selective checkpointing"
IN_BACKWARD = "optimizer step fused into backward"
OPTIMIZER = "optimizer the contract has no name for"
ADAPTER = "adapter method other than LoRA"
VARIANT = "LoRA variant: the trainable count in the notes is not plain LoRA's"
NOT_STATED = "setup not stated"
SEQUENCE = "sequence parallelism (Ulysses)"
REASONS = [
    MODEL,
    MEASURE,
    OFFLOAD,
    LOW_PRECISION,
    SELECTIVE,
    IN_BACKWARD,
    OPTIMIZER,
    ADAPTER,
    VARIANT,
    SEQUENCE,
    NOT_STATED,
]


# ============================================================================ the columns


def _int(text):
    match = re.match(r"\s*(\d+)\b", text)
    return int(match.group(1)) if match else None


def parse_compare(kind):
    """measure_kind -> (compare, assumed). See the module doc for the values."""
    k = kind.lower()
    if "does not say which" in k or "unspecified which" in k or 'log_peak_memory_stats "peak memory"' in k:
        raise Out(MEASURE, "which of active / allocated / reserved is not said")
    assumed = "likely" in k
    if "peak_memory_active" in k or "active_bytes" in k:
        return "active", assumed
    if "reserved" in k and "minus" in k:
        return "reserved_minus_weights", assumed
    if "reserved" in k:
        return "reserved", assumed
    if "allocated" in k:
        return "allocated", assumed
    if any(word in k for word in ("nvml", "nvidia-smi", "device monitor", "monitoring screenshot")):
        return "device", assumed or "screenshot" in k
    raise Out(MEASURE, kind[:80])


def parse_precision(text):
    """precision -> (contract precision, note). The 4-bit base of QLoRA is parse_base_weights'."""
    t = text.lower()
    if any(word in t for word in ("float8", "mxfp8", "nvfp4", "fp8")):
        raise Out(LOW_PRECISION, text)
    if t.startswith("not stated"):
        raise Out(NOT_STATED, "precision")
    if "fp16/bf16" in t or "bf16/fp16" in t:
        raise Out(NOT_STATED, "compute precision (fp16 or bf16)")
    if "weights/collectives bf16" in t:  # torchtitan's BF16 baseline: FSDP2 mixed precision
        return "amp_bf16", "torchtitan FSDP2 mixed precision (bf16 compute, fp32 master weights) assumed"
    if "4-bit" in t and "fp16 compute" in t:
        return "amp_fp16", "fp16 autocast over the 4-bit base (Trainer fp16=True on a T4) assumed"
    if any(
        word in t for word in ("pure", "bf16-true", "full bf16", "bf16 weights", "bfloat16 weights")
    ) or t.startswith("bf16 (train.py"):
        return "bf16", ""
    if any(word in t for word in ("amp", "autocast", "mixed", "--bf16 true", "bf16 + tf32")):
        if "bf16" in t:
            return "amp_bf16", ""
        if "fp16" in t:
            return "amp_fp16", ""
    if "4-bit" in t:
        raise Out(NOT_STATED, "compute precision of the 4-bit base")
    if t.startswith("fp32"):
        return "fp32", ""
    if t.startswith("tf32"):
        return "tf32", ""
    raise Out(NOT_STATED, f"precision {text!r}")


def parse_base_weights(precision, peft):
    """The frozen base of a LoRA: `nf4` (bitsandbytes / torchao NF4: QLoRA), else `same`."""
    text = f"{precision} {peft}".lower()
    if "nf4" in text or "4-bit" in text or "qlora" in text:
        return "nf4"
    if "int8" in text or "8-bit base" in text:
        return "int8"
    return "same"


def parse_optimizer(text):
    """optimizer -> (optimizer, optimizer_implementation, note)."""
    t = text.lower()
    if ("in_bwd" in t and "no optimizer_in_bwd" not in t) or "fused into backward" in t:
        raise Out(IN_BACKWARD, text[:80])
    if ("offload" in t and "offload: none" not in t) or "cpu-offloaded" in t:
        raise Out(OFFLOAD, text[:80])
    for word, name in (
        ("galore", "GaLore"),
        ("muon", "Muon"),
        ("lisa", "LISA"),
        ("lora-fa", "LoRA-FA"),
        ("4-bit", "4-bit Adam"),
        ("fp8", "FP8 Adam"),
    ):
        if word in t:
            raise Out(OPTIMIZER, name)
    if t.startswith("not stated"):
        raise Out(NOT_STATED, "optimizer")
    bnb = "bitsandbytes" in t or "bnb." in t or t.startswith("adamw_8bit")
    note = "bitsandbytes updates each tensor in one in-place kernel (read as fused)" if bnb else ""
    if "paged" in t:
        name = "paged_adamw_8bit" if "8bit" in t or "8-bit" in t else "paged_adamw"
        return name, "fused", note
    if "8-bit" in t or "8bit" in t:
        name = "adamw_8bit" if "adamw" in t else "adam_8bit"
        if "torchao" in t:
            return name, "fused", ("torchao's 8-bit AdamW (blockwise, 256-value blocks) read as bitsandbytes' layout")
        return name, "fused", note
    if "adafactor" in t:
        return "adafactor", "for_loop", "transformers' Adafactor (a loop over the parameters)"
    if "sgd" in t:
        return ("momentum" if "momentum" in t else "sgd"), "foreach", ""
    if "adam" in t:
        name = "adamw" if "adamw" in t else "adam"
        if "fused" in t:
            return name, "fused", ""
        if "foreach=false" in t:
            return name, "for_loop", ""
        if "adamw_hf" in t:
            return name, "for_loop", "transformers' own AdamW (adamw_hf: a loop over the parameters)"
        return name, "foreach", ""
    raise Out(OPTIMIZER, text[:80])


def parse_checkpointing(text):
    """grad_checkpointing -> ("none" | "full", note)."""
    t = text.lower().strip()
    if "selective" in t or "sac" in t:
        raise Out(SELECTIVE, text)
    if "offload" in t:
        raise Out(OFFLOAD, "activation offloading")
    if t in ("off", "false", "no") or t.startswith("off") or "default off" in t:
        return "none", ""
    if "likely on" in t or "default on" in t:
        return "full", "activation checkpointing on assumed (the source says it is likely / the default)"
    if "not stated" in t:
        raise Out(NOT_STATED, "activation checkpointing")
    if t.startswith("on") or t in ("true", "full") or "activation checkpointing" in t:
        return "full", ""
    raise Out(NOT_STATED, f"activation checkpointing {text!r}")


def parse_micro_batch(text):
    """micro_batch_size -> (samples per GPU per forward/backward, note)."""
    value = _int(text)
    if value is not None:
        return value, ""
    match = re.search(r"recipe default \((\d+)\)", text)
    if match:
        return int(match.group(1)), "the recipe's default micro-batch"
    raise Out(NOT_STATED, "micro-batch size")


def parse_accumulation(text, batch_text, micro, world, parallelism_text):
    """grad_accum -> (micro-batches per optimizer step, note)."""
    value = _int(text)
    if value is not None:
        return value, ""
    if "likely 1" in text:
        return 1, "no gradient accumulation assumed (likely 1 for the benchmark)"
    if text.startswith("global/("):  # Thunder's pretraining commands: global 32 under FSDP, else 512
        per = int(re.search(r"global/\((\d+)\*devices\)", text).group(1))
        fsdp = parallelism_text.lower().startswith("fsdp")
        match = re.search(r"global (\d+) for FSDP runs, (\d+) default", batch_text)
        global_batch = int(match.group(1) if fsdp else match.group(2))
        return global_batch // (per * world), f"accumulation = global batch {global_batch} / (4 x {world})"
    raise Out(NOT_STATED, "gradient accumulation")


def parse_sequence(text):
    """seq_len -> (tokens per sample, note)."""
    value = _int(text)
    if value is not None:
        return value, ("sequence length as the CSV assumes it" if "assumed" in text else "")
    match = re.match(r"\s*<=\s*(\d+)", text)
    if match and "unpacked" in text:
        raise Out(NOT_STATED, "sequence length (unpacked samples: the longest is not stated)")
    if match:
        if "short" in text:
            raise Out(NOT_STATED, "sequence length (only a bound far above the data)")
        return int(match.group(1)), f"sequence length at its bound {match.group(1)} (dynamic padding)"
    match = re.search(r"max_length=(\d+)", text)
    if match and "short" in text:
        return int(match.group(1)), f"inputs padded to {match.group(1)} tokens (the example's max_length)"
    raise Out(NOT_STATED, "sequence length")


def parse_image(text):
    """image_size -> (pixels per side, note)."""
    match = re.search(r"(\d+)x(\d+)", text)
    if match and match.group(1) == match.group(2):
        return int(match.group(1)), ("image size assumed (the source says likely)" if "likely" in text else "")
    raise Out(NOT_STATED, "image size")


def parse_parallelism(text, n_gpus):
    """parallelism, n_gpus -> the contract's parallelism object."""
    t = text.lower()
    if "offload" in t and not any(word in t for word in ("offload_params=false", "cpu_offload false", "no offload")):
        raise Out(OFFLOAD, text)
    if "ulysses" in t or re.search(r"\bsp=\d", t):
        raise Out(SEQUENCE, text)
    world = int(n_gpus)
    if t.startswith("single"):
        if world != 1:
            raise ValueError(f"single GPU with n_gpus {n_gpus}")
        return {"strategy": "none", "world_size": 1}

    def degree(name):
        match = re.search(rf"\b{name} (\d+)", text)
        return int(match.group(1)) if match else 1

    tp, pp, cp = degree("TP"), degree("PP"), degree("CP")
    if "ddp" in t:
        strategy = "ddp"
    elif "deepspeed" in t:
        stage = re.search(r"zero-(\d)", t).group(1)
        strategy = "zero" + stage
    elif "fsdp" in t:
        strategy = "fsdp"
    else:
        raise Out(NOT_STATED, f"parallelism {text!r}")
    result = {"strategy": strategy, "world_size": world}
    for key, value in (("tensor_parallel", tp), ("pipeline_parallel", pp), ("context_parallel", cp)):
        if value > 1:
            result[key] = value
    if world % (tp * pp * cp):
        raise ValueError(f"{text}: world {world} not divided by {tp} x {pp} x {cp}")
    nodes = re.search(r"(\d+) nodes x (\d+)", text)
    stated = re.findall(r"\bx ?(\d+)\b", text)
    if nodes:
        stated = [str(int(nodes.group(1)) * int(nodes.group(2)))]
    if stated and tp * pp * cp == 1 and int(stated[-1]) != world:
        raise ValueError(f"{text}: x{stated[-1]} but n_gpus {world}")
    return result


NON_LORA = (
    "ADALORA",
    "ADAMSS",
    "ADAPTION_PROMPT",
    "BEFT",
    "BOFT",
    "C3A",
    "DEFT",
    "DELORA",
    "FOURIERFT",
    "FROD",
    "GLORA",
    "GRALORA",
    "HIRA",
    "HRA",
    "IA3",
    "LILY",
    "LOHA",
    "LOKR",
    "MISS",
    "OFT",
    "OSF",
    "PEANUT",
    "PREFIX_TUNING",
    "PROMPT_TUNING",
    "P_TUNING",
    "PSOFT",
    "PVERA",
    "RANDLORA",
    "ROAD",
    "SHIRA",
    "TINYLORA",
    "TRAINABLE_TOKENS",
    "UNILORA",
    "VBLORA",
    "VERA",
    "WAVEFT",
)


def parse_peft(text):
    """peft -> None (every parameter trained), {"ln_tuning": [targets]}, or a LoRA:
    {"rank", "alpha", "targets" (the source's words, or "all-linear"), "dropout", "rslora"}."""
    t = text.strip()
    tl = t.lower()
    if tl.startswith("none"):
        return None
    head = re.split(r"[ (]", t, maxsplit=1)[0]
    if head in NON_LORA:
        raise Out(ADAPTER, head)
    for word, name in (
        ("use_dora", "DoRA"),
        ("dora", "DoRA"),
        ("adalora", "AdaLoRA"),
        ("velora", "VeLoRA"),
        ("llama-adapter", "LLaMA-Adapter"),
        ("llama-pro", "LLaMA-Pro"),
        ("lisa", "LISA"),
    ):
        if word in tl:
            raise Out(ADAPTER, name)
    if head == "LN_TUNING":
        return {"ln_tuning": re.findall(r"'([^']+)'", t)}
    if "lora" not in tl:
        raise Out(ADAPTER, t[:40])
    rank = re.search(r"\br=(\d+)", t)
    if not rank:
        raise Out(NOT_STATED, "LoRA rank")
    alpha = re.search(r"(?:lora_)?alpha=(\d+)", t)
    if not alpha:
        raise Out(NOT_STATED, "LoRA alpha")
    listed = re.search(r"target_modules=\[([^\]]*)\]", t)
    if "default target modules" in tl:
        targets = None  # the framework's default
    elif "all-linear" in tl:
        targets = "all-linear"
    elif listed:
        targets = re.findall(r"'([^']+)'", listed.group(1))
    else:
        match = (
            re.search(r"\bon ([A-Za-z_,+ ]+?)(?:\s*\(|\)|;|$| \+ base)", t)
            or re.search(r"targets? ([A-Za-z_,]+)", t)
            or re.search(r"\((query_key_value)\)", t)
        )
        if re.search(r"q and v only", tl):
            targets = ["q", "v"]
        elif "all layers (" in tl:
            targets = re.split(r"[,+ ]+", re.search(r"all layers \(([^)]*)\)", t).group(1))
        elif match:
            targets = [word for word in re.split(r"[,+ ]+", match.group(1)) if word]
        else:
            targets = None  # the framework's default
    dropout = re.search(r"dropout[ =]?(0?\.\d+|0)\b", t)
    return {
        "rank": int(rank.group(1)),
        "alpha": int(alpha.group(1)),
        "targets": targets,
        "dropout": float(dropout.group(1)) if dropout else None,
        "rslora": "use_rslora=True" in t,
    }


def trainable_in_notes(notes, peft):
    """The trainable-parameter count a row's notes (or peft column) state, else None."""
    match = re.search(r"trainable(?: params)?[ =]([\d,]+)", f"{peft}; {notes}")
    return int(match.group(1).replace(",", "")) if match else None


def unmodelled_of(row):
    """What the run had that the contract has no field for (a list of short phrases)."""
    framework, notes, kind = row["framework"].lower(), row["notes"].lower(), row["measure_kind"].lower()
    text = " ".join((framework, notes, row["parallelism"].lower(), row["precision"].lower()))
    found = []
    if "(thunder;" in framework:
        found.append("Lightning Thunder compiler")
    elif re.search(r"torch\.compile|compiled|\+ ?compile|compile enabled|compile on", text):
        found.append("torch.compile")
    if "chunked" in notes:
        found.append("chunked cross-entropy")
    if "unsloth" in framework:
        found.append("Unsloth kernels")
    if "liger" in text:
        found.append("Liger kernels")
    if "padding_free=true" in text:
        found.append("padding-free batches")
    if any(word in kind for word in ("incl. eval", "includes validation", "incl. periodic eval")):
        found.append("evaluation phase inside the peak")
    if "set_per_process_memory_fraction" in row["gpu"]:
        found.append("allocator capped with set_per_process_memory_fraction")
    if "full_state_dict save" in notes:
        found.append("checkpoint save inside the peak")
    return found


# ============================================================================ the architectures
# Published config.json values, keyed by the model id they come from. `kind` picks the
# transformers config class (or one of public_rows' builders).


def _llama3_rope(factor, theta=500000.0):
    return {
        "rope_theta": theta,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }


def _llama(hidden, layers, heads, kv, inter, vocab, max_pos, theta=10000.0, tie=False, eps=1e-5, **extra):
    return dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        rope_theta=theta,
        tie_word_embeddings=tie,
        rms_norm_eps=eps,
        **extra,
    )


# The kinds the source's software ran with eager attention: no SDPA there (BERT in transformers
# 4.16-4.21, BLOOM, T5/mT0, BART) or attention written out (Gemma 2's logit soft-capping in LitGPT).
EAGER_KINDS = ("bert", "gemma2", "bloom", "t0", "mt5", "bart")


def eager_attention(architecture):
    """Whether the source's software ran `architecture` (a key of ARCHITECTURES) eagerly."""
    known = ARCHITECTURES.get(architecture)
    return bool(known) and known[0] in EAGER_KINDS


ARCHITECTURES = {
    # id: (kind, config kwargs, LoRA naming)
    "meta-llama/Llama-2-7b-hf": ("llama", _llama(4096, 32, 32, 32, 11008, 32000, 4096), "llama"),
    "meta-llama/Llama-2-13b-hf": ("llama", _llama(5120, 40, 40, 40, 13824, 32000, 4096), "llama"),
    "meta-llama/Llama-2-70b-hf": ("llama", _llama(8192, 80, 64, 8, 28672, 32000, 4096), "llama"),
    "meta-llama/Meta-Llama-3-8B": ("llama", _llama(4096, 32, 32, 8, 14336, 128256, 8192, 500000.0), "llama"),
    "meta-llama/Meta-Llama-3-70B": ("llama", _llama(8192, 80, 64, 8, 28672, 128256, 8192, 500000.0), "llama"),
    "meta-llama/Llama-3.1-8B": (
        "llama",
        dict(_llama(4096, 32, 32, 8, 14336, 128256, 131072), **_llama3_rope(8.0)),
        "llama",
    ),
    "meta-llama/Llama-3.1-70B": (
        "llama",
        dict(_llama(8192, 80, 64, 8, 28672, 128256, 131072), **_llama3_rope(8.0)),
        "llama",
    ),
    "meta-llama/Llama-3.1-405B": (
        "llama",
        dict(_llama(16384, 126, 128, 8, 53248, 128256, 131072), **_llama3_rope(8.0)),
        "llama",
    ),
    "meta-llama/Llama-3.2-1B": (
        "llama",
        dict(_llama(2048, 16, 32, 8, 8192, 128256, 131072, tie=True, head_dim=64), **_llama3_rope(32.0)),
        "llama",
    ),
    "meta-llama/Llama-3.2-3B": (
        "llama",
        dict(_llama(3072, 28, 24, 8, 8192, 128256, 131072, tie=True, head_dim=128), **_llama3_rope(32.0)),
        "llama",
    ),
    "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T": (
        "llama",
        _llama(2048, 22, 32, 4, 5632, 32000, 2048),
        "llama",
    ),
    "01-ai/Yi-34B": ("llama", _llama(7168, 60, 56, 8, 20480, 64000, 4096, 5000000.0), "llama"),
    "codellama/CodeLlama-34b-hf": ("llama", _llama(8192, 48, 64, 8, 22016, 32000, 16384, 1000000.0), "llama"),
    "GaLore configs/llama_7b.json": ("llama", _llama(4096, 32, 32, 32, 11008, 32000, 2048, eps=1e-6), "llama"),
    "mistralai/Mistral-7B-v0.1": (
        "mistral",
        dict(_llama(4096, 32, 32, 8, 14336, 32000, 32768), sliding_window=4096),
        "llama",
    ),
    "mistral-community/Mistral-7B-v0.2": (
        "mistral",
        dict(_llama(4096, 32, 32, 8, 14336, 32000, 32768, 1000000.0), sliding_window=None),
        "llama",
    ),
    "Qwen/Qwen2.5-7B": ("qwen2", _llama(3584, 28, 28, 4, 18944, 152064, 131072, 1000000.0, eps=1e-6), "llama"),
    "Qwen/Qwen2.5-7B-Instruct": ("qwen2", _llama(3584, 28, 28, 4, 18944, 152064, 32768, 1000000.0, eps=1e-6), "llama"),
    "Qwen/Qwen2.5-0.5B": ("qwen2", _llama(896, 24, 14, 2, 4864, 151936, 32768, 1000000.0, tie=True, eps=1e-6), "llama"),
    "Qwen/Qwen3-4B": (
        "qwen3",
        _llama(2560, 36, 32, 8, 9728, 151936, 40960, 1000000.0, tie=True, eps=1e-6, head_dim=128),
        "llama",
    ),
    "Qwen/Qwen3-8B": (
        "qwen3",
        _llama(4096, 36, 32, 8, 12288, 151936, 40960, 1000000.0, eps=1e-6, head_dim=128),
        "llama",
    ),
    "google/gemma-2b": (
        "gemma",
        dict(
            _llama(2048, 18, 8, 1, 16384, 256000, 8192, tie=True, eps=1e-6),
            head_dim=256,
            hidden_activation="gelu_pytorch_tanh",
        ),
        "llama",
    ),
    "google/gemma-7b": (
        "gemma",
        dict(
            _llama(3072, 28, 16, 16, 24576, 256000, 8192, tie=True, eps=1e-6),
            head_dim=256,
            hidden_activation="gelu_pytorch_tanh",
        ),
        "llama",
    ),
    "google/gemma-2-2b": (
        "gemma2",
        dict(
            _llama(2304, 26, 8, 4, 9216, 256000, 8192, tie=True, eps=1e-6),
            head_dim=256,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=256,
            sliding_window=4096,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),
        "llama",
    ),
    "google/gemma-2-9b": (
        "gemma2",
        dict(
            _llama(3584, 42, 16, 8, 14336, 256000, 8192, tie=True, eps=1e-6),
            head_dim=256,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=256,
            sliding_window=4096,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),
        "llama",
    ),
    "microsoft/phi-1_5": (
        "phi",
        dict(
            hidden_size=2048,
            num_hidden_layers=24,
            num_attention_heads=32,
            intermediate_size=8192,
            vocab_size=51200,
            max_position_embeddings=2048,
            partial_rotary_factor=0.5,
            rope_theta=10000.0,
            layer_norm_eps=1e-5,
            hidden_act="gelu_new",
            tie_word_embeddings=False,
        ),
        "phi",
    ),
    "microsoft/phi-2": (
        "phi",
        dict(
            hidden_size=2560,
            num_hidden_layers=32,
            num_attention_heads=32,
            intermediate_size=10240,
            vocab_size=51200,
            max_position_embeddings=2048,
            partial_rotary_factor=0.4,
            rope_theta=10000.0,
            layer_norm_eps=1e-5,
            hidden_act="gelu_new",
            tie_word_embeddings=False,
        ),
        "phi",
    ),
    "microsoft/Phi-3-mini-4k-instruct": (
        "phi3",
        dict(_llama(3072, 32, 32, 32, 8192, 32064, 4096), sliding_window=2047),
        "phi3",
    ),
    "tiiuae/falcon-7b": (
        "falcon",
        dict(
            hidden_size=4544,
            num_hidden_layers=32,
            num_attention_heads=71,
            multi_query=True,
            new_decoder_architecture=False,
            parallel_attn=True,
            bias=False,
            alibi=False,
            vocab_size=65024,
            layer_norm_epsilon=1e-5,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        ),
        "fused",
    ),
    "stabilityai/stablelm-base-alpha-3b": (
        "gpt_neox",
        dict(
            hidden_size=4096,
            num_hidden_layers=16,
            num_attention_heads=32,
            intermediate_size=16384,
            vocab_size=50688,
            rotary_pct=0.25,
            max_position_embeddings=4096,
            layer_norm_eps=1e-5,
            use_parallel_residual=True,
            tie_word_embeddings=False,
        ),
        "neox",
    ),
    "bigscience/bloomz-7b1": (
        "bloom",
        dict(hidden_size=4096, n_layer=30, n_head=32, vocab_size=250880, layer_norm_epsilon=1e-5),
        "fused",
    ),
    "bigscience/mt0-xxl": (
        "mt5",
        dict(
            d_model=4096,
            d_ff=10240,
            d_kv=64,
            num_heads=64,
            num_layers=24,
            num_decoder_layers=24,
            vocab_size=250112,
            feed_forward_proj="gated-gelu",
            tie_word_embeddings=False,
            decoder_start_token_id=0,
            pad_token_id=0,
        ),
        "t5",
    ),
    "facebook/bart-large": (
        "bart",
        dict(
            d_model=1024,
            encoder_layers=12,
            decoder_layers=12,
            encoder_attention_heads=16,
            decoder_attention_heads=16,
            encoder_ffn_dim=4096,
            decoder_ffn_dim=4096,
            vocab_size=50265,
            max_position_embeddings=1024,
        ),
        "bart",
    ),
    # public_rows' builders
    "google-bert/bert-large-uncased": ("bert", {}, "bert"),
    "bigscience/T0_3B": ("t0", {}, "t5"),
    "timm vit_huge_patch14_224": ("timm", {"name": "vit_huge_patch14_224", "num_classes": 45}, None),
    "timm vit_giant_patch14_dinov2": (
        "timm",
        {"name": "vit_giant_patch14_dinov2", "num_classes": 45, "img_size": 224},
        None,
    ),
    "torchvision vit_l_16": ("torchvision", {"name": "vit_l_16"}, None),
    "SegFormer MiT": ("segformer", {}, None),
}

# The model column -> the architecture id (first match; lower-cased column).
MODEL_PATTERNS = [
    (r"flux|stable-diffusion", None, "diffusion model (FLUX.2 transformer / Stable Diffusion UNet)"),
    (r"faster r-cnn|mask r-cnn|retinanet|detr,", None, "MMDetection detector (mmdet/mmcv)"),
    (r"bert-large-uncased", "google-bert/bert-large-uncased", ""),
    (r"t0_3b", "bigscience/T0_3B", ""),
    (r"mt0-xxl", "bigscience/mt0-xxl", ""),
    (r"bloomz-7b1", "bigscience/bloomz-7b1", ""),
    (r"bart-large", "facebook/bart-large", ""),
    (r"vit_huge_patch14_224", "timm vit_huge_patch14_224", ""),
    (r"vit_giant_patch14_dinov2", "timm vit_giant_patch14_dinov2", ""),
    (r"torchvision vit_l_16", "torchvision vit_l_16", ""),
    (r"segformer mit-b\d", "SegFormer MiT", ""),
    (r"llama-3\.2-3b", "meta-llama/Llama-3.2-3B", ""),
    (r"llama-3\.2-1b", "meta-llama/Llama-3.2-1B", ""),
    (r"llama-3\.1-405b", "meta-llama/Llama-3.1-405B", ""),
    (r"llama-3\.1-70b", "meta-llama/Llama-3.1-70B", ""),
    (r"meta-llama-3-70b", "meta-llama/Meta-Llama-3-70B", ""),
    (r"llama-3\.1-8b|llama3-8b \(torchtitan|llama 3 8b \(torchtitan", "meta-llama/Llama-3.1-8B", ""),
    (r"meta-llama-3-8b", "meta-llama/Meta-Llama-3-8B", ""),
    (r"llama-2-70b", "meta-llama/Llama-2-70b-hf", ""),
    (r"llama-2-13b|llama 2 13b", "meta-llama/Llama-2-13b-hf", ""),
    (r"llama-2-7b|llama 2 7b|llama-2 7b", "meta-llama/Llama-2-7b-hf", ""),
    (r"galore configs/llama_7b", "GaLore configs/llama_7b.json", ""),
    (r"tinyllama|tiny-llama", "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T", ""),
    (r"mistral-7b-v0\.2|mistral 7b v0\.2", "mistral-community/Mistral-7B-v0.2", ""),
    (r"mistral-7b", "mistralai/Mistral-7B-v0.1", ""),
    (r"qwen2\.5-7b-instruct", "Qwen/Qwen2.5-7B-Instruct", ""),
    (r"qwen2\.5-7b", "Qwen/Qwen2.5-7B", ""),
    (r"qwen2\.5-0\.5b", "Qwen/Qwen2.5-0.5B", ""),
    (r"qwen3-4b", "Qwen/Qwen3-4B", ""),
    (r"qwen3 8b", "Qwen/Qwen3-8B", ""),
    (r"google/gemma-2-2b", "google/gemma-2-2b", ""),
    (r"gemma-2-9b", "google/gemma-2-9b", ""),
    (r"gemma-7b", "google/gemma-7b", ""),
    (r"gemma-2b", "google/gemma-2b", ""),
    (r"phi-1_5|phi-1\.5", "microsoft/phi-1_5", ""),
    (r"phi-2\b", "microsoft/phi-2", ""),
    (r"phi-3-mini-4k", "microsoft/Phi-3-mini-4k-instruct", ""),
    (r"falcon-7b", "tiiuae/falcon-7b", ""),
    (r"stablelm", "stabilityai/stablelm-base-alpha-3b", ""),
    (r"yi-34b", "01-ai/Yi-34B", ""),
    (r"codellama-34b", "codellama/CodeLlama-34b-hf", ""),
]


def architecture_of(model):
    """The model column -> an ARCHITECTURES id, or Out."""
    text = model.lower()
    for pattern, arch, why in MODEL_PATTERNS:
        if re.search(pattern, text):
            if arch is None:
                raise Out(MODEL, why)
            return arch
    raise Out(MODEL, f"no architecture for {model!r}")


# How the source's LoRA target words name each architecture's modules (last name component).
LORA_NAMES = {
    "llama": {
        "q": ["q_proj"],
        "k": ["k_proj"],
        "v": ["v_proj"],
        "o": ["o_proj"],
        "mlp": ["gate_proj", "up_proj", "down_proj"],
        "gate": ["gate_proj"],
        "up": ["up_proj"],
        "down": ["down_proj"],
        "head": ["lm_head"],
    },
    "phi": {
        "q": ["q_proj"],
        "k": ["k_proj"],
        "v": ["v_proj"],
        "o": ["dense"],
        "mlp": ["fc1", "fc2"],
        "head": ["lm_head"],
    },
    "phi3": {
        "q": ["qkv_proj"],
        "k": ["qkv_proj"],
        "v": ["qkv_proj"],
        "o": ["o_proj"],
        "mlp": ["gate_up_proj", "down_proj"],
        "head": ["lm_head"],
    },
    "fused": {
        "q": ["query_key_value"],
        "k": ["query_key_value"],
        "v": ["query_key_value"],
        "o": ["dense"],
        "mlp": ["dense_h_to_4h", "dense_4h_to_h"],
        "head": ["lm_head"],
        "query_key_value": ["query_key_value"],
    },
    "neox": {
        "q": ["query_key_value"],
        "k": ["query_key_value"],
        "v": ["query_key_value"],
        "o": ["dense"],
        "mlp": ["dense_h_to_4h", "dense_4h_to_h"],
        "head": ["embed_out"],
        "query_key_value": ["query_key_value"],
    },
    "t5": {"q": ["q"], "k": ["k"], "v": ["v"], "o": ["o"], "mlp": ["wi_0", "wi_1", "wo"]},
    "bert": {"q": ["query"], "k": ["key"], "v": ["value"]},
    "bart": {"q": ["q_proj"], "k": ["k_proj"], "v": ["v_proj"], "o": ["out_proj"], "mlp": ["fc1", "fc2"]},
}
# PEFT's default LoRA targets (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING) for a config
# that names none.
PEFT_DEFAULT_TARGETS = {
    "llama": ["q_proj", "v_proj"],
    "phi": ["q_proj", "v_proj"],
    "phi3": ["qkv_proj"],
    "fused": ["query_key_value"],
    "neox": ["query_key_value"],
    "t5": ["q", "v"],
    "bert": ["query", "value"],
    "bart": ["q_proj", "v_proj"],
}
WORDS = {
    "query": "q",
    "q": "q",
    "q_proj": "q",
    "key": "k",
    "k": "k",
    "k_proj": "k",
    "value": "v",
    "v": "v",
    "v_proj": "v",
    "projection": "o",
    "output_proj": "o",
    "o_proj": "o",
    "mlp": "mlp",
    "gate": "gate",
    "gate_proj": "gate",
    "up": "up",
    "up_proj": "up",
    "down": "down",
    "down_proj": "down",
    "head": "head",
    "output": "head",
    "lm_head": "head",
    "query_key_value": "query_key_value",
}


def lora_targets(words, naming):
    """The source's target words -> (module names as PEFT matches them, note)."""
    if words == "all-linear":
        return "all-linear", ""
    if words == "peft-default":
        return list(PEFT_DEFAULT_TARGETS[naming]), "PEFT's default LoRA targets for the architecture (none named)"
    names, table = [], LORA_NAMES[naming]
    for word in words:
        key = WORDS.get(word.lower(), word)
        for name in table.get(key, [word]):
            if name not in names:
                names.append(name)
    note = ""
    fused = [name for name in names if name in ("query_key_value", "qkv_proj")]
    generic = {WORDS.get(w.lower(), w) for w in words}
    if fused and not {"q", "k", "v"} <= generic and "query_key_value" not in generic:
        note = (
            f"LoRA on the whole fused {fused[0]} projection (the source adapts only the "
            f"{'/'.join(sorted(generic & {'q', 'k', 'v'}))} slices)"
        )
    return names, note


# ============================================================================ one row


def plan_row(index, row):
    """The setup of one CSV row, before any model is built: a dict, or Out (its reasons in
    `.reasons`, the first one primary). Standard library only."""
    reasons, plan, notes = [], {"row": index}, []

    def attempt(function, *args):
        try:
            return function(*args)
        except Out as out:
            reasons.append((out.reason, out.detail))
            return None

    plan["arch"] = attempt(architecture_of, row["model"])
    measured = attempt(parse_compare, row["measure_kind"])
    parallelism = attempt(parse_parallelism, row["parallelism"], row["n_gpus"])
    precision = attempt(parse_precision, row["precision"])
    checkpointing = attempt(parse_checkpointing, row["grad_checkpointing"])
    optimizer = attempt(parse_optimizer, row["optimizer"])
    peft = attempt(parse_peft, row["peft"])
    if peft and "rank" in peft and peft["targets"] is None:
        if "peft" in row["framework"].lower():
            peft["targets"] = "peft-default"
        else:
            reasons.append((NOT_STATED, "LoRA target modules"))
    micro = attempt(parse_micro_batch, row["micro_batch_size"])
    world = int(row["n_gpus"])
    accumulation = None
    if micro is not None:
        accumulation = attempt(
            parse_accumulation, row["grad_accum"], row["batch_size"], micro[0], world, row["parallelism"]
        )
    vision = plan["arch"] in ARCHITECTURES and ARCHITECTURES[plan["arch"]][0] in ("timm", "torchvision", "segformer")
    if plan["arch"] is not None:
        size = attempt(parse_image if vision else parse_sequence, row["image_size"] if vision else row["seq_len"])
    else:
        size = None
    trainable = trainable_in_notes(row["notes"], row["peft"])
    if peft and "rank" in peft and trainable is not None and "method_comparison" in row["source_url_or_repo_path"]:
        plan["check_trainable"] = trainable  # the PEFT harness: plain LoRA's count must match
    if reasons:
        order = {reason: position for position, reason in enumerate(REASONS)}
        reasons.sort(key=lambda item: order[item[0]])
        out = Out(*reasons[0])
        out.reasons = reasons
        raise out
    plan["compare"], assumed = measured
    if assumed:
        notes.append(f"compare {measured[0]!r} assumed from the measure kind ({row['measure_kind'][:60]}...)")
    plan["precision"] = precision[0]
    plan["checkpointing"] = checkpointing[0]
    plan["optimizer"], plan["optimizer_implementation"] = optimizer[0], optimizer[1]
    plan["micro"], plan["accumulation"], plan["size"] = micro[0], accumulation[0], size[0]
    plan["vision"] = vision
    plan["parallelism"] = parallelism
    notes += [
        note for note in (precision[1], checkpointing[1], optimizer[2], micro[1], accumulation[1], size[1]) if note
    ]
    plan["trainable_in_notes"] = trainable
    base = "same"
    if peft is not None and "rank" in peft:
        base = parse_base_weights(row["precision"], row["peft"])
        if (
            base == "nf4"
            and "nf4" in row["peft"]
            and "nf4-dq" not in row["peft"]
            and "double" not in (row["peft"] + row["precision"]).lower()
            and "bnb.nf4" in row["peft"]
        ):
            notes.append("NF4 without double quantisation (the contract's nf4 has it: ~0.37 bit a weight more here)")
        if "torchao" in row["peft"].lower() and base == "nf4":
            notes.append("torchao's NF4 read as bitsandbytes' NF4")
        if peft["rslora"]:
            notes.append("rsLoRA: only the adapter scale differs from LoRA")
    plan["peft"], plan["base"] = peft, base
    plan["notes"] = notes
    plan["unmodelled"] = unmodelled_of(row)
    plan["confidence"] = row["notes"].split(";")[0].strip()
    if plan["precision"] == "fp16" and plan["optimizer"].endswith("8bit"):
        raise ValueError(f"row {index}: pure fp16 with an 8-bit optimizer")
    return plan


def families_of(job):
    """The setup families a job belongs to (a row is in every family it has)."""
    found = []
    if job["precision"] != "fp32":
        found.append("precision:" + job["precision"])
    if job["activation_checkpointing"] != "none":
        found.append("checkpointing")
    if job["gradient_accumulation_steps"] > 1:
        found.append("accumulation")
    lora = job.get("lora")
    if lora:
        found.append("qlora" if lora["base_weights"] != "same" else "lora")
    elif job.get("trainable"):
        found.append("trainable_subset")
    optimizer = job["optimizer"]
    if optimizer.endswith("8bit"):
        found.append("low_bit_optimizer")
    if optimizer.startswith("paged"):
        found.append("paged_optimizer")
    if optimizer in ("adafactor", "sgd", "momentum"):
        found.append("optimizer:" + optimizer)
    parallel = job["parallelism"]
    if parallel["strategy"] in ("fsdp", "zero1", "zero2", "zero3"):
        found.append("fsdp_zero")
    if parallel["strategy"] == "ddp":
        found.append("ddp")
    if any(parallel.get(key, 1) > 1 for key in ("tensor_parallel", "pipeline_parallel", "context_parallel")):
        found.append("tp_pp_cp")
    return found or ["plain"]


# ============================================================================ building (torch)


def build(arch, plan, row):
    """(module, input_shape, input_dtype, naming, inner HF/timm model) for a planned row, on meta."""
    import torch
    from . import public_rows as pr

    kind, kwargs, naming = ARCHITECTURES[arch]
    size = plan["size"]
    eager = kind in EAGER_KINDS
    with torch.device("meta"):
        if kind == "bert":
            model = pr.bert_large_classifier()
            model.set_attn_implementation("eager")
            return model, [size], torch.int64, naming, model
        if kind == "t0":
            wrapped = pr.t0_3b()
            _untie_lm_head(wrapped.model)
            return wrapped, [size], torch.int64, naming, wrapped.model
        if kind == "timm":
            options = {k: v for k, v in kwargs.items() if k != "name"}
            model = pr.timm_model(kwargs["name"], **options)
            return model, [3, size, size], torch.float32, naming, model
        if kind == "torchvision":
            model = pr.torchvision_model(kwargs["name"])
            return model, [3, size, size], torch.float32, naming, model
        if kind == "segformer":
            variant = re.search(r"MIT-(B\d)", row["model"]).group(1)
            labels = 150 if "ADE20K" in row["head_or_task"] else 19
            wrapped = pr.segformer(variant, labels)
            return wrapped, [3, size, size], torch.float32, naming, wrapped.model
        import transformers

        config_class = {
            "llama": transformers.LlamaConfig,
            "mistral": transformers.MistralConfig,
            "qwen2": transformers.Qwen2Config,
            "qwen3": transformers.Qwen3Config,
            "gemma": transformers.GemmaConfig,
            "gemma2": transformers.Gemma2Config,
            "phi": transformers.PhiConfig,
            "phi3": transformers.Phi3Config,
            "falcon": transformers.FalconConfig,
            "gpt_neox": transformers.GPTNeoXConfig,
            "bloom": transformers.BloomConfig,
            "mt5": transformers.MT5Config,
            "bart": transformers.BartConfig,
        }[kind]
        config = config_class(**kwargs)
        attention = {"attn_implementation": "eager"} if eager else {}
        if kind in ("mt5", "bart"):
            model = transformers.AutoModelForSeq2SeqLM.from_config(config, **attention)
            if kind == "mt5":
                _untie_lm_head(model)
            return pr.Seq2SeqLoss(model, 4), [size], torch.int64, naming, model
        if "classification" in row["head_or_task"].lower():
            config.num_labels = 1
            model = transformers.AutoModelForSequenceClassification.from_config(config, **attention)
            wrapped = pr.LossOf(model, lambda ids: torch.zeros(ids.shape[0], dtype=torch.float32, device=ids.device))
            return wrapped, [size], torch.int64, naming, model
        model = transformers.AutoModelForCausalLM.from_config(config, **attention)
        return pr.LossOf(model, lambda ids: ids), [size], torch.int64, naming, model


def _untie_lm_head(model):
    """T5 v1.1 / mT5 checkpoints (T0_3B, mt0-xxl) have their own lm_head (tie_word_embeddings
    false in their config.json), which transformers 5 ties to the shared embedding all the same
    (T5Config forces tie_word_embeddings true): give the head its own (meta) weight again."""
    import torch

    if model.lm_head.weight is model.shared.weight:
        model.lm_head.weight = torch.nn.Parameter(torch.empty(model.shared.weight.shape, device="meta"))


def _strip_wrapper(description, module, wrapped):
    """Layer names as the Hugging Face model names its modules (PEFT's names): LossOf and
    Seq2SeqLoss hold the model as `.model`, so describe's paths start with `model.`. A linear
    layer whose weight another layer owns (a head tied to the embedding: describe counts the
    tensor once, at the embedding, and gives the head no features) gets its in/out features
    here, so that a LoRA on it can be sized."""
    import torch

    features = {
        name: (child.in_features, child.out_features)
        for name, child in module.named_modules()
        if isinstance(child, torch.nn.Linear)
    }
    for layer in description["layers"]:
        if layer["kind"] == "linear" and "in_features" not in layer and layer["name"] in features:
            layer["in_features"], layer["out_features"] = features[layer["name"]]
        if wrapped and layer["name"].startswith("model."):
            layer["name"] = layer["name"][len("model.") :]
    return description


def describe_row(module, shape, dtype, micro, plan, job_setup, simulate=False, name=None, wrapped=False):
    """describe's job for one row. Without `simulate` (the default) the description is
    batch-independent (`micro` unused) and cached by the caller; with it, describe simulates the
    training step at the row's micro-batch with the row's setup, `job_setup` being the job built
    from the cached description (run() copies the `simulation` it returns into the job; a step
    that cannot run on meta tensors leaves it out, with a warning on stderr)."""
    from gpucast_describe import describe_module

    if not simulate:
        return describe_module(module, shape, micro, name=name, input_dtype=dtype, simulation=False)
    lora = job_setup.get("lora")
    trainable = (job_setup.get("trainable") or {}).get("modules")
    if trainable and wrapped:  # the job's names are the inner model's (see _strip_wrapper)
        trainable = ["model." + name for name in trainable]
    return describe_module(
        module,
        shape,
        micro,
        name=name,
        input_dtype=dtype,
        simulation=True,
        optimizer=job_setup["optimizer"],
        precision=job_setup["precision"],
        optimizer_implementation=job_setup["optimizer_implementation"],
        activation_checkpointing=job_setup["activation_checkpointing"],
        lora=lora,
        trainable=trainable,
        gradient_accumulation_steps=job_setup["gradient_accumulation_steps"],
        loss="auto",
        attention="efficient",
    )


def _matches(name, target):
    """PEFT's rule: the module's name is the target, or ends with '.' + target."""
    return name == target or name.endswith("." + target)


def lora_count(layers, targets, rank, naming):
    """Parameters LoRA adds: rank x (in + out) on each targeted linear layer (all-linear: every
    linear layer but the output head, as PEFT does)."""
    heads = {"lm_head", "embed_out", "classifier", "score"}
    total, hit = 0, set()
    for layer in layers:
        if layer["kind"] != "linear" or "in_features" not in layer:
            continue
        last = layer["name"].rsplit(".", 1)[-1]
        if targets == "all-linear":
            chosen = last not in heads
        else:
            chosen = any(_matches(layer["name"], target) for target in targets)
            hit.update(target for target in targets if _matches(layer["name"], target))
        if chosen:
            total += rank * (layer["in_features"] + layer["out_features"])
    if targets != "all-linear":
        missing = [target for target in targets if target not in hit]
        if missing:
            raise ValueError(f"LoRA targets {missing} name no linear layer ({naming})")
    return total


def model_params(module):
    """(total, largest layer) parameters as DeepSpeed's model_to_params counts them (shared
    tensors once: by identity, since meta tensors have no data pointer)."""
    seen, total, largest = set(), 0, 0
    for param in module.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    for submodule in module.modules():
        largest = max(largest, sum(p.numel() for p in submodule.parameters(recurse=False)))
    return total, largest


def baselines(inner, total, largest, precision, base, parallelism):
    """DeepSpeed's ZeRO-2 / ZeRO-3 model-state figures and accelerate's "Training using Adam",
    MiB per GPU, exactly as their functions return them (bytes / 2^20)."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    world = parallelism["world_size"]
    per_node = min(world, GPUS_PER_NODE)
    nodes = max(1, world // GPUS_PER_NODE) if world > GPUS_PER_NODE else 1
    _, zero2 = estimate_zero2_model_states_mem_needs(
        total_params=total, num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=False
    )
    _, zero3, _ = estimate_zero3_model_states_mem_needs(
        total_params=total,
        largest_layer_params=largest,
        num_gpus_per_node=per_node,
        num_nodes=nodes,
        cpu_offload=False,
        cpu_offload_params=False,
    )
    size, _ = calculate_maximum_sizes(inner)
    dtype = "int4" if base == "nf4" else ("int8" if base == "int8" else ACCELERATE_DTYPE[precision])
    usage = estimate_training_usage(size, dtype)
    adam = max(usage.values())
    return {
        "deepspeed_zero2_mib": zero2 / 2**20,
        "deepspeed_zero3_mib": zero3 / 2**20,
        "accelerate_mib": adam / 2**20 if adam != -1 else None,
        "accelerate_dtype": dtype,
        "total_params": total,
        "largest_layer_params": largest,
        "accelerate_model_bytes": int(size),
        "num_gpus_per_node": per_node,
        "num_nodes": nodes,
    }


def job_of(plan, description, naming, row):
    """The POST /v1/estimate body of a planned row from its (batch-independent) description."""
    job = json.loads(json.dumps(description))
    job["model"] = row["model"].split(" (")[0]
    micro, steps = plan["micro"], plan["accumulation"]
    job["batch_size"] = micro * steps
    job["precision"] = plan["precision"]
    job["optimizer"] = plan["optimizer"]
    job["optimizer_implementation"] = plan["optimizer_implementation"]
    job["activation_checkpointing"] = plan["checkpointing"]
    job["micro_batch_size"] = micro
    job["gradient_accumulation_steps"] = steps
    job["parallelism"] = plan["parallelism"]
    notes = list(plan["notes"])
    peft = plan["peft"]
    if peft and "rank" in peft:
        targets, note = lora_targets(peft["targets"], naming)
        if note:
            notes.append(note)
        job["lora"] = {
            "rank": peft["rank"],
            "alpha": peft["alpha"],
            "target_modules": targets,
            "base_weights": plan["base"],
        }
        if peft["dropout"]:
            job["lora"]["dropout"] = peft["dropout"]
        added = lora_count(job["layers"], targets, peft["rank"], naming)
        stated = plan["trainable_in_notes"]
        if plan.get("check_trainable") is not None and added != plan["check_trainable"]:
            raise Out(VARIANT, f"{plan['check_trainable']} trainable, plain LoRA {added}")
        if stated is not None and added != stated:
            notes.append(f"LoRA parameters here {added:,}, the source's {stated:,}")
        notes.append(f"LoRA adds {added:,} parameters")
    elif peft and "ln_tuning" in peft:
        wanted = peft["ln_tuning"]
        modules = [
            layer["name"] for layer in job["layers"] if layer["params"] and layer["name"].rsplit(".", 1)[-1] in wanted
        ]
        job["trainable"] = {"modules": modules}
        count = sum(layer["params"] for layer in job["layers"] if layer["name"] in modules)
        stated = plan["trainable_in_notes"]
        if stated is not None and count != stated:
            raise ValueError(f"row {plan['row']}: LN tuning trains {count}, the notes say {stated}")
        notes.append(f"LN tuning: {len(modules)} norm layers, {count:,} parameters trained")
    return job, notes


def _reason_summary(left):
    counts = {}
    for item in left:
        counts[item["reasons"][0][0]] = counts.get(item["reasons"][0][0], 0) + 1
    return counts


def _ranges(indices):
    indices, spans, start = sorted(indices), [], None
    for position, value in enumerate(indices):
        if start is None:
            start = value
        if position + 1 == len(indices) or indices[position + 1] != value + 1:
            spans.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ", ".join(spans)


def plan_all(rows):
    """(plans, left-out records) for the CSV's rows: standard library only."""
    plans, left = [], []
    for index, row in enumerate(rows):
        try:
            plans.append(plan_row(index, row))
        except Out as out:
            left.append({"row": index, "model": row["model"], "reasons": [list(r) for r in out.reasons]})
    return plans, left


def run(layout, threads=None, simulate=False):
    import torch

    torch.set_num_threads(threads or THREADS)
    started = time.perf_counter()
    csv_path = layout.public_csv
    with open(csv_path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    plans, left = plan_all(rows)
    cache, lines, built = {}, [], {}
    for plan in plans:
        row = rows[plan["row"]]
        arch = plan["arch"]
        # One description per architecture, input size and head (SegFormer: per MiT variant and
        # label set, both in the model and task columns).
        segformer = ARCHITECTURES[arch][0] == "segformer"
        key = (
            arch,
            plan["size"],
            (row["model"], row["head_or_task"]) if segformer else "",
            "classification" in row["head_or_task"].lower(),
        )
        if key not in built:
            clock = time.perf_counter()
            module, shape, dtype, naming, inner = build(arch, plan, row)
            total, largest = model_params(module)
            description = _strip_wrapper(
                describe_row(module, shape, dtype, 1, plan, None, name=row["model"].split(" (")[0]),
                module,
                module is not inner,
            )
            built[key] = (module, shape, dtype, naming, inner, total, largest)
            cache[key] = description
            print(
                f"described {arch} {shape} in {time.perf_counter() - clock:.1f} s "
                f"({total:,} parameters, {len(description['layers'])} layers)",
                flush=True,
            )
        module, shape, dtype, naming, inner, total, largest = built[key]
        try:
            job, notes = job_of(plan, cache[key], naming, row)
        except Out as out:
            left.append({"row": plan["row"], "model": row["model"], "reasons": [[out.reason, out.detail]]})
            continue
        if simulate:
            try:
                simulated = describe_row(
                    module,
                    shape,
                    dtype,
                    plan["micro"],
                    plan,
                    job,
                    simulate=True,
                    name=row["model"].split(" (")[0],
                    wrapped=module is not inner,
                )
            except TypeError as exc:  # describe_module without the setup arguments
                raise SystemExit(f"--simulate: describe cannot simulate training setups yet ({exc})")
            if "simulation" in simulated:
                job["simulation"] = simulated["simulation"]
        line = {
            "row": plan["row"],
            "model": row["model"],
            "gpu": row["gpu"],
            "measured_mib": float(row["measured_mib"]),
            "compare": plan["compare"],
            "confidence": plan["confidence"],
            "families": families_of(job),
            "job": job,
            "baselines": baselines(inner, total, largest, plan["precision"], plan["base"], plan["parallelism"]),
            "architecture": arch,
            "notes": "; ".join(notes),
            "unmodelled": plan["unmodelled"],
        }
        p99 = re.search(r"train-steps-only memory_reserved 99th pct=(\d+) MiB", row["notes"])
        if p99:
            line["train_steps_reserved_p99_mib"] = float(p99.group(1))
        lines.append(line)
    lines.sort(key=lambda line: line["row"])
    left.sort(key=lambda item: item["row"])
    elapsed = time.perf_counter() - started
    write_jsonl_gz(layout.out(*OUT_JOBS), lines)
    with open(layout.out(*OUT_LEFT), "w") as handle:
        json.dump(left, handle, indent=1)
        handle.write("\n")
    write_doc(layout, csv_path, rows, lines, left, built, elapsed, simulate)
    print(f"{len(lines)} rows emitted, {len(left)} left out ({_reason_summary(left)}) in {elapsed:.0f} s")


def write_doc(layout, csv_path, rows, lines, left, built, elapsed, simulate):
    import platform
    import accelerate
    import deepspeed
    import timm
    import torch
    import torchvision
    import transformers
    from . import manifest as mf

    families, compares, confidence = {}, {}, {}
    for line in lines:
        for family in line["families"]:
            families[family] = families.get(family, 0) + 1
        compares[line["compare"]] = compares.get(line["compare"], 0) + 1
        confidence[line["confidence"]] = confidence.get(line["confidence"], 0) + 1
    counts = _reason_summary(left)
    details = {}
    for item in left:
        for reason, detail in item["reasons"]:
            details.setdefault((reason, detail), []).append(item["row"])
    text = (
        [
            "# data/public/setup_jobs.jsonl.gz: provenance",
            "",
            "Every row of `public_training_memory.csv` whose training setup the request contract of",
            "docs/user/setups.md can express, as a gpucast job (the body of `POST /v1/estimate`) with that",
            "setup, plus DeepSpeed's and accelerate's model-state baselines. The rules, the published",
            "configurations the models are built from and the line format: training/gpucast_training/public_setups.py.",
            "",
            "```",
            "cd training && python -m gpucast_training public-setups" + (" --simulate" if simulate else ""),
            "```",
            "",
            f"- source: `{os.path.basename(csv_path)}`, sha256 `{mf.sha256_of(csv_path)}`, {len(rows)} rows",
            f"- Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
            f"timm {timm.__version__}, torchvision {torchvision.__version__}, deepspeed {deepspeed.__version__}, "
            f"accelerate {accelerate.__version__}",
            f"- run time: {elapsed:.0f} s on {torch.get_num_threads()} thread(s); {len(built)} distinct models described",
            f"- rows emitted: {len(lines)}; rows left out: {len(left)}; together {len(lines) + len(left)}",
            "",
            "## Rows emitted, by family (a row is in each family it has)",
            "",
            "| family | rows |",
            "| --- | --- |",
        ]
        + [f"| {family} | {count} |" for family, count in sorted(families.items(), key=lambda kv: (-kv[1], kv[0]))]
        + [
            "",
            "By what was measured: " + ", ".join(f"{k} {v}" for k, v in sorted(compares.items())) + ".",
            "By the CSV's confidence: " + ", ".join(f"{k} {v}" for k, v in sorted(confidence.items())) + ".",
            "",
            "Emitted rows: " + _ranges([line["row"] for line in lines]) + ".",
            "",
            "## Rows left out, by first reason",
            "",
            "A row can have several reasons (all are in data/public/setup_left_out.json); it is counted under",
            "the first in this order.",
            "",
            "| reason | rows |",
            "| --- | --- |",
        ]
        + [f"| {reason} | {counts[reason]} |" for reason in REASONS if reason in counts]
        + [
            "",
            "## Every reason with its rows (a row appears under each of its reasons)",
            "",
        ]
        + [
            f"- {reason}{': ' + detail if detail else ''}: rows {_ranges(indices)}"
            for (reason, detail), indices in sorted(details.items(), key=lambda kv: (REASONS.index(kv[0][0]), kv[0][1]))
        ]
        + [
            "",
            "## What the lines assume",
            "",
            "- Models are built on the meta device from the published config.json values written into",
            "  public_setups.ARCHITECTURES (model id as the source), with Hugging Face's classes; LitGPT, torchtune",
            "  and fsdp_qlora runs used their own implementations of the same architectures. BERT, T0, the ViTs and",
            "  SegFormer come from public_rows' builders.",
            "- Attention: SDPA, except eager where the source's software had no SDPA (BERT in transformers",
            "  4.16-4.21, BLOOM, T5/mT0) or wrote attention out (Gemma 2's logit soft-capping in LitGPT).",
            "- Causal LMs compute their loss from labels (public_rows.LossOf); seq2seq models get 4 label",
            "  tokens (public_rows.Seq2SeqLoss). Layer names are the Hugging Face modules' (the wrapper's `model.`",
            "  prefix removed), so LoRA targets and trainable modules name them as PEFT does.",
            "- `batch_size` = micro-batch x accumulation (one data-parallel replica's optimizer step).",
            "- LoRA targets: the source's words mapped to the architecture's module names (query -> q_proj,",
            "  projection -> o_proj or dense, mlp -> the MLP's linears, head -> lm_head); on fused qkv projections",
            "  (Falcon, StableLM/GPT-NeoX, BLOOM, Phi-3) the whole fused module is the target (noted per row).",
            "- `baselines`: DeepSpeed's estimate_zero2/3_model_states_mem_needs with cpu_offload False (the",
            "  figures estimate_zero2/3_model_states_mem_needs_all_cold print on their `offload_optimizer=none`",
            "  rows), total parameters counted once per tensor and the largest module's own parameters as",
            "  model_to_params counts them; num_gpus_per_node = the row's world size up to 8, num_nodes = world / 8",
            "  beyond. accelerate: estimate_training_usage(calculate_maximum_sizes(model)[0], dtype), the",
            '  "Training using Adam" column of `accelerate estimate-memory`, on the built model (the task head',
            "  included; the CLI would build AutoModel from the Hub) with dtype float32 (fp32/tf32), float16",
            "  (fp16/amp_fp16) or bfloat16 (bf16/amp_bf16); for a 4-bit base accelerate has no training figure",
            "  (N/A: null).",
        ]
    )
    with open(layout.out(*OUT_DOC), "w") as handle:
        handle.write("\n".join(text) + "\n")
