"""Walk a PyTorch module on the meta device and turn it into a gpucast job description."""

from __future__ import annotations

import copy
import math
import sys
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from .kinds import CONV_KINDS, kind_of

ROOT_NAME = "(root)"
# The batch size of the layer walk (layers and per-layer FLOPs are per sample).
WALK_BATCH = 1
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


# CUDA's flash attention kernel (sm80+): fp16/bf16 only, equal head dimensions up to 256 (padded
# to a multiple of 8 first, the output sliced back).
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256
_FLASH_HEAD_DIM_ALIGNMENT = 8


def _dense_meta(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.is_meta and \
        tensor.layout == torch.strided and not tensor.is_nested


def _can_use_flash(query, key, value, attn_mask, is_causal, enable_gqa) -> bool:
    """``sdp::can_use_flash_attention`` (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp)
    for dense 4-D inputs on an sm80+ GPU: fp16/bf16, no ``attn_mask``, the three head
    dimensions equal and at most 256, no ``is_causal`` with more keys than queries or fewer
    (non-square), one batch size, the same head counts or, with ``enable_gqa``, k and v heads
    dividing the query's (the kernel reads each k/v head for its group: nothing is expanded),
    no empty sequence, the last dimensions contiguous."""
    if attn_mask is not None or query.dtype not in _FLASH_DTYPES:
        return False
    (b, hq, l, e), (hk, s), hv = query.shape, key.shape[1:3], value.shape[1]
    if not e == key.shape[3] == value.shape[3] or e > _FLASH_MAX_HEAD_DIM:
        return False
    if is_causal and l != s:
        return False
    if key.shape[0] != b or value.shape[0] != b:
        return False
    if not hq == hk == hv and not (enable_gqa and hk == hv and hk > 0 and hq % hk == 0):
        return False
    if min(l, s) < 1:
        return False
    return all(t.stride(-1) == 1 for t in (query, key, value)) or e == 1


def _can_use_efficient(query, key, value, attn_mask) -> bool:
    """``sdp::can_use_mem_efficient_attention`` for dense 4-D inputs on an sm80+ GPU: fp32,
    fp16 or bf16, the head dimensions multiples of 16 bytes' worth of values (4 fp32, 8
    fp16/bf16) and q's equal to k's, one batch size, the same head counts (no grouped-query
    attention: ``enable_gqa`` with fewer k/v heads goes to the math path), no empty sequence,
    q, k, v and the mask contiguous in their last dimension."""
    alignment = _HEAD_DIM_ALIGNMENT.get(query.dtype)
    if alignment is None:
        return False
    (b, h, l, e), (s, ev) = query.shape, (key.shape[2], value.shape[3])
    if key.shape[3] != e or min(e, ev) < 1 or e % alignment or ev % alignment:
        return False
    if key.shape[:2] != (b, h) or value.shape[:3] != (b, h, s):
        return False
    if min(l, s) < 1:
        return False
    tensors = (query, key, value) if attn_mask is None else (query, key, value, attn_mask)
    return all(t.stride(-1) == 1 for t in tensors)


def sdpa_backend(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                 scale=None, enable_gqa=False) -> Optional[str]:
    """The kernel CUDA runs ``F.scaled_dot_product_attention`` with on an sm80+ GPU (A100,
    H100/H200), for meta tensors: ``"flash"``, ``"efficient"`` or ``"math"``.

    ``sdp::select_sdp_backend`` tries, in its default order, flash attention, then the
    memory-efficient kernel, then the math path (cuDNN attention comes after math unless
    asked for): flash for fp16/bf16 without a mask (with grouped-query attention too), the
    memory-efficient kernel for fp32 and for masks, the math path (N x N probabilities kept)
    for what neither takes (fp32 or masked grouped-query attention, misaligned head
    dimensions, a mask not contiguous in its last dimension, fp64...). See
    :func:`_can_use_flash` and :func:`_can_use_efficient`.

    None for arguments this emulation does not take (not dense meta tensors, not 4-D q/k/v of
    one floating dtype, a mask of another dtype or with ``is_causal``): the caller makes the
    normal call, which decides (or raises) for itself.
    """
    qkv = (query, key, value)
    if not all(_dense_meta(t) and t.dim() == 4 for t in qkv):
        return None
    if not query.is_floating_point() or key.dtype != query.dtype or value.dtype != query.dtype:
        return None
    if attn_mask is not None:
        if is_causal or not _dense_meta(attn_mask) or attn_mask.dim() > 4 or \
                attn_mask.dtype not in (torch.bool, query.dtype):
            return None
    if _can_use_flash(query, key, value, attn_mask, is_causal, enable_gqa):
        return "flash"
    if _can_use_efficient(query, key, value, attn_mask):
        return "efficient"
    return "math"


def _flash_attention(query, key, value, dropout_p=0.0, is_causal=False, scale=None):
    """``at::scaled_dot_product_attention``'s flash branch: head dimensions padded to a
    multiple of 8 (and the output sliced back), the scale from the unpadded one, then
    ``aten._scaled_dot_product_flash_attention`` (meta kernels and an autograd formula:
    autograd saves q, k, v, the output, a log-sum-exp [B, heads, L] in fp32 and the dropout
    RNG state; k and v keep their own head counts under grouped-query attention)."""
    head_dim = query.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    pad = -head_dim % _FLASH_HEAD_DIM_ALIGNMENT
    if pad:
        query, key, value = (nn.functional.pad(t, (0, pad)) for t in (query, key, value))
    output = torch.ops.aten._scaled_dot_product_flash_attention(
        query, key, value, float(dropout_p), bool(is_causal), False, scale=float(scale))[0]
    return output[..., :head_dim] if pad else output


def _efficient_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                         scale=None):
    """``at::scaled_dot_product_attention``'s memory-efficient branch, for inputs
    :func:`sdpa_backend` sends there: ``aten._scaled_dot_product_efficient_attention`` (meta
    kernels and an autograd formula, so autograd saves what it would on the GPU: q, k, v,
    the bias, the output and the log-sum-exp, no N x N probabilities or dropout mask).

    A boolean mask becomes an additive float mask (0 / -inf) in the query's dtype, a bias
    whose leading strides are not multiples of 8 is padded in its last dimension and sliced
    back, the bias is expanded to ``[B, heads, L, S]``, and the log-sum-exp is computed when
    autograd needs it.
    """
    b, h, l, s = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    bias = None
    if attn_mask is not None:
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
    compute_log_sumexp = torch.is_grad_enabled() and any(
        t.requires_grad for t in (query, key, value))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, compute_log_sumexp, float(dropout_p), bool(is_causal),
        scale=scale)[0]


def _additive_mask(mask, dtype):
    """``convert_boolean_attn_mask``: 0 where a boolean mask is true, -inf where false."""
    return torch.where(mask, torch.scalar_tensor(0.0, dtype=dtype, device=mask.device),
                       torch.scalar_tensor(-math.inf, dtype=dtype, device=mask.device))


def _math_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                    scale=None, enable_gqa=False):
    """``aten._scaled_dot_product_attention_math`` op for op, with CUDA's dropout: there
    ``at::dropout`` is the fused ``native_dropout`` (a 1-byte mask kept for backward) where
    the meta device's composite keeps a float noise tensor (4 bytes an element of the N x N
    probabilities). Without dropout the two are the same: callers make the normal call then.

    fp16/bf16 inputs are computed in fp32 (``allowFP16BF16ReductionMathSDP`` is off by
    default) and the output cast back; a boolean mask becomes an additive one first, as
    ``at::scaled_dot_product_attention`` does before choosing the path.
    """
    # The names follow the C++ (each lives to the end, as there: the order of frees counts).
    origin_dtype = query.dtype
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = _additive_mask(attn_mask, origin_dtype)
    query_acc, key_acc, value_acc = query, key, value
    if origin_dtype in (torch.float16, torch.bfloat16) and \
            not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed():
        query_acc, key_acc, value_acc = (t.to(torch.float32) for t in (query, key, value))
    negative = scale is not None and scale < 0.0
    factor = math.sqrt(abs(scale) if scale is not None else 1.0 / math.sqrt(query.shape[-1]))
    scaled_query = query_acc * (-factor if negative else factor)
    if is_causal:
        l, s = scaled_query.shape[-2], key_acc.shape[-2]
        attn_mask = _additive_mask(
            torch.ones(l, s, dtype=torch.bool, device=query.device).tril(), scaled_query.dtype)
    key_expanded, value_expanded = key_acc, value_acc
    heads, key_heads, value_heads = query.shape[-3], key.shape[-3], value.shape[-3]
    if enable_gqa and not heads == key_heads == value_heads:
        key_expanded = key_acc.repeat_interleave(heads // key_heads, -3)
        value_expanded = value_acc.repeat_interleave(heads // value_heads, -3)
    attn = torch.matmul(scaled_query, key_expanded.transpose(-2, -1) * factor)
    if attn_mask is not None:
        attn = attn.add(attn_mask)
    attn = torch.ops.aten._safe_softmax(attn, -1)
    if dropout_p > 0.0:
        attn = torch.ops.aten.native_dropout(attn, float(dropout_p), True)[0]
    # The op returns the probabilities too, cast back first (a transient copy in fp16/bf16).
    probabilities = attn.to(origin_dtype)  # noqa: F841
    return torch.matmul(attn, value_expanded).to(origin_dtype)


def _gpu_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` as CUDA runs it on an sm80+ GPU: the kernel
    :func:`sdpa_backend` picks, flash (:func:`_flash_attention`) or memory-efficient
    (:func:`_efficient_attention`), whose autograd formulas keep no N x N probabilities; the
    math path with dropout as :func:`_math_attention` (the GPU's 1-byte dropout mask).
    Returns None (the caller makes the normal call, the math path on meta tensors) for the
    math path without dropout, which is the same on meta, and for what :func:`sdpa_backend`
    does not take."""
    backend = sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal, scale,
                           enable_gqa)
    if backend == "flash":
        return _flash_attention(query, key, value, dropout_p, is_causal, scale)
    if backend == "efficient":
        return _efficient_attention(query, key, value, attn_mask, dropout_p, is_causal, scale)
    if backend == "math" and dropout_p > 0.0:
        return _math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                               enable_gqa)
    return None


class _GpuAttentionMode(TorchFunctionMode):
    """While active (in this thread), ``F.scaled_dot_product_attention`` calls, however the
    function was imported, go to :func:`_gpu_attention`, or to the normal call when it
    returns None. Nothing is patched: leaving the ``with`` block, on error too, ends it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            try:
                output = _gpu_attention(*args, **kwargs)
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

    with torch.inference_mode(False), torch.enable_grad(), _GpuAttentionMode(), \
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
    ``F.scaled_dot_product_attention`` run as CUDA runs them on an A100 or H100: with the
    kernel it picks (:func:`sdpa_backend`). In fp32 that is the memory-efficient attention
    kernel, ``aten._scaled_dot_product_efficient_attention``, which saves q, k, v, the
    attention bias, the output and a log-sum-exp, not the N x N attention probabilities (nor
    a dropout mask) that the math path, the one the meta device takes, would save (see
    :func:`_efficient_attention`); fp16/bf16 without a mask goes to flash attention, which
    saves alike. Inputs both kernels refuse (not 4-D, grouped-query attention in fp32 or with
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
    ``docs/setups.md``): ``optimizer_implementation`` (not ``foreach``),
    ``activation_checkpointing`` (not ``"none"``), ``gradient_accumulation_steps`` k > 1 with
    ``micro_batch_size`` = ``batch_size`` (the samples of one forward/backward pass, what is
    simulated) and ``batch_size`` = ``batch_size`` x k (the samples of one optimizer step),
    ``lora`` (``{"rank", "alpha", "target_modules", "base_weights"}``) and ``trainable``
    (``{"modules": [name prefixes]}``). ``precision`` is emitted under its canonical name
    (``mixed16`` as ``amp_fp16``). The layers and ``saved_tensors`` are the base model's,
    whatever the setup.
    """
    from .simulate import normalise_setup

    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    setup = normalise_setup(
        optimizer=optimizer, precision=precision,
        optimizer_implementation=optimizer_implementation,
        gradient_accumulation_steps=gradient_accumulation_steps,
        activation_checkpointing=activation_checkpointing, lora=lora, trainable=trainable)
    input_shape = [int(d) for d in input_shape]
    if any(d < 1 for d in input_shape):
        raise ValueError(f"input_shape must be positive, got {input_shape}")
    model = _on_meta(module)
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
        print(f"warning: {name or type(module).__name__}: per-layer flops not counted "
              f"(FlopCounterMode total {counter.get_total_flops()}, credited {credited})",
              file=sys.stderr, flush=True)

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
        return with_batch_size(description, batch_size, model=model, input_dtype=input_dtype,
                               loss=loss, attention=attention)
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
    from .simulate import SimulationError, simulate_step
    try:
        result["simulation"] = simulate_step(
            model, description["input_shape"], batch_size, input_dtype, loss=loss,
            attention=attention, **setup)
    except SimulationError as exc:
        result.pop("simulation", None)
        print(f"warning: {description.get('model')}: simulation not run at batch "
              f"{batch_size}: {exc}"[:500], file=sys.stderr, flush=True)
    return result


def total_params(module: nn.Module) -> int:
    """Parameter count of a module, shared tensors counted once."""
    return sum(p.numel() for p in module.parameters())
