"""Measuring a running job: GPU memory through NVML (pynvml, from the nvidia-ml-py package),
utilization through DCGM (`dcgmi dmon`) when it is installed, else NVML GPM metrics (Hopper
and later). Every call is guarded: a metric the GPU or driver cannot give is None, which the
CSV writes as an empty cell."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from typing import Optional

MIB = 1024 * 1024

# DCGM field ids -> our metric names. 203 GPU utilization (%), then profiling fields (0..1):
# 1001 graphics engine active, 1002 SM active, 1003 SM occupancy, 1005 DRAM active,
# 1007 FP32 pipe active.
DCGM_FIELDS = {203: "gputl", 1001: "gract", 1002: "smact", 1003: "smocc", 1005: "drama", 1007: "fp32a"}

# NVML GPM metric constant names -> our metric names. GPM reports percentages; they are
# divided by 100 to match DCGM's fractions.
GPM_METRICS = {
    "NVML_GPM_METRIC_GRAPHICS_UTIL": "gract",
    "NVML_GPM_METRIC_SM_UTIL": "smact",
    "NVML_GPM_METRIC_SM_OCCUPANCY": "smocc",
    "NVML_GPM_METRIC_DRAM_BW_UTIL": "drama",
    "NVML_GPM_METRIC_FP32_UTIL": "fp32a",
}


def mean(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


class Nvml:
    """A guarded pynvml session. `Nvml.open()` is None without pynvml or a driver."""

    def __init__(self, pynvml):
        self.nv = pynvml

    @staticmethod
    def open() -> Optional["Nvml"]:
        try:
            import pynvml

            pynvml.nvmlInit()
            return Nvml(pynvml)
        except Exception:  # noqa: BLE001 - no library, no driver, no GPU
            return None

    def _try(self, fn, *args, default=None):
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001 - unsupported on this GPU/driver
            return default

    def handle(self, index: int):
        return self.nv.nvmlDeviceGetHandleByIndex(index)

    def device_info(self, index: int) -> dict:
        h = self.handle(index)
        text = lambda v: v.decode() if isinstance(v, bytes) else v  # noqa: E731 (older pynvml: bytes)
        memory = self._try(self.nv.nvmlDeviceGetMemoryInfo, h)
        return {
            "name": text(self._try(self.nv.nvmlDeviceGetName, h, default="unknown")),
            "uuid": text(self._try(self.nv.nvmlDeviceGetUUID, h, default="")),
            "driver": text(self._try(self.nv.nvmlSystemGetDriverVersion, default="")),
            "total_mib": memory.total // MIB if memory else None,
        }

    def used_mib(self, h) -> Optional[int]:
        memory = self._try(self.nv.nvmlDeviceGetMemoryInfo, h)
        return -(-memory.used // MIB) if memory else None

    def process_mib(self, h, pid: int) -> Optional[int]:
        """The process's used GPU memory (MiB), None when it is not on the GPU (or unknowable)."""
        processes = self._try(self.nv.nvmlDeviceGetComputeRunningProcesses, h, default=[]) or []
        used = [p.usedGpuMemory for p in processes if p.pid == pid and p.usedGpuMemory is not None]
        return -(-sum(used) // MIB) if used else None

    def gputl(self, h) -> Optional[float]:
        rates = self._try(self.nv.nvmlDeviceGetUtilizationRates, h)
        return float(rates.gpu) if rates else None

    # GPM (Hopper and later)

    def gpm_supported(self, h) -> bool:
        support = self._try(getattr(self.nv, "nvmlGpmQueryDeviceSupport", None) or (lambda _h: None), h)
        return bool(support and getattr(support, "isSupportedDevice", 0))

    def gpm_sample(self, h):
        try:
            sample = self.nv.nvmlGpmSampleAlloc()
            self.nv.nvmlGpmSampleGet(h, sample)
            return sample
        except Exception:  # noqa: BLE001
            return None

    def gpm_free(self, sample) -> None:
        if sample is not None:
            self._try(self.nv.nvmlGpmSampleFree, sample)

    def gpm_metrics(self, first, second) -> dict:
        """Our metric names -> fractions between two GPM samples; missing ones left out."""
        try:
            wanted = [(getattr(self.nv, const), name) for const, name in GPM_METRICS.items() if hasattr(self.nv, const)]
            request = self.nv.c_nvmlGpmMetricsGet_t()
            request.version = self.nv.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = len(wanted)
            request.sample1, request.sample2 = first, second
            for i, (metric_id, _) in enumerate(wanted):
                request.metrics[i].metricId = metric_id
            self.nv.nvmlGpmMetricsGet(request)
            values = {}
            for i, (_, name) in enumerate(wanted):
                metric = request.metrics[i]
                if getattr(metric, "nvmlReturn", 0) == 0:
                    values[name] = float(metric.value) / 100.0
            return values
        except Exception:  # noqa: BLE001
            return {}


class JobSampler(threading.Thread):
    """Samples device and process memory (and, without DCGM, GPM metrics) of one job until
    stopped. Averages cover the time the process was on the GPU."""

    def __init__(
        self, nvml: Nvml, index: int, pid: int, interval: float = 0.2, gpm: bool = True, gpm_every: float = 1.0
    ):
        super().__init__(daemon=True)
        self.nvml, self.pid, self.interval = nvml, pid, interval
        self.handle = nvml.handle(index)
        self.use_gpm = gpm and nvml.gpm_supported(self.handle)
        self.gpm_every = gpm_every
        self._stop_event = threading.Event()
        self.peak_mib: Optional[int] = None
        self.process_peak_mib: Optional[int] = None
        self.samples: dict = {name: [] for name in ("gputl", *GPM_METRICS.values())}

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)

    def run(self) -> None:
        previous_gpm, last_gpm = None, 0.0
        try:
            while not self._stop_event.is_set():
                used = self.nvml.used_mib(self.handle)
                if used is not None:
                    self.peak_mib = max(self.peak_mib or 0, used)
                mine = self.nvml.process_mib(self.handle, self.pid)
                if mine is not None:
                    self.process_peak_mib = max(self.process_peak_mib or 0, mine)
                    self.samples["gputl"].append(self.nvml.gputl(self.handle))
                    now = time.monotonic()
                    if self.use_gpm and now - last_gpm >= self.gpm_every:
                        current = self.nvml.gpm_sample(self.handle)
                        if previous_gpm is not None and current is not None:
                            for name, value in self.nvml.gpm_metrics(previous_gpm, current).items():
                                self.samples[name].append(value)
                        self.nvml.gpm_free(previous_gpm)
                        previous_gpm, last_gpm = current, now
                self._stop_event.wait(self.interval)
        finally:
            self.nvml.gpm_free(previous_gpm)

    def metrics(self) -> dict:
        return {name: mean(values) for name, values in self.samples.items()}


def parse_dcgmi_dmon(text: str, fields: dict = DCGM_FIELDS) -> dict:
    """Mean of each metric in `dcgmi dmon` output; N/A readings skipped, absent metrics None.

    The output is a header line `#Entity  GPUTL  GRACT ...`, an `ID` line, then one line per
    reading: `GPU 0  87  0.912 ...`, values in the order of the `-e` field list."""
    names = list(fields.values())
    readings: dict = {name: [] for name in names}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3 or parts[0] != "GPU":
            continue
        for name, raw in zip(names, parts[2:]):
            try:
                readings[name].append(float(raw))
            except ValueError:
                pass  # N/A
    return {name: mean(values) for name, values in readings.items()}


class Dcgm:
    """`dcgmi dmon` in the background for the length of one job; None where dcgmi is absent."""

    def __init__(self, index: int, interval_ms: int = 500):
        self.command = [
            "dcgmi",
            "dmon",
            "-i",
            str(index),
            "-e",
            ",".join(str(f) for f in DCGM_FIELDS),
            "-d",
            str(interval_ms),
        ]
        self.process: Optional[subprocess.Popen] = None

    @staticmethod
    def available() -> bool:
        return shutil.which("dcgmi") is not None

    def start(self) -> None:
        try:
            self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.process = None

    def stop(self) -> dict:
        """The job's mean metrics; all None when dcgmi failed (e.g. no host engine)."""
        if self.process is None:
            return {}
        self.process.terminate()
        try:
            out, _ = self.process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, _ = self.process.communicate()
        metrics = parse_dcgmi_dmon(out or "")
        return {k: v for k, v in metrics.items() if v is not None}
