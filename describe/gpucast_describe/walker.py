"""Walk a PyTorch module on the meta device and turn it into a gpucast job description."""

from __future__ import annotations

import copy
import sys
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from .kinds import CONV_KINDS, kind_of

ROOT_NAME = "(root)"
# The two batch sizes of the saved-tensor trace (batch 1 is avoided: some models take other
# paths at batch 1, e.g. squeezed dimensions).
SAVED_TENSORS_BATCHES = (2, 4)


def infer_family(layers: Sequence[Dict[str, Any]]) -> str:
    """``transformer`` if any attention layer, else ``cnn`` if any convolution, else ``mlp``."""
    kinds = {layer["kind"] for layer in layers}
    if "attention" in kinds:
        return "transformer"
    if kinds & CONV_KINDS:
        return "cnn"
    return "mlp"


def output_numel(value: Any) -> int:
    """Total number of elements of the tensors in a (possibly nested) module output."""
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, dict):  # includes Hugging Face ModelOutput
        return sum(output_numel(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(output_numel(v) for v in value)
    return 0


def _on_meta(module: nn.Module) -> nn.Module:
    """The module itself when all its tensors are on the meta device, else a meta copy."""
    tensors = list(module.parameters()) + list(module.buffers())
    if all(t.is_meta for t in tensors):
        return module
    return copy.deepcopy(module).to("meta")


def _training_mode(model: nn.Module) -> None:
    """Training mode, as in a training job, except for batch/instance norms.

    In training mode PyTorch rejects a batch norm input with one value per channel, which a
    batch of 1 produces after global pooling; in eval mode the output shape is the same.
    """
    model.train()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._NormBase):
            module.eval()


class _Recorder:
    """Forward hooks that append one layer per recorded module call, in execution order.

    A call is recorded when the module is a leaf, an attention module, or a module whose class
    maps to a known kind although it has children (timm's ``BatchNormAct2d`` is a batch norm
    with an activation child). The slot is reserved in the pre-hook, so a parent comes before
    its children, and the output size is filled in by the post-hook.

    Each parameter tensor is counted once, by the first module call that owns it, so the
    ``params`` of the layers sum to the model's parameter count. Parameters owned by modules
    that are not recorded (``cls_token``, ``pos_embed`` on a ViT) go to one ``other`` layer,
    output size 0, named after the owning module and placed where that module is first called;
    those of modules never called go to such layers at the end.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers: List[Dict[str, Any]] = []
        self._counted: set = set()  # ids of the parameters already attributed to a layer
        self._open: Dict[int, List[int]] = {}  # id(module) -> indices awaiting an output
        self._names: Dict[int, str] = {}
        self._plan: Dict[int, Optional[str]] = {}  # id(module) -> kind, None if not recorded
        self._handles: list = []
        for name, module in model.named_modules():
            self._names[id(module)] = name or ROOT_NAME
            kind = kind_of(module)
            is_leaf = next(module.children(), None) is None
            self._plan[id(module)] = kind if is_leaf or kind != "other" else None

    def __enter__(self) -> "_Recorder":
        for module in self.model.modules():
            self._handles.append(module.register_forward_pre_hook(self._before))
            self._handles.append(module.register_forward_hook(self._after))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _take_params(self, module: nn.Module) -> int:
        total = 0
        for param in module._parameters.values():
            if param is not None and id(param) not in self._counted:
                self._counted.add(id(param))
                total += param.numel()
        return total

    def _append(self, kind: str, module: nn.Module, params: int) -> int:
        self.layers.append({
            "kind": kind,
            "output_size": 0,
            "params": params,
            "name": self._names.get(id(module), type(module).__name__),
        })
        return len(self.layers) - 1

    def _before(self, module: nn.Module, args: Any) -> None:
        kind = self._plan.get(id(module))
        params = self._take_params(module)
        if kind is not None:
            index = self._append(kind, module, params)
            self._open.setdefault(id(module), []).append(index)
        elif params:
            self._append("other", module, params)

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        pending = self._open.get(id(module))
        if pending:
            self.layers[pending.pop()]["output_size"] = output_numel(output)

    def finish(self) -> List[Dict[str, Any]]:
        """Attribute the parameters of modules that were never called, and return the layers."""
        for module in self.model.modules():
            params = self._take_params(module)
            if params:
                self._append("other", module, params)
        return self.layers


def _storage_key_and_bytes(tensor: torch.Tensor) -> tuple:
    """The identity and size in bytes of a tensor's storage (the tensor itself if it has none)."""
    try:
        storage = tensor.untyped_storage()
        return ("storage", storage._cdata), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # e.g. sparse or nested tensors
        return ("tensor", id(tensor)), tensor.numel() * tensor.element_size()


def _saved_bytes(model: nn.Module, example: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward of ``example``.

    Storages of the model's parameters and buffers (model state, resident anyway) are left out;
    every other storage is counted once however many tensors or ops save it. The packed tensors
    are held until the end, so no storage is freed (and its address reused) during the pass.
    """
    state = {_storage_key_and_bytes(t)[0]
             for t in [*model.parameters(), *model.buffers()]}
    held: List[torch.Tensor] = []
    sizes: Dict[tuple, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        held.append(tensor)
        key, nbytes = _storage_key_and_bytes(tensor)
        if key not in state:
            sizes[key] = nbytes
        return tensor

    with torch.inference_mode(False), torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = model(example)
    total = sum(sizes.values())
    del output, held
    return int(total)


def trace_saved_tensors(
    model: nn.Module,
    input_shape: Sequence[int],
    input_dtype: torch.dtype = torch.float32,
    *,
    name: Optional[str] = None,
) -> Optional[Dict[str, int]]:
    """The bytes autograd saves for backward in one training step's forward pass, per sample.

    Two forward passes with autograd enabled, on meta tensors ``[2, *input_shape]`` and
    ``[4, *input_shape]`` of ``input_dtype``, in training mode (batch/instance norms in eval
    mode, as in the layer walk), with a ``saved_tensors_hooks`` pack hook that records the
    storage of every tensor an autograd node saves. Parameters and buffers are left out, each
    other storage is counted once (the model input counts when an op saves it, e.g. the first
    linear or convolution). Saved bytes are linear in the batch size B,
    ``saved(B) = fixed_bytes + per_sample_bytes * B``::

        per_sample_bytes = round((saved(4) - saved(2)) / 2)
        fixed_bytes = max(0, saved(2) - 2 * per_sample_bytes)

    Returns ``{"per_sample_bytes": int, "fixed_bytes": int}``, or None, with one warning line
    on stderr, when a pass raises (an op that cannot run on meta with autograd). The module's
    training flags are restored; a module not on the meta device is traced on a meta copy.
    """
    small, large = SAVED_TENSORS_BATCHES
    input_shape = [int(d) for d in input_shape]
    try:
        model = _on_meta(model)
        modes = {submodule: submodule.training for submodule in model.modules()}
        _training_mode(model)
        try:
            saved = {
                batch: _saved_bytes(
                    model, torch.empty([batch, *input_shape], dtype=input_dtype, device="meta"))
                for batch in (small, large)
            }
        finally:
            for submodule, training in modes.items():
                submodule.training = training
    except Exception as exc:  # the description is still useful without the field
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"warning: {name or type(model).__name__}: saved_tensors not traced: "
              f"{type(exc).__name__}: {message}"[:500], file=sys.stderr, flush=True)
        return None
    per_sample = max(0, round((saved[large] - saved[small]) / (large - small)))
    fixed = max(0, saved[small] - small * per_sample)
    return {"per_sample_bytes": int(per_sample), "fixed_bytes": int(fixed)}


def describe_module(
    module: nn.Module,
    input_shape: Sequence[int],
    batch_size: int,
    family: Optional[str] = None,
    name: Optional[str] = None,
    input_dtype: torch.dtype = torch.float32,
) -> Dict[str, Any]:
    """Describe ``module`` as a gpucast job description (the body of ``POST /v1/estimate``).

    The layers come from one forward pass, in training mode (batch norms excepted) and without
    autograd, on a meta tensor of shape ``[1, *input_shape]`` (use ``input_dtype=torch.int64``
    for token ids), so nothing is allocated or computed and the result does not depend on
    ``batch_size``. Then ``saved_tensors`` (``{"per_sample_bytes", "fixed_bytes"}``, the bytes
    autograd saves for backward, linear in the batch size) comes from two more meta passes
    with autograd, at batch 2 and 4: see :func:`trace_saved_tensors`. When those passes fail
    the field is left out (with a warning on stderr) and the rest of the description stands.
    A module that is not on the meta device is copied there first; the caller's module is
    left as it was (training flags included).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    input_shape = [int(d) for d in input_shape]
    if any(d < 1 for d in input_shape):
        raise ValueError(f"input_shape must be positive, got {input_shape}")
    model = _on_meta(module)
    example = torch.empty([1, *input_shape], dtype=input_dtype, device="meta")

    modes = {module: module.training for module in model.modules()}
    _training_mode(model)
    try:
        with _Recorder(model) as recorder, torch.no_grad():
            model(example)
    finally:
        for submodule, training in modes.items():
            submodule.training = training
    layers = recorder.finish()

    description = {
        "model": name or type(module).__name__,
        "family": family or infer_family(layers),
        "batch_size": int(batch_size),
        "input_shape": input_shape,
        "layers": layers,
    }
    saved_tensors = trace_saved_tensors(model, input_shape, input_dtype,
                                        name=description["model"])
    if saved_tensors is not None:
        description["saved_tensors"] = saved_tensors
    return description


def with_batch_size(description: Dict[str, Any], batch_size: int) -> Dict[str, Any]:
    """The same description for another batch size (the walk is batch-independent, and
    ``saved_tensors`` is given per sample plus a fixed part)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    return {**description, "batch_size": int(batch_size)}


def total_params(module: nn.Module) -> int:
    """Parameter count of a module, shared tensors counted once."""
    return sum(p.numel() for p in module.parameters())
