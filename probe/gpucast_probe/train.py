"""The child process: build one job's model on the GPU, train it for a bounded time with Adam
in fp32 on random data, and write what happened as JSON. Run as

    python -m gpucast_probe.train SPEC.json RESULT.json SECONDS

One job per process, so each job's peak is its own (CUDA context and caching allocator
included, as a real job's would be). Needs torch (and timm for timm models)."""

from __future__ import annotations

import json
import sys
import time

from .generators import JobSpec
from .measure import CudaEventTimer, environment, measure_steps
from .utilization import choose_sampler, open_nvml_handle

# Unmeasured steps before the steady part (allocator growth, cuDNN/cuBLAS set-up, Adam's state).
WARMUP_STEPS = 3
# Training time set aside for them when the measured part's length is set.
WARMUP_SECONDS_GUESS = 2.0


def _visible_uuid():
    """The GPU's UUID when the parent named it in CUDA_VISIBLE_DEVICES (it does), else None."""
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return visible if visible.startswith("GPU-") else None


# torch.nn class name -> GPUMemNet layer kind, for real models' layer lists.
KINDS = {
    "Linear": "linear",
    "Conv2d": "conv2d",
    "BatchNorm1d": "batch_normalization",
    "BatchNorm2d": "batch_normalization",
    "LayerNorm": "layer_norm",
    "Dropout": "dropout",
    "MaxPool2d": "max_pooling",
    "AvgPool2d": "avg_pooling",
    "AdaptiveAvgPool2d": "adaptive_avg_pooling",
    "Embedding": "embedding",
}


def build(spec: JobSpec, torch):
    """The model, a batch of inputs and targets, and the loss function."""
    nn = torch.nn
    act = lambda: getattr(nn, spec.activation)()  # noqa: E731
    c, b = spec.config, spec.batch_size
    if spec.family == "mlp":
        modules, previous = [], c["input_size"]
        for width in c["widths"]:
            modules.append(nn.Linear(previous, width))
            if spec.batchnorm:
                modules.append(nn.BatchNorm1d(width))
            modules.append(act())
            if spec.dropout > 0:
                modules.append(nn.Dropout(spec.dropout))
            previous = width
        modules.append(nn.Linear(previous, c["output_size"]))
        x = torch.randn(b, c["input_size"])
        head = c.get("head", "Softmax")
        if head == "Sigmoid":  # binary classification
            modules.append(nn.Sigmoid())
            y = torch.randint(0, 2, (b, c["output_size"])).float()
            return nn.Sequential(*modules), x, y, nn.BCELoss()
        if head == "Identity":  # regression
            modules.append(nn.Identity())
            return nn.Sequential(*modules), x, torch.randn(b, c["output_size"]), nn.MSELoss()
        modules.append(nn.Softmax(dim=1))
        y = torch.randint(0, c["output_size"], (b,))
        return nn.Sequential(*modules), x, y, nn.CrossEntropyLoss()
    if spec.family == "cnn":
        modules, c_in = [], 3
        pool = nn.MaxPool2d if c["pool"] == "max" else nn.AvgPool2d
        for stage in range(c["stages"]):
            c_out = c["channels"] * 2**stage
            for _ in range(c["convs_per_stage"]):
                modules.append(nn.Conv2d(c_in, c_out, c["kernel"], padding=c["kernel"] // 2))
                if spec.batchnorm:
                    modules.append(nn.BatchNorm2d(c_out))
                modules.append(act())
                c_in = c_out
            modules.append(pool(2))
        modules += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        if spec.dropout > 0:
            modules.append(nn.Dropout(spec.dropout))
        modules.append(nn.Linear(c_in, c["classes"]))
        x = torch.randn(b, 3, c["image"], c["image"])
        y = torch.randint(0, c["classes"], (b,))
        return nn.Sequential(*modules), x, y, nn.CrossEntropyLoss()
    if spec.family == "transformer":
        model = TokenTransformer(torch, c, spec)
        x = torch.randint(0, c["vocab"], (b, c["seq"]))
        y = torch.randint(0, c["vocab"], (b, c["seq"]))
        ce = nn.CrossEntropyLoss()
        return model, x, y, lambda logits, target: ce(logits.reshape(-1, c["vocab"]), target.reshape(-1))
    if spec.family == "real":
        if c["source"] == "timm":
            import timm

            model = timm.create_model(c["model"], pretrained=False, num_classes=c["classes"])
        else:
            import torchvision

            model = torchvision.models.get_model(c["model"], weights=None, num_classes=c["classes"])
        x = torch.randn(b, *c["input_shape"])
        y = torch.randint(0, c["classes"], (b,))
        return model, x, y, nn.CrossEntropyLoss()
    raise ValueError(f"unknown family {spec.family!r}")


def TokenTransformer(torch, c, spec):  # noqa: N802 (a factory standing in for a class)
    nn = torch.nn

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(c["vocab"], c["d_model"])
            self.positions = nn.Embedding(c["seq"], c["d_model"])
            layer = nn.TransformerEncoderLayer(
                c["d_model"],
                c["heads"],
                c["ffn"],
                dropout=spec.dropout,
                activation=spec.activation.lower(),
                batch_first=True,
                norm_first=True,
            )
            self.encoder = nn.TransformerEncoder(layer, c["layers"], enable_nested_tensor=False)
            self.norm = nn.LayerNorm(c["d_model"])
            self.head = nn.Linear(c["d_model"], c["vocab"])

        def forward(self, x):
            positions = torch.arange(x.shape[1], device=x.device)
            return self.head(self.norm(self.encoder(self.tokens(x) + self.positions(positions))))

    return Model()


def layer_list(model, x, torch) -> list:
    """[(kind, output elements per sample, own params)] of every leaf module, by forward hooks
    on one small forward pass of `x` (a batch of one is enough)."""
    layers, hooks = [], []
    batch = x.shape[0]
    for module in model.modules():
        if list(module.children()):
            continue
        kind = KINDS.get(type(module).__name__, type(module).__name__)
        params = sum(p.numel() for p in module.parameters(recurse=False))

        def hook(_m, _inputs, output, kind=kind, params=params):
            out = output[0] if isinstance(output, (tuple, list)) else output
            n = out.numel() // batch if hasattr(out, "numel") else 0
            layers.append((kind, int(n), int(params)))

        hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return layers


def train(spec: JobSpec, seconds: float) -> dict:
    import torch

    result = {"status": "failed", "steps": 0, "error": None, "train_seconds": 0.0}
    try:
        model, x, y, loss_fn = build(spec, torch)
        result["model_params"] = sum(p.numel() for p in model.parameters())
        if spec.layers:
            # The layer accounting counts PReLU's one weight as 0 (GPUMemNet's convention).
            prelus = sum(1 for m in model.modules() if type(m).__name__ == "PReLU")
            result["params_match_spec"] = result["model_params"] - prelus == spec.total_params
        device = torch.device("cuda")
        model, x, y = model.to(device), x.to(device), y.to(device)
        if spec.family == "real":
            model.eval()
            result["layers"] = layer_list(model, x[:1], torch)
        model.train()
        optimizer = torch.optim.Adam(model.parameters())

        def step():
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            result["steps"] += 1

        # Warm-up steps, then steps timed on the GPU's timeline with utilization sampled over
        # them only (GPM on Hopper and later, else NVML's utilization rates), to the end of
        # the training time.
        pynvml, handle = open_nvml_handle(_visible_uuid())
        sampler = choose_sampler(pynvml, handle, torch.cuda.get_device_capability(0))
        result["environment"] = environment(torch, pynvml, handle)
        started = time.monotonic()
        steady = measure_steps(
            step,
            torch.cuda.synchronize,
            sampler,
            spec.batch_size,
            warmup_steps=WARMUP_STEPS,
            max_steps=10**9,
            min_steps=3,
            max_seconds=max(0.0, seconds - WARMUP_SECONDS_GUESS),
            timer=CudaEventTimer(torch),
        )
        result["train_seconds"] = time.monotonic() - started
        result["step_time_ms"] = steady["step_time_ms"]
        result["samples_per_s"] = steady["samples_per_s"]
        result["steady"] = steady
        result["torch_max_reserved_mib"] = torch.cuda.max_memory_reserved() // 2**20
        result["status"] = "ok"
    except torch.cuda.OutOfMemoryError as e:
        result["status"], result["error"] = "oom", str(e)[:500]
    except Exception as e:  # noqa: BLE001 - any failure is recorded, not raised
        result["error"] = f"{type(e).__name__}: {e}"[:500]
    return result


def main(argv: list[str]) -> int:
    spec_path, result_path, seconds = argv[0], argv[1], float(argv[2])
    with open(spec_path) as f:
        spec = JobSpec.from_json(json.load(f))
    result = train(spec, seconds)
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
