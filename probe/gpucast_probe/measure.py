"""The steady part of a training job: warm-up steps, then measured optimizer steps timed one
by one, with utilization sampled over exactly the measured steps. No torch here: the step,
the synchronisation and the clock are passed in, so tests drive it with fakes."""

from __future__ import annotations

import statistics
import time
from typing import Callable

from .utilization import UtilizationSampler


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
) -> dict:
    """Runs `warmup_steps` unmeasured optimizer steps, synchronises, starts `sampler`, then
    runs measured steps, each followed by `sync()` (CUDA-synchronised: a step's time is the
    wall time from the previous step's end to its own end on the GPU), until `max_steps` or,
    after at least `min_steps`, `max_seconds` of measured time; then stops the sampler.

    Returns `step_time_ms` (median over the measured steps), `step_time_ms_mean`,
    `samples_per_s` (batch_size x steps / the measured time), `warmup_steps`,
    `measured_steps`, `measured_seconds` and `utilization` (the sampler's window). An
    exception from a step (out of memory...) propagates after the sampler was stopped."""
    for _ in range(warmup_steps):
        step()
    sync()
    times = []
    sampler.start()
    try:
        started = previous = clock()
        while len(times) < max_steps:
            step()
            sync()
            now = clock()
            times.append(now - previous)
            previous = now
            if len(times) >= min_steps and now - started >= max_seconds:
                break
    finally:
        utilization = sampler.stop()
    total = sum(times)
    return {
        "step_time_ms": round(1000 * statistics.median(times), 4),
        "step_time_ms_mean": round(1000 * total / len(times), 4),
        "samples_per_s": round(batch_size * len(times) / total, 3) if total > 0 else None,
        "warmup_steps": warmup_steps,
        "measured_steps": len(times),
        "measured_seconds": round(total, 4),
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
        except Exception:  # noqa: BLE001: a missing package is a reading too
            env[name] = None
    if pynvml is not None:
        text = lambda v: v.decode() if isinstance(v, bytes) else v  # noqa: E731
        for key, call in (("driver", lambda: pynvml.nvmlSystemGetDriverVersion()),
                          ("nvml_cuda_driver", lambda: pynvml.nvmlSystemGetCudaDriverVersion_v2()),
                          ("nvml_gpu_name", lambda: pynvml.nvmlDeviceGetName(handle)),
                          ("nvml_memory_total_mib", lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).total // 2**20)):
            try:
                env[key] = text(call())
            except Exception:  # noqa: BLE001
                env[key] = None
    return env
