"""Job descriptions and feature extraction for the gpucast estimators.

Pure standard library on purpose: the service's CI runs the feature tests without numpy or
torch, and the Rust implementation in src/ must agree with this file bit for bit (up to float
rounding).  The definitions follow docs/design/models.md; keep the two in step.
"""

import ast
import json
import math
from pathlib import Path

from .constants import MIB, MLP_CLASS_BINS_MIB

# The service's layer-kind vocabulary (`gpucast layer-kinds`, openapi/layer_kinds.json): every
# canonical kind in the order of the real-model sequence estimators' `kind_vocab`, the aliases a
# name may arrive as, and the groups features count. Read from the one file, never restated.
with open(Path(__file__).resolve().parents[2] / "openapi" / "layer_kinds.json") as _vocabulary:
    _LAYER_KINDS = json.load(_vocabulary)
ALL_KINDS = _LAYER_KINDS["kinds"]
KIND_ALIASES = _LAYER_KINDS["aliases"]
ACTIVATION_KINDS = _LAYER_KINDS["groups"]["activation"]
CONV_KINDS = _LAYER_KINDS["groups"]["convolution"]
NORM_KINDS = _LAYER_KINDS["groups"]["normalisation"]

# Canonical layer kinds, in the order used for the sequence model's `kind_vocab`.
CANONICAL_KINDS = [
    "linear",
    "batch_norm",
    "dropout",
    "relu",
    "leaky_relu",
    "prelu",
    "elu",
    "selu",
    "gelu",
    "silu",
    "mish",
    "softplus",
    "tanh",
    "sigmoid",
    "softmax",
    "identity",
]


# Output-layer activations: never the hidden activation.
OUTPUT_ACTIVATIONS = ("softmax", "sigmoid")

# Candidates for the one-hot `act_<name>` features.
HIDDEN_ACTIVATIONS = [
    "relu",
    "leaky_relu",
    "prelu",
    "elu",
    "selu",
    "gelu",
    "silu",
    "mish",
    "softplus",
    "tanh",
    "identity",
]

COUNT_FEATURES = [
    "depth",
    "n_layers",
    "total_params",
    "total_activations",
    "batch_size",
    "activations_x_batch",
    "params_x_batch",
    "max_output_size",
    "n_batch_norm",
    "n_dropout",
    "n_activation",
]
# Features added for the real-model families (docs/design/models.md "Real-model families").
REAL_COUNT_FEATURES = [
    "n_conv",
    "n_attention",
    "n_norm",
    "n_embedding",
    "input_pixels",
    "conv_outputs_x_batch",
    "norm_outputs_x_batch",
    "activation_outputs_x_batch",
    "linear_outputs_x_batch",
    "attention_outputs_x_batch",
    "other_outputs_x_batch",
    "first_principles_mib",
    "traced_first_principles_mib",
    "horus_mib",
]
# The whole-step simulation's figures (bytes / 2^20; 0 without a simulation): allocated,
# reserved and minimum capacity, then the allocated bytes at the peak by category.
SIMULATION_CATEGORIES = ["parameters", "gradients", "optimizer_state", "activations", "temporaries"]
SIMULATION_FEATURES = ["sim_allocated_mib", "sim_reserved_mib", "sim_min_capacity_mib"] + [
    "sim_%s_mib" % category for category in SIMULATION_CATEGORIES
]
AGGREGATE_FEATURES = COUNT_FEATURES + ["act_" + name for name in HIDDEN_ACTIVATIONS]
ALL_AGGREGATE_FEATURES = (
    COUNT_FEATURES + REAL_COUNT_FEATURES + SIMULATION_FEATURES + ["act_" + name for name in HIDDEN_ACTIVATIONS]
)

# Analytic memory models (Rust src/physics/analytic.rs).
FRAMEWORK_OVERHEAD_MIB = 1300.0
MAX_SAVED_BYTES = 1 << 44
OPTIMIZER_ALIASES = {
    "sgd": "sgd",
    "momentum": "momentum",
    "sgd_momentum": "momentum",
    "nesterov": "momentum",
    "adam": "adam",
    "adamw": "adamw",
}
OPTIMIZER_STATE_BYTES = {"sgd": 0.0, "momentum": 4.0, "adam": 8.0, "adamw": 8.0}
# The service's six precisions in the three memory layouts the formulas know (src/job/setup.rs):
# fp32 storage (fp32, tf32), autocast with fp32 master weights (mixed16), pure 16-bit (pure16).
PRECISION_ALIASES = {
    "fp32": "fp32",
    "float32": "fp32",
    "tf32": "fp32",
    "mixed16": "mixed16",
    "amp": "mixed16",
    "amp_fp16": "mixed16",
    "amp_bf16": "mixed16",
    "bf16": "pure16",
    "bfloat16": "pure16",
    "fp16": "pure16",
    "float16": "pure16",
}
# Bytes per weight and per activation element of each layout.
PRECISION_BYTES = {"fp32": (4.0, 4.0), "mixed16": (6.0, 2.0), "pure16": (2.0, 2.0)}
MAX_INPUT_DIMENSION = 1000000

TOKEN_FEATURES = ["output_size", "params", "batch_size", "output_x_batch", "position"]

# Default transform per raw feature when building a manifest (one-hots and position stay linear).
DEFAULT_TRANSFORMS = {name: "log1p" for name in COUNT_FEATURES + REAL_COUNT_FEATURES + SIMULATION_FEATURES}
DEFAULT_TRANSFORMS.update({"act_" + name: "identity" for name in HIDDEN_ACTIVATIONS})
DEFAULT_TOKEN_TRANSFORMS = {
    "output_size": "log1p",
    "params": "log1p",
    "batch_size": "log1p",
    "output_x_batch": "log1p",
    "position": "identity",
}

# The MLP estimators' classes (constants.py); memory_class's default bins.
CLASS_BINS_MIB = MLP_CLASS_BINS_MIB


def normalise_kind(kind):
    """Map any accepted spelling of a layer kind to its canonical name."""
    key = str(kind).lower().replace("_", "").replace("-", "").replace(" ", "")
    if key not in KIND_ALIASES:
        raise ValueError("unknown layer kind: %r" % (kind,))
    return KIND_ALIASES[key]


def infer_family(kinds):
    """Attention blocks make a transformer; otherwise convolutions make a CNN (Rust Family::infer)."""
    if "attention" in kinds:
        return "transformer"
    if any(kind in CONV_KINDS for kind in kinds):
        return "cnn"
    return "mlp"


def normalise_job(job):
    """Return a copy of `job` with canonical layer kinds, optimizer and precision, validated.

    `optimizer` defaults to adam and `precision` to fp32; `input_shape` is kept when given.
    """
    batch_size = job["batch_size"]
    if batch_size is None or batch_size <= 0:
        raise ValueError("batch_size must be positive")
    layers = job.get("layers") or []
    if not layers:
        raise ValueError("a job needs at least one layer")
    normalised = []
    for layer in layers:
        output_size, params = layer["output_size"], layer["params"]
        if output_size < 0 or params < 0:
            raise ValueError("output_size and params must be non-negative")
        normalised.append({"kind": normalise_kind(layer["kind"]), "output_size": output_size, "params": params})
    optimizer = job.get("optimizer")
    optimizer = "adam" if optimizer is None else OPTIMIZER_ALIASES.get(str(optimizer).lower())
    if optimizer is None:
        raise ValueError("unknown optimizer: %r" % (job.get("optimizer"),))
    precision = job.get("precision")
    precision = "fp32" if precision is None else PRECISION_ALIASES.get(str(precision).lower())
    if precision is None:
        raise ValueError("unknown precision: %r" % (job.get("precision"),))
    input_shape = job.get("input_shape")
    if input_shape is not None:
        if not (1 <= len(input_shape) <= 5) or not all(0 < d <= MAX_INPUT_DIMENSION for d in input_shape):
            raise ValueError("input_shape must hold 1 to 5 positive dimensions of at most 1,000,000")
        input_shape = [int(d) for d in input_shape]
    saved = job.get("saved_tensors")
    if saved is not None:
        saved = {"per_sample_bytes": int(saved["per_sample_bytes"]), "fixed_bytes": int(saved["fixed_bytes"])}
        if not all(0 <= v <= MAX_SAVED_BYTES for v in saved.values()):
            raise ValueError("saved_tensors counts must be between 0 and 2^44")
    simulation = job.get("simulation")
    if simulation is not None:
        simulation = normalise_simulation(simulation, batch_size, optimizer, precision)
    family = job.get("family") or infer_family([layer["kind"] for layer in normalised])
    return {
        "family": family,
        "batch_size": batch_size,
        "layers": normalised,
        "optimizer": optimizer,
        "precision": precision,
        "input_shape": input_shape,
        "saved_tensors": saved,
        "simulation": simulation,
    }


def _whole_bytes(value, field):
    """A byte count: a whole number (also written as 29440.0) from 0 to 2^44 (Rust `whole_number`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError("simulation.%s: must be a whole number, got %r" % (field, value))
    value = int(value)
    if not 0 <= value <= MAX_SAVED_BYTES:
        raise ValueError("simulation.%s: must be between 0 and 2^44, got %d" % (field, value))
    return value


def normalise_simulation(simulation, batch_size, optimizer, precision):
    """The job's `simulation`, checked as the service checks it (Rust `Job::with_simulation`):
    of the job's batch size, optimizer and precision; allocated <= min capacity <= reserved;
    the categories at the peak summing exactly to the allocated peak."""
    peaks = {
        field: _whole_bytes(simulation[field], field)
        for field in ("allocated_peak_bytes", "reserved_peak_bytes", "min_capacity_bytes")
    }
    breakdown = {
        category: _whole_bytes(simulation["breakdown_at_peak"][category], "breakdown_at_peak." + category)
        for category in SIMULATION_CATEGORIES
    }
    if simulation["batch_size"] != batch_size:
        raise ValueError(
            "simulation.batch_size: %r is not the job's batch_size %r" % (simulation["batch_size"], batch_size)
        )
    for field, aliases, expected in (
        ("optimizer", OPTIMIZER_ALIASES, optimizer),
        ("precision", PRECISION_ALIASES, precision),
    ):
        given = simulation.get(field)
        if given is not None and aliases.get(str(given).lower()) != expected:
            raise ValueError("simulation.%s: %r is not the job's %s (%s)" % (field, given, field, expected))
    allocated, reserved, min_capacity = (
        peaks["allocated_peak_bytes"],
        peaks["reserved_peak_bytes"],
        peaks["min_capacity_bytes"],
    )
    if allocated > reserved:
        raise ValueError("simulation.reserved_peak_bytes: below allocated_peak_bytes")
    if not allocated <= min_capacity <= reserved:
        raise ValueError("simulation.min_capacity_bytes: outside allocated_peak_bytes to reserved_peak_bytes")
    if sum(breakdown.values()) != allocated:
        raise ValueError(
            "simulation.breakdown_at_peak: sums to %d bytes, allocated_peak_bytes is %d"
            % (sum(breakdown.values()), allocated)
        )
    return dict(
        peaks,
        batch_size=batch_size,
        optimizer=optimizer,
        precision=precision,
        breakdown_at_peak=breakdown,
        attention=simulation.get("attention"),
        interpolated=bool(simulation.get("interpolated", False)),
    )


def simulation_features(job):
    """The SIMULATION_FEATURES of a normalised job, in order; all 0 without a simulation."""
    simulation = job["simulation"]
    if simulation is None:
        return [0.0] * len(SIMULATION_FEATURES)
    counts = [simulation["allocated_peak_bytes"], simulation["reserved_peak_bytes"], simulation["min_capacity_bytes"]]
    counts += [simulation["breakdown_at_peak"][category] for category in SIMULATION_CATEGORIES]
    return [count / MIB for count in counts]


def _totals(job):
    params = float(sum(layer["params"] for layer in job["layers"]))
    activations = float(sum(layer["output_size"] for layer in job["layers"]))
    return params, activations, float(job["batch_size"])


def _model_state_bytes_and_activation_bytes(job):
    params, _, _ = _totals(job)
    weight_bytes, activation_bytes = PRECISION_BYTES[job["precision"]]
    # Gradients and optimizer state are stored like the weights: fp32, or 16 bits when pure.
    storage = 2.0 if job["precision"] == "pure16" else 4.0
    gradient_bytes = storage
    state_bytes = OPTIMIZER_STATE_BYTES[job["optimizer"]] * storage / 4.0
    return params * (weight_bytes + gradient_bytes + state_bytes), activation_bytes


def first_principles_mib(job):
    """Weights + gradients + optimizer state + activations kept for backward + overhead (MiB)."""
    job = normalise_job(job)
    _, activations, batch = _totals(job)
    model, activation_bytes = _model_state_bytes_and_activation_bytes(job)
    return FRAMEWORK_OVERHEAD_MIB + (model + activations * batch * activation_bytes) / MIB


def traced_first_principles_mib(job):
    """first_principles with the traced saved tensors (fp32 bytes, halved for mixed16) as the
    activations; None without a trace."""
    job = normalise_job(job)
    saved = job["saved_tensors"]
    if saved is None:
        return None
    model, activation_bytes = _model_state_bytes_and_activation_bytes(job)
    traced = saved["per_sample_bytes"] * float(job["batch_size"]) + saved["fixed_bytes"]
    return FRAMEWORK_OVERHEAD_MIB + (model + traced * activation_bytes / 4.0) / MIB


def horus_mib(job):
    """The Horus formula: fp32 weights plus feature maps (MiB)."""
    job = normalise_job(job)
    params, activations, batch = _totals(job)
    return (4.0 * params + 4.0 * activations * batch) / MIB


def hidden_activation(kinds):
    """Most frequent activation, ignoring softmax/sigmoid; ties -> first seen; none -> identity."""
    counts, first_seen = {}, {}
    for position, kind in enumerate(kinds):
        if kind in ACTIVATION_KINDS and kind not in OUTPUT_ACTIVATIONS:
            counts[kind] = counts.get(kind, 0) + 1
            first_seen.setdefault(kind, position)
    if not counts:
        return "identity"
    return min(counts, key=lambda kind: (-counts[kind], first_seen[kind]))


def raw_aggregate_features(job):
    """Raw aggregate features of a job, as an ordered dict name -> float."""
    job = normalise_job(job)
    layers = job["layers"]
    kinds = [layer["kind"] for layer in layers]
    batch_size = float(job["batch_size"])
    total_params = float(sum(layer["params"] for layer in layers))
    total_activations = float(sum(layer["output_size"] for layer in layers))
    features = {
        "depth": float(kinds.count("linear")),
        "n_layers": float(len(layers)),
        "total_params": total_params,
        "total_activations": total_activations,
        "batch_size": batch_size,
        "activations_x_batch": total_activations * batch_size,
        "params_x_batch": total_params * batch_size,
        "max_output_size": float(max(layer["output_size"] for layer in layers)),
        "n_batch_norm": float(kinds.count("batch_norm")),
        "n_dropout": float(kinds.count("dropout")),
        "n_activation": float(sum(1 for kind in kinds if kind in ACTIVATION_KINDS)),
        "n_conv": float(sum(1 for kind in kinds if kind in CONV_KINDS)),
        "n_attention": float(kinds.count("attention")),
        "n_norm": float(sum(1 for kind in kinds if kind in NORM_KINDS)),
        "n_embedding": float(kinds.count("embedding")),
        "input_pixels": _product(job["input_shape"]) if job["input_shape"] else 0.0,
        # Outputs per sample x batch by what kind of layer produced them: what a layer keeps for
        # backward depends on its kind (a norm keeps its input and statistics, an in-place ReLU
        # its output only, an unrecognised module anything).
        "conv_outputs_x_batch": _outputs(layers, CONV_KINDS) * batch_size,
        "norm_outputs_x_batch": _outputs(layers, NORM_KINDS) * batch_size,
        "activation_outputs_x_batch": _outputs(layers, [k for k in ACTIVATION_KINDS if k != "identity"]) * batch_size,
        "linear_outputs_x_batch": _outputs(layers, ("linear",)) * batch_size,
        "attention_outputs_x_batch": _outputs(layers, ("attention",)) * batch_size,
        "other_outputs_x_batch": _outputs(layers, ("other",)) * batch_size,
        "first_principles_mib": first_principles_mib(job),
        # 0 without a trace: only the traced regressors read it, and only traced jobs reach them.
        "traced_first_principles_mib": traced_first_principles_mib(job) or 0.0,
        "horus_mib": horus_mib(job),
    }
    # 0 without a simulation: only the regressors that require one read them.
    features.update(zip(SIMULATION_FEATURES, simulation_features(job)))
    hidden = hidden_activation(kinds)
    for name in HIDDEN_ACTIVATIONS:
        features["act_" + name] = 1.0 if name == hidden else 0.0
    return features


def _outputs(layers, kinds):
    return float(sum(layer["output_size"] for layer in layers if layer["kind"] in kinds))


def _product(values):
    result = 1.0
    for value in values:
        result *= float(value)
    return result


def raw_token_features(job):
    """Raw per-layer token features, one list (TOKEN_FEATURES order) per layer."""
    job = normalise_job(job)
    layers = job["layers"]
    batch_size = float(job["batch_size"])
    last = max(1, len(layers) - 1)
    tokens = []
    for index, layer in enumerate(layers):
        output_size = float(layer["output_size"])
        tokens.append([output_size, float(layer["params"]), batch_size, output_size * batch_size, index / last])
    return tokens


def kind_ids(job, kind_vocab=CANONICAL_KINDS):
    """1 + index of each layer's canonical kind in `kind_vocab` (0 is reserved for padding)."""
    job = normalise_job(job)
    return [1 + kind_vocab.index(layer["kind"]) for layer in job["layers"]]


def apply_transform(value, transform):
    if transform == "log1p":
        return math.log1p(value)
    if transform == "identity":
        return value
    raise ValueError("unknown transform: %r" % (transform,))


def normalise_value(value, entry):
    """(t(raw) - mean) / std for one manifest feature entry."""
    return (apply_transform(value, entry["transform"]) - entry["mean"]) / entry["std"]


def aggregate_vector(job, feature_entries):
    """Model input row for an aggregate estimator, in manifest order."""
    raw = raw_aggregate_features(job)
    return [normalise_value(raw[entry["name"]], entry) for entry in feature_entries]


def token_vectors(job, token_entries):
    """Normalised token features [L][T] for a sequence estimator, in manifest order."""
    columns = {name: index for index, name in enumerate(TOKEN_FEATURES)}
    return [
        [normalise_value(token[columns[entry["name"]]], entry) for entry in token_entries]
        for token in raw_token_features(job)
    ]


def memory_class(peak_mib, bins=CLASS_BINS_MIB):
    """Class index: 0 for (0, b0], i for (b(i-1), bi], len(bins) for (b_last, inf)."""
    for index, upper in enumerate(bins):
        if peak_mib <= upper:
            return index
    return len(bins)


def csv_row_to_job(row):
    """Job description (docs/design/models.md) from a row of gpumemnet_mlp_a100.csv (a csv.DictReader dict)."""
    layers = [
        {"kind": normalise_kind(kind), "output_size": int(output_size), "params": int(params)}
        for kind, output_size, params in ast.literal_eval(row["Activations-Params"])
    ]
    return {"family": "mlp", "batch_size": int(row["Batch Size"]), "layers": layers}


def group_key(filename):
    """The run name without its batch size: one architecture at several batch sizes is one group."""
    stem = filename[: -len(".out")] if filename.endswith(".out") else filename
    return "_".join(part for part in stem.split("_") if not part.startswith("batch:"))
