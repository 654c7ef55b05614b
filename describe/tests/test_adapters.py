"""Training-setup transforms (gpucast_describe.adapters): frozen modules, LoRA on full-precision
and quantised bases, activation checkpointing, on toy models and meta-built real architectures.
The memory claims are checked by running the step: on meta tensors under a dispatch mode that
sees every storage live and die, or through simulate_step."""

import copy
import time
import unittest
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gpucast_describe import simulate_step
from gpucast_describe.adapters import (
    Linear4bit,
    Linear8bitLt,
    LoraLinear,
    _dynamic_map,
    apply_setup,
    is_checkpointed,
    repeated_blocks,
)

try:
    import transformers
except ImportError:
    transformers = None
try:
    import timm
except ImportError:
    timm = None

MIB = 1 << 20


def on_meta(factory):
    with torch.device("meta"):
        return factory()


def rounded(nbytes):
    """The caching allocator's block size for a request (512-byte multiples)."""
    return max(512, -(-nbytes // 512) * 512)


class LiveStorages(TorchDispatchMode):
    """Every storage an op creates while active, its bytes and whether it is still alive (a
    finalizer on the storage sees it die), tagged with the current ``phase``."""

    def __init__(self, *models):
        super().__init__()
        # storages that exist already (parameters, buffers) are not counted, nor their views
        self.known = {t.untyped_storage()._cdata for m in models for t in [*m.parameters(), *m.buffers()]}
        self.live = {}
        self.born = []  # (phase, nbytes, dtype)
        self.phase = "forward"
        self.peak = {}

    def bytes(self):
        return sum(nbytes for nbytes, _ in self.live.values())

    def alive(self):
        """(nbytes, dtype) of the storages alive now."""
        return list(self.live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                storage = value.untyped_storage()
                key = storage._cdata
                if key not in self.live and key not in self.known and storage.nbytes():
                    self.live[key] = (storage.nbytes(), value.dtype)
                    self.born.append((self.phase, storage.nbytes(), value.dtype))
                    weakref.finalize(storage, self.live.pop, key, None)
        self.peak[self.phase] = max(self.peak.get(self.phase, 0), self.bytes())
        return out


# ---------------------------------------------------------------------------------------------
# Toy models
# ---------------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_dim):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, n, d = x.shape
        head_dim = d // self.heads
        q = self.q_proj(x).view(b, n, self.heads, head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, -1, head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, -1, head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, dim, heads, kv_dim, hidden):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, kv_dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(self.act(self.up(self.norm2(x))))


class ToyTransformer(nn.Module):
    """Token ids -> embedding -> ``layers`` (a ModuleList of Blocks) -> norm -> lm_head."""

    def __init__(self, vocab=64, dim=64, heads=4, kv_dim=32, hidden=256, depth=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim, heads, kv_dim, hidden) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class WideBlock(nn.Module):
    """A residual MLP block whose saved activations are ~10x its input."""

    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class WideStack(nn.Module):
    def __init__(self, dim=256, depth=6, classes=10):
        super().__init__()
        self.blocks = nn.ModuleList([WideBlock(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Expert(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)


class MoeLayer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        self.experts = nn.ModuleList([Expert(dim) for _ in range(4)])


class MoeModel(nn.Module):
    """Layers each holding a ModuleList of experts: the layers are the blocks."""

    def __init__(self, dim=8):
        super().__init__()
        self.layers = nn.ModuleList([MoeLayer(dim) for _ in range(3)])


class Stage(nn.Module):
    def __init__(self, dim, depth):
        super().__init__()
        self.downsample = nn.Linear(dim, dim)
        self.blocks = nn.Sequential(*[WideBlock(dim) for _ in range(depth)])


class StagedModel(nn.Module):
    """timm-like stages (a Sequential of stages, each with a Sequential of blocks)."""

    def __init__(self, dim=8):
        super().__init__()
        self.stem = nn.Linear(dim, dim)
        self.stages = nn.Sequential(Stage(dim, 2), Stage(dim, 3), Stage(dim, 1))
        self.head = nn.Linear(dim, 2)


def lora_linear_count(model):
    return sum(isinstance(m, LoraLinear) for m in model.modules())


# ---------------------------------------------------------------------------------------------
# LoRA
# ---------------------------------------------------------------------------------------------


class LoraParametersTest(unittest.TestCase):
    def test_adapters_are_rank_times_in_plus_out_per_target(self):
        model = on_meta(ToyTransformer)  # q: 64 -> 64, v: 64 -> 32 (grouped keys/values)
        result = apply_setup(model, lora={"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]})
        expected = 4 * (8 * (64 + 64) + 8 * (64 + 32))
        self.assertEqual(result["lora_params"], expected)
        self.assertEqual(result["trainable_params"], expected)  # the base is frozen
        self.assertEqual(lora_linear_count(model), 8)
        v = model.layers[0].attn.v_proj
        self.assertEqual(tuple(v.lora_A.weight.shape), (8, 64))  # A [rank, in]
        self.assertEqual(tuple(v.lora_B.weight.shape), (32, 8))  # B [out, rank]
        self.assertAlmostEqual(v.scaling, 2.0)
        self.assertEqual(result["checkpointed"], [])

    def test_only_adapters_train_and_frozen_parameters_get_no_gradient(self):
        torch.manual_seed(0)
        model = ToyTransformer()
        result = apply_setup(model, lora={"rank": 4, "alpha": 8, "target_modules": ["q_proj"]}, trainable=["lm_head"])
        self.assertEqual(result["trainable_params"], result["lora_params"] + model.lm_head.weight.numel())
        model(torch.randint(0, 64, (2, 16))).float().pow(2).mean().backward()
        for name, param in model.named_parameters():
            if "lora_" in name or name.startswith("lm_head"):
                self.assertTrue(param.requires_grad, name)
                self.assertIsNotNone(param.grad, name)
            else:
                self.assertFalse(param.requires_grad, name)
                self.assertIsNone(param.grad, name)

    def test_output_is_base_plus_scaled_low_rank_update(self):
        torch.manual_seed(0)
        base = nn.Linear(12, 10)
        reference = copy.deepcopy(base)
        holder = nn.Sequential(base)
        apply_setup(holder, lora={"rank": 3, "alpha": 6, "target_modules": ["0"]})
        layer = holder[0]
        self.assertIsInstance(layer, LoraLinear)
        x = torch.randn(5, 12)
        torch.testing.assert_close(layer(x), reference(x))  # B starts at zero, as in PEFT
        with torch.no_grad():
            layer.lora_B.weight.normal_()
        expected = reference(x) + x @ layer.lora_A.weight.t() @ layer.lora_B.weight.t() * 2.0
        torch.testing.assert_close(layer(x), expected)

    def test_adapters_are_fp32_on_a_16_bit_base_as_peft_keeps_them(self):
        model = on_meta(ToyTransformer).to(torch.bfloat16)
        apply_setup(model, lora={"rank": 4, "target_modules": ["q_proj"]})
        q = model.layers[0].attn.q_proj
        self.assertEqual(q.lora_A.weight.dtype, torch.float32)
        self.assertEqual(q.base_layer.weight.dtype, torch.bfloat16)
        model.to(torch.float16)  # a conversion afterwards keeps them too
        self.assertEqual(q.lora_B.weight.dtype, torch.float32)
        fp64 = nn.Sequential(nn.Linear(4, 4, dtype=torch.float64))
        apply_setup(fp64, lora={"rank": 2, "target_modules": ["0"]})
        self.assertEqual(fp64[0].lora_A.weight.dtype, torch.float64)

    def test_all_linear_excludes_the_head(self):
        model = on_meta(ToyTransformer)
        result = apply_setup(model, lora={"rank": 2, "target_modules": "all-linear"})
        self.assertEqual(lora_linear_count(model), 4 * 6)  # q, k, v, o, up, down
        self.assertIsInstance(model.lm_head, nn.Linear)
        self.assertNotIsInstance(model.lm_head, LoraLinear)
        per_layer = 2 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 256) + (256 + 64))
        self.assertEqual(result["lora_params"], 4 * per_layer)

    def test_all_linear_leaves_multihead_attention_projections_alone(self):
        model = nn.Sequential(nn.Linear(8, 8), nn.MultiheadAttention(8, 2), nn.Linear(8, 3))
        apply_setup(model, lora={"rank": 2, "target_modules": "all-linear"})
        self.assertIsInstance(model[0], LoraLinear)
        self.assertNotIsInstance(model[1].out_proj, LoraLinear)
        self.assertIsInstance(model[2], LoraLinear)  # no head by name: a linear like others
        with self.assertRaisesRegex(ValueError, "^lora.target_modules"):
            apply_setup(nn.Sequential(nn.MultiheadAttention(8, 2)), lora={"rank": 2, "target_modules": ["out_proj"]})

    def test_targets_match_whole_name_components(self):
        model = on_meta(ToyTransformer)
        apply_setup(model, lora={"rank": 2, "target_modules": ["attn.q_proj", "layers.1.up"]})
        self.assertEqual(lora_linear_count(model), 5)
        self.assertIsInstance(model.layers[1].up, LoraLinear)
        self.assertNotIsInstance(model.layers[0].up, LoraLinear)
        # PEFT: a string other than "all-linear" is a regular expression, fully matched
        model = on_meta(ToyTransformer)
        apply_setup(model, lora={"rank": 2, "target_modules": r"layers\.[02]\.attn\.(q|v)_proj"})
        self.assertEqual(lora_linear_count(model), 4)

    def test_dropout_keeps_a_separate_dropped_input_per_target(self):
        b, n, dim = 8, 128, 64
        kept = {}
        for p in (0.0, 0.1):
            model = on_meta(ToyTransformer)
            apply_setup(model, lora={"rank": 4, "target_modules": ["q_proj", "v_proj"], "dropout": p})
            self.assertIsInstance(model.layers[0].attn.q_proj.lora_dropout, nn.Dropout if p else nn.Identity)
            tracker = LiveStorages(model)
            with tracker:
                loss = model(torch.zeros(b, n, dtype=torch.int64, device="meta")).sum()
                kept[p] = [
                    nbytes for nbytes, dtype in tracker.alive() if dtype == torch.float32 and nbytes == b * n * dim * 4
                ]
            del loss
        # without dropout lora_A keeps the input the base keeps too; with it, each of the
        # 8 targets keeps its own dropped input
        self.assertGreaterEqual(len(kept[0.1]) - len(kept[0.0]), 8)
        # and through a simulated step (the GPU's one-byte masks): the peak grows
        plain = on_meta(ToyTransformer)
        apply_setup(plain, lora={"rank": 4, "target_modules": ["q_proj", "v_proj"]})
        dropped = on_meta(ToyTransformer)
        apply_setup(dropped, lora={"rank": 4, "target_modules": ["q_proj", "v_proj"], "dropout": 0.1})
        gap = (
            simulate_step(dropped, [n], b, torch.int64)["allocated_peak_bytes"]
            - simulate_step(plain, [n], b, torch.int64)["allocated_peak_bytes"]
        )
        self.assertGreater(gap, 4 * b * n * dim * 5)

    def test_pure_16_bit_training_keeps_an_fp32_copy_of_each_targets_input(self):
        b, n = 8, 128
        for base_weights in ("same", "int8", "nf4"):
            model = on_meta(ToyTransformer).to(torch.bfloat16)
            apply_setup(model, lora={"rank": 4, "target_modules": ["q_proj"], "base_weights": base_weights})
            inputs = []
            for layer in model.layers:
                layer.attn.q_proj.lora_A.register_forward_hook(lambda module, args, out: inputs.append(args[0]))
            tracker = LiveStorages(model)
            with tracker:
                loss = model(torch.zeros(b, n, dtype=torch.int64, device="meta")).sum()
                alive = set(tracker.live)
                keys = {x.untyped_storage()._cdata for x in inputs}
                dtypes = {x.dtype for x in inputs}
                del inputs[:]
                still = set(tracker.live)
            del loss
            self.assertEqual(dtypes, {torch.float32}, base_weights)  # x.to(lora_A's dtype)
            self.assertEqual(len(keys), 4)  # one copy per target...
            self.assertLessEqual(keys, alive)
            self.assertLessEqual(keys, still)  # ... kept for backward by lora_A, not the hook


@unittest.skipIf(transformers is None, "transformers is not installed")
class LoraOnHuggingFaceTest(unittest.TestCase):
    def test_llama_3_8b_q_v_rank_16_matches_peft(self):
        config = transformers.LlamaConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
        )
        model = on_meta(lambda: transformers.LlamaForCausalLM(config))
        start = time.perf_counter()
        result = apply_setup(model, lora={"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]})
        self.assertLess(time.perf_counter() - start, 5.0)
        self.assertEqual(result["lora_params"], 6_815_744)  # PEFT's print_trainable_parameters
        self.assertEqual(result["trainable_params"], 6_815_744)
        model = on_meta(lambda: transformers.LlamaForCausalLM(config))
        start = time.perf_counter()
        result = apply_setup(
            model,
            lora={"rank": 16, "target_modules": "all-linear", "base_weights": "nf4"},
            activation_checkpointing="full",
        )
        self.assertLess(time.perf_counter() - start, 5.0)
        self.assertEqual(result["lora_params"], 41_943_040)  # PEFT, all-linear r=16
        self.assertEqual(len(result["checkpointed"]), 32)

    def test_all_linear_on_gpt2_takes_conv1d_and_leaves_the_tied_head(self):
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500)
        model = on_meta(lambda: transformers.GPT2LMHeadModel(config))
        result = apply_setup(model, lora={"rank": 4, "target_modules": "all-linear"})
        block = model.transformer.h[0]
        for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            self.assertIsInstance(block.get_submodule(name), LoraLinear, name)
        self.assertNotIsInstance(model.lm_head, LoraLinear)
        per_block = 4 * ((64 + 192) + (64 + 64) + (64 + 256) + (256 + 64))
        self.assertEqual(result["lora_params"], 2 * per_block)

    def test_all_linear_on_bert_classifier_leaves_the_classifier(self):
        config = transformers.BertConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=500
        )
        model = on_meta(lambda: transformers.BertForSequenceClassification(config))
        apply_setup(model, lora={"rank": 4, "target_modules": "all-linear"}, trainable=["classifier"])
        self.assertNotIsInstance(model.classifier, LoraLinear)
        self.assertTrue(model.classifier.weight.requires_grad)
        self.assertIsInstance(model.bert.encoder.layer[0].attention.self.query, LoraLinear)
        self.assertIsInstance(model.bert.pooler.dense, LoraLinear)


# ---------------------------------------------------------------------------------------------
# Quantised bases
# ---------------------------------------------------------------------------------------------


class Projection(nn.Module):
    """A trainable input layer, one large frozen linear (the LoRA target), a trainable head:
    the large layer's input requires a gradient, as inside a LoRA-tuned network."""

    def __init__(self, dim=1024, classes=16):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.big = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, classes)

    def forward(self, x):
        return self.out(self.big(self.inp(x)))


def state_bytes(module):
    return {name: b.numel() * b.element_size() for name, b in module.named_buffers()}


class QuantisedBaseTest(unittest.TestCase):
    def test_nf4_bytes_are_half_a_byte_per_weight_plus_double_quantised_absmax(self):
        model = on_meta(lambda: nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 4096), nn.Linear(4096, 10)))
        apply_setup(model, lora={"rank": 8, "target_modules": ["0"], "base_weights": "nf4"})
        n = 4096 * 4096
        base = model[0].base_layer
        self.assertIsInstance(base, Linear4bit)
        self.assertIsInstance(model[1], Linear4bit)  # quantised although not a target
        self.assertNotIsInstance(model[2], Linear4bit)  # the head stays in full precision
        b = state_bytes(base)
        self.assertEqual(b["weight"], n // 2)
        self.assertEqual(b["absmax"], n // 64)
        self.assertEqual(b["absmax2"], 4 * n // 64 // 256)
        self.assertEqual((b["code"], b["code2"], b["offset"]), (16 * 4, 256 * 4, 4))
        self.assertEqual(base.weight.dtype, torch.uint8)
        per_param = sum(b.values()) / n
        self.assertAlmostEqual(per_param, 0.5 + 1 / 64 + 4 / (64 * 256), delta=1e-4)
        # the weight is no parameter any more: only the bias (frozen) and the adapters are
        self.assertEqual({name for name, _ in base.named_parameters()}, {"bias"})
        self.assertIs(model[0].base_layer.code2, model[1].code2)  # one dynamic map

    def test_int8_bytes_are_one_byte_per_weight_plus_fp32_row_scales(self):
        model = on_meta(lambda: nn.Sequential(nn.Linear(2048, 4096), nn.Linear(4096, 10)))
        apply_setup(model, lora={"rank": 8, "target_modules": ["0"], "base_weights": "int8"})
        base = model[0].base_layer
        self.assertIsInstance(base, Linear8bitLt)
        self.assertEqual(state_bytes(base), {"weight": 2048 * 4096, "SCB": 4096 * 4})
        self.assertEqual(base.weight.dtype, torch.int8)

    def test_quantised_model_parameters_shrink(self):
        def build():
            return on_meta(ToyTransformer)

        sizes = {}
        for base in ("same", "int8", "nf4"):
            model = build()
            apply_setup(model, lora={"rank": 2, "target_modules": ["q_proj"], "base_weights": base})
            sizes[base] = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        linear_weights = 4 * (64 * 64 * 2 + 64 * 32 * 2 + 64 * 256 * 2)
        self.assertAlmostEqual(
            sizes["same"] - sizes["int8"], linear_weights * 3, delta=linear_weights * 0.05
        )  # 4 -> 1 byte (+ row scales)
        self.assertAlmostEqual(sizes["same"] - sizes["nf4"], linear_weights * 3.5, delta=linear_weights * 0.05)

    def test_quantised_weights_dequantise_close_to_the_original(self):
        torch.manual_seed(0)
        linear = nn.Linear(256, 96)
        reference = linear.weight.detach().clone()
        nf4 = Linear4bit(linear, _dynamic_map())
        int8 = Linear8bitLt(linear)
        block_absmax = reference.reshape(-1, 64).abs().amax(1, keepdim=True)
        nf4_error = (nf4.dequantize(torch.float32) - reference).reshape(-1, 64).abs()
        # NF4's widest gap is 1 - 0.7230 of the block's absmax: half of it at most, plus the
        # absmax's own 8-bit error
        self.assertTrue(bool((nf4_error <= 0.16 * block_absmax).all()))
        self.assertLess(float(nf4_error.mean() / block_absmax.mean()), 0.06)
        row_absmax = reference.abs().amax(1, keepdim=True)
        int8_error = (int8.dequantize(torch.float32) - reference).abs()
        self.assertTrue(bool((int8_error <= row_absmax / 127 * 0.51).all()))
        x = torch.randn(3, 256)
        torch.testing.assert_close(int8(x), F.linear(x, int8.dequantize(), linear.bias))
        torch.testing.assert_close(nf4(x), F.linear(x, nf4.dequantize(), linear.bias))

    def test_qlora_trains_the_adapters_on_cpu(self):
        for base_weights in ("int8", "nf4"):
            torch.manual_seed(0)
            model = Projection(dim=128)
            apply_setup(
                model,
                lora={"rank": 4, "target_modules": ["big"], "base_weights": base_weights},
                trainable=["inp", "out"],
            )
            x = torch.randn(6, 128)
            model(x).pow(2).mean().backward()
            self.assertIsNotNone(model.big.lora_A.weight.grad)
            self.assertIsNotNone(model.inp.weight.grad)  # grad-input went through the base
            self.assertGreater(float(model.inp.weight.grad.abs().sum()), 0)
            self.assertIsNone(model.big.base_layer.bias.grad)

    def test_nf4_dequantised_weight_is_a_temporary_of_forward_and_backward(self):
        dim, batch = 1024, 4
        model = on_meta(lambda: Projection(dim)).to(torch.bfloat16)
        apply_setup(model, lora={"rank": 8, "target_modules": ["big"], "base_weights": "nf4"}, trainable=["inp", "out"])
        tracker = LiveStorages(model)
        weight16 = dim * dim * 2
        with tracker:
            loss = model(torch.zeros(batch, dim, dtype=torch.bfloat16, device="meta")).sum()
            after_forward = tracker.bytes()
            tracker.phase = "backward"
            loss.backward()
        sizes = [(phase, nbytes) for phase, nbytes, dtype in tracker.born if dtype == torch.bfloat16]
        self.assertIn(("forward", weight16), sizes)  # dequantised for the matmul
        self.assertIn(("backward", weight16), sizes)  # and again for grad-input
        # ... but not kept between the two: what forward leaves is far below one weight
        self.assertLess(after_forward, weight16 / 4)

    def test_nf4_simulated_step_keeps_no_dequantised_weight_as_activation(self):
        dim = 2048
        model = on_meta(lambda: Projection(dim))
        apply_setup(model, lora={"rank": 8, "target_modules": ["big"], "base_weights": "nf4"}, trainable=["inp", "out"])
        sim = simulate_step(model, [dim], 4, optimizer="sgd")
        self.assertLess(sim["breakdown_at_peak"]["activations"], dim * dim * 4 / 8)
        params = sum(rounded(t.numel() * t.element_size()) for t in [*model.parameters(), *model.buffers()])
        self.assertEqual(sim["breakdown_at_peak"]["parameters"], params)

    def test_int8_keeps_the_input_and_quantises_it_in_forward(self):
        dim, batch = 1024, 64
        model = on_meta(lambda: Projection(dim)).to(torch.float16)
        apply_setup(
            model, lora={"rank": 8, "target_modules": ["big"], "base_weights": "int8"}, trainable=["inp", "out"]
        )
        tracker = LiveStorages(model)
        with tracker:
            loss = model(torch.zeros(batch, dim, dtype=torch.float16, device="meta")).sum()
            tracker.phase = "backward"
            loss.backward()
        born = [(p, n, d) for p, n, d in tracker.born]
        self.assertIn(("forward", batch * dim, torch.int8), born)  # int8 rows
        self.assertIn(("forward", batch * dim * 4, torch.int32), born)  # int32 accumulator
        self.assertIn(("backward", dim * dim * 2, torch.float16), born)  # weight rebuilt

    def test_qlora_steps_simulate_in_every_precision(self):
        for base_weights in ("int8", "nf4"):
            for precision in ("fp32", "mixed16"):
                model = on_meta(ToyTransformer)
                apply_setup(
                    model,
                    lora={"rank": 4, "target_modules": "all-linear", "base_weights": base_weights, "dropout": 0.05},
                    activation_checkpointing="full",
                )
                sim = simulate_step(model, [32], 2, torch.int64, precision=precision)
                self.assertGreater(sim["allocated_peak_bytes"], 0)

    @unittest.skipIf(transformers is None, "transformers is not installed")
    def test_hugging_face_quantisation_keeps_the_head_and_tied_weights(self):
        config = transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=300,
        )
        model = on_meta(lambda: transformers.LlamaForCausalLM(config))
        apply_setup(model, lora={"rank": 4, "target_modules": ["q_proj", "v_proj"], "base_weights": "nf4"})
        layer = model.model.layers[0]
        self.assertIsInstance(layer.self_attn.q_proj.base_layer, Linear4bit)
        self.assertIsInstance(layer.self_attn.k_proj, Linear4bit)  # not a target, quantised
        self.assertIsInstance(layer.mlp.down_proj, Linear4bit)
        self.assertNotIsInstance(model.lm_head, Linear4bit)
        gpt2 = on_meta(
            lambda: transformers.GPT2LMHeadModel(
                transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)
            )
        )
        apply_setup(gpt2, lora={"rank": 2, "target_modules": ["c_attn"], "base_weights": "int8"})
        self.assertIsInstance(gpt2.transformer.h[0].mlp.c_fc, Linear8bitLt)
        self.assertEqual(tuple(gpt2.transformer.h[0].mlp.c_fc.weight.shape), (128, 32))
        self.assertIs(gpt2.lm_head.weight, gpt2.transformer.wte.weight)  # still tied

    def test_applying_twice_quantises_no_adapter(self):
        model = on_meta(lambda: nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 4)))
        apply_setup(model, lora={"rank": 2, "target_modules": ["0"], "base_weights": "nf4"})
        apply_setup(model, lora={"rank": 2, "target_modules": ["1"], "base_weights": "nf4"})
        result = apply_setup(model, lora={"rank": 2, "target_modules": ["2"]})
        self.assertNotIsInstance(model[0].lora_A, Linear4bit)
        self.assertIsInstance(model[1].base_layer, Linear4bit)
        self.assertTrue(model[0].lora_A.weight.requires_grad)  # still trained
        self.assertEqual(result["lora_params"], 2 * 2 * (64 + 64) + 2 * (64 + 4))
        self.assertEqual(result["trainable_params"], result["lora_params"])

    def test_a_later_dtype_conversion_keeps_the_quantised_layout(self):
        model = on_meta(lambda: nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 4)))
        apply_setup(model, lora={"rank": 2, "target_modules": ["0"], "base_weights": "nf4"})
        model.to(torch.bfloat16)
        base = model[0].base_layer
        self.assertEqual(base.weight.dtype, torch.uint8)
        self.assertEqual(base.absmax2.dtype, torch.float32)
        self.assertEqual(base.quant_dtype, torch.bfloat16)
        self.assertEqual(model[0].lora_A.weight.dtype, torch.float32)


# ---------------------------------------------------------------------------------------------
# Trainable modules
# ---------------------------------------------------------------------------------------------


class TrainableTest(unittest.TestCase):
    def test_everything_outside_the_prefixes_is_frozen(self):
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(12)])
        result = apply_setup(model, trainable=["1", "11.bias"])
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        self.assertEqual(trained, {"1.weight", "1.bias", "11.bias"})  # "1" is not "11"
        self.assertEqual(result["trainable_params"], 20 + 4)
        self.assertEqual(result["lora_params"], 0)

    def test_frozen_parameters_have_no_gradients_or_optimizer_state_in_a_step(self):
        dim = 512
        model = on_meta(lambda: WideStack(dim=dim, depth=4))
        full = simulate_step(model, [dim], 2)
        apply_setup(model, trainable=["head"])
        head = simulate_step(model, [dim], 2)
        head_bytes = rounded(10 * dim * 4) + rounded(10 * 4)
        self.assertEqual(head["breakdown_at_peak"]["optimizer_state"], 2 * head_bytes)
        self.assertLessEqual(head["breakdown_at_peak"]["gradients"], head_bytes)
        self.assertGreater(full["breakdown_at_peak"]["optimizer_state"], 100 * head_bytes)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


class ValidationTest(unittest.TestCase):
    def assert_refused(self, field, **setup):
        model = on_meta(ToyTransformer)
        before = [(n, type(m)) for n, m in model.named_modules()]
        flags = [p.requires_grad for p in model.parameters()]
        with self.assertRaisesRegex(ValueError, "^" + field.replace(".", r"\.") + ":"):
            apply_setup(model, **setup)
        # nothing changed
        self.assertEqual([(n, type(m)) for n, m in model.named_modules()], before)
        self.assertEqual([p.requires_grad for p in model.parameters()], flags)
        self.assertFalse(any(is_checkpointed(m) for m in model.modules()))

    def test_rank_above_a_targets_smaller_dimension(self):
        self.assert_refused("lora.rank", lora={"rank": 33, "target_modules": ["v_proj"]})
        self.assert_refused("lora.rank", lora={"rank": 0, "target_modules": ["v_proj"]})
        self.assert_refused("lora.rank", lora={"rank": 2.5, "target_modules": ["v_proj"]})
        # 32 is v_proj's output: allowed
        apply_setup(on_meta(ToyTransformer), lora={"rank": 32, "target_modules": ["v_proj"]})

    def test_targets_that_name_no_linear_layer(self):
        self.assert_refused("lora.target_modules", lora={"rank": 2, "target_modules": ["q_proj", "w_proj"]})
        self.assert_refused("lora.target_modules", lora={"rank": 2, "target_modules": ["proj"]})  # no suffix match
        self.assert_refused("lora.target_modules", lora={"rank": 2, "target_modules": ["attn"]})
        self.assert_refused("lora.target_modules", lora={"rank": 2, "target_modules": []})
        self.assert_refused("lora.target_modules", lora={"rank": 2, "target_modules": "nothing"})

    def test_other_lora_fields(self):
        self.assert_refused("lora.base_weights", lora={"rank": 2, "target_modules": ["q_proj"], "base_weights": "fp8"})
        self.assert_refused("lora.dropout", lora={"rank": 2, "target_modules": ["q_proj"], "dropout": 1.0})
        self.assert_refused("lora.alpha", lora={"rank": 2, "target_modules": ["q_proj"], "alpha": -1})
        self.assert_refused("lora.rnak", lora={"rnak": 2, "target_modules": ["q_proj"]})
        self.assert_refused("lora", lora=[2])

    def test_checkpointed_modules_that_name_no_module(self):
        self.assert_refused("activation_checkpointing", activation_checkpointing=["layers.9"])
        self.assert_refused("activation_checkpointing", activation_checkpointing="some")
        with self.assertRaisesRegex(ValueError, "^activation_checkpointing:"):
            apply_setup(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), activation_checkpointing="full")

    def test_trainable_prefixes_that_name_no_module(self):
        self.assert_refused("trainable", trainable=["layers.0", "layer.1"])
        self.assert_refused("trainable", trainable="lm_head")
        self.assert_refused("trainable", trainable={"params": 1000})

    def test_a_refusal_after_valid_fields_changes_nothing(self):
        self.assert_refused(
            "activation_checkpointing",
            lora={"rank": 2, "target_modules": ["q_proj"], "base_weights": "nf4"},
            trainable=["lm_head"],
            activation_checkpointing=["nope"],
        )


# ---------------------------------------------------------------------------------------------
# Activation checkpointing
# ---------------------------------------------------------------------------------------------


class FullCheckpointingRuleTest(unittest.TestCase):
    def test_toy_rules(self):
        self.assertEqual(repeated_blocks(on_meta(ToyTransformer)), [f"layers.{i}" for i in range(4)])
        # a ModuleList inside a block is a part of it: the layers, not the experts
        self.assertEqual(repeated_blocks(MoeModel()), ["layers.0", "layers.1", "layers.2"])
        # stages holding Sequential blocks: block by block (timm's granularity); a stage whose
        # blocks are one (no stack inside) is checkpointed whole
        self.assertEqual(
            repeated_blocks(StagedModel()),
            [
                "stages.0.blocks.0",
                "stages.0.blocks.1",
                "stages.1.blocks.0",
                "stages.1.blocks.1",
                "stages.1.blocks.2",
                "stages.2",
            ],
        )
        # leaves of one class are no blocks
        self.assertEqual(repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))), [])

    @unittest.skipIf(transformers is None, "transformers is not installed")
    def test_hugging_face_llama_and_bert(self):
        llama = on_meta(
            lambda: transformers.LlamaForCausalLM(
                transformers.LlamaConfig(
                    hidden_size=64,
                    intermediate_size=128,
                    num_hidden_layers=3,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    vocab_size=100,
                )
            )
        )
        self.assertEqual(repeated_blocks(llama), [f"model.layers.{i}" for i in range(3)])
        bert = on_meta(
            lambda: transformers.BertForMaskedLM(
                transformers.BertConfig(
                    num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=100
                )
            )
        )
        self.assertEqual(repeated_blocks(bert), ["bert.encoder.layer.0", "bert.encoder.layer.1"])

    @unittest.skipIf(timm is None, "timm is not installed")
    def test_timm_vit_and_resnet(self):
        vit = on_meta(lambda: timm.create_model("vit_tiny_patch16_224"))
        self.assertEqual(repeated_blocks(vit), [f"blocks.{i}" for i in range(12)])
        resnet = on_meta(lambda: timm.create_model("resnet50"))
        expected = [f"layer{s}.{b}" for s, depth in zip(range(1, 5), (3, 4, 6, 3)) for b in range(depth)]
        self.assertEqual(repeated_blocks(resnet), expected)
        result = apply_setup(resnet, activation_checkpointing="full")
        self.assertEqual(result["checkpointed"], expected)
        self.assertTrue(is_checkpointed(resnet.layer3[5]))
        self.assertFalse(is_checkpointed(resnet.layer3))


class CheckpointingTest(unittest.TestCase):
    dim, depth, seq, batch = 256, 6, 128, 8

    def block_input_bytes(self):
        return self.batch * self.seq * self.dim * 4

    def test_simulated_activations_drop_to_block_inputs_plus_one_block(self):
        shape = [self.seq, self.dim]
        plain = simulate_step(on_meta(lambda: WideStack(self.dim, self.depth)), shape, self.batch, optimizer="sgd")
        model = on_meta(lambda: WideStack(self.dim, self.depth))
        result = apply_setup(model, activation_checkpointing="full")
        self.assertEqual(result["checkpointed"], [f"blocks.{i}" for i in range(self.depth)])
        ckpt = simulate_step(model, shape, self.batch, optimizer="sgd")
        inputs = self.block_input_bytes()
        per_block = plain["breakdown_at_peak"]["activations"] / self.depth
        self.assertGreater(per_block, 8 * inputs)  # the toy's physics: blocks keep ~10 inputs
        state = 2 * sum(rounded(p.numel() * 4) for p in model.parameters())  # weights + grads
        # checkpointed: the block inputs, one block recomputed with its gradients' temporaries
        self.assertLess(ckpt["allocated_peak_bytes"], state + self.depth * inputs + 1.5 * per_block)
        self.assertGreater(plain["allocated_peak_bytes"] - ckpt["allocated_peak_bytes"], (self.depth - 3) * per_block)

    def test_block_internals_are_freed_after_forward_and_recomputed_in_backward(self):
        inputs = self.block_input_bytes()
        kept = {}
        for mode in ("none", "full"):
            model = on_meta(lambda: WideStack(self.dim, self.depth))
            apply_setup(model, activation_checkpointing=mode)
            calls = []
            model.blocks[2].fc1.register_forward_hook(lambda *a: calls.append(1))
            tracker = LiveStorages(model)
            x = torch.zeros(self.batch, self.seq, self.dim, device="meta", requires_grad=True)
            with tracker:
                loss = model(x).sum()
                kept[mode] = tracker.bytes()
                tracker.phase = "backward"
                forward_calls = len(calls)
                loss.backward()
            self.assertEqual(forward_calls, 1)
            self.assertEqual(len(calls), 2 if mode == "full" else 1)  # recomputed in backward
            recomputed = sum(n for phase, n, d in tracker.born if phase == "backward")
            kept[mode + "_backward_births"] = recomputed
        # after forward: each block's output (the next one's input), the head's stuff, no more
        self.assertLess(kept["full"], (self.depth + 1.5) * inputs)
        self.assertGreater(kept["none"], 8 * self.depth * inputs)
        # backward allocates each block's internals again
        self.assertGreater(kept["full_backward_births"] - kept["none_backward_births"], self.depth * 8 * inputs)

    def test_gradients_are_unchanged(self):
        torch.manual_seed(0)
        model = WideStack(32, 3)
        twin = copy.deepcopy(model)
        apply_setup(twin, activation_checkpointing="full")
        x = torch.randn(2, 5, 32)
        model(x).square().sum().backward()
        twin(x).square().sum().backward()
        for (name, a), b in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(a.grad, b.grad, msg=name)

    def test_named_modules_are_checkpointed_exactly(self):
        model = on_meta(ToyTransformer)
        result = apply_setup(model, activation_checkpointing=["layers.1", "layers.3.attn"])
        self.assertEqual(result["checkpointed"], ["layers.1", "layers.3.attn"])
        flagged = [n for n, m in model.named_modules() if is_checkpointed(m)]
        self.assertEqual(flagged, ["layers.1", "layers.3.attn"])
        sim = simulate_step(model, [16], 2, torch.int64)
        self.assertGreater(sim["allocated_peak_bytes"], 0)

    def test_wrappers_survive_deep_copies_and_simulate_steps_copy(self):
        model = WideStack(self.dim, self.depth)  # on the CPU: simulate_step copies it to meta
        apply_setup(model, activation_checkpointing="full")
        twin = copy.deepcopy(model)
        self.assertIs(twin.blocks[0].forward.__self__, twin.blocks[0])
        x = torch.randn(2, 3, self.dim)
        torch.testing.assert_close(twin(x), model(x))
        shape = [self.seq, self.dim]
        ckpt = simulate_step(model, shape, self.batch, optimizer="sgd")
        plain = simulate_step(WideStack(self.dim, self.depth), shape, self.batch, optimizer="sgd")
        self.assertLess(ckpt["allocated_peak_bytes"], 0.6 * plain["allocated_peak_bytes"])

    def test_applying_twice_does_not_nest(self):
        model = on_meta(ToyTransformer)
        apply_setup(model, activation_checkpointing="full")
        inner = model.layers[0].__dict__["_gpucast_checkpointed_inner"]
        apply_setup(model, activation_checkpointing="full")
        self.assertIs(model.layers[0].__dict__["_gpucast_checkpointed_inner"], inner)

    def test_lora_inside_checkpointed_blocks(self):
        model = on_meta(ToyTransformer)
        result = apply_setup(
            model, lora={"rank": 4, "target_modules": ["q_proj", "v_proj"]}, activation_checkpointing="full"
        )
        self.assertEqual(len(result["checkpointed"]), 4)
        ckpt = simulate_step(model, [128], 8, torch.int64)
        model = on_meta(ToyTransformer)
        apply_setup(model, lora={"rank": 4, "target_modules": ["q_proj", "v_proj"]})
        plain = simulate_step(model, [128], 8, torch.int64)
        self.assertLess(ckpt["breakdown_at_peak"]["activations"], plain["breakdown_at_peak"]["activations"])


@unittest.skipIf(transformers is None, "transformers is not installed")
class HuggingFaceCheckpointingTest(unittest.TestCase):
    def build(self):
        config = transformers.LlamaConfig(
            hidden_size=128,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
        )
        return on_meta(lambda: transformers.LlamaForCausalLM(config))

    def test_llama_step_with_full_checkpointing(self):
        batch, seq, hidden = 4, 256, 128
        plain = simulate_step(self.build(), [seq], batch, torch.int64)
        model = self.build()
        result = apply_setup(model, activation_checkpointing="full")
        self.assertEqual(result["checkpointed"], [f"model.layers.{i}" for i in range(4)])
        ckpt = simulate_step(model, [seq], batch, torch.int64)
        inputs = batch * seq * hidden * 4
        saved_plain = plain["breakdown_at_peak"]["activations"]
        self.assertGreater(saved_plain, 4 * 10 * inputs)
        self.assertLess(ckpt["allocated_peak_bytes"], plain["allocated_peak_bytes"])
        self.assertLess(ckpt["breakdown_at_peak"]["activations"], saved_plain / 2)

    def test_llama_qlora_step_with_checkpointing_runs(self):
        model = self.build()
        result = apply_setup(
            model,
            lora={"rank": 8, "target_modules": "all-linear", "base_weights": "nf4"},
            activation_checkpointing="full",
        )
        self.assertEqual(result["trainable_params"], result["lora_params"])
        sim = simulate_step(model, [64], 2, torch.int64)
        self.assertGreater(sim["allocated_peak_bytes"], 0)


if __name__ == "__main__":
    unittest.main()
