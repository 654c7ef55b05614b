"""``F.scaled_dot_product_attention`` as CUDA runs it on an sm80+ GPU (A100, H100/H200), on
meta tensors: which kernel it picks (:func:`sdpa_backend`), and the flash, memory-efficient and
math paths with the allocations and saved tensors of the GPU's kernels, not the meta device's
composite (:func:`_gpu_attention`, :class:`_GpuAttentionMode`).

The layer walk's saved-tensor trace (:mod:`.walker`) and the simulated training step
(:mod:`.simulate`) both run attention through it.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

# The function :class:`_GpuAttentionMode` routes to the kernel CUDA picks (the saved-tensor
# trace runs under it).
_SDPA = torch.nn.functional.scaled_dot_product_attention
# CUDA's memory-efficient attention kernel: the head dimensions must be multiples of this
# (16 bytes: 4 fp32, 8 fp16/bf16 values on sm80+), an attention bias whose strides are not
# multiples of _BIAS_ALIGNMENT is padded in its last dimension first (and sliced back).
_HEAD_DIM_ALIGNMENT = {torch.float32: 4, torch.float16: 8, torch.bfloat16: 8}
_BIAS_ALIGNMENT = 8


# CUDA's flash attention kernel (sm80+): fp16/bf16 only, equal head dimensions up to 256 (padded
# to a multiple of 8 first, the output sliced back).
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256
_FLASH_HEAD_DIM_ALIGNMENT = 8


def _dense_meta(tensor: Any) -> bool:
    return (
        isinstance(tensor, torch.Tensor) and tensor.is_meta and tensor.layout == torch.strided and not tensor.is_nested
    )


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


def sdpa_backend(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
) -> Optional[str]:
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
        if (
            is_causal
            or not _dense_meta(attn_mask)
            or attn_mask.dim() > 4
            or attn_mask.dtype not in (torch.bool, query.dtype)
        ):
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
        query, key, value, float(dropout_p), bool(is_causal), False, scale=float(scale)
    )[0]
    return output[..., :head_dim] if pad else output


def _efficient_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
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
                bias.logical_not(), -math.inf
            )
        aligned = bias.stride(-1) == 1 and all(bias.stride(i) % _BIAS_ALIGNMENT == 0 for i in range(bias.dim() - 1))
        if not aligned:
            last = bias.shape[-1]
            bias = nn.functional.pad(bias, (0, _BIAS_ALIGNMENT - last % _BIAS_ALIGNMENT))
            bias = bias[..., :last]
        bias = bias.expand(b, h, l, s)
    compute_log_sumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, compute_log_sumexp, float(dropout_p), bool(is_causal), scale=scale
    )[0]


def _additive_mask(mask, dtype):
    """``convert_boolean_attn_mask``: 0 where a boolean mask is true, -inf where false."""
    return torch.where(
        mask,
        torch.scalar_tensor(0.0, dtype=dtype, device=mask.device),
        torch.scalar_tensor(-math.inf, dtype=dtype, device=mask.device),
    )


def _math_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
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
    if (
        origin_dtype in (torch.float16, torch.bfloat16)
        and not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    ):
        query_acc, key_acc, value_acc = (t.to(torch.float32) for t in (query, key, value))
    negative = scale is not None and scale < 0.0
    factor = math.sqrt(abs(scale) if scale is not None else 1.0 / math.sqrt(query.shape[-1]))
    scaled_query = query_acc * (-factor if negative else factor)
    if is_causal:
        l, s = scaled_query.shape[-2], key_acc.shape[-2]
        attn_mask = _additive_mask(torch.ones(l, s, dtype=torch.bool, device=query.device).tril(), scaled_query.dtype)
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


def _gpu_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` as CUDA runs it on an sm80+ GPU: the kernel
    :func:`sdpa_backend` picks, flash (:func:`_flash_attention`) or memory-efficient
    (:func:`_efficient_attention`), whose autograd formulas keep no N x N probabilities; the
    math path with dropout as :func:`_math_attention` (the GPU's 1-byte dropout mask).
    Returns None (the caller makes the normal call, the math path on meta tensors) for the
    math path without dropout, which is the same on meta, and for what :func:`sdpa_backend`
    does not take."""
    backend = sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if backend == "flash":
        return _flash_attention(query, key, value, dropout_p, is_causal, scale)
    if backend == "efficient":
        return _efficient_attention(query, key, value, attn_mask, dropout_p, is_causal, scale)
    if backend == "math" and dropout_p > 0.0:
        return _math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
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
