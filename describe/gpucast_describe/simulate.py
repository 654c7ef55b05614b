"""Simulate whole training steps on the meta device and replay their memory through a model of
PyTorch's CUDA caching allocator.

Two steps of forward -> loss -> backward -> optimizer step -> zero_grad run on meta tensors
(nothing is allocated or computed). A dispatch mode sees every tensor an op creates and a weak
reference on its storage sees it die, so the steps become one ordered stream of allocations and
frees, each storage counted once (views share it), each labelled with what it is: parameters,
gradients, optimizer state, activations (kept from the forward pass for backward, the loss
included; the model's output is dropped once the loss is computed, as a loop that keeps only
the loss does: Hugging Face's Trainer, the GPU check) or temporaries (everything freed within
the phase that made it). The stream is replayed through :mod:`.allocator` for the allocated
and reserved peaks a GPU would show. The second step is the steady state (optimizer state
exists from the first); the peaks are taken over both, as ``torch.cuda.max_memory_*`` would
report them.

Where the meta device would run other kernels than a GPU, the GPU's choice is emulated:
``F.scaled_dot_product_attention`` runs with the kernel CUDA picks on an sm80+ GPU (flash
attention for fp16/bf16 without a mask, grouped-query attention included, else the
memory-efficient kernel, neither keeping N x N probabilities, else the math path; see
:func:`.walker.sdpa_backend`; ``attention="math"`` forces the math path), dropout, in SDPA's
math path too, as the fused ``native_dropout`` (a one-byte mask, not a float one), fp16 ->
fp32 (log-)softmax as CUDA's ``half_to_float`` kernels, and ``precision="mixed16"`` as CUDA
autocast does it (matmuls and convolutions in fp16 with the weights' casts cached for the step,
softmax, norms and losses in fp32, cross-entropy as autocast leaves it on CUDA). Optimizers
run their ``foreach`` implementations, PyTorch's default on a GPU, with the temporaries those
allocate.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import allocator
from .walker import _gpu_attention, _math_attention, _on_meta, sdpa_backend

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
PRECISIONS = ("fp32", "mixed16")
LOSSES = ("auto", "cross_entropy", "sum")
# efficient: F.scaled_dot_product_attention with the kernel the GPU picks (flash, memory-efficient
# or math: walker.sdpa_backend); math: always its math path (N x N probabilities kept); eager:
# also Hugging Face models switched to their eager attention (config._attn_implementation =
# "eager", as transformers ran before SDPA).
ATTENTIONS = ("efficient", "math", "eager")
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
STEPS = 2

_FORWARD, _BACKWARD, _OPTIMIZER, _IDLE = "forward", "backward", "optimizer", "idle"


class SimulationError(RuntimeError):
    """The model could not run a training step on the meta device."""


class _StepRecorder(TorchDispatchMode):
    """Records the birth and death of every meta storage while active.

    A storage is born with the first op output that lives in it; it dies when its last tensor
    does (a finalizer on the storage's Python object, which PyTorch keeps alive as long as the
    storage itself). Each birth gets a fresh id, so a storage address reused later is a new
    allocation. Categories are settled when the phase that made a storage ends.
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: List[tuple] = []  # (ALLOC, id, nbytes) / (FREE, id), in order
        self.category: Dict[int, str] = {}
        self.phase = _IDLE
        self._born_in: Dict[int, str] = {}
        self._live: Dict[int, int] = {}  # storage _cdata -> id
        self._refs: Dict[int, weakref.KeyedRef] = {}  # storage _cdata -> its weak reference
        self._next_id = 0
        # Meta kernels memoised by their arguments' metadata (see _memo_key)
        self._memo: Dict[tuple, Any] = {}
        self.memo_hits = 0

    def track(self, tensor: torch.Tensor, category: Optional[str] = None) -> None:
        if not isinstance(tensor, torch.Tensor) or not tensor.is_meta:
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        nbytes = storage.nbytes()
        if nbytes == 0:  # CUDA hands out no block for 0 bytes
            return
        self._next_id += 1
        ident = self._next_id
        self._live[key] = ident
        self.events.append((allocator.ALLOC, ident, int(nbytes)))
        self._born_in[ident] = self.phase
        self.category[ident] = category or _PHASE_CATEGORY.get(self.phase, "temporaries")
        # A weak reference whose callback runs when the storage dies (as weakref.finalize
        # would, for less): the storage's Python object lives as long as the storage.
        self._refs[key] = weakref.KeyedRef(storage, self._dead, key)

    def _dead(self, ref: "weakref.KeyedRef") -> None:
        self._free(ref.key)

    def _free(self, key: int) -> None:
        self._refs.pop(key, None)
        ident = self._live.pop(key, None)
        if ident is None:
            return
        self.events.append((allocator.FREE, ident))
        # Freed within the phase that made it: a temporary, whatever it was provisionally.
        if self._born_in.get(ident) == self.phase and self.category[ident] in (
                "activations", "optimizer_state"):
            self.category[ident] = "temporaries"

    def relabel(self, tensor: Optional[torch.Tensor], category: str) -> None:
        """Gives the live storage of ``tensor`` another category (e.g. a gradient)."""
        if tensor is None or tensor.device.type != "meta":
            return
        ident = self._live.get(tensor.untyped_storage()._cdata)
        if ident is not None:
            self.category[ident] = category

    def labelled_events(self) -> List[tuple]:
        return [(e[0], e[1], e[2], self.category[e[1]]) if e[0] == allocator.ALLOC else e
                for e in self.events]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fast = _FAST_META.get(func)
        if fast is not None and all(t.is_meta for t in args if isinstance(t, torch.Tensor)):
            out = fast(*args, **kwargs)
        else:
            key = _memo_key(func, args, kwargs) if MEMOISE_META_KERNELS else None
            if key is not None:
                made = self._memo.get(key)
                if made is not None:
                    if made is not _NOT_MEMOISED:
                        self.memo_hits += 1
                        out = _remake(made)
                        for value in (out,) if made[0] is None else tree_flatten(out)[0]:
                            self.track(value)
                        return out
                    key = None
            out = func(*args, **kwargs)
            if key is not None:
                self._memo[key] = _outputs_made(out, args, kwargs)
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self.track(value)
        return out


_PHASE_CATEGORY = {_FORWARD: "activations", _BACKWARD: "temporaries",
                   _OPTIMIZER: "optimizer_state"}

# -- memoised meta kernels ---------------------------------------------------------------------
#
# A meta kernel only computes its outputs' metadata (shapes, strides, dtypes) from its
# arguments' metadata, and most of them are Python (torch._refs / _meta_registrations): the
# bulk of a simulation's time. A model repeats the same calls (each transformer block, each
# step), so the outputs of an op that makes fresh tensors are memoised by its arguments'
# metadata and made directly (torch.empty_strided) on a repeat: the same allocations, in the
# same order, without running the kernel. Only ops whose schema says they return new tensors
# (no aliasing, no mutation) are memoised, and only calls whose outputs are plain dense meta
# tensors, each with a storage of its own of exactly the bytes its shape and strides span
# (checked on the first call; anything else is run every time).

MEMOISE_META_KERNELS = True  # tests switch it off to compare
_NOT_MEMOISED = object()
_MEMO_RETURNS = {"Tensor", "List[Tensor]", "Optional[Tensor]", "List[Optional[Tensor]]"}
_MEMO_SCALARS = {int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                 torch.memory_format}
_MEMOISABLE: Dict[Any, bool] = {}


class _NoMemo(Exception):
    pass


def _memoisable(func) -> bool:
    known = _MEMOISABLE.get(func)
    if known is None:
        try:
            schema = func._schema
            known = (not schema.is_mutable and bool(schema.returns) and
                     all(r.alias_info is None and str(r.type) in _MEMO_RETURNS
                         for r in schema.returns))
        except Exception:
            known = False
        _MEMOISABLE[func] = known
    return known


def _arg_key(value: Any) -> Any:
    kind = type(value)
    if kind is torch.Tensor or kind is nn.Parameter:
        if not value.is_meta or value.layout is not torch.strided:
            raise _NoMemo
        return (value.dtype, value.shape, value.stride(), value.storage_offset())
    if kind is list or kind is tuple:
        return (kind, tuple([_arg_key(v) for v in value]))
    if kind in _MEMO_SCALARS:  # the type too: 1, 1.0 and True promote differently
        return (kind, value)
    raise _NoMemo


def _memo_key(func, args, kwargs) -> Optional[tuple]:
    if not _memoisable(func):
        return None
    try:
        return (func, _arg_key(args),
                tuple([(name, _arg_key(v)) for name, v in kwargs.items()]) if kwargs else ())
    except _NoMemo:
        return None


def _spanned_bytes(shape, stride, itemsize: int) -> int:
    if any(size == 0 for size in shape):
        return 0
    return (1 + sum((size - 1) * step for size, step in zip(shape, stride))) * itemsize


def _storages(value: Any) -> set:
    return {t.untyped_storage()._cdata for t in tree_flatten(value)[0]
            if isinstance(t, torch.Tensor) and t.is_meta}


def _outputs_made(out: Any, args, kwargs) -> Any:
    """How to make ``out`` again, ``(treespec or None, [(shape, stride, dtype) or None])``, or
    _NOT_MEMOISED when its outputs are not all fresh, dense meta tensors of their own."""
    leaves, spec = tree_flatten(out)
    made, seen = [], _storages((args, kwargs))
    for leaf in leaves:
        if leaf is None:
            made.append(None)
            continue
        if type(leaf) is not torch.Tensor or not leaf.is_meta or \
                leaf.layout is not torch.strided or leaf.storage_offset() != 0:
            return _NOT_MEMOISED
        storage = leaf.untyped_storage()
        shape, stride = tuple(leaf.shape), tuple(leaf.stride())
        if storage._cdata in seen or \
                storage.nbytes() != _spanned_bytes(shape, stride, leaf.element_size()):
            return _NOT_MEMOISED
        seen.add(storage._cdata)
        made.append((shape, stride, leaf.dtype))
    if not made:
        return _NOT_MEMOISED
    return (None if isinstance(out, torch.Tensor) else spec, made)


def _remake(made: tuple) -> Any:
    spec, metas = made
    leaves = [None if m is None else
              torch.empty_strided(m[0], m[1], dtype=m[2], device="meta") for m in metas]
    return leaves[0] if spec is None else tree_unflatten(leaves, spec)


def _statistics_dtype(tensor: torch.Tensor) -> torch.dtype:
    """Norm statistics are kept in fp32 for fp16/bf16 inputs (the accumulate type)."""
    return torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else tensor.dtype


def _like_or_none(tensor: Optional[torch.Tensor], wanted: bool) -> Optional[torch.Tensor]:
    return torch.empty_like(tensor) if wanted and tensor is not None else None


def _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    statistics = _statistics_dtype(input)
    return (torch.empty_like(input), torch.empty([input.shape[1]], dtype=statistics, device=input.device),
            torch.empty([input.shape[1]], dtype=statistics, device=input.device))


def _batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd,
                         train, eps, output_mask):
    return (_like_or_none(input, output_mask[0]), _like_or_none(weight, output_mask[1]),
            _like_or_none(weight, output_mask[2]))


def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    kept = input.dim() - len(normalized_shape)
    shape = list(input.shape[:kept]) + [1] * len(normalized_shape)
    statistics = _statistics_dtype(input)
    # The output is contiguous whatever the input's strides (strides decide later copies).
    return (torch.empty(input.shape, dtype=input.dtype, device=input.device),
            torch.empty(shape, dtype=statistics, device=input.device),
            torch.empty(shape, dtype=statistics, device=input.device))


def _layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    # The input's gradient takes the strides of the incoming gradient.
    return (torch.empty_like(grad_out, dtype=input.dtype) if output_mask[0] else None,
            _like_or_none(weight, output_mask[1]), _like_or_none(bias, output_mask[2]))


# Meta kernels PyTorch implements as Python decompositions, about half of a CNN's or a fifth of a
# transformer's simulation time: the same outputs (shapes, dtypes, strides, so the same
# allocations) made directly. tests/test_simulate.py checks them against the real meta kernels.
_FAST_META = {
    torch.ops.aten.native_batch_norm.default: _batch_norm,
    torch.ops.aten.native_batch_norm_backward.default: _batch_norm_backward,
    torch.ops.aten.native_layer_norm.default: _layer_norm,
    torch.ops.aten.native_layer_norm_backward.default: _layer_norm_backward,
}


def _native_dropout(input, p=0.5, training=True, inplace=False):
    """Dropout as CUDA runs it: ``native_dropout`` saves a bool mask (1 byte an element); the
    meta/CPU path saves a float noise tensor instead."""
    if not training or p <= 0.0 or p >= 1.0 or input.numel() == 0:
        return None
    return torch.ops.aten.native_dropout(input, p, True)[0]


def _gpu_math_attention(*args, **kwargs):
    """SDPA forced onto the math path (``attention="math"``) as CUDA runs it: the same as on
    meta but for dropout (a 1-byte mask kept, not a float noise tensor); None, the normal
    call, without dropout or for arguments :func:`sdpa_backend` does not take."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
             "enable_gqa")
    bound = {**dict(zip(names, args)), **kwargs}
    if bound.get("dropout_p", 0.0) <= 0.0 or sdpa_backend(**bound) is None:
        return None
    return _math_attention(**bound)


# Autocast's lists (aten/src/ATen/autocast_mode.cpp), for the functions models call.
_LOWER_PRECISION = {
    F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
    F.conv_transpose3d, F.scaled_dot_product_attention, torch.matmul, torch.mm, torch.bmm,
    torch.addmm, torch.baddbmm, torch.addbmm, torch.einsum, torch.Tensor.matmul,
    torch.Tensor.__matmul__, torch.Tensor.mm, torch.Tensor.bmm, F.prelu,
}
_FULL_PRECISION = {
    F.softmax, F.log_softmax, F.cross_entropy, F.nll_loss, F.layer_norm, F.group_norm,
    F.mse_loss, F.binary_cross_entropy_with_logits, torch.softmax, torch.log_softmax,
    torch.Tensor.softmax, torch.Tensor.log_softmax, F.normalize, torch.cumsum, torch.exp,
    torch.log, torch.pow, torch.Tensor.pow, torch.sum, torch.Tensor.sum, torch.norm,
}


_LOG_SOFTMAXES = {F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax}
_SOFTMAXES = {F.softmax, torch.softmax, torch.Tensor.softmax} | _LOG_SOFTMAXES


def _half_to_float_softmax(func, args, kwargs, autocast: bool) -> Optional[torch.Tensor]:
    """(Log-)softmax of an fp16 tensor into fp32, as CUDA computes it: ``at::softmax`` /
    ``at::log_softmax`` with ``dtype=float32`` on a CUDA fp16 input call ``_softmax(input,
    dim, half_to_float=True)``, which reads the fp16 input (no fp32 copy of it) and whose
    backward writes the fp16 gradient directly (no fp32 one then cast). The meta device
    converts the input first. Under autocast (fp32 list, ``fp32_set_opt_dtype``) a call
    without ``dtype`` gets ``dtype=float32``. None (the normal call) otherwise."""
    names = ("input", "dim", "_stacklevel", "dtype") if func in (F.softmax, F.log_softmax) \
        else ("input", "dim", "dtype")
    bound = {**dict(zip(names, args)), **kwargs}
    if len(args) > len(names) or set(bound) - set(names):
        return None
    tensor, dim, dtype = bound.get("input"), bound.get("dim"), bound.get("dtype")
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "meta" or \
            not isinstance(dim, int) or tensor.dtype != torch.float16:
        return None
    if dtype is None and autocast:
        dtype = torch.float32
    if dtype != torch.float32:
        return None
    op = torch.ops.aten._log_softmax if func in _LOG_SOFTMAXES else torch.ops.aten._softmax
    return op(tensor, dim, True)


def _autocast_cross_entropy(args, kwargs, cast: Callable) -> Optional[torch.Tensor]:
    """``F.cross_entropy`` of fp16 logits ``[N, C]`` with class indices under CUDA autocast.
    ``cross_entropy_loss`` is on none of autocast's CUDA lists: it calls
    ``log_softmax(input, 1, dtype=input.dtype)`` (an explicit dtype, which autocast leaves:
    fp16 log-probabilities) and ``nll_loss``, which autocast runs in fp32 on a cast copy of
    them (kept for backward with the fp16 ones). None (the caller's handling) otherwise."""
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce",
             "reduction", "label_smoothing")
    bound = {**dict(zip(names, args)), **kwargs}
    if len(args) > len(names) or set(bound) - set(names):
        return None
    logits, target = bound.get("input"), bound.get("target")
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor) or \
            logits.device.type != "meta" or logits.dtype != torch.float16 or \
            logits.dim() != 2 or target.is_floating_point():
        return None
    if bound.get("label_smoothing", 0.0) or bound.get("size_average") is not None or \
            bound.get("reduce") is not None:
        return None
    log_probs = torch.log_softmax(logits, 1, dtype=logits.dtype)
    weight = cast(bound.get("weight"), torch.float32)
    return F.nll_loss(cast(log_probs, torch.float32), target, weight,
                      ignore_index=bound.get("ignore_index", -100),
                      reduction=bound.get("reduction", "mean"))


class _GpuKernelMode(TorchFunctionMode):
    """Routes the calls whose GPU kernels keep other tensors than the meta ones would: SDPA to
    the kernel a GPU picks (or its math path, ``efficient_attention=False``), dropout to
    ``native_dropout``, fp16 -> fp32 (log-)softmax to the ``half_to_float`` kernels, and
    (``autocast``) casts as CUDA autocast makes them (cross-entropy as
    :func:`_autocast_cross_entropy`), weight casts cached until :meth:`clear_cast_cache`."""

    def __init__(self, efficient_attention: bool, autocast: bool):
        super().__init__()
        self.efficient_attention = efficient_attention
        self.autocast = autocast
        self._cast_cache: Dict[int, torch.Tensor] = {}

    def clear_cast_cache(self) -> None:
        self._cast_cache.clear()

    def _cast(self, value: Any, dtype: torch.dtype) -> Any:
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or \
                value.dtype == dtype or value.dtype == torch.float64:
            return value
        cacheable = value.is_leaf and value.requires_grad
        if cacheable and id(value) in self._cast_cache:
            return self._cast_cache[id(value)]
        cast = value.to(dtype)
        if cacheable:
            self._cast_cache[id(value)] = cast
        return cast

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SOFTMAXES:
            output = _half_to_float_softmax(func, args, kwargs, self.autocast)
            if output is not None:
                return output
        if self.autocast and func is F.cross_entropy:
            output = _autocast_cross_entropy(args, kwargs, self._cast)
            if output is not None:
                return output
        if self.autocast:
            if func in _LOWER_PRECISION:
                args = tuple(self._cast(a, torch.float16) for a in args)
                kwargs = {k: self._cast(v, torch.float16) for k, v in kwargs.items()}
            elif func in _FULL_PRECISION:
                args = tuple(self._cast(a, torch.float32) for a in args)
                kwargs = {k: self._cast(v, torch.float32) for k, v in kwargs.items()}
        if func is F.dropout:
            output = _native_dropout(*args, **kwargs)
            if output is not None:
                return output
        if func is F.scaled_dot_product_attention:
            try:
                output = _gpu_attention(*args, **kwargs) if self.efficient_attention else \
                    _gpu_math_attention(*args, **kwargs)
            except (TypeError, RuntimeError, NotImplementedError):
                output = None
            if output is not None:
                return output
        return func(*args, **kwargs)


def _logits(output: Any) -> Any:
    """The tensor a loss is computed from: a tensor, HF ``ModelOutput.logits``, or the first
    tensor of a tuple/list/dict."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        for value in output:
            found = _logits(value)
            if found is not None:
                return found
    return None


def _all_outputs_sum(output: Any) -> torch.Tensor:
    tensors = [t for t in tree_flatten(output)[0]
               if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not tensors:
        raise SimulationError("the model's output has no tensor that needs a gradient")
    total = tensors[0].sum()
    for tensor in tensors[1:]:
        total = total + tensor.sum()
    return total


def default_loss(output: Any, loss: str = "auto") -> torch.Tensor:
    """The loss of one step: cross-entropy with integer targets for class logits ``[B, C]`` and
    token logits ``[B, L, V]`` (every position), else the sum of the outputs."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    logits = _logits(output)
    if loss in ("auto", "cross_entropy") and logits is not None and logits.is_floating_point() \
            and logits.dim() in (2, 3) and logits.shape[-1] > 1:
        classes = logits.shape[-1]
        flat = logits.reshape(-1, classes)
        targets = torch.zeros(flat.shape[0], dtype=torch.int64, device=logits.device)
        return F.cross_entropy(flat, targets)
    if loss == "cross_entropy":
        raise SimulationError("--loss cross_entropy needs logits [B, C] or [B, L, V]")
    return _all_outputs_sum(output)


def make_optimizer(name: str, params: List[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer as PyTorch runs it on a GPU by default: the foreach implementation."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01, foreach=True)
    if name == "momentum":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, foreach=True)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3, foreach=True)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def _hf_attention(model: nn.Module, implementation: Optional[str]) -> List[tuple]:
    """Sets Hugging Face configs' attention implementation; returns what to restore."""
    changed = []
    if implementation is None:
        return changed
    seen = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen or not hasattr(config, "_attn_implementation"):
            continue
        seen.add(id(config))
        changed.append((config, config._attn_implementation))
        config._attn_implementation = implementation
    return changed


def _batch_norms_trainable_at(model: nn.Module, batch_size: int) -> Dict[nn.Module, bool]:
    """Training mode for the whole model; at batch 1 batch norms run in eval mode (PyTorch
    refuses one value per channel in training mode; the tensors kept are alike)."""
    modes = {m: m.training for m in model.modules()}
    model.train()
    if batch_size == 1:
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._NormBase):
                module.eval()
    return modes


def simulate_step(
    module: nn.Module,
    input_shape: Sequence[int],
    batch_size: int,
    input_dtype: torch.dtype = torch.float32,
    *,
    optimizer: str = "adam",
    precision: str = "fp32",
    loss: str = "auto",
    attention: str = "efficient",
    make_input: Optional[Callable[[int], Any]] = None,
) -> Dict[str, Any]:
    """Two training steps of ``module`` at ``batch_size`` on meta tensors, replayed through the
    caching-allocator model. Returns the ``simulation`` field of a job description::

        {"batch_size", "optimizer", "precision", "attention", "allocated_peak_bytes",
         "reserved_peak_bytes", "min_capacity_bytes", "breakdown_at_peak": {category: bytes},
         "interpolated": false}

    ``reserved_peak_bytes`` is the reserved peak with unlimited memory (a large card);
    ``min_capacity_bytes`` the smallest allocator capacity on which the steps run (the cache
    is released before an allocation fails, so a smaller card can still run the job).
    The model's output is dropped once the loss is computed (backward holds only the loss and
    what autograd saved: logits that the loss does not save are freed before backward, as in a
    loop that keeps only the loss). ``breakdown_at_peak`` sums to ``allocated_peak_bytes``.
    Raises :class:`SimulationError` when the model cannot train on meta tensors.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    model = _on_meta(module)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise SimulationError("the model has no trainable parameters")
    shape = [int(batch_size), *[int(d) for d in input_shape]]

    def new_input():
        if make_input is not None:
            return make_input(batch_size)
        return torch.zeros(shape, dtype=input_dtype, device="meta")

    recorder = _StepRecorder()
    kernels = _GpuKernelMode(attention == "efficient", precision == "mixed16")
    state = {id(s): s for s in [*model.parameters(), *model.buffers()]}
    for tensor in state.values():
        recorder.track(tensor, "parameters")
    opt = make_optimizer(optimizer, params)
    modes = _batch_norms_trainable_at(model, batch_size)
    attention_configs = _hf_attention(model, "eager" if attention == "eager" else None)
    try:
        with torch.inference_mode(False), torch.enable_grad(), recorder, kernels:
            for _ in range(STEPS):
                recorder.phase = _FORWARD
                batch = new_input()
                output = model(batch)
                step_loss = default_loss(output, loss)
                del output
                kernels.clear_cast_cache()
                recorder.phase = _BACKWARD
                step_loss.backward()
                del step_loss, batch
                for param in params:
                    recorder.relabel(param.grad, "gradients")
                recorder.phase = _OPTIMIZER
                opt.step()
                recorder.phase = _IDLE
                opt.zero_grad(set_to_none=True)
    except SimulationError:
        raise
    except Exception as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise SimulationError(f"{type(exc).__name__}: {message}"[:500]) from exc
    finally:
        for submodule, training in modes.items():
            submodule.training = training
        for config, implementation in attention_configs:
            config._attn_implementation = implementation
        del opt
    events = recorder.labelled_events()
    result, min_capacity = allocator.replay_with_min_capacity(events)
    breakdown = {category: int(result.breakdown_at_peak.get(category, 0))
                 for category in CATEGORIES}
    return {
        "batch_size": int(batch_size),
        "optimizer": optimizer,
        "precision": precision,
        "attention": attention,
        "allocated_peak_bytes": int(result.allocated_peak_bytes),
        "reserved_peak_bytes": int(result.reserved_peak_bytes),
        "min_capacity_bytes": int(min_capacity),
        "breakdown_at_peak": breakdown,
        "interpolated": False,
    }


def interpolate_simulation(low: Dict[str, Any], high: Dict[str, Any],
                           batch_size: int) -> Dict[str, Any]:
    """The ``simulation`` at ``batch_size`` interpolated linearly between two simulations of
    the same job at batch sizes around it (``interpolated: true``). Peaks grow about linearly
    with the batch (activations do, the model state does not), so between two simulated batch
    sizes the error is small; the allocator's rounding is not reproduced. The breakdown still
    sums to the allocated peak, and allocated <= min capacity <= reserved still hold."""
    b0, b1 = low["batch_size"], high["batch_size"]
    if not b0 < b1 or not b0 <= batch_size <= b1:
        raise ValueError(f"batch {batch_size} is not between {b0} and {b1}")
    weight = (batch_size - b0) / (b1 - b0)

    def at(a: float, b: float) -> int:
        return int(round(a + (b - a) * weight))

    breakdown = {c: at(low["breakdown_at_peak"][c], high["breakdown_at_peak"][c])
                 for c in CATEGORIES}
    allocated = at(low["allocated_peak_bytes"], high["allocated_peak_bytes"])
    breakdown["temporaries"] += allocated - sum(breakdown.values())
    if breakdown["temporaries"] < 0:  # cannot happen with consistent inputs; keep the sum
        breakdown["activations"] += breakdown["temporaries"]
        breakdown["temporaries"] = 0
    min_capacity = max(allocated, at(low["min_capacity_bytes"], high["min_capacity_bytes"]))
    reserved = max(min_capacity, at(low["reserved_peak_bytes"], high["reserved_peak_bytes"]))
    return {**low, "batch_size": int(batch_size), "allocated_peak_bytes": allocated,
            "reserved_peak_bytes": reserved, "min_capacity_bytes": min_capacity,
            "breakdown_at_peak": breakdown, "interpolated": True}
