"""Walk a PyTorch module on the meta device and turn it into a gpucast job description."""

from __future__ import annotations

import copy
import math
import sys
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from .kinds import CONV_KINDS, kind_of

ROOT_NAME = "(root)"
# The two batch sizes of the saved-tensor trace (batch 1 is avoided: some models take other
# paths at batch 1, e.g. squeezed dimensions).
SAVED_TENSORS_BATCHES = (2, 4)
# The function the saved-tensor trace routes to the memory-efficient attention op.
_SDPA = torch.nn.functional.scaled_dot_product_attention
# CUDA's memory-efficient attention kernel: the head dimensions must be multiples of this
# (16 bytes: 4 fp32, 8 fp16/bf16 values on sm80+), an attention bias whose strides are not
# multiples of _BIAS_ALIGNMENT is padded in its last dimension first (and sliced back).
_HEAD_DIM_ALIGNMENT = {torch.float32: 4, torch.float16: 8, torch.bfloat16: 8}
_BIAS_ALIGNMENT = 8


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


def _efficient_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                         scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` as CUDA runs it in fp32 on an A100: the
    memory-efficient kernel, ``aten._scaled_dot_product_efficient_attention`` (which has meta
    kernels and an autograd formula, so autograd saves what it would save on the GPU: q, k, v,
    the bias, the output and the log-sum-exp, no N x N probabilities or dropout mask).

    Mirrors ``at::scaled_dot_product_attention``'s efficient-attention branch: a boolean mask
    becomes an additive float mask (0 / -inf) in the query's dtype, a bias whose leading strides
    are not multiples of 8 is padded in its last dimension and sliced back, the bias is expanded
    to ``[B, heads, L, S]``, and the log-sum-exp is computed when autograd needs it. Returns None
    (the caller falls back to the normal call) for inputs that kernel does not take and for which
    CUDA would pick the math path too: not 4-D dense meta tensors of one float dtype, different
    batch/head counts (``enable_gqa``), head dimensions not aligned, a last dimension not
    contiguous, a mask not broadcastable to ``[B, heads, L, S]``, a mask with ``is_causal``.
    """
    qkv = (query, key, value)
    if enable_gqa or not all(isinstance(t, torch.Tensor) for t in qkv):
        return None
    if not all(t.is_meta and t.layout == torch.strided and not t.is_nested and t.dim() == 4
               for t in qkv):
        return None
    alignment = _HEAD_DIM_ALIGNMENT.get(query.dtype)
    if alignment is None or key.dtype != query.dtype or value.dtype != query.dtype:
        return None
    (b, h, l, e), (s, ev) = query.shape, (key.shape[2], value.shape[3])
    if key.shape[:2] != (b, h) or value.shape[:3] != (b, h, s) or key.shape[3] != e:
        return None
    if min(l, s, e, ev) < 1 or e % alignment or ev % alignment:
        return None
    if any(t.stride(-1) != 1 for t in qkv):
        return None
    bias = None
    if attn_mask is not None:
        if is_causal or not isinstance(attn_mask, torch.Tensor) or not attn_mask.is_meta:
            return None
        if attn_mask.dtype not in (torch.bool, query.dtype) or attn_mask.dim() > 4:
            return None
        try:
            if torch.broadcast_shapes(attn_mask.shape, (b, h, l, s)) != (b, h, l, s):
                return None
        except RuntimeError:
            return None
        if attn_mask.stride(-1) != 1 and attn_mask.shape[-1] != 1:
            return None
        bias = attn_mask
        if bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=query.dtype, device=bias.device).masked_fill(
                bias.logical_not(), -math.inf)
        aligned = bias.stride(-1) == 1 and all(
            bias.stride(i) % _BIAS_ALIGNMENT == 0 for i in range(bias.dim() - 1))
        if not aligned:
            last = bias.shape[-1]
            bias = nn.functional.pad(bias, (0, _BIAS_ALIGNMENT - last % _BIAS_ALIGNMENT))
            bias = bias[..., :last]
        bias = bias.expand(b, h, l, s)
    compute_log_sumexp = torch.is_grad_enabled() and any(t.requires_grad for t in qkv)
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, compute_log_sumexp, float(dropout_p), bool(is_causal),
        scale=scale)[0]


class _EfficientAttentionMode(TorchFunctionMode):
    """While active (in this thread), ``F.scaled_dot_product_attention`` calls, however the
    function was imported, go to :func:`_efficient_attention`, or to the normal call when it
    returns None. Nothing is patched: leaving the ``with`` block, on error too, ends it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            try:
                output = _efficient_attention(*args, **kwargs)
            except (TypeError, RuntimeError, NotImplementedError):  # e.g. arguments the
                output = None  # normal call rejects too: it raises its own error
            if output is not None:
                return output
        return func(*args, **kwargs)


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

    with torch.inference_mode(False), torch.enable_grad(), _EfficientAttentionMode(), \
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
    linear or convolution).

    During these passes (only: not in the layer walk, and nothing is patched) calls of
    ``F.scaled_dot_product_attention`` run as CUDA runs them in fp32 on an A100: with the
    memory-efficient attention kernel, ``aten._scaled_dot_product_efficient_attention``, which
    saves q, k, v, the attention bias, the output and a log-sum-exp, not the N x N attention
    probabilities (nor a dropout mask) that the math path, the one the meta device takes,
    would save (see :func:`_efficient_attention`). Inputs that kernel refuses (not 4-D, k/v
    with other head counts or ``enable_gqa``, head dimensions not a multiple of 4 in fp32, a
    mask not contiguous in its last dimension...), which a GPU also sends to the math path,
    take the normal call. Attention written out by hand (``q @ k.transpose(-2, -1)``, softmax)
    keeps its N x N tensors, as it does on a GPU.

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
    *,
    simulation: bool = True,
    optimizer: str = "adam",
    precision: str = "fp32",
    loss: str = "auto",
    attention: str = "efficient",
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
    simulated (``optimizer``, ``precision``, ``loss``, ``attention``: see
    :func:`gpucast_describe.simulate.simulate_step`) and their allocator peaks emitted as
    ``simulation``, with the job's ``optimizer`` and ``precision``; when the steps cannot run
    on meta tensors the field is left out, with a warning on stderr.
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
    description["optimizer"] = optimizer
    description["precision"] = precision
    if simulation:
        return with_batch_size(description, batch_size, model=model, input_dtype=input_dtype,
                               loss=loss, attention=attention)
    return description


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

    A ``simulation`` holds for one batch size only: with ``model`` the training step is
    simulated again at ``batch_size`` (the description's optimizer and precision); without,
    a simulation of another batch size is dropped rather than carried over.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    result = {**description, "batch_size": int(batch_size)}
    if model is None:
        if result.get("simulation", {}).get("batch_size") != int(batch_size):
            result.pop("simulation", None)
        return result
    from .simulate import SimulationError, simulate_step
    try:
        result["simulation"] = simulate_step(
            model, description["input_shape"], batch_size, input_dtype,
            optimizer=description.get("optimizer", "adam"),
            precision=description.get("precision", "fp32"), loss=loss, attention=attention)
    except SimulationError as exc:
        result.pop("simulation", None)
        print(f"warning: {description.get('model')}: simulation not run at batch "
              f"{batch_size}: {exc}"[:500], file=sys.stderr, flush=True)
    return result


def total_params(module: nn.Module) -> int:
    """Parameter count of a module, shared tensors counted once."""
    return sum(p.numel() for p in module.parameters())
