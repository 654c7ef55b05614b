"""`GpucastCallback`: one class that is both a Hugging Face `TrainerCallback` and a Lightning
`Callback` (whichever of the two is installed), built on first use so that importing gpucast
imports neither."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import logging
import sys

from .client import Client
from .jobs import from_lightning, job_from_hf
from .models import EstimateResponse
from .observe import MemoryStats, Observer
from .stack import detect

log = logging.getLogger("gpucast")

# The base classes, by module, in the order tried; both Lightning packages name it Callback.
CALLBACK_BASES = (
    ("transformers", "TrainerCallback"),
    ("lightning.pytorch", "Callback"),
    ("pytorch_lightning", "Callback"),
)


def installed_bases() -> tuple[type, ...]:
    bases: list[type] = []
    lightning_found = False
    for module_name, class_name in CALLBACK_BASES:
        if module_name == "pytorch_lightning" and lightning_found:
            continue
        if importlib.util.find_spec(module_name.split(".")[0]) is None:
            continue
        try:
            bases.append(getattr(importlib.import_module(module_name), class_name))
        except Exception:  # a broken optional install leaves that framework out, not the package
            continue
        lightning_found = lightning_found or "lightning" in module_name
    return tuple(bases) or (object,)


class CallbackMethods:
    """The hooks of both frameworks (their names do not collide) around one `Observer`."""

    def __init__(
        self,
        client: Client | str,
        job: dict[str, Any] | None = None,
        *,
        steps: int = 20,
        gpu: Any = None,
        seq_len: int | None = None,
        batch_size: int | None = None,
        input_shape: list[int] | None = None,
        environment: str | None = None,
        stats: MemoryStats | None = None,
    ) -> None:
        self.job = job
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.input_shape = input_shape
        self.observer = Observer(client, job, steps=steps, gpu=gpu, environment=environment, stats=stats)
        self.last_global_step: int | None = None
        # The environment the user named; else the stack's label, read when training starts.
        self.named_environment = environment
        # The estimate made when training started (logged), for the caller.
        self.estimate: EstimateResponse | None = None

    def label_stack(self, framework: str, uses: tuple[str, ...]) -> None:
        """The observation's environment: the user's, else the stack this process runs."""
        if self.named_environment is not None:
            return
        torch = sys.modules.get("torch")
        cuda = getattr(getattr(torch, "version", None), "cuda", None)
        self.observer.environment = self.observer.guarded(
            "reading the stack", lambda: detect(framework, uses=uses, cuda=cuda)
        )

    def estimate_job(self) -> None:
        """Asks the service for the job's estimate in its environment, and logs it."""
        job = self.observer.job
        if not isinstance(job, dict):
            return
        request = dict(job)
        environment = self.observer.environment
        if environment and "environment" not in request:
            request["environment"] = environment
        gpu, card = self.card(request)
        if gpu is not None:
            request["gpu"] = gpu
        self.estimate = self.observer.guarded("estimating", lambda: self.observer.client.estimate(request))
        if self.estimate is not None:
            memory, fit = self.estimate.memory, self.estimate.fit
            mib = "{:.0f} MiB".format
            assumed = [f"{a['field']}={a['assumed']}" for a in (memory.uncertainty or {}).get("assumed", [])]
            log.info(
                "estimated %s (bound %s at %s) on %s (%s): %s; environment %s; assumed: %s",
                mib(memory.estimate_mib) if memory.estimate_mib is not None else "no figure",
                mib(memory.upper_bound_mib) if memory.upper_bound_mib is not None else "none",
                memory.confidence,
                fit.gpu if fit is not None else "no card",
                card,
                "fits" if fit is not None and fit.fits else "does not fit",
                environment or "none",
                ", ".join(assumed) or "nothing",
            )

    def card(self, request: dict[str, Any]) -> tuple[Any, str]:
        """The card to estimate for and why it is that one: the one named (`gpu=`), the job's,
        or this host's; on a host without a CUDA device and none named, the service's reference
        card, said as a warning rather than assumed in silence."""
        if self.observer.gpu is not None:
            return self.observer.gpu, "named"
        if "gpu" in request:
            return None, "the job's"
        stats = self.observer.stats
        if stats is not None and self.observer.guarded("reading the device", stats.available):
            return stats.device_name(), "this host's GPU"
        log.warning(
            "no CUDA device on this host and no gpu= named: the estimate is for the service's "
            "reference card; name the card the job will train on, e.g. GpucastCallback(url, gpu='rtx-4090')"
        )
        return None, "the service's reference card: no CUDA device here, none named"

    # Hugging Face Trainer hooks.
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.job is None and model is not None:
            self.observer.job = self.observer.guarded(
                "building the job", lambda: job_from_hf(model, args, seq_len=self.seq_len)
            )
        uses = tuple(
            name
            for name, used in (
                ("peft", hasattr(model, "peft_config")),
                ("deepspeed", bool(getattr(args, "deepspeed", None))),
                ("accelerate", bool(getattr(args, "fsdp", None))),
            )
            if used
        )
        self.label_stack("transformers", uses)
        self.observer.start()
        self.estimate_job()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.observer.step()

    def on_train_end(self, *args: Any, **kwargs: Any) -> None:
        """Both frameworks name a hook so, with other arguments: this one takes either's."""

    # Lightning hooks.
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.job is None:
            self.observer.job = self.observer.guarded(
                "building the job",
                lambda: from_lightning(
                    trainer,
                    pl_module,
                    batch_size=self.batch_size,
                    seq_len=self.seq_len,
                    input_shape=self.input_shape,
                ),
            )
        self.last_global_step = trainer.global_step
        strategy = type(getattr(trainer, "strategy", None)).__name__
        uses = (("deepspeed",) if "DeepSpeed" in strategy else ()) + (
            ("peft",) if hasattr(getattr(pl_module, "model", None), "peft_config") else ()
        )
        self.label_stack("lightning", uses)
        self.observer.start()
        self.estimate_job()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # A step is an optimizer step: with accumulation, several batches make one.
        if trainer.global_step != self.last_global_step:
            self.last_global_step = trainer.global_step
            self.observer.step()


def make_callback_class() -> type:
    bases = installed_bases()
    return type("GpucastCallback", (CallbackMethods, *bases), {"__module__": "gpucast", "__doc__": DOC})


DOC = """Estimates the job when training starts (logged) and posts an observation of the run
after `steps` optimizer steps: the device's peak memory (NVML, or CUDA's device-wide use),
torch's allocator peaks (logged), the median step time, the job (given, or built from the
trainer) and its environment: the one named, else the stack it ran on (the framework's,
torch's and the libraries' versions, CUDA and the launcher: `gpucast.stack`). A Hugging Face
`TrainerCallback` and a Lightning `Callback`: `Trainer(..., callbacks=[GpucastCallback(url,
seq_len=2048)])`. A failed post is a warning; training goes on."""
