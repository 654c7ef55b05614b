"""Sending measured rows to gpucast as calibration observations
(`POST /v1/calibration/observations`), with only the standard library."""

from __future__ import annotations

import ast
import hashlib
import json
import re
import urllib.error
import urllib.request
from typing import Callable, Optional

OBSERVATIONS_PATH = "/v1/calibration/observations"
ATTEMPTS = 2  # a call that timed out or got a 5xx is sent once more, with the same key
MAX_LAYERS = 4096  # the API's limit per job

# GPUMemNet layer kinds -> the API's kinds (others are sent lower-cased; the API matches them
# ignoring case, '_' and '-').
API_KINDS = {
    "batch_normalization": "batch_norm",
    "max_pooling": "max_pool",
    "avg_pooling": "avg_pool",
    "adaptive_avg_pooling": "adaptive_avg_pool",
    "multihead_attention": "attention",
    "MultiheadAttention": "attention",
    "NonDynamicallyQuantizableLinear": "linear",
    "LeakyReLU": "leaky_relu",
    "SiLU": "silu",
    "PReLU": "prelu",
    "ReLU6": "relu6",
}


def api_kind(kind: str) -> str:
    return API_KINDS.get(kind, kind.lower())


ENVIRONMENT_LABEL = re.compile(r"^[A-Za-z0-9._+-]{1,64}$")


def environment_label(environment: Optional[dict]) -> Optional[str]:
    """The API's environment label for what the child read (`measure.environment`): the torch
    build, with the CUDA version when the build does not name it (`torch2.5.1+cu124`); None
    when torch was not read. Other characters become '_'."""
    torch = (environment or {}).get("torch")
    if not torch:
        return None
    cuda = environment.get("cuda")
    label = f"torch{torch}" + (f"-cu{cuda}" if cuda and "+cu" not in torch else "")
    return re.sub(r"[^A-Za-z0-9._+-]", "_", label)[:64]


def _positive(value) -> Optional[float]:
    """A positive finite number from a row (a CSV gives text), else None."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if 0 < number < float("inf") else None


def observation(row: dict, gpu: str) -> Optional[dict]:
    """The request body for one CSV row, or None when the row is not a usable observation
    (the job did not train to the end, no peak, or too many layers for the API)."""
    peak = row.get("Max GPU Memory (MiB)")
    if row.get("status") != "ok" or peak in (None, ""):
        return None
    layers = (
        ast.literal_eval(row["Activations-Params"])
        if isinstance(row["Activations-Params"], str)
        else row["Activations-Params"]
    )
    if not layers or len(layers) > MAX_LAYERS:
        return None
    job = {
        "batch_size": int(row["Batch Size"]),
        "layers": [{"kind": api_kind(k), "output_size": int(n), "params": int(p)} for k, n, p in layers],
        "optimizer": "adam",
        "precision": "fp32",
    }
    family = row.get("family")
    if family in ("mlp", "cnn", "transformer"):
        job["family"] = family
    else:
        job["model"] = str(row["Filename"]).split("_batch:")[0]
    body = {"gpu": gpu, "job": job, "observed_peak_mib": float(peak)}
    # The steady step time teaches the environment's host cost per op (the API's step_time_ms).
    step = _positive(row.get("step_time_ms"))
    if step is not None:
        body["step_time_ms"] = step
    label = row.get("environment")
    if label and ENVIRONMENT_LABEL.match(str(label)):
        body["environment"] = str(label)
    return body


def post_rows(
    base_url: str,
    rows: list,
    gpu: str,
    token: Optional[str],
    timeout: float = 10.0,
    time_left: Callable[[], float] = lambda: float("inf"),
) -> tuple:
    """(sent, skipped, errors) after posting every usable row; errors are messages. Stops
    (counting the rest as skipped) when `time_left()` no longer covers a request's timeout."""
    sent, skipped, errors = 0, 0, []
    url = base_url.rstrip("/") + OBSERVATIONS_PATH
    for row in rows:
        body = observation(row, gpu)
        if body is None or time_left() < timeout:
            skipped += 1
            continue
        data = json.dumps(body, sort_keys=True).encode()
        error = None
        for _ in range(ATTEMPTS):
            if time_left() < timeout:
                break
            error = send(url, data, token, timeout)
            if error is None or not retryable(error):
                break
        if error is None:
            sent += 1
        else:
            errors.append(f"{row.get('Filename')}: {error}")
    return sent, skipped, errors


def idempotency_key(data: bytes) -> str:
    """The same row always gets the same key, so a retry (ours, or a rerun of the probe's post
    step) is answered from the service's record instead of counted twice."""
    return "probe-" + hashlib.sha256(data).hexdigest()


def send(url: str, data: bytes, token: Optional[str], timeout: float) -> Optional[Exception]:
    request = urllib.request.Request(url, data=data, method="POST")
    request.add_header("Content-Type", "application/json")
    request.add_header("Idempotency-Key", idempotency_key(data))
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
        return None
    except (urllib.error.URLError, OSError) as e:
        return e


def retryable(error: Exception) -> bool:
    """A timeout, a lost connection or a 5xx may have been recorded: retried with its key. A 4xx
    will not change."""
    if isinstance(error, urllib.error.HTTPError):
        return error.code >= 500
    return True
