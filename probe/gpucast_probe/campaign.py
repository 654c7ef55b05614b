#!/usr/bin/env python3
"""One measurement campaign on one GPU: 102 training jobs (MLP, CNN, ViT, NLP; several batch
sizes; fp32 and AMP bf16, AdamW), each measured over its steady steps: memory (PyTorch's
max allocated / max reserved, NVML's used-memory peak), utilization with its source (NVML GPM
SM activity / SM occupancy / DRAM bandwidth on Hopper and later, else NVML's utilization
rates), step time and samples/s; beside each, the job's `gpucast_describe` description
(layers with FLOPs, saved tensors, the simulated training step) so gpucast can be evaluated on
it, and the provenance (GPU, driver, CUDA, torch, date).

    PYTHONPATH=probe:describe python3 -m gpucast_probe.campaign --out "$OUT" --minutes 7   # on the GPU machine
    python -m gpucast_probe.campaign --dry-run --out /tmp/c --match mlp-a,resnet18   # here, in .venv-describe

In .venv-describe the workspace's packages (gpucast_probe, gpucast_describe) are installed; the
GPU machine's image has neither, so there PYTHONPATH names their folders (from the repository
root). The Hugging Face models describe is tested on are loaded from the file
describe/examples/hf_models.py.

The parent needs no torch. It runs the jobs of each family in a child process
(`--child`), one job after another, with `torch.cuda.empty_cache()` between them; the child
writes a line when a job starts and one when it ends. A job that runs past `--job-seconds`, or
a child that dies (a crash, an abort), costs that job only: the parent kills the child, records
the job as `timeout` or `crashed`, and starts a new child for the rest of the family. Out of
memory is caught in the child (`oom`), any other exception too (`failed`). Nothing starts after
the global deadline (`--minutes`, less a reserve for writing); jobs left are `skipped`.
Meanwhile `--describe-workers` CPU processes describe every job (meta tensors, no GPU);
descriptions not finished by the deadline are left out with a reason.

Writes under --out (each line flushed as it is known, so a killed run keeps what it had):
  measurements.jsonl   one line a job: the measurement or why there is none
  descriptions.jsonl   one line a job: {"id", "description"} or {"id", "describe_error"}
  jobs.jsonl           at the end: each job's measurement joined with its description and
                       the provenance (the file gpucast is evaluated on)
  campaign.json        provenance, the settings, counts by status, seconds spent
--dry-run: the same logic on the CPU, a fake utilization sampler, batches cut to 2, sequences
to 32 tokens, images to 64 px (ViTs keep 224), 1 warm-up and 2 measured steps.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
HF_MODELS = REPO / "describe" / "examples" / "hf_models.py"

PRECISIONS = ("fp32", "amp_bf16")
OPTIMIZER = "adamw"  # torch.optim.AdamW, foreach (the default on CUDA), as describe simulates it

# (model key, family, per-sample input: [C, H, W] or [tokens], batch sizes)
MODELS = [
    ("mlp-a", "mlp", [784], [64, 256, 1024]),
    ("mlp-b", "mlp", [1024], [64, 256, 1024]),
    ("mlp-c", "mlp", [4096], [64, 256, 1024]),
    ("mlp-d", "mlp", [256], [64, 256, 1024]),
    ("torchvision:resnet18", "cnn", [3, 224, 224], [32, 64, 128]),
    ("torchvision:resnet50", "cnn", [3, 224, 224], [32, 64, 128]),
    ("torchvision:mobilenet_v3_large", "cnn", [3, 224, 224], [32, 64, 128]),
    ("timm:convnext_tiny", "cnn", [3, 224, 224], [32, 64, 128]),
    ("timm:efficientnet_b0", "cnn", [3, 224, 224], [32, 64, 128]),
    ("timm:resnet34", "cnn", [3, 224, 224], [32, 64, 128]),
    ("timm:vit_small_patch16_224", "vit", [3, 224, 224], [32, 64, 128]),
    ("timm:vit_base_patch16_224", "vit", [3, 224, 224], [16, 32, 64]),
    ("timm:deit_tiny_patch16_224", "vit", [3, 224, 224], [32, 64, 128]),
    ("hf:gpt2_small", "nlp", [512], [4, 8, 16]),
    ("hf:gpt2_medium", "nlp", [512], [2, 4, 8]),
    ("hf:bert_base_mlm", "nlp", [256], [8, 16, 32]),
    ("hf:llama_small", "nlp", [1024], [2, 4, 8]),
]
FAMILIES = ("mlp", "cnn", "vit", "nlp")
# MLP widths: hidden layers of each mlp-* model, then 10 classes.
MLP_WIDTHS = {"mlp-a": [1024, 1024, 512], "mlp-b": [4096, 4096], "mlp-c": [2048, 1024, 512, 256], "mlp-d": [512] * 8}
MLP_CLASSES = 10
IMAGE_CLASSES = 1000


def job_id(model: str, batch: int, precision: str) -> str:
    return f"{model.replace(':', '-')}-b{batch}-{precision}"


def plan(dry_run: bool = False) -> List[dict]:
    """Every job, family by family (the order they run in): model x batch size x precision."""
    jobs = []
    for order, (model, family, shape, batches) in enumerate(MODELS):
        for rank, batch in enumerate(batches):
            for precision in PRECISIONS:
                job = {
                    "id": job_id(model, batch, precision),
                    "model": model,
                    "family": family,
                    "input_shape": list(shape),
                    "batch_size": batch,
                    "precision": precision,
                    "optimizer": OPTIMIZER,
                }
                jobs.append(((FAMILIES.index(family), rank, order), shrink(job) if dry_run else job))
    # Within a family, every model at its first batch size, then at its second...: a family
    # cut short by its share of the time loses its largest batches, not whole models.
    return [job for _, job in sorted(jobs, key=lambda pair: pair[0])]


def shrink(job: dict) -> dict:
    """The dry run's version of a job: batch 2, 32 tokens, 64 px images (ViTs keep 224: their
    position embeddings are sized for it); the id is kept."""
    shape = list(job["input_shape"])
    if len(shape) == 1 and job["family"] == "nlp":
        shape = [min(shape[0], 32)]
    elif len(shape) == 3 and job["family"] == "cnn":
        shape = [shape[0], 64, 64]
    return {**job, "batch_size": 2, "input_shape": shape}


def select(jobs: List[dict], families: Optional[str], match: Optional[str], max_jobs: Optional[int]) -> List[dict]:
    if families:
        wanted = set(families.split(","))
        jobs = [j for j in jobs if j["family"] in wanted]
    if match:
        parts = match.split(",")
        jobs = [j for j in jobs if any(p in j["id"] for p in parts)]
    return jobs[:max_jobs] if max_jobs is not None else jobs


# ---------------------------------------------------------------- models (child and describe)


def build_model(job: dict, torch):
    """The job's model, on the current default device (torch.device context), weights random."""
    model = job["model"]
    nn = torch.nn
    if model.startswith("mlp-"):
        layers, previous = [], job["input_shape"][0]
        for width in MLP_WIDTHS[model]:
            layers += [nn.Linear(previous, width), nn.ReLU()]
            previous = width
        layers.append(nn.Linear(previous, MLP_CLASSES))
        return nn.Sequential(*layers)
    prefix, _, name = model.partition(":")
    if prefix == "torchvision":
        import torchvision

        return torchvision.models.get_model(name, weights=None)
    if prefix == "timm":
        import timm

        return timm.create_model(name, pretrained=False)
    if prefix == "hf":
        import transformers

        hf_models = _hf_models()

        if name == "gpt2_medium":
            return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=24, n_embd=1024, n_head=16))
        if name == "llama_small":
            # a small Llama built from its configuration (no weights): grouped-query attention
            return transformers.LlamaForCausalLM(
                transformers.LlamaConfig(
                    hidden_size=1024,
                    intermediate_size=2816,
                    num_hidden_layers=8,
                    num_attention_heads=16,
                    num_key_value_heads=4,
                    vocab_size=32000,
                    max_position_embeddings=2048,
                )
            )
        return getattr(hf_models, name)()
    raise ValueError(f"unknown model {model!r}")


def _hf_models():
    """describe/examples/hf_models.py (the models describe is tested on), loaded from its file:
    an example script beside describe, not a package."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_models", HF_MODELS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def input_dtype(job: dict, torch):
    return torch.int64 if job["family"] == "nlp" else torch.float32


def make_batch(job: dict, torch, device: str):
    shape = [job["batch_size"], *job["input_shape"]]
    if job["family"] == "nlp":
        return torch.randint(0, 1000, shape, device=device)
    return torch.randn(shape, device=device)


# ---------------------------------------------------------------- describe (CPU workers)


def describe_job(job: dict) -> dict:
    """{"id", "description"} or {"id", "describe_error"}: describe_module on the meta device,
    with the job's batch size, precision and optimizer (its simulation included)."""
    try:
        import torch

        torch.set_num_threads(1)
        from gpucast_describe import describe_module

        with torch.device("meta"):
            model = build_model(job, torch)
        description = describe_module(
            model,
            job["input_shape"],
            job["batch_size"],
            name=job["model"],
            input_dtype=input_dtype(job, torch),
            optimizer=job["optimizer"],
            precision=job["precision"],
        )
        return {"id": job["id"], "description": description}
    except Exception as error:  # noqa: BLE001 - the measurement stands without it
        return {"id": job["id"], "describe_error": f"{type(error).__name__}: {error}"[:500]}


# ---------------------------------------------------------------- the child: jobs on the GPU


def _emit(handle, record: dict) -> None:
    handle.write(json.dumps(record) + "\n")
    handle.flush()
    os.fsync(handle.fileno())


class MemoryWatch:
    """NVML's used memory of the device, peak over a job, read every `interval` s."""

    def __init__(self, pynvml, handle, interval: float = 0.05):
        import threading

        self.nv, self.handle, self.interval = pynvml, handle, interval
        self.peak_mib: Optional[int] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def read(self) -> Optional[int]:
        try:
            return -(-self.nv.nvmlDeviceGetMemoryInfo(self.handle).used // 2**20)
        except Exception:  # noqa: BLE001
            return None

    def _loop(self) -> None:
        while True:
            used = self.read()
            if used is not None:
                self.peak_mib = max(self.peak_mib or 0, used)
            if self._stop.wait(self.interval):
                return

    def start(self) -> "MemoryWatch":
        if self.nv is not None:
            self._thread.start()
        return self

    def stop(self) -> Optional[int]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        return self.peak_mib


def training_pieces(torch):
    """(loss of a model output, optimizer factory, where they came from): describe's
    `default_loss` and `make_optimizer`, so the step trained is the step simulated; if
    describe cannot be imported here, the same by hand (cross-entropy over the last dimension
    with random class targets, AdamW foreach), so the measurements do not depend on it."""
    try:
        from gpucast_describe.simulate import default_loss, make_optimizer

        return default_loss, make_optimizer, "gpucast_describe"
    except Exception:  # noqa: BLE001

        def loss(output):
            logits = getattr(output, "logits", output)
            logits = logits.reshape(-1, logits.shape[-1]).float()
            target = torch.randint(0, logits.shape[-1], (logits.shape[0],), device=logits.device)
            return torch.nn.functional.cross_entropy(logits, target)

        def optimizer(name, params):
            return torch.optim.AdamW(params, foreach=True)

        return loss, optimizer, "fallback"


def run_one(job: dict, torch, device: str, sampler_factory: Callable, steps: dict, pynvml=None, handle=None) -> dict:
    """Builds, warms up and measures one job in this process; returns its measurement."""
    import gc

    from .measure import CudaEventTimer, measure_steps

    default_loss, make_optimizer, _ = training_pieces(torch)

    record: dict = {"id": job["id"], "status": "failed"}
    cuda = device == "cuda"
    model = optimizer = batch = None
    watch = MemoryWatch(pynvml, handle) if cuda and pynvml is not None else None
    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            record["nvml_used_before_mib"] = watch.read() if watch else None
            record["torch_reserved_before_bytes"] = torch.cuda.memory_reserved()
        if watch:
            watch.start()
        started = time.perf_counter()
        with torch.device(device):
            model = build_model(job, torch)
        model.train()
        record["params"] = sum(p.numel() for p in model.parameters())
        optimizer = make_optimizer(job["optimizer"], [p for p in model.parameters() if p.requires_grad])
        batch = make_batch(job, torch, device)
        amp = job["precision"] == "amp_bf16"

        def step():
            with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=amp):
                loss = default_loss(model(batch))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        sync = torch.cuda.synchronize if cuda else (lambda: None)
        timer = CudaEventTimer(torch) if cuda else None
        record.update(measure_steps(step, sync, sampler_factory(), job["batch_size"], timer=timer, **steps))
        record["seconds"] = round(time.perf_counter() - started, 3)
        if cuda:
            record["max_allocated_bytes"] = torch.cuda.max_memory_allocated()
            record["max_reserved_bytes"] = torch.cuda.max_memory_reserved()
        record["status"] = "ok"
    except Exception as error:  # noqa: BLE001 - any failure is this job's, not the campaign's
        oom = type(error).__name__ == "OutOfMemoryError" or "out of memory" in str(error)
        record["status"] = "oom" if oom else "failed"
        record["error"] = f"{type(error).__name__}: {error}"[:500]
    finally:
        if watch:
            record["nvml_used_peak_mib"] = watch.stop()
        model = optimizer = batch = None  # released before the cache is emptied
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return record


def child(jobs_path: str, result_path: str, dry_run: bool) -> int:
    import torch

    from .measure import environment
    from .utilization import FakeSampler, choose_sampler, open_nvml_handle

    with open(jobs_path) as f:
        jobs = json.load(f)
    device = "cpu" if dry_run else "cuda"
    pynvml = handle = None
    capability = (0, 0)
    if not dry_run:
        torch.zeros(1, device="cuda")  # the CUDA context, before any job
        capability = torch.cuda.get_device_capability(0)
        uuid = getattr(torch.cuda.get_device_properties(0), "uuid", None)
        pynvml, handle = open_nvml_handle(f"GPU-{uuid}" if uuid is not None else None)
        if handle is None:
            pynvml, handle = open_nvml_handle(None, 0)
    if dry_run:
        sampler_factory = FakeSampler
        steps = {"warmup_steps": 1, "max_steps": 2, "min_steps": 1, "max_seconds": 0.5}
    else:
        sampler_factory = lambda: choose_sampler(pynvml, handle, capability)  # noqa: E731
        steps = {"warmup_steps": 3, "max_steps": 25, "min_steps": 5, "max_seconds": 1.5}
    with open(result_path, "a") as out:
        _emit(
            out,
            {"environment": {**environment(torch, pynvml, handle), "training_step_from": training_pieces(torch)[2]}},
        )
        for job in jobs:
            _emit(out, {"start": job["id"]})
            if os.environ.get("GPUCAST_CAMPAIGN_CRASH") == job["id"]:  # tests: a dying child
                os._exit(3)
            _emit(out, {"done": run_one(job, torch, device, sampler_factory, steps, pynvml, handle)})
    return 0


# ---------------------------------------------------------------- the parent


def _kill(process: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 3), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_family(
    jobs: List[dict],
    child_argv: Callable[[str, str], List[str]],
    deadline: float,
    job_seconds: float,
    startup_seconds: float,
    on_record: Callable[[dict], None],
    on_environment: Callable[[dict], None] = lambda env: None,
    workdir: Optional[str] = None,
    clock: Callable[[], float] = time.monotonic,
    poll: float = 0.2,
) -> None:
    """Runs `jobs` in child processes (`child_argv(jobs_path, result_path)`), a new child
    whenever one dies or is killed, until every job has a record or `deadline` passes.
    Records: the child's for finished jobs; `timeout` for a job past `job_seconds` (the
    child's start-up allowance `startup_seconds` on top for its first job), `crashed` for the
    job a child died in, `deadline` for the job running at the deadline, `skipped` for jobs
    never started."""
    pending = list(jobs)
    with tempfile.TemporaryDirectory(prefix="gpucast-campaign-", dir=workdir) as tmp:
        attempt = start_failures = 0
        while pending:
            if clock() >= deadline:
                break
            attempt += 1
            jobs_path, result_path = (
                os.path.join(tmp, f"jobs{attempt}.json"),
                os.path.join(tmp, f"result{attempt}.jsonl"),
            )
            with open(jobs_path, "w") as f:
                json.dump(pending, f)
            stderr_path = os.path.join(tmp, f"stderr{attempt}.txt")
            with open(stderr_path, "w") as stderr:
                process = subprocess.Popen(
                    child_argv(jobs_path, result_path), stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True
                )
            running, since, first, offset, ended = None, clock(), True, 0, None
            while True:
                exited = process.poll() is not None
                if os.path.exists(result_path):
                    with open(result_path) as f:
                        f.seek(offset)
                        text = f.read()
                    complete = text[: text.rfind("\n") + 1]
                    offset += len(complete)
                    for line in complete.splitlines():
                        message = json.loads(line)
                        if "environment" in message:
                            on_environment(message["environment"])
                        elif "start" in message:
                            running, since = message["start"], clock()
                        elif "done" in message:
                            on_record(message["done"])
                            pending = [j for j in pending if j["id"] != message["done"]["id"]]
                            running, first = None, False
                if exited:
                    break
                now = clock()
                allowance = job_seconds + (startup_seconds if first else 0)
                if now >= deadline:
                    ended = "deadline"
                elif now - since > allowance:
                    ended = "timeout"
                if ended:
                    _kill(process)
                    break
                time.sleep(poll)
            if ended is None and process.returncode == 0 and not pending:
                break
            with open(stderr_path) as f:
                tail = f.read()[-800:].strip()[-500:] or None
            if running is not None:  # the job it was in is the one to blame
                on_record({"id": running, "status": ended or "crashed", "exit_code": process.returncode, "error": tail})
                pending = [j for j in pending if j["id"] != running]
                start_failures = 0
            elif ended != "deadline":  # died or hung before starting a job: twice, and the family fails
                start_failures += 1
                if start_failures >= 2:
                    for job in pending:
                        on_record(
                            {
                                "id": job["id"],
                                "status": "failed",
                                "exit_code": process.returncode,
                                "error": f"the child did not start a job: {tail}"[:500],
                            }
                        )
                    pending = []
            if ended == "deadline":
                break
    for job in pending:
        on_record({"id": job["id"], "status": "skipped", "error": "global deadline"})


class Jsonl:
    """Append-only JSON Lines, each line flushed and fsynced."""

    def __init__(self, path: Path):
        self.handle = open(path, "w")

    def write(self, record: dict) -> None:
        _emit(self.handle, record)

    def close(self) -> None:
        self.handle.close()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT"), help="output folder (default $OUT)")
    parser.add_argument("--minutes", type=float, default=7.0, help="global deadline for the whole campaign")
    parser.add_argument("--reserve-seconds", type=float, default=20.0, help="kept at the end for writing")
    parser.add_argument("--job-seconds", type=float, default=40.0, help="one job's allowance (build, warm-up, steps)")
    parser.add_argument(
        "--startup-seconds", type=float, default=60.0, help="a child's start-up allowance (imports, CUDA)"
    )
    parser.add_argument("--describe-workers", type=int, default=6, help="CPU processes describing the jobs; 0: none")
    parser.add_argument("--families", help=f"comma-separated subset of {','.join(FAMILIES)}")
    parser.add_argument("--match", help="comma-separated substrings of job ids to keep")
    parser.add_argument("--max-jobs", type=int)
    parser.add_argument("--dry-run", action="store_true", help="CPU, fake sampler, tiny shapes and step counts")
    parser.add_argument("--list", action="store_true", help="print the job ids and exit")
    parser.add_argument("--child", nargs=2, metavar=("JOBS", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child[0], args.child[1], args.dry_run)

    started_wall, started = _dt.datetime.now(_dt.timezone.utc), time.monotonic()
    deadline = started + 60 * args.minutes - args.reserve_seconds
    jobs = select(plan(args.dry_run), args.families, args.match, args.max_jobs)
    if args.list:
        print("\n".join(j["id"] for j in jobs))
        return 0
    if not args.out:
        parser.error("--out (or $OUT) is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"campaign: {len(jobs)} jobs, deadline in {deadline - started:.0f} s", flush=True)

    # Describe on the CPU meanwhile (spawned workers: the parent never imports torch).
    descriptions: Dict[str, dict] = {}
    describe_file = Jsonl(out / "descriptions.jsonl")
    pool = pending_describe = None
    if args.describe_workers > 0 and jobs:
        import multiprocessing

        pool = multiprocessing.get_context("spawn").Pool(args.describe_workers)

        def described(result: dict) -> None:  # runs in the pool's result thread
            descriptions[result["id"]] = result
            describe_file.write(result)

        pending_describe = [pool.apply_async(describe_job, (job,), callback=described) for job in jobs]
        pool.close()

    measurements: Dict[str, dict] = {}
    measure_file = Jsonl(out / "measurements.jsonl")
    environment: dict = {}

    def record(result: dict) -> None:
        measurements[result["id"]] = result
        measure_file.write(result)
        print(
            f"  {result['id']}: {result['status']}"
            + (
                f" {result.get('step_time_ms')} ms/step"
                if result["status"] == "ok"
                else f" ({(result.get('error') or '')[:120]})"
            ),
            flush=True,
        )

    def child_argv(jobs_path: str, result_path: str) -> List[str]:
        return [sys.executable, "-m", "gpucast_probe.campaign", "--child", jobs_path, result_path] + (
            ["--dry-run"] if args.dry_run else []
        )

    left = len(jobs)
    for family in FAMILIES:
        family_jobs = [j for j in jobs if j["family"] == family]
        if not family_jobs:
            continue
        # Each family gets its share of the time left (by job count), so one that runs slow
        # loses its own last jobs, not the families after it; time it leaves goes to them.
        share = time.monotonic() + (deadline - time.monotonic()) * len(family_jobs) / left
        run_family(
            family_jobs,
            child_argv,
            min(deadline, share),
            args.job_seconds,
            args.startup_seconds,
            record,
            on_environment=lambda env: environment.update(env) if not environment else None,
        )
        left -= len(family_jobs)
    measure_file.close()

    if pool is not None:
        for result in pending_describe:
            left = deadline + args.reserve_seconds / 2 - time.monotonic()
            if left <= 0:
                break
            try:
                result.wait(left)
            except Exception:  # noqa: BLE001
                pass
        pool.terminate()
        pool.join()
    describe_file.close()

    provenance = {
        **environment,
        "date": started_wall.isoformat(timespec="seconds"),
        "dry_run": args.dry_run,
        "optimizer": OPTIMIZER,
    }
    with open(out / "jobs.jsonl", "w") as f:
        for job in jobs:
            described = descriptions.get(job["id"], {"describe_error": "not finished before the deadline"})
            line = {
                "job": job,
                "measurement": measurements.get(job["id"]),
                **{k: v for k, v in described.items() if k != "id"},
                "provenance": provenance,
            }
            f.write(json.dumps(line) + "\n")
    counts: Dict[str, int] = {}
    for m in measurements.values():
        counts[m["status"]] = counts.get(m["status"], 0) + 1
    summary = {
        "provenance": provenance,
        "jobs": len(jobs),
        "by_status": counts,
        "described": sum("description" in d for d in descriptions.values()),
        "seconds": round(time.monotonic() - started, 1),
        "settings": {k: v for k, v in vars(args).items() if k not in ("child", "out")},
    }
    (out / "campaign.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: summary[k] for k in ("jobs", "by_status", "described", "seconds")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
