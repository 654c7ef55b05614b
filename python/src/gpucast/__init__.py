"""Client of the gpucast service: GPU memory estimates of training jobs before they run, and
observations of real runs that calibrate them.

    import gpucast
    answer = gpucast.Client("http://127.0.0.1:8080").estimate(job)
    answer.memory.estimate_mib
"""

from __future__ import annotations

from typing import Any

from .client import ROUTES, AsyncClient, Client
from .errors import GpucastError, ProblemError, TransportError
from .jobs import from_lightning, from_trainer
from .models import (
    AdmissionReviewResponse,
    BatchItemResponse,
    BatchResponse,
    DevicesResponse,
    EstimateResponse,
    EstimatorsResponse,
    FitResponse,
    GpusResponse,
    HealthResponse,
    MemoryResponse,
    ObservationsResponse,
    PerformanceResponse,
    PlanCardResponse,
    PlanPointResponse,
    PlanResponse,
    PlanSetupResponse,
    Problem,
    ProfilesResponse,
    ReadyResponse,
    WatchResponse,
)
from .observe import CudaMemoryStats, MemoryReading, MemoryStats, Observer, environment_label, track
from .stack import stack_label

__all__ = [
    "ROUTES",
    "AdmissionReviewResponse",
    "AsyncClient",
    "BatchItemResponse",
    "BatchResponse",
    "Client",
    "CudaMemoryStats",
    "DevicesResponse",
    "EstimateResponse",
    "EstimatorsResponse",
    "FitResponse",
    "GpucastCallback",
    "GpucastError",
    "GpusResponse",
    "HealthResponse",
    "MemoryReading",
    "MemoryResponse",
    "MemoryStats",
    "ObservationsResponse",
    "Observer",
    "PerformanceResponse",
    "PlanCardResponse",
    "PlanPointResponse",
    "PlanResponse",
    "PlanSetupResponse",
    "Problem",
    "ProblemError",
    "ProfilesResponse",
    "ReadyResponse",
    "TransportError",
    "WatchResponse",
    "environment_label",
    "from_lightning",
    "from_trainer",
    "stack_label",
    "track",
]

_callback_class: type | None = None


def __getattr__(name: str) -> Any:
    # GpucastCallback subclasses transformers' and Lightning's callbacks: built on first use so
    # that `import gpucast` imports neither.
    global _callback_class
    if name == "GpucastCallback":
        if _callback_class is None:
            from .callback import make_callback_class

            _callback_class = make_callback_class()
        return _callback_class
    raise AttributeError(f"module 'gpucast' has no attribute {name!r}")
