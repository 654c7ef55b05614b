import contextlib
import io
import math
import unittest

import torch
import torch.nn as nn

import toy_models
from gpucast_describe import (
    CANONICAL_KINDS,
    describe_module,
    infer_family,
    total_params,
    trace_saved_tensors,
    with_batch_size,
)

try:
    import torchvision
except ImportError:
    torchvision = None


def on_meta(factory):
    with torch.device("meta"):
        return factory()


def param_sum(description):
    return sum(layer["params"] for layer in description["layers"])


class MlpTest(unittest.TestCase):
    def setUp(self):
        self.model = on_meta(toy_models.mlp)
        self.desc = describe_module(self.model, [20], batch_size=64, name="toy:mlp")

    def test_layers_in_execution_order(self):
        self.assertEqual(
            [(l["kind"], l["output_size"], l["params"], l["name"]) for l in self.desc["layers"]],
            [
                ("linear", 30, 20 * 30 + 30, "0"),
                ("batch_norm", 30, 60, "1"),
                ("relu", 30, 0, "2"),
                ("dropout", 30, 0, "3"),
                ("linear", 5, 30 * 5 + 5, "4"),
                ("softmax", 5, 0, "5"),
            ],
        )

    def test_top_level_fields(self):
        self.assertEqual(
            list(self.desc),
            [
                "model",
                "family",
                "batch_size",
                "input_shape",
                "layers",
                "saved_tensors",
                "optimizer",
                "precision",
                "simulation",
            ],
        )
        self.assertEqual(self.desc["model"], "toy:mlp")
        self.assertEqual(self.desc["family"], "mlp")
        self.assertEqual(self.desc["batch_size"], 64)
        self.assertEqual(self.desc["input_shape"], [20])

    def test_params_sum_to_total(self):
        self.assertEqual(param_sum(self.desc), total_params(self.model))

    def test_batch_independent(self):
        other = describe_module(self.model, [20], batch_size=1, name="toy:mlp")
        self.assertEqual(other["layers"], self.desc["layers"])

    def test_model_name_defaults_to_class(self):
        self.assertEqual(describe_module(self.model, [20], 1)["model"], "Sequential")

    def test_family_override(self):
        self.assertEqual(describe_module(self.model, [20], 1, family="cnn")["family"], "cnn")

    def test_rejects_bad_sizes(self):
        with self.assertRaises(ValueError):
            describe_module(self.model, [20], 0)
        with self.assertRaises(ValueError):
            describe_module(self.model, [0], 1)


class ParameterAttributionTest(unittest.TestCase):
    def setUp(self):
        self.model = on_meta(toy_models.shared_and_owned)
        self.desc = describe_module(self.model, [8], batch_size=4)

    def test_one_layer_per_call_params_counted_once(self):
        self.assertEqual(
            [(l["kind"], l["output_size"], l["params"], l["name"]) for l in self.desc["layers"]],
            [
                ("other", 0, 8, "(root)"),  # the root's own parameter, where it is called
                ("linear", 8, 72, "fc"),
                ("gelu", 8, 0, "act"),
                ("linear", 8, 0, "fc"),  # second call of the same module
                ("other", 0, 27, "unused"),
            ],
        )  # never called: its params still count

    def test_params_sum_to_total(self):
        self.assertEqual(param_sum(self.desc), total_params(self.model))


class TokenModelTest(unittest.TestCase):
    def setUp(self):
        self.model = on_meta(toy_models.tiny_token_model)
        self.desc = describe_module(self.model, [10], batch_size=2, input_dtype=torch.int64)

    def test_attention_layers_and_children(self):
        rows = [(l["kind"], l["name"]) for l in self.desc["layers"]]
        self.assertEqual(
            rows,
            [
                ("other", "(root)"),
                ("embedding", "embed"),
                ("attention", "attn"),
                ("linear", "attn.qkv"),
                ("linear", "attn.proj"),
                ("attention", "mha"),
                ("layer_norm", "norm"),
                ("linear", "head"),
                ("other", "mha.out_proj"),  # nn.MultiheadAttention uses it functionally
            ],
        )
        sizes = {l["name"]: l["output_size"] for l in self.desc["layers"]}
        self.assertEqual(sizes["embed"], 10 * 16)
        self.assertEqual(sizes["attn"], 10 * 16)
        self.assertEqual(sizes["attn.qkv"], 10 * 48)
        self.assertEqual(sizes["mha"], 10 * 16)  # (output, None)
        self.assertEqual(sizes["head"], 10 * 100)

    def test_family_and_params(self):
        self.assertEqual(self.desc["family"], "transformer")
        self.assertEqual(param_sum(self.desc), total_params(self.model))
        mha = next(l for l in self.desc["layers"] if l["name"] == "mha")
        self.assertEqual(mha["params"], 3 * 16 * 16 + 3 * 16)  # in_proj weight and bias


class CnnTest(unittest.TestCase):
    def test_kinds_sizes_family(self):
        desc = describe_module(on_meta(toy_models.tiny_cnn), [3, 16, 16], batch_size=1)
        self.assertEqual(desc["family"], "cnn")
        self.assertEqual(
            [(l["kind"], l["output_size"]) for l in desc["layers"]],
            [
                ("conv2d", 8 * 16 * 16),
                ("batch_norm", 8 * 16 * 16),
                ("relu6", 8 * 16 * 16),
                ("max_pool", 8 * 8 * 8),
                ("conv2d", 4 * 8 * 8),
                ("hardswish", 4 * 8 * 8),
                ("adaptive_avg_pool", 4),
                ("flatten", 4),
                ("linear", 2),
            ],
        )


class NonMetaModuleTest(unittest.TestCase):
    def test_cpu_module_is_copied_and_left_alone(self):
        model = toy_models.mlp()  # real CPU weights
        desc = describe_module(model, [20], batch_size=1)
        self.assertEqual(param_sum(desc), total_params(model))
        self.assertFalse(next(model.parameters()).is_meta)
        self.assertEqual(len(model._forward_hooks) + len(model[0]._forward_pre_hooks), 0)

    def test_hooks_removed_and_mode_restored(self):
        model = on_meta(toy_models.mlp).eval()
        describe_module(model, [20], batch_size=1)
        self.assertFalse(model.training)
        for module in model.modules():
            self.assertFalse(module._forward_hooks)
            self.assertFalse(module._forward_pre_hooks)


FP32, INT64 = 4, 8


class SavedTensorsTest(unittest.TestCase):
    def test_small_mlp_by_hand(self):
        # Linear(10, 20) saves its input (the model input: 10 floats a sample), ReLU its output
        # (20 floats), Linear(20, 3) the ReLU output again (same storage, counted once); the
        # weights they save are parameters, left out. Nothing is independent of the batch.
        saved = trace_saved_tensors(on_meta(toy_models.small_mlp), [10])
        self.assertEqual(saved, {"per_sample_bytes": (10 + 20) * FP32, "fixed_bytes": 0})

    def test_in_every_description_and_batch_independent(self):
        model = on_meta(toy_models.small_mlp)
        desc = describe_module(model, [10], batch_size=64)
        self.assertEqual(desc["saved_tensors"], {"per_sample_bytes": 120, "fixed_bytes": 0})
        self.assertEqual(describe_module(model, [10], batch_size=1)["saved_tensors"], desc["saved_tensors"])
        self.assertEqual(with_batch_size(desc, 8)["saved_tensors"], desc["saved_tensors"])
        self.assertIsInstance(desc["saved_tensors"]["per_sample_bytes"], int)
        self.assertIsInstance(desc["saved_tensors"]["fixed_bytes"], int)

    def test_layers_unchanged_by_the_trace(self):
        model = on_meta(toy_models.mlp)
        desc = describe_module(model, [20], batch_size=1)
        self.assertEqual(
            [(l["kind"], l["output_size"], l["params"]) for l in desc["layers"]],
            [
                ("linear", 30, 630),
                ("batch_norm", 30, 60),
                ("relu", 30, 0),
                ("dropout", 30, 0),
                ("linear", 5, 155),
                ("softmax", 5, 0),
            ],
        )

    def test_mlp_with_norm_and_dropout(self):
        # Per sample: linear input 20, batch norm input 30, relu output 30, dropout's scaled
        # noise 30 (meta takes the non-fused path: a float mask), linear input 30, softmax
        # output 5 floats. Fixed: the batch norm's mean and inverse std (30 floats each); its
        # running statistics are buffers, left out like the parameters.
        saved = trace_saved_tensors(on_meta(toy_models.mlp), [20])
        self.assertEqual(saved, {"per_sample_bytes": (20 + 30 + 30 + 30 + 30 + 5) * FP32, "fixed_bytes": 2 * 30 * FP32})

    def test_token_ids(self):
        # The embedding saves the int64 ids (the input can't require grad, its weight does),
        # the linear the embeddings (16 floats a token).
        saved = trace_saved_tensors(on_meta(toy_models.token_linear), [10], torch.int64)
        self.assertEqual(saved, {"per_sample_bytes": 10 * (INT64 + 16 * FP32), "fixed_bytes": 0})

    def test_token_model_description(self):
        desc = describe_module(on_meta(toy_models.tiny_token_model), [10], batch_size=2, input_dtype=torch.int64)
        saved = desc["saved_tensors"]
        # at least the ids and one float activation per token
        self.assertGreater(saved["per_sample_bytes"], 10 * (INT64 + 16 * FP32))
        self.assertGreaterEqual(saved["fixed_bytes"], 0)

    def test_training_flags_restored(self):
        model = on_meta(toy_models.mlp).eval()
        model[3].train()
        trace_saved_tensors(model, [20])
        self.assertEqual([m.training for m in model.modules()], [False, False, False, False, True, False, False])

    def test_cpu_module_left_alone(self):
        model = toy_models.small_mlp()
        self.assertEqual(trace_saved_tensors(model, [10])["per_sample_bytes"], 120)
        self.assertFalse(next(model.parameters()).is_meta)

    def test_failure_omits_the_field(self):
        model = on_meta(toy_models.grad_refusing)
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            desc = describe_module(model, [4], batch_size=3, name="toy:refusing")
        self.assertNotIn("saved_tensors", desc)
        self.assertEqual([l["kind"] for l in desc["layers"]], ["linear"])
        self.assertNotIn("simulation", desc)
        lines = stderr.getvalue().splitlines()
        self.assertEqual(len(lines), 2)  # the saved-tensor trace, then the simulated step
        self.assertIn("toy:refusing", lines[0])
        self.assertIn("NotImplementedError", lines[0])
        self.assertIn("simulation not run", lines[1])
        self.assertTrue(model.training)

    @unittest.skipIf(torchvision is None, "torchvision not installed")
    def test_resnet18(self):
        model = on_meta(torchvision.models.resnet18)
        saved = trace_saved_tensors(model, [3, 224, 224])
        # about 21 MiB a sample at 224x224 fp32; the fixed part is the batch norms' statistics
        self.assertGreater(saved["per_sample_bytes"], 15 * 2**20)
        self.assertLess(saved["per_sample_bytes"], 30 * 2**20)
        self.assertLess(saved["fixed_bytes"], 2**20)
        # activations scale with the image area
        small = trace_saved_tensors(model, [3, 112, 112])
        self.assertAlmostEqual(small["per_sample_bytes"] / saved["per_sample_bytes"], 0.25, delta=0.02)


class EfficientAttentionTest(unittest.TestCase):
    """F.scaled_dot_product_attention is traced as CUDA's memory-efficient kernel runs it."""

    DIM, HEADS = 32, 4

    def trace(self, n, **options):
        model = on_meta(lambda: toy_models.SdpaBlock(self.DIM, self.HEADS, **options))
        return trace_saved_tensors(model, [n, self.DIM])

    def per_token_bytes(self, n):
        # Per sample: the model input (qkv's input), the qkv output (q, k and v are views of
        # it: one storage), the attention output (the proj's input is a view of it: its
        # [B, N, heads, d] layout makes transpose + reshape free) and the log-sum-exp (heads x
        # N rounded up to 32) in fp32. No heads x N x N probabilities.
        return (n * self.DIM + n * 3 * self.DIM + n * self.DIM + self.HEADS * math.ceil(n / 32) * 32) * FP32

    PHILOX = 2 * INT64  # the kernel's dropout seed and offset, saved with it (batch-independent)

    def test_by_hand(self):
        for n in (60, 64, 128):
            self.assertEqual(self.trace(n), {"per_sample_bytes": self.per_token_bytes(n), "fixed_bytes": self.PHILOX})

    def test_linear_in_sequence_length(self):
        ratio = self.trace(128)["per_sample_bytes"] / self.trace(64)["per_sample_bytes"]
        self.assertAlmostEqual(ratio, 2.0, delta=0.05)  # not ~4: nothing N x N is kept

    def test_masks(self):
        # A boolean mask becomes an additive fp32 mask, saved with the kernel; one whose row
        # stride is not a multiple of 8 (N = 60) is padded to 64 columns first, as on a GPU.
        for mask in ("bool", "bias"):
            self.assertEqual(
                self.trace(64, mask=mask),
                {"per_sample_bytes": self.per_token_bytes(64), "fixed_bytes": self.PHILOX + 64 * 64 * FP32},
            )
            self.assertEqual(
                self.trace(60, mask=mask),
                {"per_sample_bytes": self.per_token_bytes(60), "fixed_bytes": self.PHILOX + 60 * 64 * FP32},
            )

    def test_refused_inputs_take_the_normal_call(self):
        # enable_gqa and a mask not contiguous in its last dimension: the memory-efficient
        # kernel refuses them (a GPU takes the math path too), the trace does not fail, and
        # the N x N probabilities are kept.
        for options in ({"gqa": True}, {"mask": "transposed"}):
            small, large = self.trace(64, **options), self.trace(128, **options)
            self.assertIsNotNone(small, options)
            self.assertGreater(large["per_sample_bytes"] / small["per_sample_bytes"], 3.0)

    def test_only_during_the_trace(self):
        def plain_call():
            q, k, v = (torch.empty(2, 4, 64, 8, device="meta", requires_grad=True) for _ in range(3))
            return type(nn.functional.scaled_dot_product_attention(q, k, v).grad_fn).__name__

        before = plain_call()
        self.assertNotIn("Efficient", before)
        with contextlib.redirect_stderr(io.StringIO()):  # a trace that raises
            self.assertIsNone(trace_saved_tensors(on_meta(toy_models.grad_refusing), [4]))
        self.trace(64)
        self.assertEqual(plain_call(), before)
        # the layer walk (no autograd) sees the module calls as before
        desc = describe_module(on_meta(toy_models.sdpa_block), [64, self.DIM], batch_size=1)
        self.assertEqual(
            [(l["kind"], l["output_size"]) for l in desc["layers"]],
            [("linear", 64 * 3 * self.DIM), ("linear", 64 * self.DIM)],
        )
        self.assertEqual(desc["saved_tensors"]["per_sample_bytes"], self.per_token_bytes(64))


class FamilyTest(unittest.TestCase):
    def test_infer_family(self):
        layer = lambda kind: {"kind": kind, "output_size": 1, "params": 0}  # noqa: E731
        self.assertEqual(infer_family([layer("linear"), layer("relu")]), "mlp")
        self.assertEqual(infer_family([layer("conv1d"), layer("linear")]), "cnn")
        self.assertEqual(infer_family([layer("conv2d"), layer("attention")]), "transformer")
        self.assertEqual(infer_family([]), "mlp")

    def test_emitted_kinds_are_canonical(self):
        for factory, shape, dtype in [
            (toy_models.mlp, [20], torch.float32),
            (toy_models.tiny_token_model, [5], torch.int64),
            (toy_models.tiny_cnn, [3, 8, 8], torch.float32),
        ]:
            desc = describe_module(on_meta(factory), shape, 1, input_dtype=dtype)
            for layer in desc["layers"]:
                self.assertIn(layer["kind"], CANONICAL_KINDS)


if __name__ == "__main__":
    unittest.main()
