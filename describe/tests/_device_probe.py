"""One-off GPU probe behind the H200 figures in test_gpu_kernels.py and data/gpu_check/README.md
(not a test; run where a GPU is lent: `cd describe && python3 -m tests._device_probe`, writes
$OUT/probe.json): which SDPA kernel CUDA picks per dtype/mask/GQA case (the grad_fn), what
autocast keeps around an fp16 cross-entropy/softmax, and what holding the model output through
backward costs (BERT-base MLM, GPT-2 small, one step)."""

import json
import os
import time
import traceback

import torch
import torch.nn.functional as F

OUT = os.environ.get("OUT", ".")
R = {"torch": torch.__version__, "cuda": torch.version.cuda}
dev = "cuda"
T0 = time.time()


def save():
    R["seconds"] = round(time.time() - T0, 1)
    with open(os.path.join(OUT, "probe.json"), "w") as f:
        json.dump(R, f, indent=1)


def chain(t, depth=6):
    names, fn = [], t.grad_fn
    while fn is not None and len(names) < depth:
        names.append(type(fn).__name__)
        nxt = [f for f, _ in fn.next_functions if f is not None and type(f).__name__ != "AccumulateGrad"]
        fn = nxt[0] if nxt else None
    return names


def sdpa_case(dtype, hq=8, hk=8, L=256, S=256, D=64, mask=None, causal=False, gqa=False, dropout=0.0, autocast=False):
    q = torch.randn(2, hq, L, D, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(2, hk, S, D, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(2, hk, S, D, device=dev, dtype=dtype, requires_grad=True)
    m = None
    if mask == "bool":
        m = torch.ones(L, S, device=dev, dtype=torch.bool).tril()
    elif mask == "float":
        m = torch.zeros(2, 1, L, S, device=dev, dtype=dtype)
    elif mask == "transposed":
        m = torch.zeros(S, L, device=dev, dtype=dtype).t()
    kw = {"enable_gqa": True} if gqa else {}
    with torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=dropout, is_causal=causal, **kw)
    return chain(out, 3)


cases = {
    "fp16": dict(dtype=torch.float16),
    "bf16": dict(dtype=torch.bfloat16),
    "fp32": dict(dtype=torch.float32),
    "fp16_dropout": dict(dtype=torch.float16, dropout=0.1),
    "fp16_gqa_32_4_causal": dict(dtype=torch.float16, hq=32, hk=4, causal=True, gqa=True),
    "fp16_gqa_flag_equal_heads": dict(dtype=torch.float16, gqa=True),
    "fp32_gqa_32_4": dict(dtype=torch.float32, hq=32, hk=4, gqa=True),
    "fp16_gqa_32_4_boolmask": dict(dtype=torch.float16, hq=32, hk=4, gqa=True, mask="bool"),
    "fp16_bool_mask": dict(dtype=torch.float16, mask="bool"),
    "fp16_float_mask": dict(dtype=torch.float16, mask="float"),
    "fp32_float_mask": dict(dtype=torch.float32, mask="float"),
    "fp32_transposed_mask": dict(dtype=torch.float32, mask="transposed"),
    "fp32_transposed_mask_dropout": dict(dtype=torch.float32, mask="transposed", dropout=0.1),
    "fp16_causal_nonsquare": dict(dtype=torch.float16, L=128, S=256, causal=True),
    "fp16_D60": dict(dtype=torch.float16, D=60),
    "fp16_D256": dict(dtype=torch.float16, D=256),
    "fp16_D320": dict(dtype=torch.float16, D=320),
    "fp32_D60": dict(dtype=torch.float32, D=60),
    "fp32_D62": dict(dtype=torch.float32, D=62),
    "autocast_fp32_inputs": dict(dtype=torch.float32, autocast=True),
    "autocast_fp32_inputs_float_mask": dict(dtype=torch.float32, autocast=True, mask="float"),
}
R["sdpa"] = {}
for name, kw in cases.items():
    try:
        R["sdpa"][name] = sdpa_case(**kw)
    except Exception as e:
        R["sdpa"][name] = "error: %r" % e
save()


def mem_probe(fn):
    """(allocated after forward - before, peak during forward+backward - before) in MiB, chain."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    x = torch.randn(4096, 30522, device=dev, dtype=torch.float16, requires_grad=True)
    after_x = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.float16):
        y = fn(x)
    fwd = torch.cuda.memory_allocated()
    names = chain(y, 6)
    y.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    res = {
        "chain": names,
        "x_mib": (after_x - base) / 2**20,
        "kept_after_forward_mib": (fwd - after_x) / 2**20,
        "peak_over_x_mib": (peak - after_x) / 2**20,
        "grad_dtype": str(x.grad.dtype),
    }
    del x, y
    return res


target = torch.zeros(4096, dtype=torch.long, device=dev)
for name, fn in {
    "cross_entropy": lambda x: F.cross_entropy(x, target),
    "log_softmax_sum": lambda x: F.log_softmax(x, -1).sum(),
    "softmax_sum": lambda x: torch.softmax(x, -1).sum(),
}.items():
    try:
        R[name] = mem_probe(fn)
    except Exception as e:
        R[name] = "error: %r" % e
save()

# HF models (transformers of this image): SDPA kernels per call, small shapes.
try:
    import transformers

    R["transformers"] = transformers.__version__
    from examples import hf_models  # describe/examples, from describe/ (the working directory)

    seen = []
    real = F.scaled_dot_product_attention

    def spy(*a, **k):
        out = real(*a, **k)
        m = k.get("attn_mask", a[3] if len(a) > 3 else None)
        seen.append(
            (
                chain(out, 1)[0] if out.grad_fn is not None else None,
                str(a[0].dtype),
                tuple(a[0].shape),
                tuple(a[1].shape),
                None if m is None else (str(m.dtype), tuple(m.shape), tuple(m.stride())),
                bool(k.get("enable_gqa", False)),
                k.get("dropout_p", 0.0),
                k.get("is_causal", False),
            )
        )
        return out

    F.scaled_dot_product_attention = spy
    torch.nn.functional.scaled_dot_product_attention = spy
    R["hf"] = {}
    for name, seq, amp in (
        ("bert_base_mlm", 128, False),
        ("bert_base_mlm", 128, True),
        ("t5_small", 128, False),
        ("gpt2_small", 128, False),
    ):
        seen.clear()
        with torch.device(dev):
            model = getattr(hf_models, name)()
        model.train()
        ids = torch.randint(0, 1000, (2, seq), device=dev)
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            out = model(ids)
        R["hf"]["%s%s" % (name, "_amp" if amp else "")] = sorted({json.dumps(s) for s in seen})
        del model, out
        save()
    F.scaled_dot_product_attention = real
    torch.nn.functional.scaled_dot_product_attention = real
except Exception:
    R["hf_error"] = traceback.format_exc()[-1500:]
save()

# The output held through backward or not: BERT-base MLM fp32 batch 32 x 128 and GPT-2 small 8 x 512, one step each.
try:
    from gpucast_describe.simulate import default_loss

    R["hold_output"] = {}
    for name, batch, seq in (("bert_base_mlm", 32, 128), ("gpt2_small", 8, 512)):
        for hold in (False, True):
            with torch.device(dev):
                model = getattr(hf_models, name)()
            model.train()
            ids = torch.randint(0, 1000, (batch, seq), device=dev)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            if hold:
                output = model(ids)
                loss = default_loss(output)
            else:
                loss = default_loss(model(ids))
            loss.backward()
            torch.cuda.synchronize()
            R["hold_output"]["%s hold=%s" % (name, hold)] = (torch.cuda.max_memory_allocated() - base) / 2**20
            if hold:
                del output
            del loss, model, ids
            torch.cuda.empty_cache()
            save()
except Exception:
    R["hold_error"] = traceback.format_exc()[-1500:]
save()
print(json.dumps(R, indent=1))
