"""Model specs: ``timm:<name>``, ``torchvision:<name>``, ``module:<python.path:factory>``,
``hf:<model id or folder>``.

Every model is built under ``torch.device("meta")``: no weights are allocated or downloaded.
``hf:`` reads a Hugging Face ``config.json`` from a folder or the local Hugging Face cache and
never goes to the network: describing a model must not depend on a hub being reachable.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from .walker import describe_module, with_batch_size

SPEC_PREFIXES = ("timm", "torchvision", "module", "hf")
TORCHVISION_DEFAULT_INPUT = (3, 224, 224)


class SpecError(ValueError):
    """A spec that cannot be resolved (bad syntax, unknown model, missing input shape)."""


@dataclass
class ResolvedSpec:
    spec: str
    module: nn.Module  # on the meta device
    default_input_shape: Optional[List[int]]  # None when the spec gives none (module:)


def _split(spec: str) -> tuple:
    prefix, sep, rest = spec.partition(":")
    if not sep or prefix not in SPEC_PREFIXES or not rest:
        raise SpecError(
            f"bad spec {spec!r}: expected timm:<name>, torchvision:<name>, "
            f"module:<python.path:factory> or hf:<model id or folder>"
        )
    return prefix, rest


def _build_timm(name: str) -> ResolvedSpec:
    try:
        import timm
    except ImportError as exc:
        raise SpecError("timm is not installed (pip install ./describe[timm])") from exc
    if not timm.is_model(name):
        raise SpecError(f"timm has no model named {name!r}")
    with torch.device("meta"):
        module = timm.create_model(name, pretrained=False)
    cfg: Dict[str, Any] = getattr(module, "pretrained_cfg", None) or getattr(module, "default_cfg", None) or {}
    input_size = cfg.get("input_size")
    return ResolvedSpec(f"timm:{name}", module, list(input_size) if input_size else None)


def _build_torchvision(name: str) -> ResolvedSpec:
    try:
        import torchvision
    except ImportError as exc:
        raise SpecError("torchvision is not installed (pip install ./describe[torchvision])") from exc
    try:
        builder = torchvision.models.get_model_builder(name)
    except ValueError as exc:
        raise SpecError(f"torchvision has no model named {name!r}") from exc
    with torch.device("meta"):
        module = builder(weights=None)
    return ResolvedSpec(f"torchvision:{name}", module, list(TORCHVISION_DEFAULT_INPUT))


def _build_factory(target: str) -> ResolvedSpec:
    module_path, sep, attr = target.partition(":")
    if not sep or not module_path or not attr:
        raise SpecError(f"bad module spec {target!r}: expected module:<python.path:factory>")
    try:
        factory = importlib.import_module(module_path)
        for part in attr.split("."):
            factory = getattr(factory, part)
    except (ImportError, AttributeError) as exc:
        raise SpecError(f"cannot import {target!r}: {exc}") from exc
    with torch.device("meta"):
        module = factory()
    if not isinstance(module, nn.Module):
        raise SpecError(f"{target!r} returned {type(module).__name__}, not an nn.Module")
    return ResolvedSpec(f"module:{target}", module, None)


def _hf_local_path(target: str) -> Optional[str]:
    """The folder (or config file) ``target`` names, None for a hub id; a path that is not
    there is an error here, not an id that the cache lacks."""
    path = os.path.expanduser(target)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise SpecError(f"hf:{target}: the folder {path!r} holds no config.json")
        return path
    if os.path.isfile(path):
        return path
    if (
        target.startswith((".", "~", "/", os.sep))
        or target.endswith(".json")
        or target.count("/") > 1
        or (os.sep != "/" and os.sep in target)
    ):
        raise SpecError(f"hf:{target}: no such folder or file")
    return None


def _hf_cached_folder(target: str) -> str:
    """The cache's snapshot folder holding hub id ``target``'s config.json, looked up on disk
    only: huggingface_hub's download path reaches for the hub even with local_files_only
    (2.4 fetches a registry to build its request headers) unless HF_HUB_OFFLINE was set
    before it was imported."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(target, "config.json")
    except ValueError as exc:  # huggingface_hub's HFValidationError
        raise SpecError(f"hf:{target}: neither a folder nor a model id: {exc}") from exc
    if not isinstance(found, str):
        raise SpecError(
            f"hf:{target}: not in the local Hugging Face cache; download it with "
            f"`hf download {target} config.json` (only the configuration is read) "
            f"or give a folder holding config.json"
        )
    return os.path.dirname(found)


def _hf_model(transformers: Any, config: Any, target: str) -> nn.Module:
    """The first class the config's ``architectures`` names that this transformers has (a
    reward model's ...ForSequenceClassification), else its causal LM, else its base model."""
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls(config)  # float32, as the torch default: --precision casts it
    errors = []
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:  # float32 rather than the config's dtype, the checkpoint's
            return auto.from_config(config, dtype=torch.float32, trust_remote_code=False)
        except ValueError as exc:  # no model of that kind for this config
            errors.append(f"{auto.__name__}: {exc}")
    raise SpecError(f"hf:{target}: transformers builds no model from it ({'; '.join(errors)})")


def _build_hf(target: str) -> ResolvedSpec:
    local = _hf_local_path(target)
    # For a huggingface_hub not imported yet (it reads this once); one imported online is
    # kept off the network by reading only local files, found on disk.
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import transformers
    except ImportError as exc:
        raise SpecError("transformers is not installed (pip install ./describe[hf])") from exc
    source = local if local is not None else _hf_cached_folder(target)
    try:  # trust_remote_code=False: custom code is refused, never fetched nor prompted for
        config = transformers.AutoConfig.from_pretrained(source, local_files_only=True, trust_remote_code=False)
    except OSError as exc:
        raise SpecError(f"hf:{target}: cannot read its config.json: {exc}") from exc
    except ValueError as exc:  # an unknown model_type, custom code
        raise SpecError(f"hf:{target}: {exc}") from exc
    if getattr(config, "pad_token_id", None) is None and any(
        name.endswith("ForSequenceClassification") for name in getattr(config, "architectures", None) or ()
    ):
        # Without one, transformers' classifiers refuse batches above 1. Fine-tuning sets
        # one (commonly the eos token); its value does not matter on meta.
        eos = getattr(config, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        config.pad_token_id = eos if isinstance(eos, int) else 0
    with torch.device("meta"):
        module = _hf_model(transformers, config, target)
    return ResolvedSpec(f"hf:{target}", module, None)


def resolve_spec(spec: str) -> ResolvedSpec:
    """Build the model named by ``spec`` on the meta device."""
    prefix, rest = _split(spec)
    builders = {"timm": _build_timm, "torchvision": _build_torchvision, "module": _build_factory, "hf": _build_hf}
    return builders[prefix](rest)


def describe_spec(
    spec: str,
    batch_size: int = 1,
    input_shape: Optional[Sequence[int]] = None,
    seq_len: Optional[int] = None,
    family: Optional[str] = None,
    **training: Any,
) -> Dict[str, Any]:
    """Describe the model named by ``spec`` (with a simulated training step at
    ``batch_size`` unless ``simulation=False``; ``training`` takes describe_module's
    keyword arguments).

    The input is ``input_shape`` if given, int64 token ids ``[seq_len]`` if ``seq_len`` is given,
    else the spec's default (timm: the model's pretrained_cfg ``input_size``; torchvision:
    3x224x224; module: and hf: none, so one of the two is required).
    """
    return describe_spec_batches(spec, [batch_size], input_shape, seq_len, family, **training)[0]


def describe_spec_batches(
    spec: str,
    batch_sizes: Sequence[int],
    input_shape: Optional[Sequence[int]] = None,
    seq_len: Optional[int] = None,
    family: Optional[str] = None,
    *,
    simulation: bool = True,
    loss: str = "auto",
    attention: str = "efficient",
    **training: Any,
) -> List[Dict[str, Any]]:
    """One description per batch size: the model is built and walked once, its training step
    simulated at each batch size (see :func:`describe_spec`)."""
    if input_shape is not None and seq_len is not None:
        raise SpecError("give either an input shape or a sequence length, not both")
    resolved = resolve_spec(spec)
    dtype = torch.float32
    if seq_len is not None:
        shape, dtype = [int(seq_len)], torch.int64
    elif input_shape is not None:
        shape = list(input_shape)
    elif resolved.default_input_shape is not None:
        shape = resolved.default_input_shape
    else:
        raise SpecError(f"{spec}: no default input shape, give --input-shape or --seq-len")
    description = describe_module(
        resolved.module,
        shape,
        batch_sizes[0],
        family=family,
        name=resolved.spec,
        input_dtype=dtype,
        simulation=False,
        **training,
    )
    model = resolved.module if simulation else None
    return [
        with_batch_size(description, batch, model=model, input_dtype=dtype, loss=loss, attention=attention)
        for batch in batch_sizes
    ]
