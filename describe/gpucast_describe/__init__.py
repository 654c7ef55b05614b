"""Describe PyTorch models as gpucast job descriptions, on the meta device."""

from .kinds import CANONICAL_KINDS, is_attention, kind_of
from .specs import ResolvedSpec, SpecError, describe_spec, resolve_spec
from .walker import (describe_module, infer_family, total_params, trace_saved_tensors,
                     with_batch_size)

__all__ = [
    "CANONICAL_KINDS",
    "ResolvedSpec",
    "SpecError",
    "describe_module",
    "describe_spec",
    "infer_family",
    "is_attention",
    "kind_of",
    "resolve_spec",
    "total_params",
    "trace_saved_tensors",
    "with_batch_size",
]
__version__ = "0.1.0"
