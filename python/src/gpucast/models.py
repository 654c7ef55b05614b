"""Typed answers of the gpucast service, written by hand from openapi/openapi.json.

Each class names the OpenAPI schema it mirrors (`SCHEMA`) so that the contract test can compare
its fields with the committed spec. Fields the service adds later are kept in `extra` rather
than dropped, so an older client still sees them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, TypeVar

T = TypeVar("T", bound="Model")


def wire(name: str | None = None, model: type[Model] | None = None, many: bool = False) -> Any:
    """A field read from the JSON key `name` (default: the field's name), as a `model` (a list
    of them with `many`) when given."""
    parse: Callable[[Any], Any] | None = None
    if model is not None:
        parse = (lambda items: [model.from_dict(item) for item in items]) if many else model.from_dict
    return field(default=None, metadata={"json": name, "parse": parse, "model": model})


@dataclass
class Model:
    """Base of every answer: `from_dict` reads the known keys and keeps the rest in `extra`."""

    SCHEMA: ClassVar[str] = ""
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def wire_fields(cls) -> dict[str, str]:
        """The JSON key of each field (what the contract test checks against the spec)."""
        return {f.name: f.metadata.get("json") or f.name for f in fields(cls) if f.name != "extra"}

    @classmethod
    def nested_models(cls) -> dict[str, type[Model]]:
        """The JSON key and model of each field that is itself a typed answer."""
        return {
            f.metadata.get("json") or f.name: f.metadata["model"]
            for f in fields(cls)
            if f.metadata.get("model") is not None
        }

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        known: dict[str, Any] = {}
        consumed: set[str] = set()
        for f in fields(cls):
            if f.name == "extra":
                continue
            key = f.metadata.get("json") or f.name
            if key not in data:
                continue
            value = data[key]
            parse = f.metadata.get("parse")
            known[f.name] = parse(value) if parse is not None and value is not None else value
            consumed.add(key)
        return cls(**known, extra={k: v for k, v in data.items() if k not in consumed})


@dataclass
class Problem(Model):
    """An error body (`application/problem+json`, RFC 7807/9457)."""

    SCHEMA: ClassVar[str] = "Problem"
    title: str = ""
    status: int = 0
    detail: str = ""
    # RFC 7807's problem type; the service leaves it out, which the RFC reads as about:blank.
    type: str = "about:blank"


@dataclass
class MemoryResponse(Model):
    SCHEMA: ClassVar[str] = "MemoryResponse"
    estimate_mib: float | None = None
    upper_bound_mib: float | None = None
    confidence: float | None = None
    class_: dict[str, Any] | None = wire("class")
    floored: bool | None = None
    allocated_peak_mib: float | None = None
    reserved_peak_mib: float | None = None
    min_capacity_mib: float | None = None
    breakdown: dict[str, Any] | None = None
    breakdown_source: str | None = None
    peak_moment: str | None = None
    base_correction: float | None = None
    uncertainty: dict[str, Any] | None = None
    extrapolation: dict[str, Any] | None = None
    estimators: dict[str, Any] | None = None


@dataclass
class FitResponse(Model):
    SCHEMA: ClassVar[str] = "FitResponse"
    gpu: str = ""
    capacity_mib: int = 0
    fits: bool = False
    oom_probability: float = 0.0
    confidence: float = 0.0
    max_colocated: int = 0
    basis: str | None = None


@dataclass
class PerformanceResponse(Model):
    SCHEMA: ClassVar[str] = "PerformanceResponse"
    step_time_ms: float = 0.0
    samples_per_s: float = 0.0
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    optimizer_ms: float = 0.0
    collectives_ms: float = 0.0
    bound: str = ""
    source: str = ""
    host_us_per_op: float = 0.0
    host_cost_observations: int = 0


@dataclass
class EstimateResponse(Model):
    """The answer of `POST /v1/estimate`: `memory.estimate_mib` is the expected peak."""

    SCHEMA: ClassVar[str] = "EstimateResponse"
    family: str = ""
    memory: MemoryResponse = wire(model=MemoryResponse)
    fit: FitResponse | None = wire(model=FitResponse)
    performance: PerformanceResponse | None = wire(model=PerformanceResponse)
    performance_null_reason: str | None = None
    utilization: dict[str, Any] | None = None
    latency_us: dict[str, Any] | None = None
    estimator_versions: dict[str, str] | None = None
    setup: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)
    calibration: dict[str, Any] | None = None
    gpu_ranking: list[dict[str, Any]] | None = None


@dataclass
class BatchItemResponse(Model):
    """One job of a batch: `estimate` when `status` is 200, else `error`."""

    SCHEMA: ClassVar[str] = "BatchItemResponse"
    index: int = 0
    status: int = 0
    estimate: EstimateResponse | None = wire(model=EstimateResponse)
    error: Problem | None = wire(model=Problem)


@dataclass
class BatchResponse(Model):
    SCHEMA: ClassVar[str] = "BatchResponse"
    items: list[BatchItemResponse] = wire(model=BatchItemResponse, many=True)


@dataclass
class PlanPointResponse(Model):
    """The estimate's figures at one point of a plan's search."""

    SCHEMA: ClassVar[str] = "PlanPointResponse"
    micro_batch_size: int = 0
    seq_len: int | None = None
    estimate_mib: float | None = None
    upper_bound_mib: float | None = None
    oom_probability: float | None = None
    step_time_ms: float | None = None
    samples_per_s: float | None = None


@dataclass
class PlanCardResponse(Model):
    """One card at one precision: the job's fit and the largest micro-batch that fits."""

    SCHEMA: ClassVar[str] = "PlanCardResponse"
    gpu: str = ""
    capacity_mib: int = 0
    precision: str = ""
    fits: bool = False
    job: PlanPointResponse | None = wire(model=PlanPointResponse)
    largest_micro_batch: int | None = None
    at_largest: PlanPointResponse | None = wire(model=PlanPointResponse)
    limited_by_max: bool = False


@dataclass
class PlanSetupResponse(Model):
    """One setup over the job, ranked (1: fits, least time per sample)."""

    SCHEMA: ClassVar[str] = "PlanSetupResponse"
    rank: int = 0
    setup: str = ""
    changes: list[str] = field(default_factory=list)
    fits: bool = False
    estimate_mib: float | None = None
    upper_bound_mib: float | None = None
    host_memory_mib: float | None = None
    step_time_ms: float | None = None
    ms_per_sample: float | None = None


@dataclass
class PlanResponse(Model):
    """POST /v1/plan: the largest micro-batch per card (`cards`), the setups ranked, the
    smallest card the job fits."""

    SCHEMA: ClassVar[str] = "PlanResponse"
    confidence: float = 0.0
    micro_batch_size: int = 0
    gradient_accumulation_steps: int = 0
    cards: list[PlanCardResponse] = wire(model=PlanCardResponse, many=True)
    smallest_fitting_gpu: str | None = None
    seq_len: dict[str, Any] | None = None
    setups: list[PlanSetupResponse] = wire(model=PlanSetupResponse, many=True)
    estimates: int = 0
    latency_us: float = 0.0
    warnings: list[str] = field(default_factory=list)


@dataclass
class HealthResponse(Model):
    SCHEMA: ClassVar[str] = "HealthResponse"
    status: str = ""


@dataclass
class ReadyResponse(Model):
    SCHEMA: ClassVar[str] = "ReadyResponse"
    ready: bool = False
    estimates: bool = False
    store: bool = False
    store_error: str | None = None


@dataclass
class GpusResponse(Model):
    SCHEMA: ClassVar[str] = "GpusResponse"
    gpus: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class EstimatorsResponse(Model):
    SCHEMA: ClassVar[str] = "EstimatorsResponse"
    estimators: list[dict[str, Any]] = field(default_factory=list)
    training_data: list[dict[str, Any]] = field(default_factory=list)
    split: dict[str, Any] | None = None
    combined: dict[str, Any] | None = None
    combined_by_family: dict[str, Any] | None = None
    simulated: dict[str, Any] | None = None
    generated_at: str | None = None


@dataclass
class DevicesResponse(Model):
    SCHEMA: ClassVar[str] = "DevicesResponse"
    nvml: bool = False
    devices: list[dict[str, Any]] = field(default_factory=list)
    reason: str | None = None


@dataclass
class ProfilesResponse(Model):
    SCHEMA: ClassVar[str] = "ProfilesResponse"
    profiles: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class ObservationsResponse(Model):
    SCHEMA: ClassVar[str] = "ObservationsResponse"
    recorded: int = 0
    profiles: list[dict[str, Any]] = field(default_factory=list)
    limited: list[str] = field(default_factory=list)


@dataclass
class AdmissionReviewResponse(Model):
    """The admission webhook's answer (`serve --admission`): `.response` holds `allowed`, the
    base64 JSON Patch (`patch`) or the denial (`status.message`)."""

    SCHEMA: ClassVar[str] = "AdmissionReviewResponse"
    api_version: str = wire("apiVersion")
    kind: str = ""
    response: dict[str, Any] = field(default_factory=dict)


@dataclass
class WatchResponse(Model):
    SCHEMA: ClassVar[str] = "WatchResponse"
    pid: int = 0
    gpu: str = ""
    status: str = ""


# The fields of the observation this package posts (ObservationRequest), for the contract test.
OBSERVATION_FIELDS = ("gpu", "job", "observed_peak_mib", "step_time_ms", "environment")
# The fields of a job that from_trainer / from_lightning write (EstimateRequest).
JOB_FIELDS = (
    "transformer_config",
    "training_arguments",
    "adapter_config",
    "deepspeed",
    "load",
    "seq_len",
    "gpu",
    "precision",
    "attention",
    "input_shape",
    "batch_size",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "parallelism",
    "optimizer",
    "summary",
    "model",
)
