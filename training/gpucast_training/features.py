"""The estimators' inputs as training defines them: which features each model reads (by the
names `gpucast features` prints), how each is transformed and standardised (the manifest's
entries, fitted here and applied by the service), the class bins, and the CSV's jobs.

Every feature's value comes from the service (service.py: `gpucast features --batch`), never
from a copy of its rules; docs/design/models.md defines them. The normalisation stays here: its
mean and std are fitted on the training rows, so training owns the entries the manifest records
and the service applies (`FeatureSpec::normalise`: log1p or identity, then (x - mean) / std).
"""

import ast
import json
import math
from pathlib import Path

from . import service
from .constants import MLP_CLASS_BINS_MIB

# The service's layer-kind vocabulary (`gpucast layer-kinds`, openapi/layer_kinds.json): every
# canonical kind, in the order of the real-model sequence estimators' `kind_vocab`. Read from the
# one file, never restated.
with open(Path(__file__).resolve().parents[2] / "openapi" / "layer_kinds.json") as _vocabulary:
    ALL_KINDS = json.load(_vocabulary)["kinds"]

# The MLP sequence model's `kind_vocab` (a choice of the mlp stage, recorded in the manifest).
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


# The one-hot `act_<name>` features (the service's hidden activation among these).
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


def apply_transform(value, transform):
    if transform == "log1p":
        return math.log1p(value)
    if transform == "identity":
        return value
    raise ValueError("unknown transform: %r" % (transform,))


def normalise_value(value, entry):
    """(t(raw) - mean) / std for one manifest feature entry."""
    return (apply_transform(value, entry["transform"]) - entry["mean"]) / entry["std"]


def aggregate_vectors(jobs, feature_entries):
    """Model input rows for an aggregate estimator, in manifest order: the service's raw
    features, normalised as the entries say."""
    return [
        [normalise_value(raw[entry["name"]], entry) for entry in feature_entries] for raw in service.raw_aggregate(jobs)
    ]


def token_vectors(jobs, token_entries):
    """Normalised token features [job][L][T] for a sequence estimator, in manifest order."""
    names = [entry["name"] for entry in token_entries]
    return [
        [[normalise_value(value, entry) for value, entry in zip(token, token_entries)] for token in tokens]
        for tokens in service.raw_tokens(jobs, names)
    ]


def memory_class(peak_mib, bins=CLASS_BINS_MIB):
    """Class index: 0 for (0, b0], i for (b(i-1), bi], len(bins) for (b_last, inf)."""
    for index, upper in enumerate(bins):
        if peak_mib <= upper:
            return index
    return len(bins)


def csv_row_to_job(row):
    """Job description (docs/design/models.md) from a row of gpumemnet_mlp_a100.csv (a csv.DictReader
    dict), the layer kinds as the CSV spells them (service.canonical reads them as the service does)."""
    layers = [
        {"kind": kind, "output_size": int(output_size), "params": int(params)}
        for kind, output_size, params in ast.literal_eval(row["Activations-Params"])
    ]
    return {"family": "mlp", "batch_size": int(row["Batch Size"]), "layers": layers}


def group_key(filename):
    """The run name without its batch size: one architecture at several batch sizes is one group."""
    stem = filename[: -len(".out")] if filename.endswith(".out") else filename
    return "_".join(part for part in stem.split("_") if not part.startswith("batch:"))
