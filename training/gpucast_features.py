"""Job descriptions and feature extraction for the gpucast estimators.

Pure standard library on purpose: the service's CI runs the feature tests without numpy or
torch, and the Rust implementation in src/ must agree with this file bit for bit (up to float
rounding).  The definitions follow docs/models.md; keep the two in step.
"""

import ast
import math

# Canonical layer kinds, in the order used for the sequence model's `kind_vocab`.
CANONICAL_KINDS = [
    "linear", "batch_norm", "dropout",
    "relu", "leaky_relu", "prelu", "elu", "selu", "gelu", "silu", "mish", "softplus",
    "tanh", "sigmoid", "softmax", "identity",
]

# Accepted spellings after normalisation (lower case, without "_", "-" and spaces).
KIND_ALIASES = {
    "linear": "linear", "dense": "linear",
    "batchnorm": "batch_norm", "batchnormalization": "batch_norm",
    "batchnorm1d": "batch_norm", "bn": "batch_norm",
    "dropout": "dropout",
    "relu": "relu",
    "leakyrelu": "leaky_relu",
    "prelu": "prelu",
    "elu": "elu",
    "selu": "selu",
    "gelu": "gelu",
    "silu": "silu", "swish": "silu",
    "mish": "mish",
    "softplus": "softplus",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "softmax": "softmax",
    "identity": "identity",
}

ACTIVATION_KINDS = [
    "relu", "leaky_relu", "prelu", "elu", "selu", "gelu", "silu", "mish", "softplus",
    "tanh", "sigmoid", "softmax", "identity",
]

# Output-layer activations: never the hidden activation.
OUTPUT_ACTIVATIONS = ("softmax", "sigmoid")

# Candidates for the one-hot `act_<name>` features.
HIDDEN_ACTIVATIONS = [
    "relu", "leaky_relu", "prelu", "elu", "selu", "gelu", "silu", "mish", "softplus",
    "tanh", "identity",
]

COUNT_FEATURES = [
    "depth", "n_layers", "total_params", "total_activations", "batch_size",
    "activations_x_batch", "params_x_batch", "max_output_size",
    "n_batch_norm", "n_dropout", "n_activation",
]
AGGREGATE_FEATURES = COUNT_FEATURES + ["act_" + name for name in HIDDEN_ACTIVATIONS]

TOKEN_FEATURES = ["output_size", "params", "batch_size", "output_x_batch", "position"]

# Default transform per raw feature when building a manifest (one-hots and position stay linear).
DEFAULT_TRANSFORMS = {name: "log1p" for name in COUNT_FEATURES}
DEFAULT_TRANSFORMS.update({"act_" + name: "identity" for name in HIDDEN_ACTIVATIONS})
DEFAULT_TOKEN_TRANSFORMS = {
    "output_size": "log1p", "params": "log1p", "batch_size": "log1p",
    "output_x_batch": "log1p", "position": "identity",
}

CLASS_BINS_MIB = [1000, 2000, 3000, 4000, 5000]


def normalise_kind(kind):
    """Map any accepted spelling of a layer kind to its canonical name."""
    key = str(kind).lower().replace("_", "").replace("-", "").replace(" ", "")
    if key not in KIND_ALIASES:
        raise ValueError("unknown layer kind: %r" % (kind,))
    return KIND_ALIASES[key]


def normalise_job(job):
    """Return a copy of `job` with canonical layer kinds and integer sizes, validated."""
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
        normalised.append({"kind": normalise_kind(layer["kind"]),
                           "output_size": output_size, "params": params})
    return {"family": job.get("family") or "mlp", "batch_size": batch_size, "layers": normalised}


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
    }
    hidden = hidden_activation(kinds)
    for name in HIDDEN_ACTIVATIONS:
        features["act_" + name] = 1.0 if name == hidden else 0.0
    return features


def raw_token_features(job):
    """Raw per-layer token features, one list (TOKEN_FEATURES order) per layer."""
    job = normalise_job(job)
    layers = job["layers"]
    batch_size = float(job["batch_size"])
    last = max(1, len(layers) - 1)
    tokens = []
    for index, layer in enumerate(layers):
        output_size = float(layer["output_size"])
        tokens.append([output_size, float(layer["params"]), batch_size,
                       output_size * batch_size, index / last])
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
    return [[normalise_value(token[columns[entry["name"]]], entry) for entry in token_entries]
            for token in raw_token_features(job)]


def memory_class(peak_mib, bins=CLASS_BINS_MIB):
    """Class index: 0 for (0, b0], i for (b(i-1), bi], len(bins) for (b_last, inf)."""
    for index, upper in enumerate(bins):
        if peak_mib <= upper:
            return index
    return len(bins)


def csv_row_to_job(row):
    """Job description (docs/models.md) from a row of gpumemnet_mlp_a100.csv (a csv.DictReader dict)."""
    layers = [{"kind": normalise_kind(kind), "output_size": int(output_size), "params": int(params)}
              for kind, output_size, params in ast.literal_eval(row["Activations-Params"])]
    return {"family": "mlp", "batch_size": int(row["Batch Size"]), "layers": layers}


def group_key(filename):
    """The run name without its batch size: one architecture at several batch sizes is one group."""
    stem = filename[:-len(".out")] if filename.endswith(".out") else filename
    return "_".join(part for part in stem.split("_") if not part.startswith("batch:"))
