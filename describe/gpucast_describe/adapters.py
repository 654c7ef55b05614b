"""Training setups as module transforms: frozen modules, LoRA adapters on a full-precision or
quantised base, activation checkpointing.

:func:`apply_setup` rewrites a model (normally the meta copy a simulation runs) so that its
training step allocates what the setup allocates, with the libraries' own mechanics emulated
rather than approximated by a formula:

* **Frozen parameters** get ``requires_grad=False``: no gradient, no optimizer state (the
  simulation builds its optimizer from the parameters that require a gradient).
* **LoRA** as PEFT builds it (``peft.tuners.lora``): each targeted linear layer is replaced by a
  :class:`LoraLinear` holding the frozen ``base_layer``, ``lora_A`` (``nn.Linear(in, r)``),
  ``lora_B`` (``nn.Linear(r, out)``) and ``lora_dropout`` (``nn.Dropout`` or ``nn.Identity``),
  whose forward is PEFT's: ``base(x) + lora_B(lora_A(dropout(x))) * alpha / r``. Adapters are
  created in fp32 whatever the base's 16-bit dtype (PEFT's ``autocast_adapter_dtype=True``,
  its default, upcasts fp16/bf16 adapters; an fp64 base keeps fp64 ones), and the input is cast
  to the adapters' dtype first (PEFT's ``_cast_input_dtype``: under pure bf16 an fp32 copy of
  each target's input is what ``lora_A`` keeps for backward). Quantised bases take PEFT's
  ``lora/bnb.py`` forwards (4-bit: the base output cloned, the adapter output cast back before
  the sum).
* **Quantised base weights** as ``from_pretrained(..., quantization_config=BitsAndBytesConfig
  (...))`` leaves them: every linear layer (``nn.Linear``, GPT-2's ``Conv1D``) is replaced by a
  :class:`Linear8bitLt` or :class:`Linear4bit` look-alike *except* those transformers keeps in
  full precision (``get_keys_to_not_convert``: the output embeddings, the module of the last
  parameter, linears whose weight is tied to another module) and those under a ``trainable``
  prefix. The weight becomes buffers with bitsandbytes' layout: LLM.int8 an int8 ``[out, in]``
  weight and fp32 row scales ``SCB``; NF4 (QLoRA, double quantisation) a packed uint8
  ``[ceil(n/2), 1]`` weight, uint8 block absmax (64-element blocks), fp32 second-level absmax
  (256 first-level values a block), fp32 offset and 16-value code book, the 256-value fp32
  dynamic map shared by all layers. Their matmuls are ``torch.autograd.Function`` s with
  bitsandbytes' allocations: NF4 dequantises the whole weight in forward and again in backward
  (``MatMul4Bit``: nothing of the input kept); LLM.int8 quantises the input to int8 rows, runs
  an int32 matmul and dequantises the output in forward, keeps a reference to the input (its
  ``ctx.tensors``, outside autograd's saved tensors: activation checkpointing does not drop
  it), and dequantises the weight in backward for the input's gradient (``MatMul8bitLt``).
  The compute dtype is the input's (``bnb_4bit_compute_dtype`` set to the training dtype);
  LLM.int8's outlier columns (``llm_int8_threshold``, data dependent) are not modelled. On the
  meta device the kernels' outputs are allocated as the CUDA kernels allocate them; on real
  tensors the arithmetic is done (NF4's code book; the second level with the dynamic map as
  reconstructed here: only its size matters to memory), so the numbers can be checked.
* **Activation checkpointing** with ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
  (Hugging Face's ``gradient_checkpointing_enable`` default, torchtune, torchtitan): each chosen
  module's ``forward`` is replaced, on the instance, by one that checkpoints the original. In
  training with autograd on, the module's internals are dropped after the forward and really
  recomputed in backward; otherwise the original runs. Hugging Face layers drop their KV cache
  arguments as ``GradientCheckpointingLayer`` does, and a Hugging Face model taking
  ``input_ids`` gets ``enable_input_require_grads()`` as ``gradient_checkpointing_enable`` gives
  it. The replacement is a bound method and the original is kept as the class's function, so
  ``copy.deepcopy`` (``meta.on_meta``) carries working wrappers into the copy. The
  recomputation runs under the torch-function modes the forward ran under (the simulation's
  GPU-kernel and autocast emulation): ``simulate`` keeps them through backward itself; for a
  plain ``loss.backward()``, which autograd runs without them, the wrapper re-enters them
  (:func:`_in_modes`), so the recomputation is the forward again.

``activation_checkpointing="full"`` checkpoints every block of the model's repeated block stack
(:func:`repeated_blocks`):

1. a Hugging Face model: its ``GradientCheckpointingLayer`` s (the outermost ones), exactly the
   layers its ``gradient_checkpointing_enable`` checkpoints;
2. otherwise the members of the *stacks*: ``nn.Sequential`` / ``nn.ModuleList`` containers of at
   least two modules of one class, each with children and parameters (timm's ``blocks``,
   ResNet's ``layer1``..``layer4``, a custom ``layers`` list). Nested stacks resolve to the
   innermost ``nn.Sequential``: a member holding a finer Sequential stack (timm's ConvNeXt or
   Swin stages holding ``blocks``) is replaced by that stack's members, as timm's own
   ``set_grad_checkpointing`` checkpoints block by block; a member without one stays a block.
   A ``nn.ModuleList`` inside a member is part of that member (a mixture of experts'
   ``experts``, parallel heads), not a stack, since a list says nothing about running in
   sequence.

Call :func:`apply_setup` once the model is in its storage dtype: the transforms read it (the
adapters' and the dequantised weight's dtypes). Converting the model afterwards is tolerated:
the quantised buffers keep their dtypes and follow the new compute dtype, and adapters are
upcast back to fp32 as PEFT keeps them.
"""

from __future__ import annotations

import contextlib
import math
import re
import types
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .vocabulary import VOCABULARY

CHECKPOINTING = tuple(VOCABULARY["activation_checkpointing"])
BASE_WEIGHTS = ("same", "int8", "nf4")
LORA_FIELDS = ("rank", "alpha", "target_modules", "base_weights", "dropout")
ALL_LINEAR = "all-linear"
PEFT_DEFAULT_ALPHA = 8
# bitsandbytes' 4-bit layout: 64-element blocks, their absmax quantised to 8 bits per 256.
NF4_BLOCK = 64
NF4_ABSMAX_BLOCK = 256
# Names a model's output head goes by when it says nothing of it (no Hugging Face
# get_output_embeddings, no timm get_classifier): top-level linears only.
HEAD_NAMES = ("lm_head", "score", "classifier", "head", "fc", "output")

# bitsandbytes.functional.get_4bit_type("nf4")
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)

_HALF = (torch.float16, torch.bfloat16)


def _dynamic_map() -> torch.Tensor:
    """bitsandbytes' ``create_dynamic_map(signed=True)``: the 256-value 8-bit code the
    second-level (double) quantisation of the 4-bit absmax uses."""
    data: List[float] = []
    max_exponent_bits, non_sign_bits = 7, 7
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float64)
        means = ((boundaries[:-1] + boundaries[1:]) / 2.0).tolist()
        scale = 10 ** (-(max_exponent_bits - 1) + i)
        data += [scale * m for m in means] + [-scale * m for m in means]
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


def _nearest(values: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of the sorted ``code`` for each value."""
    middles = (code[1:] + code[:-1]) / 2
    return torch.bucketize(values.contiguous(), middles.contiguous())


# ---------------------------------------------------------------------------------------------
# Quantised linear layers
# ---------------------------------------------------------------------------------------------


def _linear_shape(module: nn.Module) -> Optional[Tuple[int, int]]:
    """``(in_features, out_features)`` of an ``nn.Linear`` or a GPT-2 ``Conv1D`` (weight
    ``[in, out]``), None for anything else."""
    if isinstance(module, nn.Linear):
        return int(module.in_features), int(module.out_features)
    if _is_conv1d(module):
        return int(module.weight.shape[0]), int(module.weight.shape[1])
    return None


def _is_conv1d(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(getattr(module, "nf", None), int)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
    )


def _weight_out_in(module: nn.Module) -> torch.Tensor:
    """The weight as ``[out, in]`` (a GPT-2 Conv1D's transposed)."""
    return module.weight.t() if _is_conv1d(module) else module.weight


class _QuantizedLinear(nn.Linear):
    """Shared parts of the bitsandbytes look-alikes: an ``nn.Linear`` (as bitsandbytes' classes
    are) whose weight is buffers; the bias stays a (frozen) parameter. ``quant_dtype`` is the
    dtype the weight had, which dequantisation produces (bitsandbytes' ``quant_state.dtype``)."""

    def __init__(self, base: nn.Module):
        nn.Module.__init__(self)
        self.in_features, self.out_features = _linear_shape(base)
        self.quant_dtype = base.weight.dtype
        bias = getattr(base, "bias", None)
        if isinstance(bias, torch.Tensor):
            self.bias = nn.Parameter(bias.detach(), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.train(base.training)

    def _bias_for(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        if self.bias is None:
            return None
        return self.bias if self.bias.dtype == x.dtype else self.bias.to(x.dtype)

    def _apply(self, fn, recurse=True):
        # A model converted after quantisation (model.to(torch.bfloat16)) keeps the quantised
        # layout; the dequantised weight follows the conversion, as the compute dtype would.
        kept = {name: b.dtype for name, b in self._buffers.items() if b is not None}
        device = next(iter(self._buffers.values())).device
        super()._apply(fn, recurse)
        for name, dtype in kept.items():
            if self._buffers[name].dtype != dtype:
                self._buffers[name] = self._buffers[name].to(dtype)
        self.quant_dtype = fn(torch.empty(0, dtype=self.quant_dtype, device=device)).dtype
        return self

    def reset_parameters(self) -> None:  # nn.Linear's would allocate a float weight
        pass

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        raise NotImplementedError


class Linear8bitLt(_QuantizedLinear):
    """bitsandbytes' ``Linear8bitLt`` (LLM.int8, ``has_fp16_weights=False``): int8 weight
    ``[out, in]`` and fp32 per-row absmax ``SCB``."""

    def __init__(self, base: nn.Module):
        super().__init__(base)
        weight = _weight_out_in(base).detach()
        out_features, in_features = weight.shape
        if weight.is_meta:
            cb = torch.empty((out_features, in_features), dtype=torch.int8, device="meta")
            scb = torch.empty((out_features,), dtype=torch.float32, device="meta")
        else:
            w = weight.float()
            scb = w.abs().amax(dim=1)
            cb = torch.round(w * (127.0 / scb.clamp_min(1e-12)).unsqueeze(1)).to(torch.int8)
        self.register_buffer("weight", cb)
        self.register_buffer("SCB", scb)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The weight ``[out, in]`` as bitsandbytes' backward rebuilds it."""
        dtype = dtype or self.quant_dtype
        return self.weight.to(dtype, copy=True).mul_(self.SCB.unsqueeze(1).mul(1.0 / 127.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Int8Matmul.apply(x, self._bias_for(x), self)


class Linear4bit(_QuantizedLinear):
    """bitsandbytes' ``Linear4bit`` with ``quant_type="nf4"``, ``blocksize=64`` and double
    quantisation (``bnb_4bit_use_double_quant=True``, QLoRA): the weight packed two 4-bit codes
    a byte, ``[ceil(n/2), 1]``; each 64-element block's absmax quantised to uint8 with the
    dynamic map, an fp32 scale per 256 of them and one fp32 offset; the 16-value NF4 code book.
    ``code2`` (the dynamic map) is one tensor shared by all the layers of a model."""

    def __init__(self, base: nn.Module, code2: torch.Tensor):
        super().__init__(base)
        weight = _weight_out_in(base).detach()
        numel = weight.numel()
        blocks = -(-numel // NF4_BLOCK)
        blocks2 = -(-blocks // NF4_ABSMAX_BLOCK)
        device = weight.device
        code = torch.tensor(NF4_CODE, dtype=torch.float32, device=device)
        if weight.is_meta:
            packed = torch.empty(((numel + 1) // 2, 1), dtype=torch.uint8, device=device)
            qabsmax = torch.empty((blocks,), dtype=torch.uint8, device=device)
            absmax2 = torch.empty((blocks2,), dtype=torch.float32, device=device)
            offset = torch.empty((), dtype=torch.float32, device=device)
        else:
            flat = weight.float().reshape(-1)
            flat = F.pad(flat, (0, blocks * NF4_BLOCK - numel)).reshape(blocks, NF4_BLOCK)
            absmax = flat.abs().amax(dim=1)
            indices = _nearest(flat / absmax.clamp_min(1e-12).unsqueeze(1), code)
            indices = indices.reshape(-1)[:numel].to(torch.uint8)
            if numel % 2:
                indices = torch.cat([indices, indices.new_zeros(1)])
            packed = ((indices[0::2] << 4) | indices[1::2]).reshape(-1, 1)
            offset = absmax.mean()
            centred = F.pad(absmax - offset, (0, blocks2 * NF4_ABSMAX_BLOCK - blocks))
            centred = centred.reshape(blocks2, NF4_ABSMAX_BLOCK)
            absmax2 = centred.abs().amax(dim=1)
            qabsmax = _nearest(centred / absmax2.clamp_min(1e-12).unsqueeze(1), code2)
            qabsmax = qabsmax.reshape(-1)[:blocks].to(torch.uint8)
        self.numel = numel
        self.register_buffer("weight", packed)
        self.register_buffer("absmax", qabsmax)
        self.register_buffer("absmax2", absmax2)
        self.register_buffer("offset", offset)
        self.register_buffer("code", code)
        self.register_buffer("code2", code2)

    def _absmax(self) -> torch.Tensor:
        """``dequantize_blockwise(absmax, state2) + offset``: fp32, one per 64-element block."""
        if self.absmax.is_meta:
            return torch.empty(self.absmax.shape, dtype=torch.float32, device="meta")
        scales = self.absmax2.repeat_interleave(NF4_ABSMAX_BLOCK)[: self.absmax.numel()]
        return self.code2[self.absmax.long()] * scales + self.offset

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``dequantize_4bit(...).to(dtype)``: the weight ``[out, in]`` in the dtype it had
        (then cast when another is asked for), the fp32 absmax a temporary meanwhile."""
        shape = (self.out_features, self.in_features)
        absmax = self._absmax()
        if self.weight.is_meta:
            weight = torch.empty(shape, dtype=self.quant_dtype, device="meta")
        else:
            packed = self.weight.reshape(-1)
            indices = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[: self.numel]
            scales = absmax.repeat_interleave(NF4_BLOCK)[: self.numel]
            weight = (self.code[indices.long()] * scales).reshape(shape).to(self.quant_dtype)
        del absmax
        if dtype is not None and dtype != weight.dtype:
            weight = weight.to(dtype)
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # compute dtype = the input's (bnb_4bit_compute_dtype set to the training dtype)
        return _Nf4Matmul.apply(x, self._bias_for(x), self)


class _Nf4Matmul(torch.autograd.Function):
    """bitsandbytes' ``MatMul4Bit``: ``linear(x, dequantize_4bit(W).to(x.dtype), bias)``; the
    dequantised weight is a temporary of forward and, again, of backward (grad-input only:
    the 4-bit weight gets no gradient). Nothing of the input is kept."""

    @staticmethod
    def forward(ctx, x, bias, layer):
        weight = layer.dequantize(x.dtype)
        output = F.linear(x, weight, bias)
        del weight
        ctx.layer = layer
        ctx.bias_dtype = None if bias is None else bias.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output):
        return (*_frozen_linear_backward(ctx, grad_output, grad_output.dtype), None)


def _frozen_linear_backward(ctx, grad_output, dtype):
    """The gradients of a frozen quantised linear layer: its bias's, and its input's through
    the weight rebuilt in ``dtype`` (a temporary, as bitsandbytes does; the 4- or 8-bit weight
    gets none). ``.to`` of a tensor already in ``dtype`` is the tensor itself."""
    grad_x = grad_bias = None
    if ctx.needs_input_grad[1]:
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0, dtype=ctx.bias_dtype)
    if ctx.needs_input_grad[0]:
        weight = ctx.layer.dequantize(dtype)
        grad_x = torch.matmul(grad_output.to(dtype), weight)
        del weight
    return grad_x, grad_bias


class _Int8Matmul(torch.autograd.Function):
    """bitsandbytes' ``MatMul8bitLt`` (no outlier columns: ``threshold`` decomposition is data
    dependent): forward quantises the input rows to int8 (from an fp16 copy unless fp16),
    int32 matmul, dequantised into the output's dtype; ``ctx.tensors`` keeps the input (outside
    autograd's saved tensors); backward rebuilds the weight in the input's dtype for the
    input's gradient."""

    @staticmethod
    def forward(ctx, x, bias, layer):
        if layer.weight.is_meta:
            rows = x.reshape(-1, x.shape[-1])
            half = rows if rows.dtype == torch.float16 else rows.to(torch.float16)
            ca = torch.empty(half.shape, dtype=torch.int8, device=x.device)  # int8 rows
            sca = torch.empty(half.shape[:1], dtype=torch.float32, device=x.device)  # row scales
            del half
            accumulated = torch.empty((rows.shape[0], layer.out_features), dtype=torch.int32, device=x.device)
            output = torch.empty(
                (rows.shape[0], layer.out_features), dtype=x.dtype, device=x.device
            )  # int8_mm_dequant, bias fused
            del accumulated, ca, sca
            output = output.reshape(*x.shape[:-1], layer.out_features)
        else:
            output = F.linear(x, layer.dequantize(x.dtype), bias)
        ctx.layer = layer
        ctx.input_dtype = x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.tensors = (x,) if ctx.needs_input_grad[0] else (None,)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        grad_x, grad_bias = _frozen_linear_backward(ctx, grad_output, ctx.input_dtype)
        ctx.tensors = (None,)
        return grad_x, grad_bias, None


# ---------------------------------------------------------------------------------------------
# LoRA
# ---------------------------------------------------------------------------------------------


def _function_modes() -> List[Any]:
    try:
        return list(torch.overrides._get_current_function_mode_stack())
    except Exception:  # pragma: no cover - private API moved
        return []


def _autocast_active() -> bool:
    """CUDA autocast on, or the simulation's emulation of it (a torch-function mode with a true
    ``autocast`` attribute: ``simulate._GpuKernelMode``)."""
    if torch.is_autocast_enabled():
        return True
    return any(getattr(mode, "autocast", False) is True for mode in _function_modes())


def adapter_dtype(base_dtype: torch.dtype) -> torch.dtype:
    """PEFT's adapter dtype: the base's when fp32/fp64, else fp32 (16-bit bases are upcast by
    ``autocast_adapter_dtype=True``; quantised bases keep the adapters as created, fp32)."""
    return base_dtype if base_dtype in (torch.float32, torch.float64) else torch.float32


class LoraLinear(nn.Module):
    """PEFT's LoRA layer for a linear base (``nn.Linear``, GPT-2 ``Conv1D``, the quantised
    look-alikes): ``base_layer``, ``lora_A``, ``lora_B``, ``lora_dropout``, ``scaling``."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float):
        super().__init__()
        in_features, out_features = _linear_shape(base)
        weight = base.weight
        quantised = isinstance(base, _QuantizedLinear)
        dtype = torch.float32 if quantised else adapter_dtype(weight.dtype)
        self.variant = "int8" if isinstance(base, Linear8bitLt) else "nf4" if isinstance(base, Linear4bit) else "same"
        self.in_features, self.out_features = in_features, out_features
        self.rank, self.scaling = rank, alpha / rank
        self.base_layer = base
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0.0 else nn.Identity()
        self.lora_A = nn.Linear(in_features, rank, bias=False, device=weight.device, dtype=dtype)
        self.lora_B = nn.Linear(rank, out_features, bias=False, device=weight.device, dtype=dtype)
        if not weight.is_meta:
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B.weight)
        self.train(base.training)

    @property
    def weight(self) -> torch.Tensor:  # PEFT's LoraLayer forwards these to the base layer
        return self.base_layer.weight

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return getattr(self.base_layer, "bias", None)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for adapter in (self.lora_A, self.lora_B):
            if adapter.weight.dtype in _HALF:  # PEFT keeps the adapters in fp32
                adapter.weight.data = adapter.weight.data.float()
        return self

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.lora_A.weight.dtype
        return x if x.dtype == dtype else x.to(dtype)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)
        if self.variant == "same":  # peft.tuners.lora.layer.Linear.forward
            result_dtype = result.dtype
            x = self._cast(x)
            result = result + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
            return result.to(result_dtype)
        # peft.tuners.lora.bnb.Linear8bitLt / Linear4bit .forward
        if self.variant == "nf4":
            result = result.clone()  # "defensively clone" (PEFT, for 4-bit)
        convert = not _autocast_active()
        expected = result.dtype
        if convert:
            x = self._cast(x)
        output = self.lora_B(self.lora_A(self.lora_dropout(x)))
        if self.variant == "int8":
            if convert:
                output = output.to(expected)
            output = output * self.scaling
        else:
            output = output * self.scaling
            if convert:
                output = output.to(expected)
        return result + output

    def extra_repr(self) -> str:
        return f"rank={self.rank}, scaling={self.scaling:g}, variant={self.variant}"


# ---------------------------------------------------------------------------------------------
# Activation checkpointing
# ---------------------------------------------------------------------------------------------

_CACHE_ARGUMENTS = ("cache", "layer_past", "past_key_value", "past_key_values")


def _is_hf_layer(module: nn.Module) -> bool:
    return any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__)


def _in_modes(function, modes: List[Any]):
    """``function`` run under the torch-function modes active when the forward ran.

    Autograd runs the recomputation in backward without the Python torch-function mode stack,
    so the simulation's emulation of the GPU's kernels (``simulate._GpuKernelMode``: dropout
    masks, SDPA backends, autocast casts) would be missing from the recomputed forward, and
    the recomputation would differ from the forward (torch.utils.checkpoint refuses that).
    The missing modes are re-entered for the recomputation, as torch.utils.checkpoint
    re-enters autocast; a mode's ``clear_cast_cache`` then drops the casts the recomputation
    cached, as leaving that autocast region does on a GPU (what the recomputed block saved
    for its backward keeps them alive)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        active = _function_modes()
        missing = [m for m in modes if not any(m is a for a in active)]
        if not missing:
            return function(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for mode in missing:
                stack.enter_context(mode)
            try:
                return function(*args, **kwargs)
            finally:
                for mode in missing:
                    clear = getattr(mode, "clear_cast_cache", None)
                    if callable(clear):
                        clear()

    return run


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The instance ``forward`` of a checkpointed module (bound, so that deep copies call their
    own module): ``checkpoint(original, *args, use_reentrant=False, **kwargs)`` when training
    with autograd on, the original otherwise."""
    inner = self.__dict__["_gpucast_checkpointed_inner"]
    original = (lambda *a, **k: inner(self, *a, **k)) if isinstance(inner, types.FunctionType) else inner
    if not (self.training and torch.is_grad_enabled()):
        return original(*args, **kwargs)
    modes = _function_modes()
    if modes:
        original = _in_modes(original, modes)
    if _is_hf_layer(self):  # as GradientCheckpointingLayer: the recompute must not re-cache
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        if not getattr(self, "_can_checkpoint_with_cache", False):
            for name in _CACHE_ARGUMENTS:
                if kwargs.get(name) is not None:
                    kwargs[name] = None
    return checkpoint(original, *args, use_reentrant=False, **kwargs)


def checkpoint_module(module: nn.Module) -> bool:
    """Makes ``module`` checkpoint its forward; False when it already does."""
    if "_gpucast_checkpointed_inner" in module.__dict__:
        return False
    own = module.__dict__.get("forward")
    # The class's function when the forward is the class's (deep copies rebind nothing then),
    # else the instance's own callable (another wrapper), kept as it is.
    module.__dict__["_gpucast_checkpointed_inner"] = own if own is not None else type(module).forward
    module.forward = types.MethodType(_checkpointed_forward, module)
    return True


def is_checkpointed(module: nn.Module) -> bool:
    return "_gpucast_checkpointed_inner" in module.__dict__


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _is_stack(module: nn.Module) -> bool:
    """A container of at least two modules of one class, each with children and parameters."""
    if not isinstance(module, (nn.Sequential, nn.ModuleList)):
        return False
    members = list(module.children())
    if len(members) < 2 or len({type(m) for m in members}) != 1:
        return False
    return all(next(m.children(), None) is not None and _has_params(m) for m in members)


def repeated_blocks(model: nn.Module) -> List[str]:
    """The names of the modules ``activation_checkpointing="full"`` checkpoints, in module
    order (see the module's docstring for the rule)."""
    named = list(model.named_modules())
    hf = [name for name, module in named if _is_hf_layer(module)]
    if hf:
        return _outermost(hf)
    blocks: List[str] = []

    def resolve(stack_name: str, stack: nn.Module) -> None:
        for child_name, member in stack.named_children():
            name = f"{stack_name}.{child_name}" if stack_name else child_name
            inner = _finer_stacks(name, member)
            if inner:
                for inner_name, inner_stack in inner:
                    resolve(inner_name, inner_stack)
            else:
                blocks.append(name)

    for name, stack in _top_stacks(model):
        resolve(name, stack)
    order = {name: i for i, (name, _) in enumerate(named)}
    return sorted(set(blocks), key=order.__getitem__)


def _top_stacks(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """Stacks not inside a member of another stack (searched from the root down, not entering
    a stack's members)."""
    found: List[Tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        if _is_stack(module):
            found.append((prefix, module))
            return
        for child_name, child in module.named_children():
            visit(f"{prefix}.{child_name}" if prefix else child_name, child)

    visit("", model)
    return found


def _finer_stacks(prefix: str, member: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The member itself when it is an ``nn.Sequential`` stack (timm EfficientNet's stages),
    else the outermost ``nn.Sequential`` stacks inside it (ModuleLists are its parts)."""
    if isinstance(member, nn.Sequential) and _is_stack(member):
        return [(prefix, member)]
    found: List[Tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            child_full = f"{name}.{child_name}"
            if isinstance(child, nn.Sequential) and _is_stack(child):
                found.append((child_full, child))
            elif not isinstance(child, nn.ModuleList) or not _is_stack(child):
                visit(child_full, child)

    visit(prefix, member)
    return found


def _outermost(names: Sequence[str]) -> List[str]:
    kept: List[str] = []
    for name in names:  # module order: a parent comes before its children
        if not any(name.startswith(parent + ".") for parent in kept):
            kept.append(name)
    return kept


# ---------------------------------------------------------------------------------------------
# apply_setup
# ---------------------------------------------------------------------------------------------


def _output_head(model: nn.Module) -> Optional[nn.Module]:
    """The output head LoRA's "all-linear" leaves out: Hugging Face's output embeddings, else
    timm's classifier, else a top-level linear named like a head."""
    for getter in ("get_output_embeddings", "get_classifier"):
        method = getattr(model, getter, None)
        if callable(method):
            try:
                head = method()
            except (NotImplementedError, AttributeError, TypeError):
                head = None
            if isinstance(head, nn.Module) and _linear_shape(head) is not None:
                return head
    for name in HEAD_NAMES:
        child = model._modules.get(name)
        if child is not None and _linear_shape(child) is not None:
            return child
    return None


def _under(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_lora(lora: Any) -> Dict[str, Any]:
    """A `lora` spec checked, each error naming its field, with the defaults filled in."""
    if not isinstance(lora, dict):
        raise ValueError(f"lora: must be an object with {', '.join(LORA_FIELDS)}, got {lora!r}")
    unknown = sorted(set(lora) - set(LORA_FIELDS))
    if unknown:
        raise ValueError(f"lora.{unknown[0]}: unknown field (known: {', '.join(LORA_FIELDS)})")
    rank = lora.get("rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora.rank: must be a positive integer, got {rank!r}")
    alpha = lora.get("alpha", PEFT_DEFAULT_ALPHA)
    if not _number(alpha) or alpha <= 0:
        raise ValueError(f"lora.alpha: must be a positive number, got {alpha!r}")
    targets = lora.get("target_modules", ALL_LINEAR)
    if isinstance(targets, str):
        if targets != ALL_LINEAR:
            try:
                re.compile(targets)
            except re.error as exc:
                raise ValueError(f"lora.target_modules: {targets!r} is not a regular expression: {exc}") from None
    elif isinstance(targets, (list, tuple)) and targets and all(isinstance(t, str) and t for t in targets):
        targets = list(dict.fromkeys(targets))
    else:
        raise ValueError(
            "lora.target_modules: must be a non-empty list of module names, "
            f'"{ALL_LINEAR}" or a regular expression, got {targets!r}'
        )
    base = lora.get("base_weights", "same")
    if base not in BASE_WEIGHTS:
        raise ValueError(f"lora.base_weights: must be one of {', '.join(BASE_WEIGHTS)}, got {base!r}")
    dropout = lora.get("dropout", 0.0)
    if not _number(dropout) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora.dropout: must be a number in [0, 1), got {dropout!r}")
    return {
        "rank": rank,
        "alpha": float(alpha),
        "target_modules": targets,
        "base_weights": base,
        "dropout": float(dropout),
    }


def _parse_trainable(trainable: Any) -> Optional[List[str]]:
    if trainable is None:
        return None
    if isinstance(trainable, dict):
        if set(trainable) == {"modules"}:
            trainable = trainable["modules"]
        else:
            raise ValueError(
                f'trainable: the simulation needs module names ({{"modules": [...]}} or a list), got {trainable!r}'
            )
    if (
        isinstance(trainable, str)
        or not isinstance(trainable, (list, tuple))
        or not all(isinstance(p, str) and p for p in trainable)
    ):
        raise ValueError(f"trainable: must be a list of module names, got {trainable!r}")
    return list(dict.fromkeys(trainable))


def _lora_targets(model: nn.Module, named: List[Tuple[str, nn.Module]], spec: Dict[str, Any]) -> List[str]:
    """The targeted modules' names, checked: linear, rank within their dimensions."""
    targets = spec["target_modules"]
    inside_mha = {
        id(child)
        for module in model.modules()
        if isinstance(module, nn.MultiheadAttention)
        for child in module.children()
    }
    inside_lora = {
        id(child) for module in model.modules() if isinstance(module, LoraLinear) for child in module.modules()
    }
    if targets == ALL_LINEAR:
        head = _output_head(model)
        chosen = [
            name
            for name, module in named
            if name
            and _linear_shape(module) is not None
            and module is not head
            and id(module) not in inside_mha
            and id(module) not in inside_lora
        ]
        if not chosen:
            raise ValueError(f'lora.target_modules: "{ALL_LINEAR}" found no linear layer besides the output head')
    else:
        if isinstance(targets, str):  # PEFT: a string is a regular expression, full match
            pattern = re.compile(targets)
            chosen = [name for name, _ in named if name and pattern.fullmatch(name)]
            if not chosen:
                raise ValueError(f"lora.target_modules: {targets!r} matches no module")
        else:
            chosen, missing = [], []
            for target in targets:
                matches = [name for name, _ in named if name == target or name.endswith("." + target)]
                if not matches:
                    missing.append(target)
                chosen += matches
            if missing:
                raise ValueError(f"lora.target_modules: {', '.join(map(repr, missing))} names no module of the model")
            chosen = list(dict.fromkeys(chosen))
        modules = dict(named)
        for name in chosen:
            module = modules[name]
            if _linear_shape(module) is None or id(module) in inside_lora:
                raise ValueError(f"lora.target_modules: {name!r} is a {type(module).__name__}, not a linear layer")
            if id(module) in inside_mha:
                raise ValueError(
                    f"lora.target_modules: {name!r} belongs to an "
                    "nn.MultiheadAttention, which reads its weight directly"
                )
    modules = dict(named)
    for name in chosen:
        in_features, out_features = _linear_shape(modules[name])
        if spec["rank"] > min(in_features, out_features):
            raise ValueError(
                f"lora.rank: {spec['rank']} exceeds the smaller dimension of {name!r} ({in_features} -> {out_features})"
            )
    return chosen


def _quantized_names(model: nn.Module, named: List[Tuple[str, nn.Module]], trainable: Optional[List[str]]) -> List[str]:
    """The linear layers a bitsandbytes-quantised load converts: all but the output head, the
    module of the last parameter and tied linears (transformers' get_keys_to_not_convert), and
    (here) those the setup trains."""
    keep = set()
    head = _output_head(model)
    if head is not None:
        keep.add(id(head))
    owners: Dict[int, int] = {}
    last_owner = None
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                owners[id(param)] = owners.get(id(param), 0) + 1
                last_owner = module
    if last_owner is not None:
        keep.add(id(last_owner))
    chosen = []
    inside_mha = {
        id(child)
        for module in model.modules()
        if isinstance(module, nn.MultiheadAttention)
        for child in module.children()
    }
    adapters = {
        id(m) for module in model.modules() if isinstance(module, LoraLinear) for m in (module.lora_A, module.lora_B)
    }
    for name, module in named:
        if not name or _linear_shape(module) is None or isinstance(module, _QuantizedLinear):
            continue
        if id(module) in keep or id(module) in inside_mha or id(module) in adapters:
            continue
        if owners.get(id(module.weight), 0) > 1:  # tied to another module's parameter
            continue
        if trainable is not None and _under(name, trainable):
            continue
        chosen.append(name)
    return chosen


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _checkpoint_names(model: nn.Module, named: List[Tuple[str, nn.Module]], value: Any) -> List[str]:
    if value is None or (isinstance(value, str) and value == "none"):
        return []
    if isinstance(value, str) and value == "full":
        blocks = repeated_blocks(model)
        if not blocks:
            raise ValueError(
                'activation_checkpointing: "full" found no repeated blocks in '
                f"{type(model).__name__} (name the modules to checkpoint)"
            )
        return blocks
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(n, str) for n in value):
        raise ValueError(f'activation_checkpointing: must be "none", "full" or a list of module names, got {value!r}')
    known = {name for name, _ in named if name}
    missing = [n for n in value if n not in known]
    if missing:
        raise ValueError(f"activation_checkpointing: {', '.join(map(repr, missing))} names no module of the model")
    return list(dict.fromkeys(value))


def apply_setup(
    model: nn.Module,
    *,
    activation_checkpointing: Any = "none",
    lora: Optional[Dict[str, Any]] = None,
    trainable: Optional[Sequence[str]] = None,
) -> Dict[str, Any]:
    """Applies a training setup to ``model`` in place (normally a meta copy) and returns
    ``{"trainable_params": int, "lora_params": int, "checkpointed": [module names]}``.

    * ``trainable``: module (or parameter) name prefixes, a prefix matching its name and the
      names below it (``"encoder.layer.1"`` is not ``"encoder.layer.11"``); every parameter
      outside them is frozen. With ``lora`` the base is frozen and the adapters plus these
      prefixes (a classifier head) train. None: parameters keep their flags (all of them
      train, without ``lora``).
    * ``lora``: ``{"rank", "alpha" (PEFT's default 8), "target_modules" ("all-linear" when
      absent): [names] | "all-linear" | regular expression, "base_weights": "same" | "int8" | "nf4",
      "dropout" (0)}``. A target matches a module named exactly so or ending in ``"." +
      target`` (PEFT); "all-linear" is every linear layer but the output head.
    * ``activation_checkpointing``: ``"none"``, ``"full"`` (:func:`repeated_blocks`) or a list
      of module names, each checkpointed as one unit.

    Everything is checked before anything changes: a bad value raises ValueError starting with
    the field's name (``lora.rank: ...``, ``lora.target_modules: ...``,
    ``activation_checkpointing: ...``, ``trainable: ...``).
    """
    prefixes = _parse_trainable(trainable)
    spec = parse_lora(lora) if lora is not None else None
    named = list(model.named_modules())
    if prefixes is not None:
        known = {name for name, _ in named if name}
        known.update(name for name, _ in model.named_parameters(remove_duplicate=False))
        missing = [p for p in prefixes if p not in known]
        if missing:
            raise ValueError(f"trainable: {', '.join(map(repr, missing))} names no module of the model")
    targets = _lora_targets(model, named, spec) if spec is not None else []
    quantize = _quantized_names(model, named, prefixes) if spec is not None and spec["base_weights"] != "same" else []
    to_checkpoint = _checkpoint_names(model, named, activation_checkpointing)

    adapters: List[nn.Parameter] = []
    if spec is not None:
        for param in model.parameters():
            param.requires_grad_(False)
        modules = dict(named)
        code2 = None
        replaced: Dict[str, nn.Module] = {}
        for name in quantize:
            base = modules[name]
            if spec["base_weights"] == "int8":
                replaced[name] = Linear8bitLt(base)
            else:
                if code2 is None:
                    code2 = _dynamic_map().to(base.weight.device)
                replaced[name] = Linear4bit(base, code2)
            _replace(model, name, replaced[name])
        for name in targets:
            wrapper = LoraLinear(replaced.get(name, modules[name]), spec["rank"], spec["alpha"], spec["dropout"])
            _replace(model, name, wrapper)
        # every adapter of the model (those of an earlier application too)
        adapters = [p for m in model.modules() if isinstance(m, LoraLinear) for p in (m.lora_A.weight, m.lora_B.weight)]

    if prefixes is not None or spec is not None:
        adapter_ids = {id(p) for p in adapters}
        chosen = set()
        if prefixes is not None:
            for name, param in model.named_parameters(remove_duplicate=False):
                if _under(name, prefixes) and (param.is_floating_point() or param.is_complex()):
                    chosen.add(id(param))
        for param in model.parameters():
            param.requires_grad_(id(param) in chosen or id(param) in adapter_ids)

    checkpointed = []
    for name in to_checkpoint:
        checkpoint_module(model.get_submodule(name))
        checkpointed.append(name)
    if checkpointed:
        _hf_input_require_grads(model)

    return {
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "lora_params": sum(p.numel() for p in adapters),
        "checkpointed": checkpointed,
    }


def _hf_input_require_grads(model: nn.Module) -> None:
    """What ``gradient_checkpointing_enable`` adds on a Hugging Face model that reads
    ``input_ids``: gradients required at the input embeddings' output."""
    if getattr(model, "main_input_name", None) != "input_ids":
        return
    enable = getattr(model, "enable_input_require_grads", None)
    if callable(enable) and not getattr(model, "_require_grads_hooks", None):
        try:
            enable()
        except Exception:  # a model without input embeddings: nothing to hook
            pass
