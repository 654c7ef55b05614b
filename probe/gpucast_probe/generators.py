"""Training-job generators, GPUMemNet style: random MLPs, CNNs and transformers, plus real
torchvision/timm models. Pure Python (no torch): a job is a JSON-able spec; the child process
builds the torch model from it (gpucast_probe.train), and the layer list here is the same
accounting the child's model has (checked there against the real parameter count).

Layer lists are GPUMemNet's `[(kind, output_neurons_per_sample, params), ...]`.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Iterator

# Activation key (as in GPUMemNet run names) -> torch.nn class name.
ACTIVATIONS = {
    "relu": "ReLU",
    "gelu": "GELU",
    "softplus": "Softplus",
    "mish": "Mish",
    "swish": "SiLU",
    "tanh": "Tanh",
    "identity": "Identity",
    "elu": "ELU",
    "selu": "SELU",
    "leaky": "LeakyReLU",
    "prelu": "PReLU",
}
MLP_ARCHES = ("pyramid", "uniform", "bottleneck", "gradual")
FAMILIES = ("mlp", "cnn", "transformer", "real")

# Real models: (source, name, input shape). torchvision needs only torch; timm is optional.
REAL_MODELS = (
    ("torchvision", "resnet18", (3, 224, 224)),
    ("torchvision", "resnet50", (3, 224, 224)),
    ("torchvision", "mobilenet_v3_large", (3, 224, 224)),
    ("torchvision", "efficientnet_b0", (3, 224, 224)),
    ("torchvision", "densenet121", (3, 224, 224)),
    ("torchvision", "convnext_tiny", (3, 224, 224)),
    ("torchvision", "vit_b_16", (3, 224, 224)),
    ("torchvision", "vgg16", (3, 224, 224)),
    ("timm", "resnet34", (3, 224, 224)),
    ("timm", "deit_small_patch16_224", (3, 224, 224)),
    ("timm", "efficientnet_b2", (3, 256, 256)),
    ("timm", "regnety_016", (3, 224, 224)),
)
REAL_BATCHES = (8, 16, 32, 64, 128)


@dataclass
class JobSpec:
    """One training job: everything the child needs to build and train it."""

    family: str
    name: str
    batch_size: int
    activation: str = ""  # torch class name, "" for real models
    dropout: float = 0.0  # 0 when the model has no dropout
    batchnorm: bool = False
    config: dict = field(default_factory=dict)
    # [(kind, output_neurons_per_sample, params)]; empty for real models until the child fills it.
    layers: list = field(default_factory=list)

    @property
    def depth(self) -> int:
        """Weighted layers (Linear and Conv), GPUMemNet's "Depth"."""
        return sum(1 for kind, _, _ in self.layers if kind in ("linear", "conv2d"))

    @property
    def total_params(self) -> int:
        return sum(p for _, _, p in self.layers)

    @property
    def total_activations(self) -> int:
        return sum(n for _, n, _ in self.layers)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(data: dict) -> "JobSpec":
        spec = JobSpec(**data)
        spec.layers = [tuple(layer) for layer in spec.layers]
        return spec


def _activation_layer(act_class: str, n: int) -> tuple:
    # GPUMemNet counts no parameters for activations, PReLU's single weight included; the
    # training data follow that accounting, so the probe does too.
    return (act_class, n, 0)


# --------------------------------------------------------------------------------------- MLP


def mlp_widths(input_size: int, output_size: int, depth: int, arch: str) -> list[int]:
    """Hidden widths of a GPUMemNet MLP (the output layer comes after them)."""
    if arch == "uniform":
        return [input_size] * depth
    if arch == "pyramid":
        return [max(output_size, input_size // 2 ** (i + 1)) for i in range(depth)]
    if arch == "gradual":
        step = (input_size - output_size) // depth
        return [input_size - (i + 1) * step for i in range(depth)]
    if arch == "bottleneck":
        # GPUMemNet's "bottleneck" is a pyramid one hidden layer deeper.
        return [max(output_size, input_size // 2 ** (i + 1)) for i in range(depth + 1)]
    raise ValueError(f"unknown MLP arch {arch!r}")


def mlp_layers(input_size, output_size, widths, act_class, dropout, batchnorm, head=None) -> list:
    """GPUMemNet's layer list. `head`: Softmax for several outputs; for one output Sigmoid
    (binary classification) or Identity (regression)."""
    layers, previous = [], input_size
    for width in widths:
        layers.append(("linear", width, previous * width + width))
        if batchnorm:
            layers.append(("batch_normalization", width, 2 * width))
        layers.append(_activation_layer(act_class, width))
        if dropout > 0:
            layers.append(("dropout", width, 0))
        previous = width
    layers.append(("linear", output_size, previous * output_size + output_size))
    layers.append((head or ("Sigmoid" if output_size == 1 else "Softmax"), output_size, 0))
    return layers


def mlp_job(rng: random.Random) -> JobSpec:
    input_size = rng.randint(5, 4095)
    output_size = rng.randint(1, min(1012, input_size))
    depth = rng.randint(1, 10)
    arch = rng.choice(MLP_ARCHES)
    batch = rng.randint(4, 1023)
    act_key = rng.choice(sorted(ACTIVATIONS))
    dropout = rng.uniform(0.1, 0.5) if rng.random() < 0.5 else 0.0
    batchnorm = rng.random() < 0.5
    widths = mlp_widths(input_size, output_size, depth, arch)
    head = rng.choice(("Sigmoid", "Identity")) if output_size == 1 else "Softmax"
    name = (
        f"input:{input_size}_output:{output_size}_depth:{depth}_arch:{arch}_batch:{batch}"
        f"_act:{act_key}_dropout:{dropout}_dropout:{dropout > 0}_batchnorm:{batchnorm}"
    )
    act_class = ACTIVATIONS[act_key]
    return JobSpec(
        family="mlp",
        name=name,
        batch_size=batch,
        activation=act_class,
        dropout=dropout,
        batchnorm=batchnorm,
        config={"input_size": input_size, "output_size": output_size, "widths": widths, "arch": arch, "head": head},
        layers=mlp_layers(input_size, output_size, widths, act_class, dropout, batchnorm, head),
    )


# --------------------------------------------------------------------------------------- CNN


def cnn_layers(image, channels, stages, convs_per_stage, kernel, classes, act_class, dropout, batchnorm, pool):
    """Conv stages (each ends in a 2x2 pool), global average pool, dropout, classifier."""
    layers, c_in, side = [], 3, image
    for stage in range(stages):
        c_out = channels * 2**stage
        for _ in range(convs_per_stage):
            n = c_out * side * side
            layers.append(("conv2d", n, c_in * c_out * kernel * kernel + c_out))
            if batchnorm:
                layers.append(("batch_normalization", n, 2 * c_out))
            layers.append(_activation_layer(act_class, n))
            c_in = c_out
        side //= 2
        layers.append((f"{pool}_pooling", c_in * side * side, 0))
    layers.append(("adaptive_avg_pooling", c_in, 0))
    if dropout > 0:
        layers.append(("dropout", c_in, 0))
    layers.append(("linear", classes, c_in * classes + classes))
    return layers


def cnn_job(rng: random.Random) -> JobSpec:
    image = rng.choice((32, 64, 96, 128, 224))
    stages = rng.randint(2, 5)
    while image // 2**stages < 1:
        stages -= 1
    channels = rng.choice((16, 32, 48, 64, 96, 128))
    convs = rng.randint(1, 3)
    kernel = rng.choice((3, 5))
    classes = rng.choice((10, 100, 1000))
    batch = rng.choice((8, 16, 32, 64, 128, 256))
    act_key = rng.choice(sorted(ACTIVATIONS))
    dropout = rng.uniform(0.1, 0.5) if rng.random() < 0.5 else 0.0
    batchnorm = rng.random() < 0.5
    pool = rng.choice(("max", "avg"))
    act_class = ACTIVATIONS[act_key]
    config = {
        "image": image,
        "channels": channels,
        "stages": stages,
        "convs_per_stage": convs,
        "kernel": kernel,
        "classes": classes,
        "pool": pool,
    }
    name = (
        f"cnn_image:{image}_channels:{channels}_stages:{stages}_convs:{convs}_kernel:{kernel}"
        f"_classes:{classes}_batch:{batch}_act:{act_key}_dropout:{dropout}_batchnorm:{batchnorm}_pool:{pool}"
    )
    layers = cnn_layers(image, channels, stages, convs, kernel, classes, act_class, dropout, batchnorm, pool)
    return JobSpec("cnn", name, batch, act_class, dropout, batchnorm, config, layers)


# ------------------------------------------------------------------------------- transformer


def transformer_layers(vocab, seq, d_model, n_layers, ffn, act_class, dropout) -> list:
    """Token + position embeddings, pre-norm encoder blocks, final norm, LM head."""
    layers = [("embedding", seq * d_model, vocab * d_model), ("embedding", seq * d_model, seq * d_model)]
    for _ in range(n_layers):
        layers.append(("layer_norm", seq * d_model, 2 * d_model))
        layers.append(("multihead_attention", seq * d_model, 4 * d_model * d_model + 4 * d_model))
        if dropout > 0:
            layers.append(("dropout", seq * d_model, 0))
        layers.append(("layer_norm", seq * d_model, 2 * d_model))
        layers.append(("linear", seq * ffn, d_model * ffn + ffn))
        layers.append(_activation_layer(act_class, seq * ffn))
        if dropout > 0:
            layers.append(("dropout", seq * ffn, 0))
        layers.append(("linear", seq * d_model, ffn * d_model + d_model))
        if dropout > 0:
            layers.append(("dropout", seq * d_model, 0))
    layers.append(("layer_norm", seq * d_model, 2 * d_model))
    layers.append(("linear", seq * vocab, d_model * vocab + vocab))
    return layers


def transformer_job(rng: random.Random) -> JobSpec:
    d_model = rng.choice((128, 256, 384, 512, 768, 1024))
    heads = rng.choice([h for h in (2, 4, 8, 12, 16) if d_model % h == 0])
    n_layers = rng.randint(1, 12)
    ffn = d_model * rng.choice((2, 4))
    vocab = rng.choice((1000, 8000, 16000, 32000))
    seq = rng.choice((64, 128, 256, 512, 1024))
    batch = rng.choice((1, 2, 4, 8, 16, 32, 64))
    # Keep logits (batch x seq x vocab, fp32, with gradient) within a few GiB.
    while batch > 1 and batch * seq * vocab * 4 * 3 > 8 * 2**30:
        batch //= 2
    act_key = rng.choice(("relu", "gelu"))  # what nn.TransformerEncoderLayer accepts
    dropout = rng.choice((0.0, 0.1))
    act_class = ACTIVATIONS[act_key]
    config = {"vocab": vocab, "seq": seq, "d_model": d_model, "heads": heads, "layers": n_layers, "ffn": ffn}
    name = (
        f"transformer_vocab:{vocab}_seq:{seq}_dmodel:{d_model}_heads:{heads}_layers:{n_layers}"
        f"_ffn:{ffn}_batch:{batch}_act:{act_key}_dropout:{dropout}"
    )
    layers = transformer_layers(vocab, seq, d_model, n_layers, ffn, act_class, dropout)
    return JobSpec("transformer", name, batch, act_class, dropout, False, config, layers)


# ------------------------------------------------------------------------------ real models


def real_job(rng: random.Random) -> JobSpec:
    source, model, shape = rng.choice(REAL_MODELS)
    batch = rng.choice(REAL_BATCHES)
    config = {"source": source, "model": model, "input_shape": list(shape), "classes": 1000}
    return JobSpec("real", f"{source}:{model}_batch:{batch}", batch, config=config)


GENERATORS = {"mlp": mlp_job, "cnn": cnn_job, "transformer": transformer_job, "real": real_job}


def parse_families(text: str) -> list[str]:
    families = [f.strip().lower() for f in text.split(",") if f.strip()]
    unknown = [f for f in families if f not in GENERATORS]
    if unknown or not families:
        raise ValueError(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    return families


def generate(families: list[str], seed: int) -> Iterator[JobSpec]:
    """An endless stream of jobs, round-robin over the families, reproducible from the seed."""
    rng = random.Random(seed)
    i = 0
    while True:
        yield GENERATORS[families[i % len(families)]](rng)
        i += 1
