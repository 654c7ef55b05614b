"""Observations of real training steps, posted to the service to calibrate its estimates.

`Observer` does the work; `GpucastCallback` (Hugging Face and Lightning) and `track` (plain
PyTorch) call it. A failed observation never stops training: it is logged as a warning.
"""

from __future__ import annotations

import logging
import re
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from .client import Client
from .models import ObservationsResponse

log = logging.getLogger("gpucast")

MIB = 1024 * 1024
# The service's environment labels: 1 to 64 of these (src/calibration/label.rs).
MAX_ENVIRONMENT_CHARS = 64
NOT_IN_LABEL = re.compile(r"[^A-Za-z0-9._+-]")


def environment_label(torch_version: str | None, cuda_version: str | None, driver_version: str | None) -> str | None:
    """A label such as `torch2.5-cu124-drv550.54.15` of the software a job runs under, made of
    the characters the service takes and at most 64 of them; None when nothing is known."""
    parts = []
    if torch_version:
        # `2.5.1+cu124`: the minor version is what changes allocator behaviour; the local tag
        # repeats the CUDA version.
        parts.append("torch" + ".".join(torch_version.split("+")[0].split(".")[:2]))
    if cuda_version:
        parts.append("cu" + cuda_version.replace(".", ""))
    if driver_version:
        parts.append("drv" + driver_version)
    label = NOT_IN_LABEL.sub("_", "-".join(parts))[:MAX_ENVIRONMENT_CHARS]
    return label or None


@dataclass
class MemoryReading:
    """Peaks since the last reset, bytes: torch's allocator and the whole device."""

    max_allocated: int
    max_reserved: int
    # The device's used memory (what nvidia-smi shows, CUDA context included); None unknown.
    device_peak: int | None = None


class MemoryStats(Protocol):
    """Where the memory figures come from: CUDA through torch and NVML, or a fake in tests."""

    def available(self) -> bool: ...

    def reset(self) -> None: ...

    def sample(self) -> None:
        """Reads the device's current use, keeping the largest seen (called each step)."""

    def reading(self) -> MemoryReading: ...

    def device_name(self) -> str | None: ...

    def environment(self) -> str | None: ...


class CudaMemoryStats:
    """A CUDA device's figures through torch, and through NVML (pynvml) where installed."""

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self.device_peak: int | None = None
        self.nvml_handle: Any = None
        self.pynvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml_handle = pynvml.nvmlDeviceGetHandleByIndex(device)
            self.pynvml = pynvml
        except Exception:  # no pynvml or no driver: torch's figures still serve
            self.pynvml = None

    def torch(self) -> Any:
        return sys.modules.get("torch")

    def available(self) -> bool:
        torch = self.torch()
        return torch is not None and torch.cuda.is_available()

    def reset(self) -> None:
        self.torch().cuda.reset_peak_memory_stats(self.device)
        self.device_peak = None

    def device_used(self) -> int:
        if self.pynvml is not None:
            return int(self.pynvml.nvmlDeviceGetMemoryInfo(self.nvml_handle).used)
        free, total = self.torch().cuda.mem_get_info(self.device)
        return int(total - free)

    def sample(self) -> None:
        used = self.device_used()
        self.device_peak = used if self.device_peak is None else max(self.device_peak, used)

    def reading(self) -> MemoryReading:
        cuda = self.torch().cuda
        return MemoryReading(
            max_allocated=int(cuda.max_memory_allocated(self.device)),
            max_reserved=int(cuda.max_memory_reserved(self.device)),
            device_peak=self.device_peak,
        )

    def device_name(self) -> str | None:
        return self.torch().cuda.get_device_name(self.device)

    def environment(self) -> str | None:
        torch = self.torch()
        driver = None
        if self.pynvml is not None:
            driver = self.pynvml.nvmlSystemGetDriverVersion()
            driver = driver.decode() if isinstance(driver, bytes) else driver
        return environment_label(torch.__version__, torch.version.cuda, driver)


class Observer:
    """Measures `steps` training steps and posts one observation of them.

    `client` is a `Client` or the service's URL; `job` the job as estimated (or a function
    giving it, called when the observation is posted); `gpu` the card's name or catalogue id
    (default: the device's name); `stats` where the memory figures come from.
    """

    def __init__(
        self,
        client: Client | str,
        job: dict[str, Any] | Callable[[], dict[str, Any]] | None = None,
        *,
        steps: int = 20,
        gpu: Any = None,
        environment: str | None = None,
        stats: MemoryStats | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.client = Client(client) if isinstance(client, str) else client
        self.job = job
        self.steps = max(1, int(steps))
        self.gpu = gpu
        self.environment = environment
        self.stats = stats
        self.clock = clock
        self.step_times: list[float] = []
        self.last_step_end: float | None = None
        self.steps_seen = 0
        # `posted`: an observation was posted (the service answered); `attempted`: the post
        # was tried (once), whatever came of it.
        self.posted = False
        self.attempted = False
        self.started = False
        # What was posted, its answer and the allocator's peaks (for the caller's logs).
        self.observation: dict[str, Any] | None = None
        self.response: ObservationsResponse | None = None
        self.reading: MemoryReading | None = None

    def start(self) -> None:
        """Called before the first step: resets the peaks."""
        self.started = True
        self.steps_seen = 0
        self.step_times.clear()
        self.posted = False
        self.attempted = False
        self.guarded("start", self.reset_stats)
        self.last_step_end = self.clock()

    def reset_stats(self) -> None:
        if self.stats is None:
            self.stats = CudaMemoryStats()
        if self.stats.available():
            self.stats.reset()

    def step(self) -> None:
        """Called after each training step; posts once `steps` steps have run."""
        if not self.started:
            self.start()
        now = self.clock()
        if self.last_step_end is not None:
            self.step_times.append(now - self.last_step_end)
        self.last_step_end = now
        self.steps_seen += 1
        if self.stats is not None:
            self.guarded("sample", self.sample_stats)
        if self.steps_seen >= self.steps and not self.attempted:
            self.post()

    def sample_stats(self) -> None:
        if self.stats is not None and self.stats.available():
            self.stats.sample()

    def post(self) -> ObservationsResponse | None:
        """Posts the observation now (once); returns the answer, or None after a warning."""
        if self.attempted:
            return self.response
        self.attempted = True
        self.guarded("post", self.post_observation)
        self.posted = self.response is not None
        return self.response

    def post_observation(self) -> ObservationsResponse | None:
        stats = self.stats
        if stats is None or not stats.available():
            log.warning("no CUDA device on this host: no peak to observe, no observation posted")
            return None
        reading = stats.reading()
        self.reading = reading
        peak = reading.device_peak if reading.device_peak is not None else reading.max_reserved
        gpu = self.gpu if self.gpu is not None else stats.device_name()
        job = self.job() if callable(self.job) else self.job
        if job is None:
            log.warning("no job to observe; no observation posted")
            return None
        observation: dict[str, Any] = {"gpu": gpu, "job": job, "observed_peak_mib": peak / MIB}
        step_time = self.step_time_ms()
        if step_time is not None:
            observation["step_time_ms"] = step_time
        environment = self.environment if self.environment is not None else stats.environment()
        if environment:
            observation["environment"] = environment
        self.observation = observation
        log.info(
            "observed %.0f MiB on %s (torch max allocated %.0f MiB, reserved %.0f MiB)",
            peak / MIB,
            gpu,
            reading.max_allocated / MIB,
            reading.max_reserved / MIB,
        )
        self.response = self.client.observe(observation, idempotency_key=str(uuid.uuid4()))
        return self.response

    def step_time_ms(self) -> float | None:
        """The median of the steady steps (the first, with its warm-up, left out), ms."""
        steady = self.step_times[1:] or self.step_times
        return statistics.median(steady) * 1000 if steady else None

    def guarded(self, what: str, action: Callable[[], Any]) -> Any:
        """Runs `action`; any failure is a warning, never an error of the training loop."""
        try:
            return action()
        except Exception as error:
            log.warning("%s failed, training goes on: %s", what, error)
            return None


class track:  # noqa: N801 - used as a context manager, like contextlib's
    """A plain-PyTorch loop's observer: `with gpucast.track(url, job) as t: ... t.step()`.

    Posts after `steps` steps, or on leaving the block when fewer ran (at least one). An
    exception of the loop passes through; a failed post is a warning.
    """

    def __init__(self, client: Client | str, job: dict[str, Any] | Callable[[], dict[str, Any]], **options: Any):
        self.observer = Observer(client, job, **options)

    def __enter__(self) -> Observer:
        self.observer.start()
        return self.observer

    def __exit__(self, *exc_info: Any) -> None:
        if not self.observer.attempted and self.observer.steps_seen > 0:
            self.observer.post()
