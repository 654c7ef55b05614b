"""Sync and async clients of every route of the gpucast service (standard library HTTP only)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from .errors import ProblemError, TransportError
from .models import (
    AdmissionReviewResponse,
    BatchResponse,
    DevicesResponse,
    EstimateResponse,
    EstimatorsResponse,
    GpusResponse,
    HealthResponse,
    Model,
    ObservationsResponse,
    PlanResponse,
    Problem,
    ProfilesResponse,
    ReadyResponse,
    WatchResponse,
)


class Route(NamedTuple):
    method: str
    path: str
    # The answer's model; None for plain text (/metrics).
    response: type[Model] | None
    # The request body's schema in openapi.json; None for routes without a body.
    request_schema: str | None = None


# Every route the client calls, by method name; the contract test compares them with the spec.
ROUTES: dict[str, Route] = {
    "estimate": Route("POST", "/v1/estimate", EstimateResponse, "EstimateRequest"),
    "estimate_batch": Route("POST", "/v1/estimate/batch", BatchResponse, "BatchRequest"),
    "plan": Route("POST", "/v1/plan", PlanResponse, "PlanRequest"),
    "gpus": Route("GET", "/v1/gpus", GpusResponse),
    "estimators": Route("GET", "/v1/estimators", EstimatorsResponse),
    "devices": Route("GET", "/v1/devices", DevicesResponse),
    "healthz": Route("GET", "/healthz", HealthResponse),
    "readyz": Route("GET", "/readyz", ReadyResponse),
    "metrics": Route("GET", "/metrics", None),
    "profiles": Route("GET", "/v1/calibration/profiles", ProfilesResponse),
    "observe": Route("POST", "/v1/calibration/observations", ObservationsResponse, "ObservationsRequest"),
    "watch": Route("POST", "/v1/calibration/watch", WatchResponse, "WatchRequest"),
    "admission": Route("POST", "/v1/kubernetes/admission", AdmissionReviewResponse, "AdmissionReviewRequest"),
}

Job = Mapping[str, Any]


class Client:
    """A client of one gpucast service: `Client("http://127.0.0.1:8080").estimate(job)`.

    Each method is one route; an error answer raises `ProblemError` with the problem details,
    an unreachable service `TransportError`.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.headers = dict(headers or {})

    def estimate(self, job: Job) -> EstimateResponse:
        """POST /v1/estimate: the memory (`.memory.estimate_mib`), fit and performance of a job."""
        return self._call("estimate", dict(job))

    def estimate_batch(self, jobs: Sequence[Job]) -> BatchResponse:
        """POST /v1/estimate/batch: each job answered on its own (a bad one gets its own error)."""
        return self._call("estimate_batch", {"items": [dict(job) for job in jobs]})

    def plan(self, job: Job, **search: Any) -> PlanResponse:
        """POST /v1/plan: the largest micro-batch that fits each card of the job's `gpu`, the
        setups that make it fit, the smallest card; `search` holds the plan's other fields
        (`catalogue`, `precisions`, `max_micro_batch`, `max_seq_len`, `setups`)."""
        return self._call("plan", {"job": dict(job), **search})

    def gpus(self) -> GpusResponse:
        return self._call("gpus")

    def estimators(self) -> EstimatorsResponse:
        return self._call("estimators")

    def devices(self) -> DevicesResponse:
        return self._call("devices")

    def healthz(self) -> HealthResponse:
        return self._call("healthz")

    def readyz(self) -> ReadyResponse:
        """GET /readyz; a service not ready answers 503, raised as `ProblemError`."""
        return self._call("readyz")

    def metrics(self) -> str:
        """GET /metrics: the Prometheus text."""
        return self._call("metrics")

    def profiles(self) -> ProfilesResponse:
        return self._call("profiles")

    def observe(
        self,
        observations: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        idempotency_key: str | None = None,
    ) -> ObservationsResponse:
        """POST /v1/calibration/observations: one observation or a list, recorded all or none.

        An Idempotency-Key is always sent (a fresh UUID unless given), so that a retry of the
        same call with the same key records nothing twice.
        """
        body: Any = dict(observations) if isinstance(observations, Mapping) else [dict(o) for o in observations]
        key = idempotency_key or str(uuid.uuid4())
        return self._call("observe", body, headers={"Idempotency-Key": key})

    def watch(
        self,
        pid: int,
        job: Job,
        *,
        interval_ms: int | None = None,
        max_seconds: int | None = None,
    ) -> WatchResponse:
        """POST /v1/calibration/watch: the service records the process's peak when it exits."""
        body: dict[str, Any] = {"pid": pid, "job": dict(job)}
        if interval_ms is not None:
            body["interval_ms"] = interval_ms
        if max_seconds is not None:
            body["max_seconds"] = max_seconds
        return self._call("watch", body)

    def admission(self, review: Mapping[str, Any]) -> AdmissionReviewResponse:
        """POST /v1/kubernetes/admission (a service started with --admission): what the webhook
        answers the API server for this AdmissionReview."""
        return self._call("admission", dict(review))

    def _call(self, name: str, body: Any = None, headers: Mapping[str, str] | None = None) -> Any:
        route = ROUTES[name]
        request_headers = {"Accept": "application/json, application/problem+json, text/plain", **self.headers}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            request_headers["Content-Type"] = "application/json"
        if self.token:
            request_headers["Authorization"] = f"Bearer {self.token}"
        request_headers.update(headers or {})
        request = urllib.request.Request(self.url + route.path, data=data, method=route.method, headers=request_headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            raise ProblemError(_problem_of(error), method=route.method, path=route.path) from None
        except (urllib.error.URLError, OSError) as error:
            raise TransportError(f"{route.method} {self.url}{route.path}: {error}") from error
        if route.response is None:
            return text
        try:
            return route.response.from_dict(json.loads(text))
        except ValueError as error:
            raise TransportError(f"{route.method} {route.path}: answer is not JSON: {text[:200]!r}") from error


def _problem_of(error: urllib.error.HTTPError) -> Problem:
    """The problem details of an error answer; a body that is not one (a proxy's page) still
    gives the status and its reason."""
    text = error.read().decode(errors="replace")
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict) and "status" in body:
        return Problem.from_dict(body)
    return Problem(title=str(error.reason), status=error.code, detail=text[:1024])


class AsyncClient:
    """The same routes as `Client`, awaitable: each call runs in a worker thread."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.sync = Client(url, token=token, timeout=timeout, headers=headers)

    async def estimate(self, job: Job) -> EstimateResponse:
        return await asyncio.to_thread(self.sync.estimate, job)

    async def estimate_batch(self, jobs: Sequence[Job]) -> BatchResponse:
        return await asyncio.to_thread(self.sync.estimate_batch, jobs)

    async def plan(self, job: Job, **search: Any) -> PlanResponse:
        return await asyncio.to_thread(self.sync.plan, job, **search)

    async def gpus(self) -> GpusResponse:
        return await asyncio.to_thread(self.sync.gpus)

    async def estimators(self) -> EstimatorsResponse:
        return await asyncio.to_thread(self.sync.estimators)

    async def devices(self) -> DevicesResponse:
        return await asyncio.to_thread(self.sync.devices)

    async def healthz(self) -> HealthResponse:
        return await asyncio.to_thread(self.sync.healthz)

    async def readyz(self) -> ReadyResponse:
        return await asyncio.to_thread(self.sync.readyz)

    async def metrics(self) -> str:
        return await asyncio.to_thread(self.sync.metrics)

    async def profiles(self) -> ProfilesResponse:
        return await asyncio.to_thread(self.sync.profiles)

    async def observe(
        self,
        observations: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        idempotency_key: str | None = None,
    ) -> ObservationsResponse:
        return await asyncio.to_thread(self.sync.observe, observations, idempotency_key=idempotency_key)

    async def watch(
        self,
        pid: int,
        job: Job,
        *,
        interval_ms: int | None = None,
        max_seconds: int | None = None,
    ) -> WatchResponse:
        return await asyncio.to_thread(self.sync.watch, pid, job, interval_ms=interval_ms, max_seconds=max_seconds)

    async def admission(self, review: Mapping[str, Any]) -> AdmissionReviewResponse:
        return await asyncio.to_thread(self.sync.admission, review)
