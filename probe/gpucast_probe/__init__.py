"""gpucast's GPU probe: generate training jobs, run each alone on a GPU for a bounded time,
record its peak memory and utilization as CSV, and optionally teach a gpucast service."""

__version__ = "0.1.0"
