"""The GPU's kernel choices the simulation emulates on meta tensors: the SDPA backend, the math
path's dropout, fp16 -> fp32 softmax and cross-entropy under autocast, and the model output
freed before backward. Figures marked "H200" were measured on an H200 with torch 2.11."""

import itertools
import math
import unittest

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpucast_describe import allocator, simulate, simulate_step
from gpucast_describe.attention import _gpu_attention, _math_attention, sdpa_backend

MIB = 1 << 20


def on_meta(factory):
    with torch.device("meta"):
        return factory()


def qkv(dtype, heads=8, kv_heads=None, length=256, keys=None, head_dim=64, grad=False):
    keys = keys or length
    kv_heads = kv_heads or heads

    def empty(*shape):
        return torch.empty(shape, device="meta", dtype=dtype, requires_grad=grad)

    return (empty(2, heads, length, head_dim), empty(2, kv_heads, keys, head_dim), empty(2, kv_heads, keys, head_dim))


def saved_bytes(fn):
    """Bytes of the distinct storages autograd saves while ``fn()`` runs, and the saved
    tensors' shapes."""
    storages, shapes = {}, []

    def pack(tensor):
        storages[tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()
        shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values()), shapes


class SdpaBackendTest(unittest.TestCase):
    """sdp_utils' default order (flash, memory-efficient, math) on an sm80+ GPU."""

    def backend(self, dtype, mask=None, causal=False, gqa=False, **shape):
        q, k, v = qkv(dtype, **shape)
        length, keys = q.shape[2], k.shape[2]
        attn_mask = None
        if mask == "bool":
            attn_mask = torch.empty(length, keys, dtype=torch.bool, device="meta")
        elif mask == "float":
            attn_mask = torch.empty(2, 1, length, keys, dtype=dtype, device="meta")
        elif mask == "transposed":
            attn_mask = torch.empty(keys, length, dtype=dtype, device="meta").t()
        return sdpa_backend(q, k, v, attn_mask, 0.0, causal, None, gqa)

    def test_backend_per_dtype_mask_and_gqa(self):
        # On an H200 torch 2.11 picked these too, except that it prefers cuDNN attention
        # where flash is marked here and for fp16 with masks (same tensors kept: q, k, v, the
        # output and an fp32 log-sum-exp, no N x N).
        half, bf16, fp32 = torch.float16, torch.bfloat16, torch.float32
        cases = [
            ("flash", dict(dtype=half)),
            ("flash", dict(dtype=bf16)),
            ("flash", dict(dtype=half, heads=32, kv_heads=4, causal=True, gqa=True)),
            ("flash", dict(dtype=half, gqa=True)),  # the flag with equal head counts
            ("flash", dict(dtype=half, head_dim=60)),  # padded to 64 (H200: flash too)
            ("efficient", dict(dtype=fp32)),
            ("efficient", dict(dtype=fp32, mask="float")),
            ("efficient", dict(dtype=fp32, head_dim=60)),
            ("efficient", dict(dtype=half, mask="bool")),
            ("efficient", dict(dtype=half, mask="float")),
            ("efficient", dict(dtype=half, length=128, keys=256, causal=True)),  # not square
            ("efficient", dict(dtype=half, head_dim=320)),  # over flash's 256 (H200: same)
            ("math", dict(dtype=fp32, heads=32, kv_heads=4, gqa=True)),  # H200: math too
            ("math", dict(dtype=fp32, mask="transposed")),  # H200: math too
            ("math", dict(dtype=fp32, head_dim=62)),  # not a multiple of 4 (H200: math too)
            ("math", dict(dtype=half, heads=32, kv_heads=4, gqa=True, mask="bool")),
            ("math", dict(dtype=torch.float64)),
        ]
        for expected, case in cases:
            self.assertEqual(self.backend(**case), expected, case)

    def test_not_emulated_inputs(self):
        q, k, v = qkv(torch.float32)
        self.assertIsNone(sdpa_backend(q[0], k[0], v[0]))  # 3-D
        self.assertIsNone(sdpa_backend(q, k.half(), v))  # mixed dtypes
        mask = torch.empty(256, 256, dtype=torch.int64, device="meta")
        self.assertIsNone(sdpa_backend(q, k, v, mask))
        causal_and_mask = torch.empty(256, 256, dtype=torch.bool, device="meta")
        self.assertIsNone(sdpa_backend(q, k, v, causal_and_mask, 0.0, True))


class GqaFlashAttentionTest(unittest.TestCase):
    def test_fp16_gqa_keeps_no_n_by_n_and_k_v_unexpanded(self):
        # TinyLlama's attention: 32 query heads sharing 4 k/v heads, fp16, causal.
        n = 1024
        q, k, v = qkv(torch.float16, heads=32, kv_heads=4, length=n, grad=True)
        out = _gpu_attention(q, k, v, is_causal=True, enable_gqa=True)
        self.assertEqual(type(out.grad_fn).__name__, "ScaledDotProductFlashAttentionBackward0")
        self.assertEqual(tuple(out.shape), (2, 32, n, 64))
        nbytes, shapes = saved_bytes(lambda: _gpu_attention(q, k, v, is_causal=True, enable_gqa=True))
        self.assertIn((2, 4, n, 64), shapes)  # k and v as they are
        self.assertFalse([s for s in shapes if s[-2:] == (n, n)])
        # q and the output [2, 32, N, 64], k and v [2, 4, N, 64] in fp16, the log-sum-exp
        # [2, 32, N] in fp32, the RNG state (16 + 8 bytes); nothing N x N
        self.assertEqual(nbytes, 2 * (2 * 32 * n * 64 * 2) + 2 * (2 * 4 * n * 64 * 2) + 2 * 32 * n * 4 + 16 + 8)
        # what the math path (expanded k/v, N x N probabilities) would keep instead
        math_bytes, _ = saved_bytes(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        self.assertGreater(math_bytes, 2 * 32 * n * n * 4)

    def test_flash_pads_head_dimensions_to_eight(self):
        q, k, v = qkv(torch.float16, head_dim=60, grad=True)
        out = _gpu_attention(q, k, v)
        self.assertEqual(tuple(out.shape), (2, 8, 256, 60))
        _, shapes = saved_bytes(lambda: _gpu_attention(q, k, v))
        self.assertIn((2, 8, 256, 64), shapes)  # the padded q, k, v are what flash keeps

    def test_mixed16_gqa_model_is_linear_in_sequence_length(self):
        class GqaBlock(nn.Module):
            def __init__(self, dim=256, heads=8, kv_heads=2):
                super().__init__()
                self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
                self.embed = nn.Embedding(100, dim)
                self.q = nn.Linear(dim, dim)
                self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
                self.out = nn.Linear(dim, 100)

            def forward(self, ids):
                x = self.embed(ids)
                b, n, _ = x.shape
                q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2)
                k, v = self.kv(x).view(b, n, 2 * self.kv_heads, -1).transpose(1, 2).chunk(2, 1)
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                return self.out(y.transpose(1, 2).reshape(b, n, -1))

        model = on_meta(GqaBlock)
        peaks = {
            n: simulate_step(model, [n], 8, torch.int64, precision="mixed16")["breakdown_at_peak"]["activations"]
            for n in (1024, 2048)
        }
        # math: 8 x 8 heads x N x N fp32 probabilities would quadruple; flash doubles
        self.assertLess(peaks[2048] / peaks[1024], 2.2)


class MathPathDropoutTest(unittest.TestCase):
    def test_math_path_is_the_aten_ops_one_for_one(self):
        # Without dropout _math_attention makes the allocations and frees the real math op
        # makes on meta, in the same order (so with dropout only the dropout differs).
        def events(fn, dtype, mask, causal, gqa, scale):
            q = torch.empty(2, 4, 16, 8, device="meta", dtype=dtype, requires_grad=True)
            kv_heads, keys = (2 if gqa else 4), (16 if causal else 24)
            k, v = (torch.empty(2, kv_heads, keys, 8, device="meta", dtype=dtype, requires_grad=True) for _ in range(2))
            attn_mask = {
                None: None,
                "bool": torch.empty(16, keys, dtype=torch.bool, device="meta"),
                "float": torch.empty(2, 1, 16, keys, dtype=dtype, device="meta"),
            }[mask]
            recorder = simulate._StepRecorder()
            with recorder:
                recorder.phase = "forward"
                out = fn(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=causal, scale=scale, enable_gqa=gqa)
                recorder.phase = "backward"
                out.sum().backward()
                del out
            return [e[:1] + e[2:] for e in recorder.labelled_events()]

        for case in itertools.product(
            (torch.float32, torch.float16), (None, "bool", "float"), (False, True), (False, True), (None, -0.5)
        ):
            if case[1] and case[2]:
                continue
            self.assertEqual(events(_math_attention, *case), events(F.scaled_dot_product_attention, *case), case)

    def test_dropout_keeps_a_one_byte_mask(self):
        # A mask not contiguous in its last dimension (T5's position bias in transformers
        # 5.17) sends fp32 attention to the math path, on an H200 too; with dropout the GPU
        # keeps the dropped probabilities (4 B) and a bool mask (1 B) besides the softmax
        # output, where the meta composite would keep a float noise tensor (4 B).
        n = 128
        q, k, v = qkv(torch.float32, length=n, grad=True)
        mask = torch.empty(n, n, device="meta").t()
        self.assertEqual(sdpa_backend(q, k, v, mask, 0.1), "math")
        with_dropout, _ = saved_bytes(lambda: _gpu_attention(q, k, v, mask, 0.1))
        self.assertIsNone(_gpu_attention(q, k, v, mask, 0.0))  # the same on meta: the normal call
        without, _ = saved_bytes(lambda: F.scaled_dot_product_attention(q, k, v, mask))
        self.assertEqual(with_dropout - without, 2 * 8 * n * n * (4 + 1))


class Fp16SoftmaxTest(unittest.TestCase):
    """fp16 logits [4096, 30522] under CUDA autocast, as BERT-base MLM's at batch 32 x 128."""

    SHAPE = (4096, 30522)

    def run_probe(self, fn):
        """(MiB kept after the forward, peak MiB over the input during forward + backward,
        the input gradient's dtype), the input not counted."""
        recorder = simulate._StepRecorder()
        with recorder, simulate._GpuKernelMode(True, True):
            x = torch.empty(self.SHAPE, device="meta", dtype=torch.float16, requires_grad=True)
            recorder.track(x, "parameters")
            y = fn(x)
            forward_events = len(recorder.events)
            y.backward()
            grad_dtype = x.grad.dtype
            del y
        live, current, peak, kept = {}, 0, 0, None
        for index, event in enumerate(recorder.labelled_events()):
            if index == forward_events:
                kept = current
            if event[0] == allocator.ALLOC:
                live[event[1]] = allocator.round_size(event[2])
                current += live[event[1]]
                peak = max(peak, current)
            else:
                current -= live.pop(event[1])
        x_bytes = allocator.round_size(math.prod(self.SHAPE) * 2)
        return (kept - x_bytes) / MIB, (peak - x_bytes) / MIB, grad_dtype

    def test_cross_entropy_as_measured_on_an_h200(self):
        # H200: fp16 log-probabilities and their fp32 copy kept (715.36 MiB), a peak of
        # 1192.27 MiB over the logits, an fp16 gradient.
        target = torch.zeros(self.SHAPE[0], dtype=torch.int64, device="meta")
        kept, peak, grad_dtype = self.run_probe(lambda x: F.cross_entropy(x, target))
        self.assertAlmostEqual(kept, 715.36, delta=0.01)
        self.assertAlmostEqual(peak, 1192.27, delta=0.01)
        self.assertEqual(grad_dtype, torch.float16)

    def test_softmax_reads_fp16_without_an_fp32_copy(self):
        # H200: only the fp32 output is kept (476.91 MiB), the input gradient is fp16.
        for fn in (
            lambda x: torch.softmax(x, -1),
            lambda x: F.log_softmax(x, dim=-1),
            lambda x: x.softmax(-1, dtype=torch.float32),
        ):
            kept, peak, grad_dtype = self.run_probe(lambda x: fn(x).sum())
            self.assertAlmostEqual(kept, 476.91, delta=0.01)
            # no fp32 input copy or fp32 gradient: the output and the fp16 gradient
            self.assertAlmostEqual(peak, 476.91 + 238.45, delta=0.01)
            self.assertEqual(grad_dtype, torch.float16)


class OutputFreedBeforeBackwardTest(unittest.TestCase):
    def test_logits_are_not_held_through_backward(self):
        # As a training loop that keeps only the loss (the H200 check, Hugging Face's
        # Trainer): there holding BERT-base MLM's output through backward measured 475 MiB
        # more (its logits: 477 MiB), GPT-2 small's 786 MiB (785 MiB).
        class WideHead(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(64, 65536)

            def forward(self, x):
                return self.fc(x)

        batch = 512
        logits = batch * 65536 * 4
        sim = simulate_step(on_meta(WideHead), [64], batch, optimizer="sgd")
        breakdown = sim["breakdown_at_peak"]
        # at the peak (log-softmax backward): its saved output, nll_loss's gradient and its
        # own output; the logits too if held
        self.assertLess(breakdown["activations"] + breakdown["temporaries"], 3.5 * logits)
        self.assertGreaterEqual(breakdown["activations"] + breakdown["temporaries"], 3 * logits)


if __name__ == "__main__":
    unittest.main()
