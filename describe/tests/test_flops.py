"""Per-layer forward FLOPs: FlopCounterMode's counts for one sample, credited to the layer of
the module call that ran them."""

import contextlib
import io
import unittest

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from gpucast_describe import describe_module

try:
    import torchvision
except ImportError:
    torchvision = None


def on_meta(factory):
    with torch.device("meta"):
        return factory()


def describe(model, shape, **kwargs):
    return describe_module(model, shape, batch_size=8, simulation=False, **kwargs)


class SelfAttention(nn.Module):
    """q, k, v from one linear, F.scaled_dot_product_attention, an output projection."""

    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class Functional(nn.Module):
    """A module that owns a weight and uses it functionally: no child, not a known kind."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(16, 8))
        self.inner = nn.Sequential(nn.ReLU())

    def forward(self, x):
        return self.inner(F.linear(x, self.weight))


class LatentQuery(nn.Module):
    """timm's AttentionPoolLatent (SigLIP's head) in small: a learned latent, expanded to the
    batch, is the input of a child linear (a view of a parameter as a module's input)."""

    def __init__(self, dim=8):
        super().__init__()
        self.latent = nn.Parameter(torch.empty(1, 1, dim))
        self.q = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.q(self.latent.expand(x.shape[0], -1, -1))


class FlopsTest(unittest.TestCase):
    def test_a_linear_layer_is_two_flops_per_weight_per_token(self):
        tokens, inputs, outputs = 7, 32, 48
        desc = describe(on_meta(lambda: nn.Linear(inputs, outputs)), [tokens, inputs])
        self.assertEqual(desc["layers"][0]["flops"], 2 * inputs * outputs * tokens)

    def test_a_grouped_convolution(self):
        k, c_in, c_out, groups, size = 3, 16, 32, 4, 20
        model = on_meta(lambda: nn.Conv2d(c_in, c_out, k, stride=2, padding=1, groups=groups))
        desc = describe(model, [c_in, size, size])
        out = (size + 2 - k) // 2 + 1
        self.assertEqual(desc["layers"][0]["flops"], 2 * k * k * c_in * c_out * out * out // groups)

    def test_scaled_dot_product_attention_is_credited_to_the_attention_layer(self):
        n, dim, heads = 10, 64, 4
        desc = describe(on_meta(lambda: SelfAttention(dim, heads)), [n, dim])
        by_name = {layer["name"]: layer for layer in desc["layers"]}
        self.assertEqual(by_name["(root)"]["kind"], "attention")
        # q @ k^T and probabilities @ v: two batched matmuls of heads x n x n x head_dim
        self.assertEqual(by_name["(root)"]["flops"], 2 * 2 * heads * n * n * (dim // heads))
        self.assertEqual(by_name["qkv"]["flops"], 2 * dim * 3 * dim * n)
        self.assertEqual(by_name["proj"]["flops"], 2 * dim * dim * n)

    def test_elementwise_and_norm_layers_count_zero(self):
        model = on_meta(
            lambda: nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU(), nn.Dropout(0.1), nn.BatchNorm1d(8))
        )
        desc = describe(model, [8])
        self.assertEqual([l["flops"] for l in desc["layers"]], [2 * 8 * 8, 0, 0, 0, 0])

    def test_every_call_of_a_shared_module_counts(self):
        class Twice(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 8)

            def forward(self, x):
                return self.fc(self.fc(x))

        desc = describe(on_meta(Twice), [8])
        self.assertEqual([(l["params"], l["flops"]) for l in desc["layers"]], [(72, 128), (0, 128)])

    def test_a_functional_weight_goes_to_its_modules_other_layer(self):
        desc = describe(on_meta(Functional), [8])
        other = [l for l in desc["layers"] if l["kind"] == "other"]
        self.assertEqual([(l["name"], l["params"], l["flops"]) for l in other], [("(root)", 16 * 8, 2 * 16 * 8)])

    def test_flops_are_per_sample_and_the_same_for_every_batch_size(self):
        model = on_meta(lambda: nn.Linear(4, 4))
        small = describe_module(model, [4], batch_size=1, simulation=False)
        large = describe_module(model, [4], batch_size=64, simulation=False)
        self.assertEqual(small["layers"], large["layers"])
        self.assertIsInstance(small["layers"][0]["flops"], int)

    @unittest.skipIf(torchvision is None, "torchvision not installed")
    def test_the_layers_add_up_to_flop_counter_modes_total(self):
        model = on_meta(torchvision.models.resnet18)
        desc = describe(model, [3, 224, 224])
        model.eval()
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(torch.empty(1, 3, 224, 224, device="meta"))
        self.assertEqual(sum(l["flops"] for l in desc["layers"]), counter.get_total_flops())
        # about 1.8 G multiply-adds a 224 px image
        self.assertAlmostEqual(counter.get_total_flops() / 2e9, 1.82, delta=0.01)
        convs = [l for l in desc["layers"] if l["kind"] == "conv2d"]
        self.assertEqual(convs[0]["flops"], 2 * 7 * 7 * 3 * 64 * 112 * 112)

    def test_a_view_of_a_parameter_as_a_modules_input(self):
        # Under no_grad such a view requires grad but has no autograd node: FlopCounterMode's
        # module tracker raised "Expected gradient function to be set" on it (issue 23)
        desc = describe_module(on_meta(LatentQuery), [4, 8], batch_size=2)
        self.assertEqual(
            [(l["name"], l["params"], l["flops"]) for l in desc["layers"]], [("(root)", 8, 0), ("q", 72, 2 * 8 * 8)]
        )
        self.assertIn("simulation", desc)

    def test_flops_are_left_out_when_flop_counter_mode_counts_past_the_hook(self):
        from gpucast_describe import walker

        original = walker._LayerFlopCounter._count_flops
        walker._LayerFlopCounter._count_flops = walker.FlopCounterMode._count_flops
        try:
            with contextlib.redirect_stderr(io.StringIO()) as err:
                desc = describe(on_meta(lambda: nn.Linear(4, 4)), [4])
        finally:
            walker._LayerFlopCounter._count_flops = original
        self.assertNotIn("flops", desc["layers"][0])
        self.assertIn("per-layer flops not counted", err.getvalue())


if __name__ == "__main__":
    unittest.main()
