"""docs/reports/setup-simulations.md: the training setups of `transformer_config` jobs (issue 25) checked
against describe's simulation of the same jobs.

    python -m gpucast_training setup-simulations        (from training/, or anywhere in .venv-describe)

For every case of CASES the service's figure for a config-path job (`gpucast estimate --batch`,
the release binary: target/release/gpucast, or $GPUCAST_BINARY) is set beside describe's
simulation of the same job (two training steps on meta tensors, replayed through its model of
the CUDA caching allocator), term by term, and for every pair of DELTAS the difference between
two setups is compared on both paths: what a setup adds or saves is the sharpest check, since
whatever both paths count alike cancels.

This module imports the standard library only. The describe side runs in a subprocess through
describe's venv (.venv-describe, or $GPUCAST_DESCRIBE_PYTHON) with `driver_main` below, whose
torch imports are made there. The model is built by describe's own `hf:` spec from a folder
holding the case's config.json; the setup is applied with describe's own adapters
(`apply_setup`: PEFT-style LoRA) and the rest is built the way the libraries build it, each
named beside its emulation with the source it follows:

- `lora.modules_to_save`: PEFT's ModulesToSaveWrapper (peft/utils/other.py): the original module
  frozen, a deep copy of it trained (`modules_to_save["default"]`) and called in its place.
  PEFT's default `ensure_weight_tying=False`: a tied head and embedding named both get two
  copies, not one.
- reward heads: transformers' `LlamaForSequenceClassification` (describe's `hf:` spec reads
  `architectures` and `num_labels`), trained on TRL's RewardTrainer loss,
  `-logsigmoid(r_chosen - r_rejected).mean()` over a batch of (chosen, rejected) pairs.
- `reference_model`: TRL's DPOTrainer._compute_loss (trl/trainer/dpo_trainer.py): the policy's
  forward first, its outputs kept, then the reference's forward under `no_grad` (a frozen copy
  of the loaded model for `copy`; the same model with PEFT's adapters and saved modules
  disabled for `adapters_disabled`), its log-probabilities taken row by row
  (`selective_log_softmax`, trl/trainer/utils.py) and summed per sequence. The policy's loss is
  the case's loss implementation (Hugging Face's by default), so that only the reference
  differs from the job without it (TRL's own DPO loss reads the policy's log-probabilities
  instead, which is none of the service's loss implementations).
- `loss_implementation`: `upcast_fp32` is transformers' own causal-LM loss (the model called
  with `labels`: `ForCausalLMLoss`, logits upcast to fp32); `chunked` is torchtune's
  `CEWithChunkedOutputLoss` (8 output chunks, each projected by the head, upcast and taken on
  its own); `fused` is Liger's `LigerFusedLinearCrossEntropyFunction` for bf16 weights
  (liger_kernel/ops/fused_linear_cross_entropy.py: chunks of the head's matmul whose gradients
  are made in the forward pass, the input's and the weight's gradients kept for backward);
  `native` is `F.cross_entropy` on the head's logits in their own dtype (nanoGPT's loss: no
  upcast, so 16-bit under pure bf16).

Not simulated (describe cannot express them), answered analytically in the document instead:
`master_weights: fp32` (an fp32 master copy in the optimizer, DeepSpeed's bf16 mode) and
`base_weights: gptq_int4 | awq_int4` (packed int4 checkpoints; describe's quantised bases are
bitsandbytes' int8 and NF4).
"""

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

from gpucast_training import pages

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = ("docs", "reports", "setup-simulations.md")
TERMS_OUT = ("data", "setup_simulations.json")
# The sections (and their blocks) the page keeps; every one is in docs/reports/setup-simulations.json.
KEEP = {"Deltas: what each setup adds, on both paths": [0, 1]}
COMMAND = "python -m gpucast_training setup-simulations"
MIB = 1024.0 * 1024.0

# The models: committed configs (tests/fixtures/transformer_configs/public), as the hub serves
# them. Llama-3.2-1B ties its head to the embeddings; TinyLlama does not.
CONFIGS = {
    "llama-3.2-1b": "tests/fixtures/transformer_configs/public/meta-llama__Llama-3.2-1B.json",
    "tinyllama-1.1b": "tests/fixtures/transformer_configs/public/"
    "TinyLlama__TinyLlama-1.1B-intermediate-step-1431k-3T.json",
}
SEQ_LEN = 1024
MICRO_BATCH = 2  # sequences: one (chosen, rejected) pair for the reward and DPO cases
OPTIMIZER = "adamw"
GPU = "h200"  # a card the jobs fit on many times over: no figure capped at the card
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"rank": 16, "alpha": 32, "target_modules": TARGETS}
HEADS = ("lm", "reward")
# The service's names of the fields a case sets (`gpucast vocabulary`, the client's
# vocabulary.json), read from the one file, never restated.
with open(os.path.join(REPO, "python", "src", "gpucast", "vocabulary.json")) as _vocabulary:
    _NAMES = json.load(_vocabulary)
REFERENCES = tuple(_NAMES["reference_model"])
LOSSES = tuple(_NAMES["loss_implementation"])
PRECISIONS = ("bf16", "amp_bf16")
BASES = ("same", "nf4")
# A delta is "off" when the two paths differ by more than this share of describe's delta, and
# by more than FLOOR_MIB (allocator rounding, buffers).
OFF_SHARE = 0.10
FLOOR_MIB = 32.0
TERMS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "allocated", "reserved", "figure")
TERM_LABELS = {
    "parameters": "weights",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations",
    "temporaries": "temporaries",
    "allocated": "allocated peak",
    "reserved": "reserved peak",
    "figure": "figure (reserved + CUDA context)",
}


def case(
    name,
    model,
    *,
    head="lm",
    precision="bf16",
    lora=False,
    modules_to_save=None,
    reference="none",
    loss="upcast_fp32",
    base="same",
    trainable=None,
):
    return {
        "name": name,
        "model": model,
        "head": head,
        "precision": precision,
        "lora": bool(lora),
        "modules_to_save": list(modules_to_save or []),
        "reference": reference,
        "loss": loss,
        "base": base,
        "trainable": list(trainable or []),
    }


CASES = [
    # Llama-3.2-1B, pure bf16
    case("L-full", "llama-3.2-1b"),
    case("L-lora", "llama-3.2-1b", lora=True),
    case("L-lora-mts", "llama-3.2-1b", lora=True, modules_to_save=["embed_tokens", "lm_head"]),
    case("L-lora-mts-head", "llama-3.2-1b", lora=True, modules_to_save=["lm_head"]),
    case("L-reward-full", "llama-3.2-1b", head="reward"),
    case("L-reward-lora", "llama-3.2-1b", head="reward", lora=True, modules_to_save=["score"]),
    case("L-full-ref-copy", "llama-3.2-1b", reference="copy"),
    case("L-lora-ref-copy", "llama-3.2-1b", lora=True, reference="copy"),
    case("L-lora-ref-disabled", "llama-3.2-1b", lora=True, reference="adapters_disabled"),
    case("L-full-chunked", "llama-3.2-1b", loss="chunked"),
    case("L-full-fused", "llama-3.2-1b", loss="fused"),
    case("L-full-native", "llama-3.2-1b", loss="native"),
    case("L-lora-chunked", "llama-3.2-1b", lora=True, loss="chunked"),
    case("L-lora-fused", "llama-3.2-1b", lora=True, loss="fused"),
    case("L-lora-fused-ref-disabled", "llama-3.2-1b", lora=True, loss="fused", reference="adapters_disabled"),
    case("L-lora-nf4", "llama-3.2-1b", lora=True, base="nf4"),
    case("L-freeze-last2", "llama-3.2-1b", trainable=["model.layers.14", "model.layers.15", "model.norm"]),
    # Llama-3.2-1B, autocast bf16 (fp32 weights)
    case("L-amp-full", "llama-3.2-1b", precision="amp_bf16"),
    case("L-amp-lora", "llama-3.2-1b", precision="amp_bf16", lora=True),
    case(
        "L-amp-lora-mts", "llama-3.2-1b", precision="amp_bf16", lora=True, modules_to_save=["embed_tokens", "lm_head"]
    ),
    # TinyLlama-1.1B (untied head), pure bf16
    case("T-full", "tinyllama-1.1b"),
    case("T-lora", "tinyllama-1.1b", lora=True),
    case("T-lora-mts", "tinyllama-1.1b", lora=True, modules_to_save=["embed_tokens", "lm_head"]),
    case("T-reward-full", "tinyllama-1.1b", head="reward"),
    case("T-full-ref-copy", "tinyllama-1.1b", reference="copy"),
    case("T-lora-ref-disabled", "tinyllama-1.1b", lora=True, reference="adapters_disabled"),
]

# (what is checked, the case without it, the case with it)
DELTAS = [
    ("LoRA instead of full fine-tuning (Llama-3.2-1B)", "L-full", "L-lora"),
    ("modules_to_save [embed_tokens, lm_head], tied head (Llama-3.2-1B)", "L-lora", "L-lora-mts"),
    ("modules_to_save [lm_head], tied head (Llama-3.2-1B)", "L-lora", "L-lora-mts-head"),
    ("modules_to_save [embed_tokens, lm_head], amp_bf16 (Llama-3.2-1B)", "L-amp-lora", "L-amp-lora-mts"),
    ("modules_to_save [embed_tokens, lm_head], untied head (TinyLlama)", "T-lora", "T-lora-mts"),
    ("reward head instead of the LM head, full (Llama-3.2-1B)", "L-full", "L-reward-full"),
    ("reward head (score saved) instead of the LM head, LoRA (Llama-3.2-1B)", "L-lora", "L-reward-lora"),
    ("reward head instead of the LM head, full (TinyLlama)", "T-full", "T-reward-full"),
    ("reference_model copy, full (Llama-3.2-1B)", "L-full", "L-full-ref-copy"),
    ("reference_model copy, LoRA (Llama-3.2-1B)", "L-lora", "L-lora-ref-copy"),
    ("reference_model adapters_disabled (Llama-3.2-1B)", "L-lora", "L-lora-ref-disabled"),
    (
        "reference_model adapters_disabled under a fused loss (Llama-3.2-1B)",
        "L-lora-fused",
        "L-lora-fused-ref-disabled",
    ),
    ("reference_model copy, full (TinyLlama)", "T-full", "T-full-ref-copy"),
    ("reference_model adapters_disabled (TinyLlama)", "T-lora", "T-lora-ref-disabled"),
    ("loss chunked instead of upcast_fp32, full (Llama-3.2-1B)", "L-full", "L-full-chunked"),
    ("loss fused instead of upcast_fp32, full (Llama-3.2-1B)", "L-full", "L-full-fused"),
    ("loss native (16-bit) instead of upcast_fp32, full (Llama-3.2-1B)", "L-full", "L-full-native"),
    ("loss chunked instead of upcast_fp32, LoRA (Llama-3.2-1B)", "L-lora", "L-lora-chunked"),
    ("loss fused instead of upcast_fp32, LoRA (Llama-3.2-1B)", "L-lora", "L-lora-fused"),
    ("NF4 base instead of bf16 under LoRA (Llama-3.2-1B)", "L-lora", "L-lora-nf4"),
    ("freeze tuning: the last two of 16 blocks trained (Llama-3.2-1B)", "L-full", "L-freeze-last2"),
    ("amp_bf16 instead of pure bf16, full (Llama-3.2-1B)", "L-full", "L-amp-full"),
]

# What makes a delta differ, by its pair of cases: printed under the summary only while that delta
# is off, so that a fixed service drops its note. Each names the source it reads.
NOTES = {
    ("L-full", "L-lora"): "Both paths now keep each adapted input in the adapters' fp32 (PEFT's "
    "`_cast_input_dtype`, peft/tuners/lora/layer.py), but the service counts one copy for every "
    "adapted projection, down_proj's 8,192-wide input included (2,560 MiB here), where describe's "
    "peak holds 1,518 MiB: about the copies of q, k, v, o, gate and up alone. Not resolved. And the "
    "service's full job holds the largest gradient (the embedding's) at the start of backward, "
    "where describe's peak holds none.",
    ("L-lora", "L-lora-mts"): "Both paths train two V x H copies on a tied model (PEFT's default "
    "`ensure_weight_tying=False`); the gap is the service's convention of holding the largest "
    "gradient (a head copy's) at the start of backward, which describe's peak does not hold.",
    (
        "L-lora",
        "L-lora-mts-head",
    ): "Both paths train the tied head's own copy; the gap is the service's convention of holding "
    "the largest gradient (the copy's) at the start of backward, which describe's peak does not hold.",
    ("L-amp-lora", "L-amp-lora-mts"): "As for pure bf16: the tied head's second copy, in fp32 here.",
    ("T-lora", "T-lora-mts"): "Untied: weights and optimizer state agree. The allocated gap is the service's "
    "convention of holding the largest gradient (the head copy's) at the start of "
    "backward, which describe's peak does not hold; the reserved gap is the service's "
    "allocator cache share (8 % of whatever it adds).",
    ("L-full", "L-reward-full"): "The reward job itself agrees with describe (see the cases); the gap is the LM job's "
    "upcast loss: the service counts 10 bytes a class and token at the start of backward "
    "(fp32 gradients of the log-softmax and of the upcast logits, and the bf16 logits' "
    "gradient), but transformers' ForCausalLMLoss (5.x: labels shifted, no logits copy) "
    "never holds the three at once: the peak is the log-softmax's backward, two fp32 "
    "logits-sized tensors beside the kept log-softmax; and the full job's first gradient.",
    ("L-lora", "L-reward-lora"): "As above: the reward job's peak agrees in its new parts; the gap is the LM job's "
    "upcast-loss temporaries (10 bytes a class and token counted, 8 held).",
    ("T-full", "T-reward-full"): "The reward job itself agrees with describe; the gap is in the LM job (its upcast "
    "loss's temporaries and the activations of the head).",
    ("L-full", "L-full-chunked"): "torchtune's chunked loss applies the head chunk by chunk (TransformerDecoder."
    "chunked_output) and CEWithChunkedOutputLoss upcasts one chunk at a time, each chunk's "
    "fp32 log-softmax kept (torchtune/modules/loss/ce_chunked_output_loss.py). With a "
    "trained (here tied) head, backward then makes the head's V x H weight gradient once "
    "per chunk and sums them: describe's peak is there, three V x H bf16 tensors beside the "
    "chunks' logits gradients. The service's chunked loss counts one chunk's gradients "
    "(nothing) and moves this job's peak to the optimizer step, below describe's.",
    ("L-full", "L-full-fused"): "Liger's fused linear cross-entropy makes the gradients in the forward pass and keeps "
    "them for backward: the input's (tokens x hidden) and, for a trained head, the "
    "weight's (`torch.zeros_like(weight)`, V x H); with bf16 weights (no `accum_dtype`, "
    "the default) each chunk adds `torch.mm(grad_logits.t(), x).float()`, a bf16 and an "
    "fp32 V x H temporary (liger_kernel/ops/fused_linear_cross_entropy.py). The service's "
    "fused loss keeps nothing, so it moves this job's peak to the optimizer step, below "
    "describe's, which stays in the loss. With a frozen head (LoRA) none of this exists.",
    ("L-lora", "L-lora-chunked"): "With a frozen head the chunked loss peaks at the end of the loss, in forward: "
    "CEWithChunkedOutputLoss takes the list of every chunk's bf16 logits (kept until it "
    "returns) and upcasts one chunk at a time, so the whole bf16 logits (2 bytes a class "
    "and token) and one chunk's fp32 copy sit beside the kept fp32 log-softmax; the "
    "service's chunked loss counts the kept log-softmax only. Beside that, the upcast "
    "job's 10-byte count (8 held).",
    ("L-lora", "L-lora-fused"): "With a frozen head the fused loss keeps nothing of the vocabulary on both paths; the "
    "gap is the upcast job's 10-byte count (8 held).",
    ("L-lora-fused", "L-lora-fused-ref-disabled"): "TRL's DPOTrainer runs the reference forward after the policy's "
    "(trl/trainer/dpo_trainer.py `_compute_loss`: `outputs = model(...)`, then the "
    "reference under `no_grad`), with the policy's activations held: the reference's "
    "logits (B x L x V, bf16) and one row's log-softmax (`selective_log_softmax`) come on "
    "top of them. Behind the upcast loss the start of backward (two fp32 logits-sized "
    "tensors) stays higher and the reference adds its weights only, as the service says; "
    "behind a loss that keeps little of the vocabulary the reference's forward is the "
    "peak, which the service (weights only) leaves out.",
}
CONVENTIONS = (
    "Conventions that move single terms without a setup being wrong: the two paths may peak "
    "at different moments (the service's `backward_start` or `optimizer_step`; describe's "
    "breakdown is at its own allocated peak), and then term deltas compare different moments "
    "and only the allocated peak compares like with like. The service holds the largest "
    "gradient at the start of backward; describe's peak there holds none. The service's "
    "reserved peak adds 8 % of the allocated one as allocator cache; describe replays the "
    "allocator (weights loaded once add no cache)."
)

# Service-only checks (describe cannot simulate these setups): (what, base job, changed job).
ANALYTIC = [
    ("master_weights fp32 beside pure bf16, full (Llama-3.2-1B)", "L-full", {"master_weights": "fp32"}),
    ("base_weights gptq_int4 under LoRA (Llama-3.2-1B)", "L-lora", {"base_weights": "gptq_int4"}),
    ("base_weights awq_int4 under LoRA (Llama-3.2-1B)", "L-lora", {"base_weights": "awq_int4"}),
]


def check_cases(cases=CASES, deltas=DELTAS, analytic=ANALYTIC):
    """Raises ValueError for a case list that cannot be run: duplicate names, unknown models or
    values, a setup the service refuses (saved modules or an adapters-disabled reference
    without LoRA, a quantised base without LoRA), deltas naming unknown cases or comparing
    different models."""
    names = [c["name"] for c in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate case names: {sorted(n for n in names if names.count(n) > 1)}")
    by_name = {c["name"]: c for c in cases}
    for c in cases:
        where = c["name"]
        if c["model"] not in CONFIGS:
            raise ValueError(f"{where}: unknown model {c['model']!r}")
        for key, allowed in (
            ("head", HEADS),
            ("reference", REFERENCES),
            ("loss", LOSSES),
            ("precision", PRECISIONS),
            ("base", BASES),
        ):
            if c[key] not in allowed:
                raise ValueError(f"{where}: {key} {c[key]!r} not one of {allowed}")
        if not c["lora"] and (c["modules_to_save"] or c["reference"] == "adapters_disabled" or c["base"] != "same"):
            raise ValueError(f"{where}: modules_to_save, adapters_disabled and quantised bases need LoRA")
        if c["lora"] and c["trainable"]:
            raise ValueError(f"{where}: trainable modules are freeze tuning, without LoRA")
        if c["head"] == "reward" and c["loss"] != "upcast_fp32":
            raise ValueError(f"{where}: a reward head has no loss over the vocabulary")
        if c["loss"] == "fused" and c["precision"] != "bf16":
            raise ValueError(f"{where}: the fused loss is emulated for bf16 weights only")
    for what, a, b in deltas:
        for name in (a, b):
            if name not in by_name:
                raise ValueError(f"delta {what!r}: no case {name!r}")
        if by_name[a]["model"] != by_name[b]["model"]:
            raise ValueError(f"delta {what!r}: {a} and {b} are of different models")
    for what, base, _ in analytic:
        if base not in by_name:
            raise ValueError(f"analytic {what!r}: no case {base!r}")
    return True


# ---------------------------------------------------------------------------------------------
# The two requests of a case
# ---------------------------------------------------------------------------------------------


def model_config(c, configs=None):
    """The case's config.json: the committed one, with a sequence-classification head of one
    label for a reward model."""
    if configs is not None:
        config = dict(configs[c["model"]])
    else:
        with open(os.path.join(REPO, CONFIGS[c["model"]])) as f:
            config = json.load(f)
    if c["head"] == "reward":
        arch = config.get("architectures", ["LlamaForCausalLM"])[0]
        config["architectures"] = [arch.replace("ForCausalLM", "ForSequenceClassification")]
        config["num_labels"] = 1
    return config


def lora_block(c, extra=None):
    lora = dict(LORA)
    if c["modules_to_save"]:
        lora["modules_to_save"] = list(c["modules_to_save"])
    if c["base"] != "same":
        lora["base_weights"] = c["base"]
    lora.update(extra or {})
    return lora


def service_request(c, configs=None, extra=None):
    """The body of POST /v1/estimate for case `c` (`extra`: fields changed on top of it, with
    `base_weights` going into `lora`)."""
    extra = dict(extra or {})
    body = {
        "transformer_config": model_config(c, configs),
        "seq_len": SEQ_LEN,
        "batch_size": MICRO_BATCH,
        "precision": c["precision"],
        "optimizer": OPTIMIZER,
        "gpu": GPU,
    }
    lora_extra = {k: extra.pop(k) for k in ("base_weights",) if k in extra}
    if c["lora"]:
        body["lora"] = lora_block(c, lora_extra)
    if c["reference"] != "none":
        body["reference_model"] = c["reference"]
    if c["trainable"]:
        body["trainable"] = {"modules": list(c["trainable"])}
    if c["head"] == "lm":
        body["loss_implementation"] = c["loss"]
    body.update(extra)
    return body


def describe_job(c, folder):
    """What the describe driver runs for case `c` (the model from `folder`'s config.json)."""
    return {
        "name": c["name"],
        "folder": folder,
        "head": c["head"],
        "seq_len": SEQ_LEN,
        "batch_size": MICRO_BATCH,
        "precision": c["precision"],
        "optimizer": OPTIMIZER,
        "lora": (
            {"rank": LORA["rank"], "alpha": LORA["alpha"], "target_modules": list(TARGETS), "base_weights": c["base"]}
            if c["lora"]
            else None
        ),
        "modules_to_save": list(c["modules_to_save"]),
        "reference": c["reference"],
        "loss": c["loss"],
        "trainable": list(c["trainable"]),
    }


# ---------------------------------------------------------------------------------------------
# Figures, errors, deltas
# ---------------------------------------------------------------------------------------------


def service_terms(estimate):
    """MiB by term from the service's answer: the breakdown at its peak, the allocated peak
    (everything but the allocator's cache, the CUDA context and paged state), the reserved
    peak (with the cache) and the figure."""
    memory = estimate["memory"]
    parts = memory["breakdown"]
    terms = {k: float(parts[k]) for k in TERMS[:5]}
    allocated = sum(terms.values()) + float(parts.get("collective_buffers", 0.0))
    terms["allocated"] = allocated
    terms["reserved"] = allocated + float(parts["allocator_cache"])
    terms["figure"] = float(memory["estimate_mib"])
    return {
        "terms": terms,
        "cuda_context": float(parts["cuda_context"]),
        "peak": memory.get("peak_moment"),
        "trainable_params": estimate.get("setup", {}).get("trainable_params"),
    }


def simulation_terms(result, cuda_context):
    """MiB by term from describe's simulation; its figure is the reserved peak plus the same
    CUDA context the service adds (as the service answers a simulated job)."""
    sim = result["simulation"]
    breakdown = sim["breakdown_at_peak"]
    terms = {k: breakdown.get(k, 0) / MIB for k in TERMS[:5]}
    terms["allocated"] = sim["allocated_peak_bytes"] / MIB
    terms["reserved"] = sim["reserved_peak_bytes"] / MIB
    terms["figure"] = terms["reserved"] + cuda_context
    if breakdown.get("activations", 0) == 0:
        peak = "optimizer_step"
    elif breakdown.get("gradients", 0) > 0:
        peak = "in backward"
    else:
        peak = "backward_start"
    return {
        "terms": terms,
        "peak": peak,
        "trainable_params": sim.get("trainable_params"),
        "params": result.get("params"),
    }


def relative(service, simulated):
    """(service - simulated) / simulated, None where the simulated figure is 0."""
    if simulated == 0:
        return None
    return service / simulated - 1.0


def delta(without, with_):
    """Term by term: what the second figures add to the first (MiB)."""
    return {k: with_[k] - without[k] for k in without}


def delta_off(service_delta, simulated_delta, share=OFF_SHARE, floor=FLOOR_MIB):
    """Whether a delta disagrees: the paths differ by more than `share` of describe's delta
    and by more than `floor` MiB."""
    gap = abs(service_delta - simulated_delta)
    return gap > floor and gap > share * abs(simulated_delta)


def _mib(x):
    return f"{x:,.1f}"


def _pct(x):
    return "—" if x is None else f"{100 * x:+.1f} %"


def delta_terms(a, b, service, simulated):
    """One delta's terms on both paths, MiB: `b` less `a`. `service`/`simulated` map case names to
    their terms (service_terms / simulation_terms)."""
    return delta(service[a]["terms"], service[b]["terms"]), delta(simulated[a]["terms"], simulated[b]["terms"])


def describe_setup(c):
    parts = [c["model"], c["precision"], OPTIMIZER]
    parts.append("reward head (1 label)" if c["head"] == "reward" else "LM head")
    if c["lora"]:
        lora = f"LoRA r{LORA['rank']} on {len(TARGETS)} projections"
        if c["base"] != "same":
            lora += f", {c['base']} base"
        if c["modules_to_save"]:
            lora += f", modules_to_save {c['modules_to_save']}"
        parts.append(lora)
    else:
        parts.append("full fine-tuning")
    if c["reference"] != "none":
        parts.append(f"reference {c['reference']}")
    if c["head"] == "lm":
        parts.append(f"loss {c['loss']}")
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------
# Analytic checks (service only)
# ---------------------------------------------------------------------------------------------


def linear_shapes(config):
    """(in, out) of every linear layer a Llama-family decoder quantises (all but the head)."""
    h = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or h // heads
    inter = config["intermediate_size"]
    per_layer = [
        (h, heads * head_dim),
        (h, kv * head_dim),
        (h, kv * head_dim),
        (heads * head_dim, h),
        (h, inter),
        (h, inter),
        (inter, h),
    ]
    return per_layer * config["num_hidden_layers"]


def packed_int4_bytes(shapes, kind, group=128):
    """Bytes of 4-bit checkpoints' linear layers as their kernels hold them (no bias):
    AutoGPTQ's QuantLinear: qweight int32 [in/8, out], qzeros int32 [in/group, out/8], scales
    fp16 [in/group, out], g_idx int32 [in]; AutoAWQ's WQLinear_GEMM: qweight int32 [in, out/8],
    qzeros int32 [in/group, out/8], scales fp16 [in/group, out]."""
    total = 0.0
    for i, o in shapes:
        groups = -(-i // group)
        total += i * o / 2 + groups * (o / 8) * 4 + groups * o * 2
        if kind == "gptq_int4":
            total += i * 4
    return total


def analytic_lines(what, base, extra, answers, c, config):
    """Markdown lines for one service-only check: the service's terms with and without the
    field, and what the field should add by the libraries' layouts."""
    s0 = service_terms(answers[0])["terms"]
    s1 = service_terms(answers[1])["terms"]
    lines = [
        f"### {what}: {base} with {json.dumps(extra)}",
        "",
        "| term | without MiB | with MiB | service Δ MiB |",
        "| --- | ---: | ---: | ---: |",
    ]
    for term in TERMS:
        lines.append(f"| {TERM_LABELS[term]} | {_mib(s0[term])} | {_mib(s1[term])} | {s1[term] - s0[term]:+,.1f} |")
    lines.append("")
    trainable = answers[0]["setup"]["trainable_params"]
    if "master_weights" in extra:
        expected = trainable * (4 + 2 * 4 - 2 * 2) / MIB
        lines.append(
            f"Expected optimizer state Δ: {trainable:,} trained parameters x (4-byte "
            f"master + two 4-byte moments − two 2-byte moments) = {expected:+,.1f} MiB; "
            f"the service's: {s1['optimizer_state'] - s0['optimizer_state']:+,.1f} MiB "
            f"({_pct(relative(s1['optimizer_state'] - s0['optimizer_state'], expected))})."
        )
    if "base_weights" in extra:
        shapes = linear_shapes(config)
        params = sum(i * o for i, o in shapes)
        packed = packed_int4_bytes(shapes, extra["base_weights"])
        expected = (packed - 2 * params) / MIB
        lines.append(
            f"Expected weights Δ: {len(shapes)} projections, {params:,} weights, from "
            f"2 bytes each to {packed / MIB:,.1f} MiB packed = {expected:+,.1f} MiB; the "
            f"service's: {s1['parameters'] - s0['parameters']:+,.1f} MiB "
            f"({_pct(relative(s1['parameters'] - s0['parameters'], expected))})."
        )
    return lines + [""]


# ---------------------------------------------------------------------------------------------
# Running both sides
# ---------------------------------------------------------------------------------------------


def gpucast_binary():
    return os.environ.get("GPUCAST_BINARY") or os.path.join(REPO, "target", "release", "gpucast")


def describe_python():
    return os.environ.get("GPUCAST_DESCRIBE_PYTHON") or os.path.join(REPO, ".venv-describe", "bin", "python")


def answer(requests):
    """The service's answers (`gpucast estimate --batch`), one per request, in order."""
    binary = gpucast_binary()
    if not os.path.exists(binary):
        raise SystemExit(f"no gpucast binary at {binary} (cargo build --release, or $GPUCAST_BINARY)")
    env = dict(os.environ)
    env.setdefault("ORT_DYLIB_PATH", os.path.join(REPO, ".cache", "onnxruntime", "libonnxruntime.so"))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(requests, f)
    try:
        done = subprocess.run(
            [binary, "estimate", "--batch", f.name], capture_output=True, text=True, cwd=REPO, env=env, check=False
        )
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        raise SystemExit(f"gpucast estimate failed ({done.returncode}): {done.stderr[-2000:]}")
    answers = []
    for item in json.loads(done.stdout)["items"]:
        if "estimate" not in item:
            raise SystemExit(f"gpucast refused a request: {json.dumps(item)[:2000]}")
        answers.append(item["estimate"])
    return answers


def simulate(jobs, threads=1):
    """describe's results for the driver jobs, by name, through describe's venv."""
    python = describe_python()
    if not os.path.exists(python):
        raise SystemExit(
            f"no describe python at {python} (scripts/test.sh makes .venv-describe, or set $GPUCAST_DESCRIBE_PYTHON)"
        )
    env = dict(os.environ)
    # describe's venv holds gpucast_describe and gpucast_training (editable, the workspace lock).
    env["HF_HUB_OFFLINE"] = "1"
    code = "from gpucast_training.setup_simulations import driver_main; driver_main()"
    done = subprocess.run(
        [python, "-c", code],
        input=json.dumps({"jobs": jobs, "threads": threads}),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"describe driver failed ({done.returncode}): {done.stderr[-3000:]}")
    payload = json.loads(done.stdout)
    return payload


def git_commit_time():
    """HEAD's commit time (seconds since the epoch), None when git cannot say."""
    try:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%ct"], capture_output=True, text=True, cwd=REPO, check=False
        ).stdout.strip()
        return int(out) if out else None
    except (OSError, ValueError):
        return None


def git_commit():
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO, check=False
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        return "unknown"


def run(layout=None, threads=None, **_):
    check_cases()
    started = time.time()
    configs = {}
    for name, path in CONFIGS.items():
        with open(os.path.join(REPO, path)) as f:
            configs[name] = json.load(f)
    with tempfile.TemporaryDirectory() as scratch:
        jobs, folders = [], {}
        for c in CASES:
            key = (c["model"], c["head"])
            if key not in folders:
                folder = os.path.join(scratch, f"{c['model']}-{c['head']}")
                os.makedirs(folder)
                with open(os.path.join(folder, "config.json"), "w") as f:
                    json.dump(model_config(c, configs), f)
                folders[key] = folder
            jobs.append(describe_job(c, folders[key]))
        print(f"describe: simulating {len(jobs)} cases", flush=True)
        payload = simulate(jobs, threads or 1)
    results = {r["name"]: r for r in payload["results"]}
    by_name = {c["name"]: c for c in CASES}
    analytic_requests = []
    for _, base, extra in ANALYTIC:
        analytic_requests += [service_request(by_name[base], configs), service_request(by_name[base], configs, extra)]
    answers = answer([service_request(c, configs) for c in CASES] + analytic_requests)
    service = {c["name"]: service_terms(a) for c, a in zip(CASES, answers)}
    analytic_answers = answers[len(CASES) :]
    simulated, failed = {}, {}
    for c in CASES:
        r = results.get(c["name"])
        if r is None or r.get("error"):
            failed[c["name"]] = (r or {}).get("error", "no result")
        else:
            simulated[c["name"]] = simulation_terms(r, service[c["name"]]["cuda_context"])
    text = report(service, simulated, failed, analytic_answers, configs, payload, time.time() - started)
    path = layout.out(*OUT) if layout is not None else os.path.join(REPO, *OUT)
    with open(os.path.join(REPO, *TERMS_OUT), "w") as f:
        json.dump(terms_by_case(service, simulated), f, indent=1, sort_keys=True)
        f.write("\n")
    print(pages.write(path, text, KEEP, "setup-simulations"))


def render(layout=None):
    """`setup-simulations --from-data`: the page again from docs/reports/setup-simulations.json."""
    path = layout.out(*OUT) if layout is not None else os.path.join(REPO, *OUT)
    print(pages.render(path, KEEP, "setup-simulations"))


def terms_by_case(service, simulated, cases=CASES, deltas=DELTAS):
    """Every case's terms on both paths and every delta's, MiB: the detail behind the report's
    tables, as data."""
    cases = {
        c["name"]: {
            "setup": describe_setup(c),
            "service": {t: round(service[c["name"]]["terms"][t], 1) for t in TERMS},
            "describe": {t: round(simulated[c["name"]]["terms"][t], 1) for t in TERMS}
            if c["name"] in simulated
            else None,
        }
        for c in cases
    }
    out = []
    for what, a, b in deltas:
        if a in simulated and b in simulated:
            ds, dd = delta_terms(a, b, service, simulated)
            out.append(
                {
                    "setup": what,
                    "cases": [b, a],
                    "service": {t: round(ds[t], 1) for t in TERMS},
                    "describe": {t: round(dd[t], 1) for t in TERMS},
                }
            )
    return {"cases": cases, "deltas": out}


def report(service, simulated, failed, analytic_answers, configs, payload, elapsed):
    by_name = {c["name"]: c for c in CASES}
    binary = gpucast_binary()
    built = (
        datetime.datetime.fromtimestamp(os.path.getmtime(binary), datetime.timezone.utc)
        if os.path.exists(binary)
        else None
    )
    lines = [
        "# Training setups of config-path jobs against describe's simulation",
        "",
        f"Made by `{COMMAND}` (from training/), "
        f"{datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}, at commit "
        f"`{git_commit()}`, in {elapsed:.0f} s. The service: `{os.path.relpath(binary, REPO)}`"
        + (f" (built {built.strftime('%Y-%m-%d %H:%M UTC')})" if built else "")
        + f", `gpucast estimate --batch`. describe: torch {payload.get('torch')}, transformers "
        f"{payload.get('transformers')}, `simulate_step` (two steps on meta tensors through the "
        "caching-allocator model). The module's docstring "
        "(training/gpucast_training/setup_simulations.py) says how each setup is built on the "
        "describe side and which library source each emulation follows.",
        "",
        (
            f"Every job: {SEQ_LEN} tokens, micro-batch {MICRO_BATCH} (one step, no accumulation), "
            f"{OPTIMIZER} (foreach), LoRA rank {LORA['rank']} alpha {LORA['alpha']} on "
            f"{', '.join(TARGETS)} where LoRA is used, one GPU ({GPU}: no figure capped). Terms are "
            "each path's breakdown at its own peak; the allocated peak is their sum "
            "(`max_memory_allocated`), the reserved peak adds the allocator's cache "
            "(`max_memory_reserved`), the figure adds the service's CUDA context to both. Error: "
            "(service − describe) / describe."
        ),
        "",
    ]
    committed = git_commit_time()
    if built is not None and committed is not None and built.timestamp() < committed:
        when = datetime.datetime.fromtimestamp(committed, datetime.timezone.utc)
        lines += [
            f"**The binary is older than the commit** (committed {when.strftime('%Y-%m-%d %H:%M UTC')}): "
            "the service's figures are those of the code it was built from, which may lack the "
            "commit's last changes.",
            "",
        ]
    # Summary of the deltas
    lines += [
        "## Deltas: what each setup adds, on both paths",
        "",
        (
            "| setup | cases | service Δ allocated MiB | describe Δ allocated MiB | "
            "service Δ figure MiB | describe Δ figure MiB | off terms |"
        ),
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    off_pairs = []
    for what, a, b in DELTAS:
        if a not in simulated or b not in simulated:
            lines.append(f"| {what} | {b} − {a} | — | — | — | — | not simulated |")
            continue
        ds, dd = delta_terms(a, b, service, simulated)
        off = [TERM_LABELS[t] for t in TERMS if delta_off(ds[t], dd[t])]
        if delta_off(ds["allocated"], dd["allocated"]):
            off_pairs.append((what, a, b))
        lines.append(
            f"| {what} | {b} − {a} | {ds['allocated']:+,.1f} | {dd['allocated']:+,.1f} | "
            f"{ds['figure']:+,.1f} | {dd['figure']:+,.1f} | {', '.join(off) or 'none'} |"
        )
    lines += [
        "",
        f"A term is **off** when the paths' deltas differ by more than "
        f"{100 * OFF_SHARE:.0f} % of describe's and by more than {FLOOR_MIB:.0f} MiB. " + CONVENTIONS,
        "",
    ]
    if off_pairs:
        lines += ["### Why the deltas that are off differ", ""]
        for what, a, b in off_pairs:
            lines.append(f"- {b} − {a} ({what}): {NOTES.get((a, b), 'no reading recorded.')}")
        lines.append("")
    lines += [
        "## Cases: both figures",
        "",
        (
            "| case | setup | service figure MiB | describe figure MiB | error | service allocated "
            "MiB | describe allocated MiB | error |"
        ),
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in CASES:
        name = c["name"]
        s = service[name]["terms"]
        if name not in simulated:
            lines.append(
                f"| {name} | {describe_setup(c)} | {_mib(s['figure'])} | — | — | {_mib(s['allocated'])} | — | — |"
            )
            continue
        d = simulated[name]["terms"]
        lines.append(
            f"| {name} | {describe_setup(c)} | {_mib(s['figure'])} | {_mib(d['figure'])} | "
            f"{_pct(relative(s['figure'], d['figure']))} | {_mib(s['allocated'])} | "
            f"{_mib(d['allocated'])} | {_pct(relative(s['allocated'], d['allocated']))} |"
        )
    lines.append("")
    if failed:
        lines += ["Not simulated:", ""] + [f"- {n}: {e}" for n, e in failed.items()] + [""]
    lines += [
        f"Each case's and each delta's terms on both paths: `{'/'.join(TERMS_OUT)}` (written with this page).",
        "",
    ]
    lines += [
        "## Not simulated: the service against the libraries' layouts",
        "",
        (
            "describe cannot express these setups (its optimizers keep their state in the "
            "weights' dtype and have no master copy; its quantised bases are bitsandbytes' int8 "
            "and NF4), so the service's delta is set against the bytes the libraries' layouts "
            "hold."
        ),
        "",
    ]
    for i, (what, base, extra) in enumerate(ANALYTIC):
        c = by_name[base]
        lines += analytic_lines(what, base, extra, analytic_answers[2 * i : 2 * i + 2], c, model_config(c, configs))
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------
# The describe side (run by describe's venv: torch, transformers, gpucast_describe)
# ---------------------------------------------------------------------------------------------


def _torch_side():
    """The modules and functions the driver builds jobs with; torch is imported here only."""
    import copy

    import torch
    import torch.nn.functional as F
    from gpucast_describe.adapters import LoraLinear, apply_setup
    from torch import nn

    class SavedCopy(nn.Module):
        """PEFT's ModulesToSaveWrapper (peft/utils/other.py): `original_module` frozen, a deep
        copy in `modules_to_save["default"]` trained and called instead; with the adapters
        disabled (a reference pass), the original."""

        def __init__(self, original):
            super().__init__()
            self.original_module = original
            self.modules_to_save = nn.ModuleDict({"default": copy.deepcopy(original)})
            self.original_module.requires_grad_(False)
            self.disabled = False

        def forward(self, *args, **kwargs):
            module = self.original_module if self.disabled else self.modules_to_save["default"]
            return module(*args, **kwargs)

    def wrap_saved(model, keys):
        """Wraps every module PEFT's modules_to_save keys name (the whole name or its last
        components); returns the trained copies' name prefixes."""
        named = [(n, m) for n, m in model.named_modules() if n]
        chosen = [n for n, _ in named if any(n == k or n.endswith("." + k) for k in keys)]
        if not chosen:
            raise ValueError(f"modules_to_save {keys} names no module")
        for name in chosen:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, SavedCopy(parent.get_submodule(child)))
        return [f"{n}.modules_to_save" for n in chosen]

    def next_pow2(n):
        return 1 << max(0, (int(n) - 1).bit_length())

    class LigerFlce(torch.autograd.Function):
        """liger_kernel/ops/fused_linear_cross_entropy.py for bf16 weights (no accum_dtype):
        chunks of the head's matmul, the cross-entropy kernel writing the logits' gradient in
        place, the input's gradient and (a trained head) the weight's made in forward and kept
        for backward, which returns them (grad_output 1: no rescaling)."""

        @staticmethod
        def forward(ctx, x, weight, target):
            bt, h = x.shape
            v = weight.shape[0]
            inc_factor = -(-v // h)
            chunk = next_pow2(-(-bt // inc_factor))
            grad_input = torch.zeros_like(x)
            grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
            loss_1d = torch.zeros(bt, dtype=torch.float32, device=x.device)
            for start in range(0, bt, chunk):
                x_chunk = x[start : start + chunk]
                logits = (x_chunk @ weight.t()).contiguous()
                # liger_cross_entropy_kernel: loss into loss_1d, gradient into logits, in place
                grad_input[start : start + chunk] = logits @ weight
                if grad_weight is not None:
                    grad_weight += torch.mm(logits.t(), x_chunk).float()
                del logits
            loss = torch.sum(loss_1d)
            ctx.save_for_backward(grad_input.detach(), grad_weight.detach() if grad_weight is not None else None)
            return loss

        @staticmethod
        def backward(ctx, grad_output):
            grad_input, grad_weight = ctx.saved_tensors
            return grad_input, grad_weight, None

    def shifted(labels):
        return F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()

    def lm_loss(model, ids, loss):
        """The policy's loss and the output the training loop keeps while it is taken."""
        if loss == "upcast_fp32":  # transformers' ForCausalLMLoss
            out = model(input_ids=ids, labels=ids)
            return out.loss, out
        hidden = model.model(input_ids=ids).last_hidden_state
        head = model.lm_head
        if loss == "chunked":  # torchtune: chunked_output + CEWithChunkedOutputLoss (8 chunks)
            chunks = [head(c) for c in hidden.tensor_split(8, dim=1)]
            labels = [t.reshape(-1) for t in shifted(ids).tensor_split(8, dim=1)]
            total = (shifted(ids) != -100).sum()
            value = 0.0
            for logits, target in zip(chunks, labels):
                value = value + F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).float(), target, ignore_index=-100, reduction="sum"
                )
            del chunks
            return value / total, None
        if loss == "fused":  # Liger's LigerForCausalLMLoss
            weight = head.weight
            value = LigerFlce.apply(hidden.reshape(-1, hidden.shape[-1]), weight, shifted(ids).reshape(-1))
            return value, None
        if loss == "native":  # F.cross_entropy on the logits in their own dtype (nanoGPT)
            logits = head(hidden)
            value = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted(ids).reshape(-1), ignore_index=-100)
            return value, None
        raise ValueError(f"loss {loss!r}")

    def set_disabled(model, disabled):
        """PEFT's disable_adapter(): LoRA layers run their base, saved modules their original."""
        for module in model.modules():
            if isinstance(module, LoraLinear):
                if disabled:
                    module.forward = module.base_layer.forward
                else:
                    module.__dict__.pop("forward", None)
            if isinstance(module, SavedCopy):
                module.disabled = disabled

    def selective_log_softmax(logits, index):
        """trl/trainer/utils.py, the bf16 branch: row by row."""
        rows = []
        for row_logits, row_labels in zip(logits, index.unsqueeze(-1)):
            rows.append(F.log_softmax(row_logits, dim=-1).gather(dim=-1, index=row_labels))
        return torch.stack(rows).squeeze(-1)

    class Step(nn.Module):
        """One training step's forward and loss: the policy (`model`), and for DPO-style jobs
        the reference pass after it, as TRL's DPOTrainer._compute_loss runs it."""

        def __init__(self, model, head, loss, reference=None, reference_kind="none"):
            super().__init__()
            self.model = model
            self.reference = reference
            self.head, self.loss, self.reference_kind = head, loss, reference_kind

        def forward(self, ids):
            if self.head == "reward":  # TRL's RewardTrainer: pairs (chosen, rejected)
                rewards = self.model(input_ids=ids).logits.float()
                value = -F.logsigmoid(rewards[0::2] - rewards[1::2]).mean()
                outputs = None
            else:
                value, outputs = lm_loss(self.model, ids, self.loss)
            if self.reference_kind != "none":
                with torch.no_grad():
                    if self.reference_kind == "copy":
                        ref_logits = self.reference(input_ids=ids).logits
                    else:
                        set_disabled(self.model, True)
                        try:
                            ref_logits = self.model(input_ids=ids).logits
                        finally:
                            set_disabled(self.model, False)
                    ref_logps = selective_log_softmax(ref_logits[..., :-1, :], ids[..., 1:])
                    del ref_logits
                    ref_logps = ref_logps.sum(dim=1)
                value = value + 0.0 * ref_logps.sum()
            del outputs
            return value

    def build(job, base):
        """The step module for `job` from `base` (the model as loaded, fp32 on meta)."""
        model = copy.deepcopy(base)
        reference = None
        if job["reference"] == "copy":
            reference = copy.deepcopy(base)
            reference.requires_grad_(False)
            reference.eval()
        prefixes = wrap_saved(model, job["modules_to_save"]) if job["modules_to_save"] else None
        if job["lora"] is not None:
            apply_setup(model, lora=dict(job["lora"]), trainable=prefixes)
        elif job["trainable"]:
            apply_setup(model, trainable=job["trainable"])
        return Step(model, job["head"], job["loss"], reference, job["reference"])

    return build


def driver_main():
    """Runs in describe's venv: reads {"jobs": [...], "threads": n} on stdin, writes {"results":
    [...], "torch", "transformers"} on stdout (one result per job: its simulation, or its
    error)."""
    payload = json.load(sys.stdin)
    import torch
    import transformers
    from gpucast_describe.simulate import simulate_step
    from gpucast_describe.specs import resolve_spec

    torch.set_num_threads(int(payload.get("threads") or 1))
    build = _torch_side()
    bases = {}
    results = []
    for job in payload["jobs"]:
        clock = time.perf_counter()
        try:
            if job["folder"] not in bases:
                bases[job["folder"]] = resolve_spec("hf:" + job["folder"]).module
            base = bases[job["folder"]]
            step = build(job, base)
            params = sum(p.numel() for p in step.model.parameters())
            sim = simulate_step(
                step,
                [job["seq_len"]],
                job["batch_size"],
                torch.int64,
                optimizer=job["optimizer"],
                precision=job["precision"],
            )
            results.append(
                {
                    "name": job["name"],
                    "simulation": sim,
                    "params": params,
                    "seconds": round(time.perf_counter() - clock, 2),
                }
            )
        except Exception as exc:  # noqa: BLE001 (reported; the other jobs still run)
            results.append({"name": job["name"], "error": f"{type(exc).__name__}: {exc}"[:500]})
        print(f"{job['name']}: {time.perf_counter() - clock:.1f} s", file=sys.stderr, flush=True)
    json.dump({"results": results, "torch": torch.__version__, "transformers": transformers.__version__}, sys.stdout)


if __name__ == "__main__":
    run()
