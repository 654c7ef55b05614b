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
:func:`.attention.sdpa_backend`; ``attention="math"`` forces the math path), dropout, in SDPA's
math path too, as the fused ``native_dropout`` (a one-byte mask, not a float one), fp16 ->
fp32 (log-)softmax as CUDA's ``half_to_float`` kernels, and ``amp_fp16`` / ``amp_bf16`` as CUDA
autocast does it (matmuls and convolutions in 16 bits with the weights' casts cached for the
forward pass, softmax, norms and losses in fp32, cross-entropy as autocast leaves it on CUDA).
Optimizers run their ``foreach`` implementations by default, PyTorch's default on a GPU, with
the temporaries those allocate.

The training setup (:func:`simulate_step`): pure ``bf16`` / ``fp16`` (a cast copy of the model,
fp16 with GradScaler's tensors), the optimizers' ``fused`` and ``for_loop`` implementations,
Adafactor, bitsandbytes' 8-bit and paged Adam (:class:`BitsAndBytesAdam`), gradient
accumulation (two micro-batches a step, gradients alive across them), and the module
transforms of :mod:`.adapters` (activation checkpointing, LoRA, frozen modules).

Speed (the same stream, for less): meta kernels memoised by their arguments' metadata,
in-place updates of meta tensors not run, the second step's passes replayed from the first's
recorded events, the min-capacity search over shared continuations (:mod:`.allocator`).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import sys
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import allocator

# LoRA's base formats and default alpha are the adapters module's (LORA_* for the CLI).
from .adapters import apply_setup, parse_lora
from .attention import _gpu_attention, _math_attention, sdpa_backend
from .meta import on_meta
from .vocabulary import VOCABULARY

# The service's names (vocabulary.json); what each optimizer keeps is this module's.
OPTIMIZERS = tuple(VOCABULARY["optimizer"])
PAGED_OPTIMIZERS = ("paged_adamw", "paged_adamw_8bit")
OPTIMIZER_IMPLEMENTATIONS = tuple(VOCABULARY["optimizer_implementation"])
PRECISIONS = tuple(VOCABULARY["precision"])
PRECISION_ALIASES = {"mixed16": "amp_fp16", "amp": "amp_fp16"}
LOSSES = ("auto", "cross_entropy", "sum")
# efficient: F.scaled_dot_product_attention with the kernel the GPU picks (flash, memory-efficient
# or math: attention.sdpa_backend); math: always its math path (N x N probabilities kept); eager:
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
        self.replayed_passes = 0
        self._tracking = True
        # Tensor.item() of a meta tensor answers 1 while set (the optimizer step: Adafactor's
        # step sizes read norms; the values do not change what is allocated)
        self.fake_scalars = False

    @contextlib.contextmanager
    def untracked(self):
        """Storages made inside are not recorded (memory outside the caching allocator)."""
        self._tracking = False
        try:
            yield
        finally:
            self._tracking = True

    def track(self, tensor: torch.Tensor, category: Optional[str] = None) -> None:
        if not isinstance(tensor, torch.Tensor) or not tensor.is_meta or not self._tracking:
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
        if self._born_in.get(ident) == self.phase and self.category[ident] in ("activations", "optimizer_state"):
            self.category[ident] = "temporaries"

    # -- a forward/backward pass recorded once, replayed for the second step ------------------

    def mark(self) -> tuple:
        return (len(self.events), self._next_id)

    def capture_pass(
        self, mark: tuple, params: List[nn.Parameter], once: Sequence[torch.Tensor] = ()
    ) -> Optional[Dict[str, Any]]:
        """The events of the pass since ``mark`` as a template :meth:`replay_pass` repeats, or
        None when the pass is not self-contained: it must free only storages it made, and
        leave alive only the parameters' new gradients (their shapes kept, to be made again)
        and ``once`` (made the first time only, e.g. the loss scaler's state: left out of the
        template)."""
        start, first_id = mark
        events = self.events[start:]
        born = set()
        for event in events:
            if event[0] == allocator.ALLOC:
                born.add(event[1])
            elif event[1] not in born:
                return None
        grads: Dict[int, tuple] = {}
        for index, param in enumerate(params):
            grad = param.grad
            if grad is None:
                continue
            ident = self._live.get(grad.untyped_storage()._cdata)
            if ident is None:
                return None
            if ident <= first_id:  # accumulated into a gradient of an earlier pass
                continue
            shape, stride = tuple(grad.shape), tuple(grad.stride())
            if (
                ident in grads
                or type(grad) is not torch.Tensor
                or grad.storage_offset()
                or grad.untyped_storage().nbytes() != _spanned_bytes(shape, stride, grad.element_size())
            ):
                return None
            grads[ident] = (index, shape, stride, grad.dtype)
        once_ids = {self._live.get(t.untyped_storage()._cdata) for t in once}
        alive = {ident for ident in self._live.values() if ident > first_id}
        if alive - set(grads) - once_ids:
            return None
        return {
            "events": [e for e in events if not (e[0] == allocator.ALLOC and e[1] in once_ids)],
            "categories": {ident: self.category[ident] for ident in born},
            "grads": grads,
        }

    def replay_pass(self, template: Dict[str, Any], params: List[nn.Parameter]) -> None:
        """Appends the template's events under fresh ids and gives the parameters the
        gradients it left alive (meta tensors whose deaths are then recorded as usual)."""
        self.replayed_passes += 1
        fresh: Dict[int, int] = {}
        categories = template["categories"]
        for event in template["events"]:
            if event[0] == allocator.ALLOC:
                self._next_id += 1
                fresh[event[1]] = ident = self._next_id
                self.events.append((allocator.ALLOC, ident, event[2]))
                self.category[ident] = categories[event[1]]
            else:
                self.events.append((allocator.FREE, fresh[event[1]]))
        with self.untracked():
            for old, (index, shape, stride, dtype) in template["grads"].items():
                grad = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
                params[index].grad = grad
                storage = grad.untyped_storage()
                key = storage._cdata
                ident = fresh[old]
                self._live[key] = ident
                self._born_in[ident] = _BACKWARD
                self._refs[key] = weakref.KeyedRef(storage, self._dead, key)

    def relabel(self, tensor: Optional[torch.Tensor], category: str) -> None:
        """Gives the live storage of ``tensor`` another category (e.g. a gradient)."""
        if tensor is None or tensor.device.type != "meta":
            return
        ident = self._live.get(tensor.untyped_storage()._cdata)
        if ident is not None:
            self.category[ident] = category

    def labelled_events(self) -> List[tuple]:
        return [(e[0], e[1], e[2], self.category[e[1]]) if e[0] == allocator.ALLOC else e for e in self.events]

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # No torch._disable_dynamo wrapper around __torch_dispatch__ (a few microseconds a
        # call): nothing is compiled in a simulation.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Without torch-function handling: in backward the engine runs ops with
        # _GpuKernelMode on the stack, which would see every Tensor method called here.
        with _NO_TORCH_FUNCTION():
            return self._dispatch(func, args, kwargs or {})

    def _dispatch(self, func, args, kwargs):
        if func in _IN_PLACE_WITHOUT_META:
            return None
        in_place = _IN_PLACE.get(func)
        if in_place is None:
            in_place = _IN_PLACE[func] = _in_place_kind(func)
        if in_place and _all_meta(args) and _all_meta(kwargs.values()):
            # An in-place update of meta tensors allocates nothing and changes no metadata:
            # its meta kernel (for the optimizers' foreach updates, a Python loop over every
            # parameter) is not run. The result is what the op returns: nothing, or self.
            return args[0] if in_place == "self" else None
        if func is _LOCAL_SCALAR and self.fake_scalars and args[0].is_meta:
            return True if args[0].dtype is torch.bool else 1.0 if args[0].is_floating_point() else 1
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
        if type(out) is torch.Tensor:
            self.track(out)
            return out
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self.track(value)
        return out


_IN_PLACE: Dict[Any, Any] = {}
_NOT_IN_PLACE_ONLY = {"resize_", "resize_as_", "set_", "as_strided_"}


def _in_place_kind(func) -> Any:
    """``"void"`` for an op that only updates some of its arguments in place and returns
    nothing, ``"self"`` for one that updates its first argument and returns it (``add_``,
    ``_foreach_mul_``, ``copy_``...), False otherwise (functional ops, ``out=`` variants, which
    may resize their output, and in-place ops that change a tensor's metadata or storage:
    ``t_``, ``squeeze_``, ``resize_``, ``set_``)."""
    try:
        schema = func._schema
        name = schema.name.split("::")[-1]
        if (
            not schema.is_mutable
            or torch.Tag.inplace_view in func.tags
            or name in _NOT_IN_PLACE_ONLY
            or "resize" in name
            or any(argument.is_out for argument in schema.arguments)
        ):
            return False
        returns = schema.returns
        if not returns:
            return "void"
        first = schema.arguments[0] if schema.arguments else None
        if (
            len(returns) == 1
            and returns[0].alias_info is not None
            and returns[0].alias_info.is_write
            and first is not None
            and first.alias_info is not None
            and first.alias_info.is_write
            and returns[0].alias_info.before_set == first.alias_info.before_set
        ):
            return "self"
    except Exception:
        pass
    return False


def _all_meta(values) -> bool:
    for value in values:
        kind = type(value)
        if kind is list or kind is tuple:
            if not _all_meta(value):
                return False
        elif isinstance(value, torch.Tensor) and not value.is_meta:
            return False
    return True


_PHASE_CATEGORY = {_FORWARD: "activations", _BACKWARD: "temporaries", _OPTIMIZER: "optimizer_state"}
_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction
# In-place kernels without a meta kernel that allocate nothing on a GPU: skipped
_IN_PLACE_WITHOUT_META = {torch.ops.aten._fused_sgd_.default, torch.ops.aten._fused_sgd_.tensor_lr}

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
# The second step's forward/backward passes repeat the first's recorded events (see
# _StepRecorder.capture_pass); tests switch it off to compare.
REUSE_PASSES = True
_NOT_MEMOISED = object()
_MEMO_RETURNS = {"Tensor", "List[Tensor]", "Optional[Tensor]", "List[Optional[Tensor]]"}
_MEMO_SCALARS = {int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}
_MEMOISABLE: Dict[Any, bool] = {}


class _NoMemo(Exception):
    pass


def _memoisable(func) -> bool:
    known = _MEMOISABLE.get(func)
    if known is None:
        try:
            schema = func._schema
            known = (
                not schema.is_mutable
                and bool(schema.returns)
                and all(r.alias_info is None and str(r.type) in _MEMO_RETURNS for r in schema.returns)
            )
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
        return (func, _arg_key(args), tuple([(name, _arg_key(v)) for name, v in kwargs.items()]) if kwargs else ())
    except _NoMemo:
        return None


def _spanned_bytes(shape, stride, itemsize: int) -> int:
    if any(size == 0 for size in shape):
        return 0
    return (1 + sum((size - 1) * step for size, step in zip(shape, stride))) * itemsize


def _storages(value: Any) -> set:
    return {t.untyped_storage()._cdata for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.is_meta}


def _outputs_made(out: Any, args, kwargs) -> Any:
    """How to make ``out`` again, ``(treespec or None, [(shape, stride, dtype) or None])``, or
    _NOT_MEMOISED when its outputs are not all fresh, dense meta tensors of their own."""
    leaves, spec = tree_flatten(out)
    made, seen = [], _storages((args, kwargs))
    for leaf in leaves:
        if leaf is None:
            made.append(None)
            continue
        if (
            type(leaf) is not torch.Tensor
            or not leaf.is_meta
            or leaf.layout is not torch.strided
            or leaf.storage_offset() != 0
        ):
            return _NOT_MEMOISED
        storage = leaf.untyped_storage()
        shape, stride = tuple(leaf.shape), tuple(leaf.stride())
        if storage._cdata in seen or storage.nbytes() != _spanned_bytes(shape, stride, leaf.element_size()):
            return _NOT_MEMOISED
        seen.add(storage._cdata)
        made.append((shape, stride, leaf.dtype))
    if not made:
        return _NOT_MEMOISED
    return (None if isinstance(out, torch.Tensor) else spec, made)


def _remake(made: tuple) -> Any:
    spec, metas = made
    leaves = [None if m is None else torch.empty_strided(m[0], m[1], dtype=m[2], device="meta") for m in metas]
    return leaves[0] if spec is None else tree_unflatten(leaves, spec)


def _statistics_dtype(tensor: torch.Tensor) -> torch.dtype:
    """Norm statistics are kept in fp32 for fp16/bf16 inputs (the accumulate type)."""
    return torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else tensor.dtype


def _like_or_none(tensor: Optional[torch.Tensor], wanted: bool) -> Optional[torch.Tensor]:
    return torch.empty_like(tensor) if wanted and tensor is not None else None


def _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    statistics = _statistics_dtype(input)
    return (
        torch.empty_like(input),
        torch.empty([input.shape[1]], dtype=statistics, device=input.device),
        torch.empty([input.shape[1]], dtype=statistics, device=input.device),
    )


def _batch_norm_backward(
    grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask
):
    return (
        _like_or_none(input, output_mask[0]),
        _like_or_none(weight, output_mask[1]),
        _like_or_none(weight, output_mask[2]),
    )


def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    kept = input.dim() - len(normalized_shape)
    shape = list(input.shape[:kept]) + [1] * len(normalized_shape)
    statistics = _statistics_dtype(input)
    # The output is contiguous whatever the input's strides (strides decide later copies).
    return (
        torch.empty(input.shape, dtype=input.dtype, device=input.device),
        torch.empty(shape, dtype=statistics, device=input.device),
        torch.empty(shape, dtype=statistics, device=input.device),
    )


def _layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    # The input's gradient takes the strides of the incoming gradient.
    return (
        torch.empty_like(grad_out, dtype=input.dtype) if output_mask[0] else None,
        _like_or_none(weight, output_mask[1]),
        _like_or_none(bias, output_mask[2]),
    )


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
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = {**dict(zip(names, args)), **kwargs}
    if bound.get("dropout_p", 0.0) <= 0.0 or sdpa_backend(**bound) is None:
        return None
    return _math_attention(**bound)


# Autocast's lists (aten/src/ATen/autocast_mode.cpp), for the functions models call.
_LOWER_PRECISION = {
    F.linear,
    F.conv1d,
    F.conv2d,
    F.conv3d,
    F.conv_transpose1d,
    F.conv_transpose2d,
    F.conv_transpose3d,
    F.scaled_dot_product_attention,
    torch.matmul,
    torch.mm,
    torch.bmm,
    torch.addmm,
    torch.baddbmm,
    torch.addbmm,
    torch.einsum,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.Tensor.mm,
    torch.Tensor.bmm,
    F.prelu,
}
_FULL_PRECISION = {
    F.softmax,
    F.log_softmax,
    F.cross_entropy,
    F.nll_loss,
    F.layer_norm,
    F.group_norm,
    F.mse_loss,
    F.binary_cross_entropy_with_logits,
    torch.softmax,
    torch.log_softmax,
    torch.Tensor.softmax,
    torch.Tensor.log_softmax,
    F.normalize,
    torch.cumsum,
    torch.exp,
    torch.log,
    torch.pow,
    torch.Tensor.pow,
    torch.sum,
    torch.Tensor.sum,
    torch.norm,
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
    names = (
        ("input", "dim", "_stacklevel", "dtype") if func in (F.softmax, F.log_softmax) else ("input", "dim", "dtype")
    )
    bound = {**dict(zip(names, args)), **kwargs}
    if len(args) > len(names) or set(bound) - set(names):
        return None
    tensor, dim, dtype = bound.get("input"), bound.get("dim"), bound.get("dtype")
    if (
        not isinstance(tensor, torch.Tensor)
        or tensor.device.type != "meta"
        or not isinstance(dim, int)
        or tensor.dtype != torch.float16
    ):
        return None
    if dtype is None and autocast:
        dtype = torch.float32
    if dtype != torch.float32:
        return None
    op = torch.ops.aten._log_softmax if func in _LOG_SOFTMAXES else torch.ops.aten._softmax
    return op(tensor, dim, True)


def _autocast_cross_entropy(args, kwargs, cast: Callable) -> Optional[torch.Tensor]:
    """``F.cross_entropy`` of fp16 or bf16 logits ``[N, C]`` with class indices under CUDA
    autocast. ``cross_entropy_loss`` is on none of autocast's CUDA lists: it calls
    ``log_softmax(input, 1, dtype=input.dtype)`` (an explicit dtype, which autocast leaves:
    16-bit log-probabilities; for fp16 not the ``half_to_float`` kernel, which only an fp32
    ``dtype`` takes) and ``nll_loss``, which autocast runs in fp32 on a cast copy of them
    (kept for backward with the 16-bit ones). None (the caller's handling) otherwise."""
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
    bound = {**dict(zip(names, args)), **kwargs}
    if len(args) > len(names) or set(bound) - set(names):
        return None
    logits, target = bound.get("input"), bound.get("target")
    if (
        not isinstance(logits, torch.Tensor)
        or not isinstance(target, torch.Tensor)
        or logits.device.type != "meta"
        or logits.dtype not in (torch.float16, torch.bfloat16)
        or logits.dim() != 2
        or target.is_floating_point()
    ):
        return None
    if bound.get("label_smoothing", 0.0) or bound.get("size_average") is not None or bound.get("reduce") is not None:
        return None
    log_probs = torch.log_softmax(logits, 1, dtype=logits.dtype)
    weight = cast(bound.get("weight"), torch.float32)
    return F.nll_loss(
        cast(log_probs, torch.float32),
        target,
        weight,
        ignore_index=bound.get("ignore_index", -100),
        reduction=bound.get("reduction", "mean"),
    )


def _recomputing() -> bool:
    """Whether a call made during backward comes from activation checkpointing's
    recomputation: grad mode is on there (the engine runs backward functions with it off),
    or, with it off (a custom autograd Function's forward inside the recomputation), a
    caller's frame is torch.utils.checkpoint's ``recompute_fn``."""
    if torch.is_grad_enabled():
        return True
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "recompute_fn" and code.co_filename == _CHECKPOINT_FILE:
            return True
        frame = frame.f_back
    return False


_CHECKPOINT_FILE = torch.utils.checkpoint.__file__


class _GpuKernelMode(TorchFunctionMode):
    """Routes the calls whose GPU kernels keep other tensors than the meta ones would: SDPA to
    the kernel a GPU picks (or its math path, ``efficient_attention=False``), dropout to
    ``native_dropout``, fp16 -> fp32 (log-)softmax to the ``half_to_float`` kernels, and
    (``autocast``: True for fp16, or the dtype, fp16 or bf16) casts as CUDA autocast makes
    them (cross-entropy as :func:`_autocast_cross_entropy`), weight casts cached until
    :meth:`clear_cast_cache` while ``caching`` (autocast's cache lives as long as the
    ``autocast`` block around the forward pass: a checkpointed block's recompute in backward
    runs in an ``autocast`` block of its own, whose casts are not kept after it)."""

    def __init__(self, efficient_attention: bool, autocast: Any):
        super().__init__()
        self.efficient_attention = efficient_attention
        if autocast is True:
            autocast = torch.float16
        if autocast not in (False, None, torch.float16, torch.bfloat16):
            raise ValueError(f"autocast must be False, True, float16 or bfloat16, got {autocast!r}")
        # ``autocast`` stays a bool (adapters.py reads it to tell autocast on)
        self.autocast = autocast not in (False, None)
        self.autocast_dtype = autocast if self.autocast else None
        self.caching = True
        # Set during backward: there autocast applies only in activation checkpointing's
        # recomputation (torch.utils.checkpoint runs it under the forward's autocast state),
        # not in Python backward functions (outside autocast, as on a GPU): see _recomputing.
        self.in_backward = False
        self._cast_cache: Dict[int, torch.Tensor] = {}

    def clear_cast_cache(self) -> None:
        self._cast_cache.clear()

    def _cast(self, value: Any, dtype: torch.dtype) -> Any:
        if (
            not isinstance(value, torch.Tensor)
            or not value.is_floating_point()
            or value.dtype == dtype
            or value.dtype == torch.float64
        ):
            return value
        cacheable = self.caching and value.is_leaf and value.requires_grad
        if cacheable and id(value) in self._cast_cache:
            return self._cast_cache[id(value)]
        cast = value.to(dtype)
        if cacheable:
            self._cast_cache[id(value)] = cast
        return cast

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        autocast = self.autocast and (not self.in_backward or _recomputing())
        if func in _SOFTMAXES:
            output = _half_to_float_softmax(func, args, kwargs, autocast)
            if output is not None:
                return output
        if autocast and func is F.cross_entropy:
            output = _autocast_cross_entropy(args, kwargs, self._cast)
            if output is not None:
                return output
        if autocast:
            if func in _LOWER_PRECISION:
                low = self.autocast_dtype
                args = tuple(self._cast(a, low) for a in args)
                kwargs = {k: self._cast(v, low) for k, v in kwargs.items()}
            elif func in _FULL_PRECISION:
                args = tuple(self._cast(a, torch.float32) for a in args)
                kwargs = {k: self._cast(v, torch.float32) for k, v in kwargs.items()}
        if func is F.dropout:
            output = _native_dropout(*args, **kwargs)
            if output is not None:
                return output
        if func is F.scaled_dot_product_attention:
            try:
                output = (
                    _gpu_attention(*args, **kwargs)
                    if self.efficient_attention
                    else _gpu_math_attention(*args, **kwargs)
                )
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
    tensors = [
        t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
    ]
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
    if (
        loss in ("auto", "cross_entropy")
        and logits is not None
        and logits.is_floating_point()
        and logits.dim() in (2, 3)
        and logits.shape[-1] > 1
    ):
        classes = logits.shape[-1]
        flat = logits.reshape(-1, classes)
        targets = torch.zeros(flat.shape[0], dtype=torch.int64, device=logits.device)
        return F.cross_entropy(flat, targets)
    if loss == "cross_entropy":
        raise SimulationError("--loss cross_entropy needs logits [B, C] or [B, L, V]")
    return _all_outputs_sum(output)


# -- optimizers --------------------------------------------------------------------------------

# bitsandbytes' Optimizer2State (bitsandbytes/optim/optimizer.py), as its Adam8bit, AdamW8bit,
# PagedAdamW and PagedAdamW8bit construct it.
BNB_MIN_8BIT_SIZE = 4096  # min_8bit_size: smaller parameters keep 32-bit state
BNB_BLOCK_SIZE = 256  # blockwise quantisation: one fp32 absmax per block of a state
BNB_PAGED_MIN_NUMEL = 100_000  # get_state_buffer pages only buffers of 1e5 elements or more
BNB_QMAP_SIZE = 256  # the signed and unsigned dynamic quantisation maps, fp32

_BNB = {  # name -> (optim_bits, paged)
    "adam_8bit": (8, False),
    "adamw_8bit": (8, False),
    "paged_adamw": (32, True),
    "paged_adamw_8bit": (8, True),
}


class _FusedAdam(torch.optim.Adam):
    """Adam / AdamW with ``fused=True`` (one in-place ``torch._fused_adam(w)_`` kernel: no
    temporaries) on meta parameters. PyTorch checks a fused parameter's device when it creates
    its state, and meta is none of the fused kernels' devices; so the state is created here
    first, exactly as ``Adam._init_group`` creates it for a fused group (per parameter: a
    float32 ``step`` on the device, ``exp_avg``, ``exp_avg_sq``), and the check is not
    reached."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state[param]
                if param.grad is None or state:
                    continue
                state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return super().step(closure)


class BitsAndBytesAdam(torch.optim.Optimizer):
    """bitsandbytes' blockwise Adam / AdamW (``bnb.optim.Adam8bit``, ``AdamW8bit``,
    ``PagedAdamW``, ``PagedAdamW8bit``: ``Optimizer2State``) emulated for what it allocates on
    a GPU. Its update is one fused in-place CUDA kernel per parameter, which allocates nothing,
    so only the state is made (at the first step, parameter by parameter, as ``init_state``):

    * ``optim_bits=8``: a parameter of at least ``min_8bit_size`` (4096) elements gets two uint8
      states of its shape and, for each, an fp32 absmax per 256-element block; the two
      256-value fp32 quantisation maps (signed, unsigned) go to the device once. A smaller
      parameter gets two fp32 states.
    * ``optim_bits=32``: two fp32 states, whatever the parameter's dtype.
    * ``paged``: state buffers of 1e5 elements or more (``get_state_buffer``) are CUDA unified
      memory (``cudaMallocManaged``), outside PyTorch's caching allocator: they are made
      inside ``untracked()`` (the simulation's recorder does not see them) and counted in
      ``paged_bytes``; the absmax, the maps and smaller buffers are ordinary device tensors.
    """

    def __init__(
        self,
        params,
        *,
        optim_bits: int = 8,
        paged: bool = False,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        untracked: Optional[Callable[[], Any]] = None,
    ):
        if optim_bits not in (8, 32):
            raise ValueError(f"optim_bits must be 8 or 32, got {optim_bits!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.optim_bits, self.paged = optim_bits, paged
        self.paged_bytes = 0
        self._untracked = untracked or contextlib.nullcontext
        self._qmaps: Optional[tuple] = None

    def _buffer(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.paged and param.numel() >= BNB_PAGED_MIN_NUMEL:
            with self._untracked():
                buffer = torch.zeros(param.shape, dtype=dtype, device=param.device)
            self.paged_bytes += buffer.numel() * buffer.element_size()
            return buffer
        return torch.zeros_like(param, dtype=dtype)

    def _init_state(self, param: torch.Tensor, state: Dict[str, Any]) -> None:
        state["step"] = 0
        if self.optim_bits == 32 or param.numel() < BNB_MIN_8BIT_SIZE:
            state["state1"] = self._buffer(param, torch.float32)
            state["state2"] = self._buffer(param, torch.float32)
            return
        if self._qmaps is None:
            self._qmaps = tuple(torch.zeros(BNB_QMAP_SIZE, dtype=torch.float32, device=param.device) for _ in range(2))
        state["state1"] = self._buffer(param, torch.uint8)
        state["qmap1"] = self._qmaps[0]
        state["state2"] = self._buffer(param, torch.uint8)
        state["qmap2"] = self._qmaps[1]
        blocks = -(-param.numel() // BNB_BLOCK_SIZE)
        state["absmax1"] = torch.zeros((blocks,), dtype=torch.float32, device=param.device)
        state["absmax2"] = torch.zeros((blocks,), dtype=torch.float32, device=param.device)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    self._init_state(param, state)
                state["step"] += 1  # the update itself: a fused in-place kernel
        return loss


def make_optimizer(
    name: str,
    params: List[nn.Parameter],
    implementation: str = "foreach",
    *,
    untracked: Optional[Callable[[], Any]] = None,
) -> torch.optim.Optimizer:
    """The optimizer as a GPU runs it: PyTorch's with its ``foreach`` implementation (the GPU
    default), ``fused`` or ``for_loop`` (``foreach=False``); Adafactor is PyTorch's
    (``torch.optim.Adafactor``, factored second moments); the bitsandbytes ones are
    :class:`BitsAndBytesAdam` (``untracked``: see there)."""
    implementation = _check_implementation(name, implementation)
    if name in _BNB:
        bits, paged = _BNB[name]
        return BitsAndBytesAdam(
            params, optim_bits=bits, paged=paged, weight_decay=1e-2 if "adamw" in name else 0.0, untracked=untracked
        )
    foreach, fused = implementation == "foreach", implementation == "fused"
    if name in ("sgd", "momentum"):
        momentum = 0.9 if name == "momentum" else 0.0
        if fused:
            opt = torch.optim.SGD(params, lr=0.01, momentum=momentum, fused=True)
            # its fused-device check (meta is not a fused device): the kernel is emulated
            opt._need_device_dtype_check_for_fused = False
            return opt
        return torch.optim.SGD(params, lr=0.01, momentum=momentum, foreach=foreach)
    if name in ("adam", "adamw"):
        decay = dict(weight_decay=1e-2, decoupled_weight_decay=True) if name == "adamw" else {}
        if fused:
            return _FusedAdam(params, lr=1e-3, fused=True, **decay)
        if name == "adamw":
            return torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
        return torch.optim.Adam(params, lr=1e-3, foreach=foreach)
    if name == "adafactor":
        return torch.optim.Adafactor(params, foreach=foreach)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def _check_implementation(optimizer: str, implementation: str) -> str:
    if implementation not in OPTIMIZER_IMPLEMENTATIONS:
        raise ValueError(f"optimizer_implementation must be one of {OPTIMIZER_IMPLEMENTATIONS}, got {implementation!r}")
    # bitsandbytes updates each tensor in one kernel of its own: `fused` names it as well as
    # the default does (the service reads it so too); there is no for-loop.
    if optimizer in _BNB and implementation == "for_loop":
        raise ValueError(
            f"optimizer_implementation: {optimizer} (bitsandbytes) runs its own "
            f"fused kernels, there is no {implementation} implementation to choose"
        )
    if optimizer == "adafactor" and implementation == "fused":
        raise ValueError(
            "optimizer_implementation: torch.optim.Adafactor has no fused implementation (foreach or for_loop)"
        )
    return implementation


class _LossScaler:
    """What ``torch.amp.GradScaler`` (its defaults) allocates on the device around a pure-fp16
    step: the scale and the growth tracker (made at the first ``scale``, kept), the scaled loss,
    the unscale of the gradients (``_amp_foreach_non_finite_check_and_unscale_``, in place,
    with an inverse scale and a found-inf flag copied per device) before the optimizer step,
    and the scale update. Fused optimizers get the scale and the flag instead
    (``_step_supports_amp_scaling``) after the inf check with a dummy inverse scale. Values are
    unknown on meta tensors: no inf is ever found, the step is always taken. (Unlike
    GradScaler's ``unscale_``, fp16 gradients are unscaled here: GradScaler refuses them outside
    fused optimizers, custom loss scalers of pure-fp16 training do not.)"""

    INIT_SCALE = 2.0**16

    def __init__(self, recorder: "_StepRecorder"):
        self.recorder = recorder
        self.scale_tensor: Optional[torch.Tensor] = None
        self.found_inf: Dict[Any, torch.Tensor] = {}

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        if self.scale_tensor is None:  # _lazy_init_scale_growth_tracker
            self.scale_tensor = torch.full((), self.INIT_SCALE, dtype=torch.float32, device=loss.device)
            self.growth_tracker = torch.full((), 0, dtype=torch.int32, device=loss.device)
            for tensor in (self.scale_tensor, self.growth_tracker):
                self.recorder.relabel(tensor, "optimizer_state")  # kept across steps
        return loss * self.scale_tensor.to(device=loss.device, non_blocking=True)

    def state(self) -> tuple:
        return () if self.scale_tensor is None else (self.scale_tensor, self.growth_tracker)

    def _unscale(
        self, opt: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor
    ) -> Dict[Any, torch.Tensor]:
        groups: Dict[tuple, List[torch.Tensor]] = {}
        for group in opt.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    groups.setdefault((param.grad.device, param.grad.dtype), []).append(param.grad)
        per_device_inv, per_device_found = {}, {}
        with torch.no_grad():
            for (device, _), grads in groups.items():
                if device not in per_device_found:  # _MultiDeviceReplicator.get
                    per_device_found[device] = found_inf.to(device=device, copy=True)
                    per_device_inv[device] = inv_scale.to(device=device, copy=True)
                torch._amp_foreach_non_finite_check_and_unscale_(
                    grads, per_device_found[device], per_device_inv[device]
                )
        return per_device_found

    def step(self, opt: torch.optim.Optimizer) -> None:
        scale = self.scale_tensor
        if getattr(opt, "_step_supports_amp_scaling", False):
            dummy = torch.full((), 1.0, dtype=torch.float32, device=scale.device)
            found = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
            self.found_inf = self._unscale(opt, dummy, found)
            del dummy, found
            opt.grad_scale = scale * 1
            opt.found_inf = sum(t.to(scale.device) for t in self.found_inf.values())
            try:
                opt.step()
            finally:
                del opt.grad_scale, opt.found_inf
            return
        inv_scale = scale.double().reciprocal().float()
        found = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
        self.found_inf = self._unscale(opt, inv_scale, found)
        del inv_scale, found
        opt.step()  # GradScaler reads the flags (.item()) first: never an inf here

    def update(self) -> None:
        found = [t.to(device=self.scale_tensor.device) for t in self.found_inf.values()]
        combined = found[0]
        for other in found[1:]:
            combined += other
        torch._amp_update_scale_(self.scale_tensor, self.growth_tracker, combined, 2.0, 0.5, 2000)
        del found, combined
        self.found_inf = {}


# -- the training setup ------------------------------------------------------------------------


def canonical_precision(precision: str) -> str:
    """The precision's canonical name (``mixed16`` and ``amp`` are ``amp_fp16``)."""
    name = PRECISION_ALIASES.get(precision, precision)
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} (or {tuple(PRECISION_ALIASES)}), got {precision!r}")
    return name


def normalise_setup(
    *,
    optimizer: str = "adam",
    precision: str = "fp32",
    optimizer_implementation: str = "foreach",
    gradient_accumulation_steps: int = 1,
    activation_checkpointing: Any = "none",
    lora: Optional[Dict[str, Any]] = None,
    trainable: Optional[Sequence[str]] = None,
) -> Dict[str, Any]:
    """The training setup checked and in canonical form (what a description and its
    simulation emit): ``{"optimizer", "precision", "optimizer_implementation",
    "gradient_accumulation_steps", "activation_checkpointing": "none" | "full" | [names],
    "lora": None | {"rank", "alpha", "target_modules": [names] | "all-linear",
    "base_weights"}, "trainable": None | [name prefixes]}``. A bad value raises ValueError
    naming the field. Whether module names name modules of the model is checked when the
    setup is applied (:func:`gpucast_describe.adapters.apply_setup`)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    precision = canonical_precision(precision)
    _check_implementation(optimizer, optimizer_implementation)
    if precision == "fp16" and optimizer in ("adam_8bit", "adamw_8bit", "paged_adamw_8bit"):
        raise ValueError(
            f"optimizer: {optimizer} (8-bit states) is not run with pure fp16 weights; use bf16 or amp_fp16"
        )
    steps = gradient_accumulation_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be a positive integer, got {steps!r}")
    checkpointing = activation_checkpointing
    if isinstance(checkpointing, str):
        if checkpointing not in ("none", "full"):
            raise ValueError(
                f'activation_checkpointing must be "none", "full" or a list of module names, got {checkpointing!r}'
            )
    elif (
        isinstance(checkpointing, (list, tuple))
        and checkpointing
        and all(isinstance(n, str) and n for n in checkpointing)
    ):
        checkpointing = list(checkpointing)
    else:
        raise ValueError(
            'activation_checkpointing must be "none", "full" or a non-empty '
            f"list of module names, got {checkpointing!r}"
        )
    if lora is not None:
        lora = _normalise_lora(lora)
    if trainable is not None:
        if (
            isinstance(trainable, str)
            or not isinstance(trainable, (list, tuple))
            or not trainable
            or not all(isinstance(n, str) and n for n in trainable)
        ):
            raise ValueError(f"trainable must be a non-empty list of module names, got {trainable!r}")
        trainable = list(trainable)
    return {
        "optimizer": optimizer,
        "precision": precision,
        "optimizer_implementation": optimizer_implementation,
        "gradient_accumulation_steps": steps,
        "activation_checkpointing": checkpointing,
        "lora": lora,
        "trainable": trainable,
    }


def _normalise_lora(lora: Any) -> Dict[str, Any]:
    """The `lora` a description carries: the adapters module's checks, narrowed to the
    service's contract (module names or "all-linear", no regular expression), in canonical
    form (an integral alpha as an integer, dropout only when above 0)."""
    spec = parse_lora(lora)
    targets = spec["target_modules"]
    if isinstance(targets, str) and targets != "all-linear":
        raise ValueError(
            f'lora.target_modules must be "all-linear" or a non-empty list of module names, got {targets!r}'
        )
    alpha = spec["alpha"]
    normalised = {
        "rank": spec["rank"],
        "alpha": int(alpha) if alpha.is_integer() else alpha,
        "target_modules": targets,
        "base_weights": spec["base_weights"],
    }
    # PEFT's lora_dropout: the dropped input of each adapted layer is kept for backward.
    if spec["dropout"]:
        normalised["dropout"] = spec["dropout"]
    return normalised


def _apply_setup(
    model: nn.Module, checkpointing: Any, lora: Optional[Dict[str, Any]], trainable: Optional[List[str]]
) -> None:
    apply_setup(
        model,
        activation_checkpointing=checkpointing,
        lora=None if lora is None else {**lora, "dropout": lora.get("dropout", 0.0)},
        trainable=trainable,
    )


class _gc_frozen:
    """The objects that exist before the simulation are left out of cyclic garbage collection
    while it runs (``gc.freeze``: a full collection of a large process's heap, 0.3 s with
    transformers imported, would otherwise land in the middle of the steps); what the
    simulation makes is collected as usual, so storages die when they would. Not done when
    the caller froze objects itself."""

    def __enter__(self):
        self.frozen = gc.get_freeze_count() == 0 and gc.isenabled()
        if self.frozen:
            gc.freeze()

    def __exit__(self, *exc):
        if self.frozen:
            gc.unfreeze()


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


def _backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` with the active torch-function modes kept during backward.
    ``Tensor.backward`` and ``torch.autograd.backward`` hand themselves to an active mode,
    which runs them with the mode popped, so the engine would run activation checkpointing's
    recomputation without :class:`_GpuKernelMode` (other kernels, no autocast: a
    recomputation that differs from the forward pass). So the engine is called as
    ``torch.autograd.backward`` calls it, with the same seed gradient (``ones_like``)."""
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run is None:  # pragma: no cover - older PyTorch
        loss.backward()
        return
    seed = torch.ones_like(loss, memory_format=torch.preserve_format)
    run((loss,), (seed,), False, False, (), allow_unreachable=True, accumulate_grad=True)


_PURE = {"bf16": torch.bfloat16, "fp16": torch.float16}
_AUTOCAST = {"amp_fp16": torch.float16, "amp_bf16": torch.bfloat16}


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
    optimizer_implementation: str = "foreach",
    gradient_accumulation_steps: int = 1,
    activation_checkpointing: Any = "none",
    lora: Optional[Dict[str, Any]] = None,
    trainable: Optional[Sequence[str]] = None,
) -> Dict[str, Any]:
    """Two training steps of ``module`` on meta tensors, ``batch_size`` samples a forward and
    backward pass (the micro-batch), replayed through the caching-allocator model. Returns the
    ``simulation`` field of a job description::

        {"batch_size", "optimizer", ["optimizer_implementation"], "precision", "attention",
         ["activation_checkpointing"], ["gradient_accumulation_steps"], "trainable_params",
         "allocated_peak_bytes", "reserved_peak_bytes", "min_capacity_bytes",
         "breakdown_at_peak": {category: bytes}, ["paged_optimizer_state_bytes"],
         "interpolated": false}

    (the bracketed keys only when the setup is not the default: another implementation than
    ``foreach``, checkpointing, accumulation, a paged optimizer). The setup:

    * ``precision``: ``fp32``; ``tf32`` (the same memory: TF32 only changes the matmuls'
      arithmetic); ``amp_fp16`` / ``amp_bf16`` (CUDA autocast to that dtype, fp32 weights,
      gradients and optimizer state; ``mixed16`` is ``amp_fp16``); ``bf16`` / ``fp16`` pure
      (a copy of the model cast to the dtype, float inputs in it: weights, gradients and the
      optimizer's state in 16 bits; ``fp16`` with a loss scaler: :class:`_LossScaler`).
    * ``optimizer``: ``sgd``, ``momentum``, ``adam``, ``adamw``, ``adafactor``, the
      bitsandbytes ``adam_8bit``, ``adamw_8bit``, ``paged_adamw``, ``paged_adamw_8bit``
      (:class:`BitsAndBytesAdam`; the paged state is left out of the allocator replay and
      reported as ``paged_optimizer_state_bytes``), with ``optimizer_implementation``
      ``foreach`` (default), ``fused`` or ``for_loop`` (:func:`make_optimizer`).
    * ``gradient_accumulation_steps`` k: each optimizer step follows min(k, 2) forward and
      backward passes (the loss divided by k); gradients persist from one to the next, the
      second backward accumulating into them, which is the peak of any further one.
    * ``activation_checkpointing`` (``"none"``, ``"full"``, module names), ``lora``
      (``{"rank", "alpha", "target_modules", "base_weights", "dropout"}``) and ``trainable``
      (module name prefixes): applied to a copy of the model by
      :func:`gpucast_describe.adapters.apply_setup` (after the pure-precision cast), which
      raises ValueError naming the field for names that name no module.

    ``reserved_peak_bytes`` is the reserved peak with unlimited memory (a large card);
    ``min_capacity_bytes`` the smallest allocator capacity on which the steps run (the cache
    is released before an allocation fails, so a smaller card can still run the job).
    The model's output is dropped once the loss is computed (backward holds only the loss and
    what autograd saved: logits that the loss does not save are freed before backward, as in a
    loop that keeps only the loss). ``breakdown_at_peak`` sums to ``allocated_peak_bytes``.
    ``trainable_params`` counts the parameters that get gradients. The caller's module is left
    as it was. Raises :class:`SimulationError` when the model cannot train on meta tensors.
    """
    lora_dropout = lora.get("dropout", 0.0) if isinstance(lora, dict) else 0.0
    setup = normalise_setup(
        optimizer=optimizer,
        precision=precision,
        optimizer_implementation=optimizer_implementation,
        gradient_accumulation_steps=gradient_accumulation_steps,
        activation_checkpointing=activation_checkpointing,
        lora={k: v for k, v in lora.items() if k != "dropout"} if isinstance(lora, dict) else lora,
        trainable=trainable,
    )
    precision = setup["precision"]
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    pure = _PURE.get(precision)
    transformed = (
        setup["activation_checkpointing"] != "none" or setup["lora"] is not None or setup["trainable"] is not None
    )
    model = on_meta(module)
    if pure is not None or transformed:
        if model is module:  # the caller's module is left as it is
            model = copy.deepcopy(module)
        if pure is not None:
            model.to(pure)
        if transformed:
            lora_spec = setup["lora"]
            if lora_spec is not None:
                lora_spec = {**lora_spec, "dropout": lora_dropout}
            _apply_setup(model, setup["activation_checkpointing"], lora_spec, setup["trainable"])
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise SimulationError("the model has no trainable parameters")
    if pure is not None and input_dtype.is_floating_point:
        input_dtype = pure
    shape = [int(batch_size), *[int(d) for d in input_shape]]

    def new_input():
        if make_input is None:
            return torch.zeros(shape, dtype=input_dtype, device="meta")
        made = make_input(batch_size)
        if pure is None:
            return made
        leaves, spec = tree_flatten(made)
        return tree_unflatten(
            [leaf.to(pure) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else leaf for leaf in leaves],
            spec,
        )

    accumulation = setup["gradient_accumulation_steps"]
    recorder = _StepRecorder()
    kernels = _GpuKernelMode(attention == "efficient", _AUTOCAST.get(precision, False))
    state = {id(s): s for s in [*model.parameters(), *model.buffers()]}
    for tensor in state.values():
        recorder.track(tensor, "parameters")
    opt = make_optimizer(setup["optimizer"], params, setup["optimizer_implementation"], untracked=recorder.untracked)
    scaler = _LossScaler(recorder) if precision == "fp16" else None
    modes = _batch_norms_trainable_at(model, batch_size)
    attention_configs = _hf_attention(model, "eager" if attention == "eager" else None)
    try:
        with _gc_frozen(), torch.inference_mode(False), torch.enable_grad(), recorder, kernels:
            templates: Dict[int, Any] = {}
            for step in range(STEPS):
                for micro in range(min(accumulation, 2)):
                    if step > 0 and templates.get(micro) is not None:
                        recorder.replay_pass(templates[micro], params)
                        continue
                    mark = recorder.mark()
                    recorder.phase = _FORWARD
                    kernels.caching = True
                    batch = new_input()
                    output = model(batch)
                    step_loss = default_loss(output, loss)
                    del output
                    if accumulation > 1:
                        step_loss = step_loss / accumulation
                    if scaler is not None:
                        step_loss = scaler.scale(step_loss)
                    kernels.clear_cast_cache()
                    kernels.caching = False
                    recorder.phase = _BACKWARD
                    kernels.in_backward = True
                    _backward(step_loss)
                    kernels.in_backward = False
                    del step_loss, batch
                    for param in params:
                        recorder.relabel(param.grad, "gradients")
                    if step == 0 and REUSE_PASSES:
                        templates[micro] = recorder.capture_pass(
                            mark, params, once=scaler.state() if scaler is not None else ()
                        )
                recorder.phase = _OPTIMIZER
                recorder.fake_scalars = True
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                recorder.fake_scalars = False
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
    paged_bytes = getattr(opt, "paged_bytes", 0)
    del opt, scaler
    events = recorder.labelled_events()
    result, min_capacity = allocator.replay_with_min_capacity(events)
    breakdown = {category: int(result.breakdown_at_peak.get(category, 0)) for category in CATEGORIES}
    simulation: Dict[str, Any] = {"batch_size": int(batch_size), "optimizer": setup["optimizer"]}
    if setup["optimizer_implementation"] != "foreach":
        simulation["optimizer_implementation"] = setup["optimizer_implementation"]
    simulation["precision"] = precision
    simulation["attention"] = attention
    if setup["activation_checkpointing"] != "none":
        simulation["activation_checkpointing"] = setup["activation_checkpointing"]
    if accumulation > 1:
        simulation["gradient_accumulation_steps"] = accumulation
    simulation.update(
        {
            "trainable_params": int(sum(p.numel() for p in params)),
            "allocated_peak_bytes": int(result.allocated_peak_bytes),
            "reserved_peak_bytes": int(result.reserved_peak_bytes),
            "min_capacity_bytes": int(min_capacity),
            "breakdown_at_peak": breakdown,
        }
    )
    if setup["optimizer"] in PAGED_OPTIMIZERS:
        simulation["paged_optimizer_state_bytes"] = int(paged_bytes)
    simulation["interpolated"] = False
    return simulation


def interpolate_simulation(low: Dict[str, Any], high: Dict[str, Any], batch_size: int) -> Dict[str, Any]:
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

    breakdown = {c: at(low["breakdown_at_peak"][c], high["breakdown_at_peak"][c]) for c in CATEGORIES}
    allocated = at(low["allocated_peak_bytes"], high["allocated_peak_bytes"])
    breakdown["temporaries"] += allocated - sum(breakdown.values())
    if breakdown["temporaries"] < 0:  # cannot happen with consistent inputs; keep the sum
        breakdown["activations"] += breakdown["temporaries"]
        breakdown["temporaries"] = 0
    min_capacity = max(allocated, at(low["min_capacity_bytes"], high["min_capacity_bytes"]))
    reserved = max(min_capacity, at(low["reserved_peak_bytes"], high["reserved_peak_bytes"]))
    return {
        **low,
        "batch_size": int(batch_size),
        "allocated_peak_bytes": allocated,
        "reserved_peak_bytes": reserved,
        "min_capacity_bytes": min_capacity,
        "breakdown_at_peak": breakdown,
        "interpolated": True,
    }
