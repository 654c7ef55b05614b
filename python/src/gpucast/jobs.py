"""Jobs (`POST /v1/estimate` bodies) built from live Hugging Face and Lightning trainers.

Nothing here imports torch, transformers, peft or lightning: the objects are read through their
attributes, so this module costs nothing to import for a caller without them.
"""

from __future__ import annotations

import enum
import json
import logging
import os
from importlib import resources
from typing import Any

log = logging.getLogger("gpucast")

# The service's names for the values of the setup fields (`gpucast vocabulary`, shipped with
# this package): request field (dotted for a nested one) -> its canonical names.
VOCABULARY: dict[str, list[str]] = json.loads(resources.files(__package__).joinpath("vocabulary.json").read_text())

# The attention kernels the service models (`load.attn_implementation`).
ATTENTION_KERNELS = tuple(VOCABULARY["load.attn_implementation"])
# Training-argument names that state the tokens per sample (TRL's SFTConfig and kin).
SEQ_LEN_ARGUMENTS = ("max_seq_length", "max_length")


def jsonable(value: Any) -> Any:
    """`value` as plain JSON: dtypes and enums become their names, what JSON cannot hold a string
    (a config may carry a torch.dtype, a set of target modules, an enum)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(jsonable(v) for v in value)
    text = str(value)
    return text.removeprefix("torch.") if type(value).__module__ == "torch" else text


def from_trainer(
    trainer: Any,
    *,
    seq_len: int | None = None,
    gpu: Any = None,
    **fields: Any,
) -> dict[str, Any]:
    """The job of a Hugging Face `Trainer` (or TRL trainer), to estimate before `train()`.

    Reads the model's config (`transformer_config`), the training arguments, the PEFT adapter,
    the DeepSpeed config, accelerate's FSDP plugin (`fsdp`) and how the weights were loaded
    (`load`). `seq_len` (tokens per sample)
    defaults to the arguments' `max_seq_length` / `max_length`; `gpu` to this host's first CUDA
    device. Other keyword arguments are job fields that override what was read.
    """
    fsdp = fsdp_options(getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "fsdp_plugin", None))
    if fsdp is not None:
        fields = {"fsdp": fsdp, **fields}
    return job_from_hf(trainer.model, trainer.args, seq_len=seq_len, gpu=gpu, **fields)


def fsdp_options(plugin: Any) -> dict[str, Any] | None:
    """accelerate's `FullyShardedDataParallelPlugin` as the service's `fsdp` field (its
    `fsdp_config` keys): the sharding strategy (FSDP2: `reshard_after_forward`), parameter
    offload and activation checkpointing."""
    if plugin is None:
        return None
    options: dict[str, Any] = {}
    strategy = getattr(plugin, "sharding_strategy", None)
    if strategy is not None:
        options["sharding_strategy"] = getattr(strategy, "name", None) or jsonable(strategy)
    reshard = getattr(plugin, "reshard_after_forward", None)
    if isinstance(reshard, bool):
        options["reshard_after_forward"] = reshard
    offload = getattr(plugin, "cpu_offload", None)
    offload = getattr(offload, "offload_params", offload)
    if isinstance(offload, bool):
        options["offload_params"] = offload
    checkpointing = getattr(plugin, "activation_checkpointing", None)
    if isinstance(checkpointing, bool):
        options["activation_checkpointing"] = checkpointing
    return options


def job_from_hf(model: Any, args: Any, *, seq_len: int | None = None, gpu: Any = None, **fields: Any) -> dict[str, Any]:
    """The job of a Hugging Face model (or PEFT model) trained with `TrainingArguments` `args`."""
    job: dict[str, Any] = {}
    job.update(model_fields(model))
    training_arguments = jsonable(args.to_dict()) if args is not None else {}
    if training_arguments:
        job["training_arguments"] = training_arguments
    deepspeed = deepspeed_config(args)
    if deepspeed is not None:
        job["deepspeed"] = deepspeed
        training_arguments.pop("deepspeed", None)
    if deepspeed is not None or training_arguments.get("fsdp") or "fsdp" in fields:
        # The service shards by the data-parallel degree, which the config does not hold.
        job["parallelism"] = {"world_size": int(getattr(args, "world_size", 1) or 1)}
    if seq_len is None:
        seq_len = next((getattr(args, n) for n in SEQ_LEN_ARGUMENTS if getattr(args, n, None)), None)
    if seq_len is None:
        raise ValueError("seq_len: tokens per sample; pass from_trainer(trainer, seq_len=...)")
    job["seq_len"] = int(seq_len)
    gpu = gpu if gpu is not None else host_card()
    if gpu is not None:
        job["gpu"] = gpu
    job.update(fields)
    return job


def model_fields(model: Any) -> dict[str, Any]:
    """`transformer_config`, `adapter_config` and `load` of a transformers (or PEFT) model."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError(f"{type(model).__name__}: not a transformers model (no `config.to_dict()`)")
    raw_config = config.to_dict()
    fields: dict[str, Any] = {"transformer_config": jsonable(raw_config)}
    name = getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", None)
    if name:
        fields["model"] = str(name)
    adapter = adapter_config(model)
    if adapter is not None:
        fields["adapter_config"] = adapter
    load: dict[str, Any] = {}
    dtype = weights_dtype(model)
    if dtype is not None:
        load["torch_dtype"] = dtype
    attention = getattr(config, "_attn_implementation", None)
    if attention in ATTENTION_KERNELS:
        load["attn_implementation"] = attention
    quantization = raw_config.get("quantization_config")
    if quantization:
        load["quantization_config"] = jsonable(quantization)
    if load:
        fields["load"] = load
    return fields


def adapter_config(model: Any) -> dict[str, Any] | None:
    """The active PEFT adapter's config (adapter_config.json), if the model carries one."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    name = getattr(model, "active_adapter", None)
    config = configs.get(name) if isinstance(name, str) else None
    config = config if config is not None else next(iter(configs.values()))
    return jsonable(config.to_dict() if hasattr(config, "to_dict") else dict(vars(config)))


def weights_dtype(model: Any) -> str | None:
    """The dtype the frozen or trained weights were loaded in (`bfloat16`, `float32`, ...):
    that of the largest floating-point parameter, which is the base's under an adapter."""
    largest: Any = None
    for parameter in getattr(model, "parameters", lambda: [])():
        if parameter.is_floating_point() and (largest is None or parameter.numel() > largest.numel()):
            largest = parameter
    return None if largest is None else jsonable(largest.dtype)


def deepspeed_config(args: Any) -> dict[str, Any] | None:
    """The DeepSpeed config of training arguments: the resolved one when the Trainer made it,
    else `args.deepspeed` as a dict or a JSON file's path."""
    resolved = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    if isinstance(resolved, dict):
        return jsonable(resolved)
    raw = getattr(args, "deepspeed", None)
    if isinstance(raw, dict):
        return jsonable(raw)
    if isinstance(raw, (str, os.PathLike)) and os.path.isfile(raw):
        with open(raw, encoding="utf-8") as file:
            return json.load(file)
    return None


def host_card() -> str | None:
    """This host's first CUDA device's name; without one, a warning (the job then names no card,
    and the service answers for its reference card) and None."""
    name = cuda_device_name()
    if name is None:
        log.warning(
            "no CUDA device on this host and no gpu given: the job names no card, so the service "
            "answers for its reference card; pass gpu='rtx-4090' (or the card it will train on)"
        )
    return name


def cuda_device_name() -> str | None:
    """This host's first CUDA device's name when torch is loaded and sees one."""
    import sys

    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # a broken driver must not stop a job from being described
        return None
    return None


def optimizer_name(optimizer: Any) -> str | None:
    """The service's name of a torch optimizer: its class name in lower case where the service
    knows that name (`Adam`, `AdamW`, `Adafactor`; `SGD` with momentum is `momentum`)."""
    name = type(optimizer).__name__.lower()
    if name == "sgd":
        groups = getattr(optimizer, "param_groups", None) or [{}]
        return "momentum" if groups[0].get("momentum") else "sgd"
    return name if name in VOCABULARY["optimizer"] else None


def from_lightning(
    trainer: Any,
    module: Any = None,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    input_shape: list[int] | None = None,
    gpu: Any = None,
    **fields: Any,
) -> dict[str, Any]:
    """The job of a Lightning `Trainer` and its `LightningModule` (before `fit`, pass `module`:
    the trainer holds it only once fitting starts).

    A transformers model inside the module (the module itself, or an attribute holding one) is
    sent as its config; any other model as its `print(model)` text, which needs `input_shape`
    (or `seq_len` for token models). `batch_size` is the per-device micro-batch; the precision
    (`bf16-mixed`, ...), gradient accumulation and the DeepSpeed/FSDP/DDP strategy come from the
    trainer.
    """
    module = module if module is not None else getattr(trainer, "lightning_module", None)
    if module is None:
        raise ValueError("module: the LightningModule (the trainer holds none before fit)")
    if batch_size is None:
        raise ValueError("batch_size: the per-device micro-batch, from_lightning(..., batch_size=N)")
    job: dict[str, Any] = {}
    hf_model = find_hf_model(module)
    if hf_model is not None:
        job.update(model_fields(hf_model))
        if seq_len is None:
            raise ValueError("seq_len: tokens per sample of the transformers model")
    else:
        job["summary"] = {"format": "module_print", "text": str(module)}
        job["model"] = type(module).__name__
    if seq_len is not None:
        job["seq_len"] = int(seq_len)
    if input_shape is not None:
        job["input_shape"] = list(input_shape)
    precision = getattr(trainer, "precision", None)
    if precision is not None:
        job["precision"] = str(precision)
        load = job.get("load", {})
        if load.get("torch_dtype") == "float32" and "quantization_config" not in load:
            # fp32 weights are what `*-mixed` precisions train, yet the service reads any
            # `load` (stated or defaulted fp32) as the precision and refuses `precision` beside
            # it; `precision` says it all, and the kernel goes as `attention`.
            del job["load"]
            if "attn_implementation" in load:
                job["attention"] = "eager" if load["attn_implementation"] == "eager" else "sdpa"
    accumulation = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
    job["micro_batch_size"] = int(batch_size)
    job["gradient_accumulation_steps"] = accumulation
    job["batch_size"] = int(batch_size) * accumulation
    job.update(strategy_fields(trainer))
    optimizers = getattr(trainer, "optimizers", None) or []
    name = optimizer_name(optimizers[0]) if optimizers else None
    if name is not None:
        job["optimizer"] = name
    gpu = gpu if gpu is not None else host_card()
    if gpu is not None:
        job["gpu"] = gpu
    job.update(fields)
    return job


def find_hf_model(module: Any) -> Any:
    """The transformers model a LightningModule trains: itself or one of its attributes."""
    if hasattr(getattr(module, "config", None), "to_dict"):
        return module
    for child in getattr(module, "children", lambda: [])():
        if hasattr(getattr(child, "config", None), "to_dict"):
            return child
    return None


def strategy_fields(trainer: Any) -> dict[str, Any]:
    """`deepspeed` / `parallelism` of a Lightning trainer's strategy."""
    strategy = getattr(trainer, "strategy", None)
    name = type(strategy).__name__ if strategy is not None else ""
    world_size = int(getattr(trainer, "world_size", 1) or 1)
    if name.startswith("DeepSpeed"):
        config = getattr(strategy, "config", None)
        fields: dict[str, Any] = {"parallelism": {"world_size": world_size}}
        if isinstance(config, dict):
            fields["deepspeed"] = jsonable(config)
        return fields
    if name.startswith("FSDP"):
        return {"parallelism": {"strategy": "fsdp", "world_size": world_size}}
    if name.startswith("DDP") and world_size > 1:
        return {"parallelism": {"strategy": "ddp", "world_size": world_size}}
    return {}
