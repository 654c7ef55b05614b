"""`GpucastCallback`: one class that is both a Hugging Face `TrainerCallback` and a Lightning
`Callback` (whichever of the two is installed), built on first use so that importing gpucast
imports neither."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from .client import Client
from .jobs import from_lightning, job_from_hf
from .observe import MemoryStats, Observer

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

    # Hugging Face Trainer hooks.
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.job is None and model is not None:
            self.observer.job = self.observer.guarded(
                "building the job", lambda: job_from_hf(model, args, seq_len=self.seq_len)
            )
        self.observer.start()

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
        self.observer.start()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # A step is an optimizer step: with accumulation, several batches make one.
        if trainer.global_step != self.last_global_step:
            self.last_global_step = trainer.global_step
            self.observer.step()


def make_callback_class() -> type:
    bases = installed_bases()
    return type("GpucastCallback", (CallbackMethods, *bases), {"__module__": "gpucast", "__doc__": DOC})


DOC = """Posts an observation of a real run after `steps` optimizer steps: the device's peak
memory (NVML, or CUDA's device-wide use), torch's allocator peaks (logged), the median step
time, the environment label and the job (given, or built from the trainer). A Hugging Face
`TrainerCallback` and a Lightning `Callback`: `Trainer(..., callbacks=[GpucastCallback(url,
seq_len=2048)])`. A failed post is a warning; training goes on."""
