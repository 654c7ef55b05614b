"""The stack a job runs on, as an environment label: the training framework and the libraries
that change how it holds memory (their versions), CUDA, and the launcher that started it.

Observations of one stack teach the service what that stack changes (issue 44); the callback
labels its observations with it unless the user names an environment. Nothing here imports
torch or the frameworks: versions come from the installed packages' metadata.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from collections.abc import Callable, Mapping

# The service's environment labels: 1 to 64 of these (src/calibration/label.rs).
MAX_ENVIRONMENT_CHARS = 64
NOT_IN_LABEL = re.compile(r"[^A-Za-z0-9._+-]")

# Each framework and library by its short tag in a label, in the label's order.
TAGS = {
    "transformers": "hf",
    "lightning": "pl",
    "torch": "torch",
    "peft": "peft",
    "deepspeed": "ds",
    "accelerate": "acc",
}
# The launchers, by the environment each sets in the processes it starts (accelerate's
# `launch` sets ACCELERATE_MIXED_PRECISION; DeepSpeed's launcher CROSS_RANK and LOCAL_SIZE;
# torchrun, and accelerate's multi-GPU launch through it, TORCHELASTIC_RUN_ID), the most
# specific first.
LAUNCHERS = (
    ("accelerate", ("ACCELERATE_MIXED_PRECISION",)),
    ("deepspeed", ("CROSS_RANK", "LOCAL_SIZE")),
    ("torchrun", ("TORCHELASTIC_RUN_ID",)),
)


def minor(version: str | None) -> str | None:
    """`2.5.1+cu124` -> `2.5`: the minor version is what changes how memory is held; the local
    tag repeats the CUDA version."""
    if not version:
        return None
    return ".".join(version.split("+")[0].split(".")[:2]) or None


def launcher(environ: Mapping[str, str]) -> str | None:
    """The launcher that started this process, from the environment it set; None for a plain
    `python` (or one not known)."""
    for name, variables in LAUNCHERS:
        if all(environ.get(v) for v in variables):
            return name
    return None


def stack_label(
    framework: str | None,
    versions: Mapping[str, str | None],
    *,
    cuda: str | None = None,
    launched_by: str | None = None,
) -> str | None:
    """A label such as `hf4.46-torch2.5-cu124-peft0.13-ds0.15-deepspeed` of a stack: the
    framework (`transformers` or `lightning`) and the libraries in `versions` that it uses, at
    their minor versions, CUDA and the launcher; within the service's rules (at most 64 of
    `[A-Za-z0-9._+-]`: the parts that do not fit are left out, the framework and torch first).
    None when nothing is known."""
    parts: list[str] = []
    names = [framework] if framework else []
    names += [
        name for name in TAGS if name != framework and name in versions and name not in ("transformers", "lightning")
    ]
    for name in names:
        version = minor(versions.get(name))
        if version:
            parts.append(TAGS.get(name, name) + version)
        if name == "torch" and cuda:
            parts.append("cu" + cuda.replace(".", ""))
    if launched_by:
        parts.append(launched_by)
    label = ""
    for part in (NOT_IN_LABEL.sub("_", p) for p in parts):
        joined = f"{label}-{part}" if label else part
        if len(joined) <= MAX_ENVIRONMENT_CHARS:
            label = joined
    return label or None


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    except Exception:  # a broken install's metadata: the label goes without it
        return None


def detect(
    framework: str | None,
    *,
    uses: tuple[str, ...] = (),
    cuda: str | None = None,
    environ: Mapping[str, str] | None = None,
    version: Callable[[str], str | None] | None = None,
) -> str | None:
    """This process's stack label: `framework` (`transformers`, `lightning` or None) and torch
    at their installed versions, the libraries in `uses` (those the job runs through: `peft`,
    `deepspeed`, `accelerate`), CUDA, and the launcher read from `environ` (default: this
    process's environment); `version` reads a package's version (default: its metadata). A launcher that is a library (deepspeed, accelerate) is used."""
    environ = os.environ if environ is None else environ
    version = installed_version if version is None else version
    launched_by = launcher(environ)
    used = set(uses)
    if launched_by in ("deepspeed", "accelerate"):
        used.add(launched_by)
    if environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        used.add("deepspeed")
    names = ([framework] if framework else []) + ["torch"] + [n for n in TAGS if n in used]
    versions = {name: version(name) for name in names}
    if framework == "lightning" and not versions.get("lightning"):
        # The older package name of the same framework.
        versions["lightning"] = version("pytorch_lightning")
    return stack_label(framework, versions, cuda=cuda, launched_by=launched_by)
