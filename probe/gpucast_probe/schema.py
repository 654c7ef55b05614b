"""The CSV the probe writes: the columns of shared/data/gpumemnet_mlp_a100.csv, in the same
order and meaning, then the columns that say where and how the row was measured."""

from __future__ import annotations

import csv
import os
from typing import Iterable, Optional

from .generators import JobSpec

# Exactly the shared file's header.
GPUMEMNET_COLUMNS = [
    "Filename",
    "Depth",
    "Activations-Params",
    "Activation Function",
    "Total Activations",
    "Total Parameters",
    "Batch Size",
    "Batch Normalization Layers",
    "Dropout Layers",
    "Max GPU Memory (MiB)",
    "Avg GPUTL",
    "Avg GRACT",
    "Avg SMACT",
    "Avg SMOCC",
    "Avg FP32A",
]
# Added: the GPU (catalogue id or driver name), the driver, DRAM activity (fraction 0..1), the
# job family, the outcome (ok, oom, failed, timeout), the process's own peak (NVML per-process
# used memory, MiB), and seconds trained.
EXTRA_COLUMNS = [
    "gpu_sku",
    "driver",
    "drama",
    "family",
    "status",
    "process_peak_mib",
    "train_seconds",
    "step_time_ms",
    "environment",
]
COLUMNS = GPUMEMNET_COLUMNS + EXTRA_COLUMNS


def _cell(value) -> str:
    """Empty for a metric that could not be measured; numbers as Python prints them."""
    if value is None:
        return ""
    if isinstance(value, float) and value != value:  # NaN
        return ""
    return str(value)


def row_for(
    spec: JobSpec,
    *,
    peak_mib: Optional[int],
    metrics: dict,
    gpu_sku: str,
    driver: str,
    status: str,
    process_peak_mib: Optional[int] = None,
    train_seconds: Optional[float] = None,
    step_time_ms: Optional[float] = None,
    environment: Optional[str] = None,
) -> dict:
    """One CSV row. `metrics` holds gputl, gract, smact, smocc, fp32a, drama (None: unmeasured)."""
    layers = [tuple(layer) for layer in spec.layers]
    return {
        "Filename": spec.name,
        "Depth": spec.depth,
        "Activations-Params": repr(layers),
        "Activation Function": spec.activation,
        "Total Activations": spec.total_activations,
        "Total Parameters": spec.total_params,
        "Batch Size": spec.batch_size,
        "Batch Normalization Layers": sum(1 for k, _, _ in layers if k == "batch_normalization"),
        "Dropout Layers": sum(1 for k, _, _ in layers if k == "dropout"),
        "Max GPU Memory (MiB)": peak_mib,
        "Avg GPUTL": metrics.get("gputl"),
        "Avg GRACT": metrics.get("gract"),
        "Avg SMACT": metrics.get("smact"),
        "Avg SMOCC": metrics.get("smocc"),
        "Avg FP32A": metrics.get("fp32a"),
        "gpu_sku": gpu_sku,
        "driver": driver,
        "drama": metrics.get("drama"),
        "family": spec.family,
        "status": status,
        "process_peak_mib": process_peak_mib,
        "train_seconds": None if train_seconds is None else round(train_seconds, 1),
        "step_time_ms": step_time_ms,
        "environment": environment,
    }


class CsvWriter:
    """Appends rows, writing the header once; flushed and fsynced per row so that a probe
    killed mid-run keeps every finished job."""

    def __init__(self, path: str):
        self.path = path
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        if not new:
            with open(path, newline="") as f:
                header = next(csv.reader(f), None)
            if header != COLUMNS:
                raise ValueError(f"{path} exists with a different header; choose another --out")
        self._file = open(path, "a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=COLUMNS)
        if new:
            self._writer.writeheader()
            self._sync()

    def write(self, row: dict) -> None:
        self._writer.writerow({k: _cell(row.get(k)) for k in COLUMNS})
        self._sync()

    def write_all(self, rows: Iterable[dict]) -> None:
        for row in rows:
            self.write(row)

    def _sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
