"""Walk a PyTorch module on the meta device and turn it into a gpucast job description."""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from .attention import _GpuAttentionMode
from .kinds import CONV_KINDS, kind_of
from .meta import on_meta
from .simulate import SimulationError, normalise_setup, simulate_step

ROOT_NAME = "(root)"
# The batch size of the layer walk (layers and per-layer FLOPs are per sample).
WALK_BATCH = 1
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


def _training_mode(model: nn.Module) -> None:
    """Training mode, as in a training job, except for batch/instance norms.

    In training mode PyTorch rejects a batch norm input with one value per channel, which a
    batch of 1 produces after global pooling; in eval mode the output shape is the same.
    """
    model.train()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._NormBase):
            module.eval()


def linear_features(module: nn.Module) -> Dict[str, int]:
    """``in_features`` and ``out_features`` of a linear layer (what a LoRA adapter's size and
    rank limit follow from): nn.Linear and its quantised look-alikes carry them; Hugging Face's
    GPT-2 ``Conv1D`` stores its weight transposed, ``[in, out]``, with ``nf`` outputs."""
    inputs, outputs = getattr(module, "in_features", None), getattr(module, "out_features", None)
    if isinstance(inputs, int) and isinstance(outputs, int):
        return {"in_features": inputs, "out_features": outputs}
    weight = getattr(module, "weight", None)
    nf = getattr(module, "nf", None)
    if isinstance(nf, int) and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return {"in_features": int(weight.shape[0]), "out_features": nf}
    return {}


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
        # Per open module call (innermost last): the index of the layer its FLOPs go to, None
        # for a call that made no layer (its FLOPs go to the nearest enclosing one).
        self._stack: List[Optional[int]] = []
        self.unattributed_flops = 0  # FLOPs counted outside every layer's call
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
        layer = {
            "kind": kind,
            "output_size": 0,
            "params": params,
            "flops": 0,
            "name": self._names.get(id(module), type(module).__name__),
        }
        layer.update(linear_features(module) if params else {})
        self.layers.append(layer)
        return len(self.layers) - 1

    def _before(self, module: nn.Module, args: Any) -> None:
        kind = self._plan.get(id(module))
        params = self._take_params(module)
        index = None
        if kind is not None:
            index = self._append(kind, module, params)
            self._open.setdefault(id(module), []).append(index)
        elif params:
            index = self._append("other", module, params)
        self._stack.append(index)

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        pending = self._open.get(id(module))
        if pending:
            self.layers[pending.pop()]["output_size"] = output_numel(output)
        if self._stack:
            self._stack.pop()

    def add_flops(self, flops: int) -> None:
        """Credit ``flops`` to the layer of the innermost open module call that has one."""
        for index in reversed(self._stack):
            if index is not None:
                self.layers[index]["flops"] += int(flops)
                return
        self.unattributed_flops += int(flops)

    def finish(self) -> List[Dict[str, Any]]:
        """Attribute the parameters of modules that were never called, and return the layers."""
        for module in self.model.modules():
            params = self._take_params(module)
            if params:
                self._append("other", module, params)
        return self.layers


class _GlobalOnly:
    """Stands in for ``FlopCounterMode``'s ``ModuleTracker``: every FLOP goes to the
    ``"Global"`` total only (the layers are the recorder's). The tracker's module hooks are
    not registered: they cost time on every module call, and under ``torch.no_grad()`` they
    fail on a module whose input is a view of a parameter (``self.latent.expand(B, -1, -1)``
    into timm's ``AttentionPoolLatent`` query projection, in the SigLIP ViTs): such a view
    requires grad but has no autograd node, and the tracker's ``register_multi_grad_hook``
    raises ``AssertionError: Expected gradient function to be set``."""

    parents = frozenset({"Global"})

    def __enter__(self) -> "_GlobalOnly":
        return self

    def __exit__(self, *exc) -> None:
        return None


class _LayerFlopCounter(FlopCounterMode):
    """``FlopCounterMode`` (its formulas: a multiply-add is 2 FLOPs; matmuls, convolutions
    and the attention kernels counted, elementwise ops and norms not) that also credits each
    counted op to the recorder's innermost open layer (:meth:`_Recorder.add_flops`). Its
    per-module tracking is replaced by :class:`_GlobalOnly` (only the total is read)."""

    def __init__(self, recorder: _Recorder):
        super().__init__(display=False)
        self.mod_tracker = _GlobalOnly()
        self.recorder = recorder

    def _count_flops(self, func_packet, out, args, kwargs):
        formula = self.flop_registry.get(func_packet)
        if formula is not None:
            self.recorder.add_flops(formula(*args, **kwargs, out_val=out))
        return super()._count_flops(func_packet, out, args, kwargs)


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
    state = {_storage_key_and_bytes(t)[0] for t in [*model.parameters(), *model.buffers()]}
    held: List[torch.Tensor] = []
    sizes: Dict[tuple, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        held.append(tensor)
        key, nbytes = _storage_key_and_bytes(tensor)
        if key not in state:
            sizes[key] = nbytes
        return tensor

    with (
        torch.inference_mode(False),
        torch.enable_grad(),
        _GpuAttentionMode(),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
    ):
        output = model(example)
    total = sum(sizes.values())
    del output
    held.clear()
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
    linear or convolution).

    During these passes (only: not in the layer walk, and nothing is patched) calls of
    ``F.scaled_dot_product_attention`` run as CUDA runs them on an A100 or H100: with the
    kernel it picks (:func:`.attention.sdpa_backend`). In fp32 that is the memory-efficient
    attention kernel, ``aten._scaled_dot_product_efficient_attention``, which saves q, k, v,
    the attention bias, the output and a log-sum-exp, not the N x N attention probabilities
    (nor a dropout mask) that the math path, the one the meta device takes, would save (see
    :func:`.attention._efficient_attention`); fp16/bf16 without a mask goes to flash
    attention, which saves alike. Inputs both kernels refuse (not 4-D, grouped-query attention in fp32 or with
    a mask, head dimensions not a multiple of 4 in fp32, a mask not contiguous in its last
    dimension...), which a GPU sends to the math path, take the normal call (with dropout,
    the math path with the GPU's one-byte dropout mask). Attention written out by hand
    (``q @ k.transpose(-2, -1)``, softmax) keeps its N x N tensors, as it does on a GPU.

    Saved bytes are linear in the batch size B,
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
        model = on_meta(model)
        modes = {submodule: submodule.training for submodule in model.modules()}
        _training_mode(model)
        try:
            saved = {
                batch: _saved_bytes(model, torch.empty([batch, *input_shape], dtype=input_dtype, device="meta"))
                for batch in (small, large)
            }
        finally:
            for submodule, training in modes.items():
                submodule.training = training
    except Exception as exc:  # the description is still useful without the field
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(
            f"warning: {name or type(model).__name__}: saved_tensors not traced: {type(exc).__name__}: {message}"[:500],
            file=sys.stderr,
            flush=True,
        )
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
    *,
    simulation: bool = True,
    optimizer: str = "adam",
    precision: str = "fp32",
    loss: str = "auto",
    attention: str = "efficient",
    optimizer_implementation: str = "foreach",
    gradient_accumulation_steps: int = 1,
    activation_checkpointing: Any = "none",
    lora: Optional[Dict[str, Any]] = None,
    trainable: Optional[Sequence[str]] = None,
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

    With ``simulation`` (the default), two whole training steps at ``batch_size`` are
    simulated (``optimizer``, ``precision``, ``loss``, ``attention`` and the training setup:
    see :func:`gpucast_describe.simulate.simulate_step`) and their allocator peaks emitted as
    ``simulation``, with the job's ``optimizer`` and ``precision``; when the steps cannot run
    on meta tensors the field is left out, with a warning on stderr.

    The training setup (checked first: a bad value raises ValueError naming the field) is
    emitted at the top level, each field only when it is not the default (see
    ``docs/user/setups.md``): ``optimizer_implementation`` (not ``foreach``),
    ``activation_checkpointing`` (not ``"none"``), ``gradient_accumulation_steps`` k > 1 with
    ``micro_batch_size`` = ``batch_size`` (the samples of one forward/backward pass, what is
    simulated) and ``batch_size`` = ``batch_size`` x k (the samples of one optimizer step),
    ``lora`` (``{"rank", "alpha", "target_modules", "base_weights"}``) and ``trainable``
    (``{"modules": [name prefixes]}``). ``precision`` is emitted under its canonical name
    (``mixed16`` as ``amp_fp16``). The layers and ``saved_tensors`` are the base model's,
    whatever the setup.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    setup = normalise_setup(
        optimizer=optimizer,
        precision=precision,
        optimizer_implementation=optimizer_implementation,
        gradient_accumulation_steps=gradient_accumulation_steps,
        activation_checkpointing=activation_checkpointing,
        lora=lora,
        trainable=trainable,
    )
    input_shape = [int(d) for d in input_shape]
    if any(d < 1 for d in input_shape):
        raise ValueError(f"input_shape must be positive, got {input_shape}")
    model = on_meta(module)
    example = torch.empty([WALK_BATCH, *input_shape], dtype=input_dtype, device="meta")

    modes = {module: module.training for module in model.modules()}
    _training_mode(model)
    try:
        with _Recorder(model) as recorder, _LayerFlopCounter(recorder) as counter, torch.no_grad():
            model(example)
    finally:
        for submodule, training in modes.items():
            submodule.training = training
    layers = recorder.finish()
    credited = sum(layer["flops"] for layer in layers) + recorder.unattributed_flops
    for layer in layers:  # FLOPs for one sample (the walk's batch is 1: exact)
        layer["flops"] //= WALK_BATCH
    if credited != counter.get_total_flops():
        # A PyTorch whose FlopCounterMode counts elsewhere than the hook used here: unknown
        # FLOPs are left out rather than emitted as zeros.
        for layer in layers:
            del layer["flops"]
        print(
            f"warning: {name or type(module).__name__}: per-layer flops not counted "
            f"(FlopCounterMode total {counter.get_total_flops()}, credited {credited})",
            file=sys.stderr,
            flush=True,
        )

    description = {
        "model": name or type(module).__name__,
        "family": family or infer_family(layers),
        "batch_size": int(batch_size),
        "input_shape": input_shape,
        "layers": layers,
    }
    saved_tensors = trace_saved_tensors(model, input_shape, input_dtype, name=description["model"])
    if saved_tensors is not None:
        description["saved_tensors"] = saved_tensors
    description["optimizer"] = setup["optimizer"]
    description["precision"] = setup["precision"]
    if setup["optimizer_implementation"] != "foreach":
        description["optimizer_implementation"] = setup["optimizer_implementation"]
    if setup["activation_checkpointing"] != "none":
        description["activation_checkpointing"] = setup["activation_checkpointing"]
    if setup["gradient_accumulation_steps"] > 1:
        description["gradient_accumulation_steps"] = setup["gradient_accumulation_steps"]
    if setup["lora"] is not None:
        description["lora"] = setup["lora"]
    if setup["trainable"] is not None:
        description["trainable"] = {"modules": setup["trainable"]}
    description = with_batch_size(description, batch_size)
    if simulation:
        return with_batch_size(
            description, batch_size, model=model, input_dtype=input_dtype, loss=loss, attention=attention
        )
    return description


def training_setup(description: Dict[str, Any]) -> Dict[str, Any]:
    """The training setup a description states (its top-level fields, defaults for those
    left out), as :func:`gpucast_describe.simulate.simulate_step` takes it."""
    trainable = description.get("trainable")
    return {
        "optimizer": description.get("optimizer", "adam"),
        "precision": description.get("precision", "fp32"),
        "optimizer_implementation": description.get("optimizer_implementation", "foreach"),
        "gradient_accumulation_steps": description.get("gradient_accumulation_steps", 1),
        "activation_checkpointing": description.get("activation_checkpointing", "none"),
        "lora": description.get("lora"),
        "trainable": trainable.get("modules") if isinstance(trainable, dict) else None,
    }


def with_batch_size(
    description: Dict[str, Any],
    batch_size: int,
    *,
    model: Optional[nn.Module] = None,
    input_dtype: torch.dtype = torch.float32,
    loss: str = "auto",
    attention: str = "efficient",
) -> Dict[str, Any]:
    """The same description for another batch size (the walk is batch-independent, and
    ``saved_tensors`` is given per sample plus a fixed part).

    ``batch_size`` is the samples of one forward/backward pass: with gradient accumulation
    (``gradient_accumulation_steps`` k > 1 in the description) it is the ``micro_batch_size``
    and ``batch_size`` becomes it times k. A ``simulation`` holds for one micro-batch only:
    with ``model`` the training step is simulated again at ``batch_size`` (the description's
    training setup: :func:`training_setup`); without, a simulation of another batch size is
    dropped rather than carried over.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    setup = training_setup(description)
    steps = setup["gradient_accumulation_steps"]
    result = {**description, "batch_size": int(batch_size) * steps}
    if steps > 1:
        result["micro_batch_size"] = int(batch_size)
    if model is None:
        if result.get("simulation", {}).get("batch_size") != int(batch_size):
            result.pop("simulation", None)
        return result
    try:
        result["simulation"] = simulate_step(
            model, description["input_shape"], batch_size, input_dtype, loss=loss, attention=attention, **setup
        )
    except SimulationError as exc:
        result.pop("simulation", None)
        print(
            f"warning: {description.get('model')}: simulation not run at batch {batch_size}: {exc}"[:500],
            file=sys.stderr,
            flush=True,
        )
    return result


def total_params(module: nn.Module) -> int:
    """Parameter count of a module, shared tensors counted once."""
    return sum(p.numel() for p in module.parameters())
