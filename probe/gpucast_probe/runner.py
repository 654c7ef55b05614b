"""Running jobs one at a time, each in its own process, within the budget."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from .budget import Budget
from .generators import JobSpec
from .sampler import Dcgm, JobSampler, Nvml


@dataclass
class Outcome:
    """What one job did."""

    status: str  # ok, oom, failed, timeout
    peak_mib: Optional[int] = None
    process_peak_mib: Optional[int] = None
    metrics: dict = field(default_factory=dict)
    train_seconds: Optional[float] = None
    layers: Optional[list] = None  # filled by the child for real models
    error: Optional[str] = None
    # The steady part, measured in the child after its warm-up steps: median ms per optimizer
    # step (GPU timeline), samples/s, and the utilization window with each metric's source.
    step_time_ms: Optional[float] = None
    samples_per_s: Optional[float] = None
    steady_utilization: Optional[dict] = None
    environment: Optional[dict] = None


# execute(spec, train_seconds, timeout_seconds) -> Outcome
Executor = Callable[[JobSpec, float, float], Outcome]


def run_jobs(
    specs: Iterable[JobSpec],
    budget: Budget,
    execute: Executor,
    on_outcome: Callable[[JobSpec, Outcome], None],
    train_seconds: float,
    startup_seconds: float,
    min_train_seconds: float,
    max_jobs: Optional[int] = None,
) -> int:
    """Runs jobs until the budget (or max_jobs) is spent; returns how many ran."""
    done = 0
    for spec in specs:
        if max_jobs is not None and done >= max_jobs:
            break
        plan = budget.plan_job(train_seconds, startup_seconds, min_train_seconds)
        if plan is None:
            break
        train, timeout = plan
        outcome = execute(spec, train, timeout)
        on_outcome(spec, outcome)
        done += 1
    return done


def _kill_group(process: subprocess.Popen) -> None:
    """SIGTERM the child's process group, then SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


class SubprocessExecutor:
    """Trains each job in `python -m gpucast_probe.train` on one GPU, sampling it meanwhile."""

    def __init__(self, nvml: Nvml, index: int, uuid: str, interval: float = 0.2, use_dcgm: Optional[bool] = None):
        self.nvml, self.index, self.uuid, self.interval = nvml, index, uuid, interval
        self.use_dcgm = Dcgm.available() if use_dcgm is None else use_dcgm

    def __call__(self, spec: JobSpec, train_seconds: float, timeout_seconds: float) -> Outcome:
        with tempfile.TemporaryDirectory(prefix="gpucast-probe-") as tmp:
            spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
            with open(spec_path, "w") as f:
                json.dump(spec.to_json(), f)
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=self.uuid or str(self.index))
            # The child imports gpucast_probe as this process did: installed, or from the
            # working directory it inherits (`cd probe && python -m gpucast_probe`).
            command = [sys.executable, "-m", "gpucast_probe.train", spec_path, result_path, f"{train_seconds:.1f}"]
            dcgm = Dcgm(self.index) if self.use_dcgm else None
            if dcgm:
                dcgm.start()
            process = subprocess.Popen(command, env=env, start_new_session=True)
            sampler = JobSampler(self.nvml, self.index, process.pid, self.interval, gpm=not self.use_dcgm)
            sampler.start()
            started, timed_out = time.monotonic(), False
            try:
                process.wait(timeout=timeout_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(process)
            finally:
                sampler.stop()
            metrics = sampler.metrics()
            if dcgm:
                metrics.update(dcgm.stop())
            result = {}
            if os.path.exists(result_path):
                with open(result_path) as f:
                    result = json.load(f)
            status = "timeout" if timed_out else result.get("status", "failed")
            return Outcome(
                status=status,
                peak_mib=sampler.peak_mib,
                process_peak_mib=sampler.process_peak_mib,
                metrics=metrics,
                train_seconds=result.get("train_seconds", time.monotonic() - started),
                layers=result.get("layers"),
                error=result.get("error"),
                step_time_ms=result.get("step_time_ms"),
                samples_per_s=result.get("samples_per_s"),
                steady_utilization=(result.get("steady") or {}).get("utilization"),
                environment=result.get("environment"),
            )
