"""The steady part of a training job: warm-up steps, then measured optimizer steps timed one
by one, with utilization sampled over exactly the measured steps. No torch here: the step,
the synchronisation and the clock are passed in, so tests drive it with fakes."""

from __future__ import annotations

import statistics
import time
from typing import Callable, List

from .utilization import UtilizationSampler


class HostTimer:
    """Step times by the host clock, synchronising after every step (CPU runs, tests)."""

    def __init__(self, sync: Callable[[], None], clock: Callable[[], float] = time.perf_counter):
        self.sync, self.clock = sync, clock
        self.marks: List[float] = []

    def start(self) -> None:
        self.marks = [self.clock()]

    def mark(self) -> None:
        self.sync()
        self.marks.append(self.clock())

    def intervals(self) -> List[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


class CudaEventTimer:
    """Step times on the GPU's timeline: a CUDA event recorded after each step's work is
    queued, no host synchronisation between steps (which would leave the GPU idle while the
    next step's first kernels are launched); read after the final synchronise. The time
    between two events is the step's wall time on the GPU, idle gaps included."""

    def __init__(self, torch):
        self.torch = torch
        self.events: list = []

    def _event(self):
        event = self.torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.events = [self._event()]

    def mark(self) -> None:
        self.events.append(self._event())

    def intervals(self) -> List[float]:
        self.torch.cuda.synchronize()
        return [a.elapsed_time(b) / 1000.0 for a, b in zip(self.events, self.events[1:])]


def measure_steps(
    step: Callable[[], None],
    sync: Callable[[], None],
    sampler: UtilizationSampler,
    batch_size: int,
    warmup_steps: int = 3,
    max_steps: int = 20,
    min_steps: int = 3,
    max_seconds: float = 2.0,
    clock: Callable[[], float] = time.perf_counter,
    timer=None,
) -> dict:
    """Runs `warmup_steps` unmeasured optimizer steps, synchronises, starts `sampler`, then
    runs measured steps until `max_steps` or, after at least `min_steps`, `max_seconds` by the
    host clock; synchronises (all queued work done) and stops the sampler, so its window is
    the measured steps' GPU work. Each step's time comes from `timer` (default: `HostTimer`,
    a synchronise after every step; on a GPU pass a `CudaEventTimer`).

    Returns `step_time_ms` (median over the measured steps), `step_time_ms_mean`,
    `samples_per_s` (batch_size x steps / the synchronised wall time of the measured steps),
    `warmup_steps`, `measured_steps`, `measured_seconds` and `utilization` (the sampler's
    window). An exception from a step (out of memory...) propagates after the sampler was
    stopped."""
    timer = timer or HostTimer(sync, clock)
    for _ in range(warmup_steps):
        step()
    sync()
    sampler.start()
    steps = 0
    try:
        timer.start()
        started = clock()
        while steps < max_steps:
            step()
            timer.mark()
            steps += 1
            if steps >= min_steps and clock() - started >= max_seconds:
                break
        sync()
        wall = clock() - started
    finally:
        utilization = sampler.stop()
    times = timer.intervals()
    return {
        "step_time_ms": round(1000 * statistics.median(times), 4),
        "step_time_ms_mean": round(1000 * sum(times) / len(times), 4),
        "samples_per_s": round(batch_size * steps / wall, 3) if wall > 0 else None,
        "warmup_steps": warmup_steps,
        "measured_steps": steps,
        "measured_seconds": round(wall, 4),
        "step_timer": type(timer).__name__,
        "utilization": utilization,
    }


def environment(torch=None, pynvml=None, handle=None) -> dict:
    """Driver, CUDA and torch versions, the GPU's name and compute capability; what cannot be
    read is None."""
    import platform
    import sys

    env: dict = {"python": sys.version.split()[0], "platform": platform.platform()}
    if torch is not None:
        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        try:
            env["cudnn"] = torch.backends.cudnn.version()
        except Exception:  # noqa: BLE001
            env["cudnn"] = None
        if torch.cuda.is_available():
            env["gpu_name"] = torch.cuda.get_device_name(0)
            env["compute_capability"] = list(torch.cuda.get_device_capability(0))
    for name in ("timm", "torchvision", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a missing package is a reading too
            env[name] = None
    if pynvml is not None:
        text = lambda v: v.decode() if isinstance(v, bytes) else v  # noqa: E731
        for key, call in (
            ("driver", lambda: pynvml.nvmlSystemGetDriverVersion()),
            ("nvml_cuda_driver", lambda: pynvml.nvmlSystemGetCudaDriverVersion_v2()),
            ("nvml_gpu_name", lambda: pynvml.nvmlDeviceGetName(handle)),
            ("nvml_memory_total_mib", lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).total // 2**20),
        ):
            try:
                env[key] = text(call())
            except Exception:  # noqa: BLE001
                env[key] = None
    return env
