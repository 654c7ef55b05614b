"""Utilization over the steady part of a training job, measured from inside the job.

A `UtilizationSampler` is started when the warm-up steps are done and stopped after the last
measured step; `stop()` returns the means over that window and, for each metric, where it came
from. Two real samplers, chosen by `choose_sampler`:

- `GpmSampler` (compute capability >= 9.0, Hopper and later, where NVML reports GPM support):
  a GPM sample (`nvmlGpmSampleAlloc` / `nvmlGpmSampleGet`) every `interval` seconds, and the
  metrics between each two consecutive samples (`nvmlGpmMetricsGet`): SM activity
  (`NVML_GPM_METRIC_SM_UTIL`), SM occupancy (`NVML_GPM_METRIC_SM_OCCUPANCY`) and DRAM bandwidth
  utilization (`NVML_GPM_METRIC_DRAM_BW_UTIL`), as fractions 0..1 (GPM gives percentages: /100,
  DCGM's SMACT/SMOCC/DRAMA scale). The window's value is the mean over its intervals.
- `RatesSampler` (elsewhere): `nvmlDeviceGetUtilizationRates` every `interval` seconds, the
  percentage of time a kernel ran (`gpu_util_pct`) and the memory controller was busy
  (`mem_util_pct`). These are not SM activity and are never reported as `smact`.

`FakeSampler` returns fixed values (tests, `--dry-run`). Nothing here imports torch; pynvml
(nvidia-ml-py) is passed in, so tests use a stand-in.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional

from .sampler import mean

SOURCE_GPM = "nvml_gpm"
SOURCE_RATES = "nvml_utilization_rates"
SOURCE_FAKE = "fake"

# our name -> NVML GPM metric constant
GPM_STEADY_METRICS = {
    "smact": "NVML_GPM_METRIC_SM_UTIL",
    "smocc": "NVML_GPM_METRIC_SM_OCCUPANCY",
    "drama": "NVML_GPM_METRIC_DRAM_BW_UTIL",
}
RATES_METRICS = ("gpu_util_pct", "mem_util_pct")
# Hopper (9.0) is the first architecture with GPM.
GPM_MIN_COMPUTE_CAPABILITY = (9, 0)


class UtilizationSampler:
    """start() when the steady part begins, stop() when it ends: {"metrics", "sources",
    "intervals", "seconds"}. `metrics` maps each metric to its mean over the window (None when
    no reading came), `sources` each metric to where it came from."""

    source = "none"
    names: tuple = ()

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> dict:
        raise NotImplementedError


class _Periodic(UtilizationSampler):
    """A background thread that calls `read()` every `interval` s between start() and stop(),
    and once more at stop() when at least half an interval has passed since the last reading
    or there is none yet (so a window shorter than the interval still has one)."""

    def __init__(self, interval: float = 0.1, clock: Callable[[], float] = time.monotonic):
        self.interval, self.clock = interval, clock
        self.readings: Dict[str, List[Optional[float]]] = {name: [] for name in self.names}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._started = self._last = 0.0
        self.seconds = 0.0

    def begin(self) -> None:
        """Called once in start(), before the thread runs."""

    def read(self) -> None:
        raise NotImplementedError

    def end(self) -> None:
        """Called once in stop(), after the thread ended."""

    def _record(self, values: dict) -> None:
        for name in self.names:
            self.readings[name].append(values.get(name))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._last = self.clock()
            self.read()

    def start(self) -> None:
        self._started = self._last = self.clock()
        self.begin()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        # A last reading for the window's tail, unless it is too short to mean much (GPM
        # metrics over a few milliseconds are noise); a window shorter than one interval still
        # gets its one reading.
        if self.clock() - self._last >= self.interval / 2 or not any(
            v is not None for values in self.readings.values() for v in values
        ):
            self.read()
        self.end()
        self.seconds = self.clock() - self._started
        metrics = {name: mean(values) for name, values in self.readings.items()}
        intervals = max((sum(v is not None for v in values) for values in self.readings.values()), default=0)
        return {
            "metrics": metrics,
            "sources": {name: self.source for name in self.names},
            "intervals": intervals,
            "seconds": round(self.seconds, 3),
        }


class GpmSampler(_Periodic):
    """NVML GPM metrics between consecutive samples (Hopper and later)."""

    source = SOURCE_GPM
    names = tuple(GPM_STEADY_METRICS)

    def __init__(self, pynvml, handle, interval: float = 0.1, clock: Callable[[], float] = time.monotonic):
        self.nv, self.handle = pynvml, handle
        self.metric_ids = {name: getattr(pynvml, const) for name, const in GPM_STEADY_METRICS.items()}
        self._previous = None
        super().__init__(interval, clock)

    def _sample(self):
        sample = self.nv.nvmlGpmSampleAlloc()
        try:
            self.nv.nvmlGpmSampleGet(self.handle, sample)
        except Exception:
            self.nv.nvmlGpmSampleFree(sample)
            raise
        return sample

    def _between(self, first, second) -> dict:
        request = self.nv.c_nvmlGpmMetricsGet_t()
        request.version = self.nv.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(self.metric_ids)
        request.sample1, request.sample2 = first, second
        names = list(self.metric_ids)
        for i, name in enumerate(names):
            request.metrics[i].metricId = self.metric_ids[name]
        self.nv.nvmlGpmMetricsGet(request)
        values = {}
        for i, name in enumerate(names):
            metric = request.metrics[i]
            if getattr(metric, "nvmlReturn", 0) == 0:
                values[name] = float(metric.value) / 100.0
        return values

    def begin(self) -> None:
        self._previous = self._sample()

    def read(self) -> None:
        try:
            current = self._sample()
        except Exception:  # noqa: BLE001 - a failed sample is a missing interval, not an error
            return
        try:
            if self._previous is not None:
                self._record(self._between(self._previous, current))
        except Exception:  # noqa: BLE001
            pass
        finally:
            if self._previous is not None:
                self.nv.nvmlGpmSampleFree(self._previous)
            self._previous = current

    def end(self) -> None:
        if self._previous is not None:
            self.nv.nvmlGpmSampleFree(self._previous)
            self._previous = None


class RatesSampler(_Periodic):
    """`nvmlDeviceGetUtilizationRates`: kernel-busy and memory-busy percentages."""

    source = SOURCE_RATES
    names = RATES_METRICS

    def __init__(self, pynvml, handle, interval: float = 0.1, clock: Callable[[], float] = time.monotonic):
        self.nv, self.handle = pynvml, handle
        super().__init__(interval, clock)

    def read(self) -> None:
        try:
            rates = self.nv.nvmlDeviceGetUtilizationRates(self.handle)
        except Exception:  # noqa: BLE001
            return
        self._record({"gpu_util_pct": float(rates.gpu), "mem_util_pct": float(rates.memory)})


class FakeSampler(UtilizationSampler):
    """Fixed readings (tests and the CPU dry run): source `fake`."""

    source = SOURCE_FAKE

    def __init__(self, values: Optional[dict] = None):
        self.values = dict(values or {"smact": 0.5, "smocc": 0.25, "drama": 0.125})
        self.names = tuple(self.values)
        self.started = self.stopped = 0

    def start(self) -> None:
        self.started += 1

    def stop(self) -> dict:
        self.stopped += 1
        return {
            "metrics": dict(self.values),
            "sources": {n: SOURCE_FAKE for n in self.names},
            "intervals": 1,
            "seconds": 0.0,
        }


class NullSampler(UtilizationSampler):
    """No NVML (no library, no driver): every metric None, source `none`."""

    def start(self) -> None:
        pass

    def stop(self) -> dict:
        return {"metrics": {}, "sources": {}, "intervals": 0, "seconds": 0.0}


def gpm_supported(pynvml, handle) -> bool:
    try:
        support = pynvml.nvmlGpmQueryDeviceSupport(handle)
        return bool(getattr(support, "isSupportedDevice", 0))
    except Exception:  # noqa: BLE001 - older driver or library
        return False


def choose_sampler(pynvml, handle, compute_capability: tuple, interval: float = 0.1) -> UtilizationSampler:
    """GPM on compute capability >= 9.0 when NVML says the device supports it, else NVML's
    utilization rates; NullSampler without pynvml."""
    if pynvml is None or handle is None:
        return NullSampler()
    if tuple(compute_capability) >= GPM_MIN_COMPUTE_CAPABILITY and gpm_supported(pynvml, handle):
        return GpmSampler(pynvml, handle, interval)
    return RatesSampler(pynvml, handle, interval)


def open_nvml_handle(uuid: Optional[str] = None, index: int = 0):
    """(pynvml, handle) for the GPU this process uses, or (None, None). With
    CUDA_VISIBLE_DEVICES=<uuid> the process's device 0 is that GPU; NVML indexes all GPUs,
    so the handle is looked up by UUID when one is known."""
    try:
        import pynvml

        pynvml.nvmlInit()
        if uuid:
            return pynvml, pynvml.nvmlDeviceGetHandleByUUID(uuid)
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # noqa: BLE001
        return None, None
