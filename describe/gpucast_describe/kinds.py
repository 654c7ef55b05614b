"""Mapping from PyTorch module classes to gpucast's canonical layer kinds.

Classes are matched by *name*, so that third-party classes (timm, Hugging Face, ...) can be
mapped without importing their packages. A class whose own name is unknown is looked up
through its base classes (timm's ``BatchNormAct2d`` subclasses ``nn.BatchNorm2d``, its
``StdConv2d`` subclasses ``nn.Conv2d``), then by a few name patterns; anything else is
``other``.
"""

from __future__ import annotations

import torch.nn as nn

# The canonical vocabulary accepted by the gpucast service (src/job/validated.rs).
CANONICAL_KINDS = (
    "linear",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose2d",
    "batch_norm",
    "layer_norm",
    "group_norm",
    "instance_norm",
    "rms_norm",
    "dropout",
    "drop_path",
    "relu",
    "relu6",
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
    "hardswish",
    "hardsigmoid",
    "softmax",
    "identity",
    "max_pool",
    "avg_pool",
    "adaptive_avg_pool",
    "adaptive_max_pool",
    "embedding",
    "attention",
    "flatten",
    "upsample",
    "other",
)

CONV_KINDS = frozenset({"conv1d", "conv2d", "conv3d", "conv_transpose2d"})

_CLASSES_BY_KIND = {
    "linear": [
        "Linear",
        "LazyLinear",
        "NonDynamicallyQuantizableLinear",
        "Bilinear",
        "Conv1D",
    ],  # Hugging Face's GPT-2 "Conv1D" is a transposed linear layer
    "conv1d": ["Conv1d", "LazyConv1d"],
    "conv2d": ["Conv2d", "LazyConv2d", "CondConv2d"],
    "conv3d": ["Conv3d", "LazyConv3d"],
    "conv_transpose2d": ["ConvTranspose2d", "LazyConvTranspose2d"],
    "batch_norm": [
        "BatchNorm1d",
        "BatchNorm2d",
        "BatchNorm3d",
        "SyncBatchNorm",
        "LazyBatchNorm1d",
        "LazyBatchNorm2d",
        "LazyBatchNorm3d",
        "FrozenBatchNorm2d",
        "SplitBatchNorm2d",
    ],
    "layer_norm": ["LayerNorm", "LayerNorm2d", "LayerNorm3d", "LayerNormFp32"],
    "group_norm": ["GroupNorm", "GroupNorm1"],
    "instance_norm": [
        "InstanceNorm1d",
        "InstanceNorm2d",
        "InstanceNorm3d",
        "LazyInstanceNorm1d",
        "LazyInstanceNorm2d",
        "LazyInstanceNorm3d",
    ],
    "rms_norm": ["RMSNorm", "RmsNorm", "RmsNorm2d", "RmsNormFp32", "RmsNorm2dFp32", "LlamaRMSNorm", "T5LayerNorm"],
    "dropout": [
        "Dropout",
        "Dropout1d",
        "Dropout2d",
        "Dropout3d",
        "AlphaDropout",
        "FeatureAlphaDropout",
        "DropBlock2d",
        "PatchDropout",
    ],
    "drop_path": ["DropPath", "StochasticDepth"],
    "relu": ["ReLU"],
    "relu6": ["ReLU6"],
    "leaky_relu": ["LeakyReLU"],
    "prelu": ["PReLU"],
    "elu": ["ELU", "CELU"],
    "selu": ["SELU"],
    "gelu": [
        "GELU",
        "GELUTanh",
        "QuickGELU",
        "GELUActivation",
        "NewGELUActivation",
        "FastGELUActivation",
        "QuickGELUActivation",
    ],
    "silu": ["SiLU", "Swish", "SwishMe", "SiLUActivation"],
    "mish": ["Mish", "MishMe"],
    "softplus": ["Softplus"],
    "tanh": ["Tanh"],
    "sigmoid": ["Sigmoid"],
    "hardswish": ["Hardswish", "HardSwish", "HardSwishMe"],
    "hardsigmoid": ["Hardsigmoid", "HardSigmoid", "HardSigmoidMe"],
    "softmax": ["Softmax", "Softmax2d", "LogSoftmax", "Softmin"],
    "identity": ["Identity"],
    "max_pool": ["MaxPool1d", "MaxPool2d", "MaxPool3d", "MaxPool2dSame"],
    "avg_pool": ["AvgPool1d", "AvgPool2d", "AvgPool3d", "AvgPool2dSame"],
    "adaptive_avg_pool": ["AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "FastAdaptiveAvgPool"],
    "adaptive_max_pool": ["AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d", "FastAdaptiveMaxPool"],
    "embedding": ["Embedding", "EmbeddingBag"],
    "attention": ["MultiheadAttention"],
    "flatten": ["Flatten"],
    "upsample": ["Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d"],
}

KIND_BY_CLASS_NAME = {cls: kind for kind, names in _CLASSES_BY_KIND.items() for cls in names}

# Self-attention (token-mixing) modules of timm whose class names do not end in "Attention".
EXTRA_ATTENTION_CLASSES = frozenset(
    {
        "ClassAttn",
        "TalkingHeadAttn",  # cait
        "HaloAttn",
        "BottleneckAttn",
        "LambdaLayer",  # halonet / botnet / lambda resnets
        "LocallyGroupedAttn",
        "GlobalSubSampleAttn",  # twins
        "CrossCovarianceAttn",  # xcit / edgenext
        "FactorAttnConvRelPosEnc",  # coat
    }
)

# Last resort for unknown classes: (substring of the lower-cased class name, kind).
_NAME_PATTERNS = (
    ("batchnorm", "batch_norm"),
    ("rmsnorm", "rms_norm"),
    ("layernorm", "layer_norm"),
    ("groupnorm", "group_norm"),
    ("instancenorm", "instance_norm"),
    ("droppath", "drop_path"),
    ("dropout", "dropout"),
)


def is_attention(module: nn.Module) -> bool:
    """True for modules that get an ``attention`` layer (besides their children's layers)."""
    name = type(module).__name__
    return name.endswith("Attention") or name in EXTRA_ATTENTION_CLASSES


def kind_of(module: nn.Module) -> str:
    """The canonical kind of a module, ``other`` when it is not recognised."""
    if is_attention(module):
        return "attention"
    for cls in type(module).__mro__:
        kind = KIND_BY_CLASS_NAME.get(cls.__name__)
        if kind is not None:
            return kind
    lowered = type(module).__name__.lower()
    for pattern, kind in _NAME_PATTERNS:
        if pattern in lowered:
            return kind
    return "other"
