"""Model specs: ``timm:<name>``, ``torchvision:<name>``, ``module:<python.path:factory>``.

Every model is built under ``torch.device("meta")``: no weights are allocated or downloaded.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from .walker import describe_module, with_batch_size

SPEC_PREFIXES = ("timm", "torchvision", "module")
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
            f"bad spec {spec!r}: expected timm:<name>, torchvision:<name> "
            f"or module:<python.path:factory>")
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
    cfg: Dict[str, Any] = getattr(module, "pretrained_cfg", None) or \
        getattr(module, "default_cfg", None) or {}
    input_size = cfg.get("input_size")
    return ResolvedSpec(f"timm:{name}", module, list(input_size) if input_size else None)


def _build_torchvision(name: str) -> ResolvedSpec:
    try:
        import torchvision
    except ImportError as exc:
        raise SpecError("torchvision is not installed (pip install ./describe[torchvision])") \
            from exc
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
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
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


def resolve_spec(spec: str) -> ResolvedSpec:
    """Build the model named by ``spec`` on the meta device."""
    prefix, rest = _split(spec)
    builders = {"timm": _build_timm, "torchvision": _build_torchvision,
                "module": _build_factory}
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
    3x224x224; module: none, so one of the two is required).
    """
    return describe_spec_batches(spec, [batch_size], input_shape, seq_len, family,
                                 **training)[0]


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
    description = describe_module(resolved.module, shape, batch_sizes[0], family=family,
                                  name=resolved.spec, input_dtype=dtype, simulation=False,
                                  **training)
    model = resolved.module if simulation else None
    return [with_batch_size(description, batch, model=model, input_dtype=dtype, loss=loss,
                            attention=attention)
            for batch in batch_sizes]
