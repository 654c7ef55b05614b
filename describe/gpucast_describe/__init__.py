"""Describe PyTorch models as gpucast job descriptions, on the meta device."""

from .kinds import CANONICAL_KINDS, is_attention, kind_of
from .simulate import SimulationError, simulate_step
from .specs import ResolvedSpec, SpecError, describe_spec, describe_spec_batches, resolve_spec
from .walker import describe_module, infer_family, total_params, trace_saved_tensors, with_batch_size

__all__ = [
    "CANONICAL_KINDS",
    "ResolvedSpec",
    "SpecError",
    "describe_module",
    "describe_spec",
    "describe_spec_batches",
    "infer_family",
    "is_attention",
    "kind_of",
    "resolve_spec",
    "SimulationError",
    "simulate_step",
    "total_params",
    "trace_saved_tensors",
    "with_batch_size",
]
__version__ = "0.1.0"
