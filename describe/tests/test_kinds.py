import unittest

import torch.nn as nn

from gpucast_describe import CANONICAL_KINDS, is_attention, kind_of
from gpucast_describe.kinds import KIND_BY_CLASS_NAME


class KindTest(unittest.TestCase):
    def test_torch_modules(self):
        cases = {
            nn.Linear(2, 2): "linear",
            nn.Conv1d(1, 1, 1): "conv1d",
            nn.Conv2d(1, 1, 1): "conv2d",
            nn.Conv3d(1, 1, 1): "conv3d",
            nn.ConvTranspose2d(1, 1, 1): "conv_transpose2d",
            nn.BatchNorm1d(2): "batch_norm",
            nn.BatchNorm3d(2): "batch_norm",
            nn.LayerNorm(2): "layer_norm",
            nn.GroupNorm(1, 2): "group_norm",
            nn.InstanceNorm2d(2): "instance_norm",
            nn.RMSNorm(2): "rms_norm",
            nn.Dropout(): "dropout",
            nn.Dropout2d(): "dropout",
            nn.ReLU(): "relu",
            nn.ReLU6(): "relu6",
            nn.LeakyReLU(): "leaky_relu",
            nn.PReLU(): "prelu",
            nn.ELU(): "elu",
            nn.SELU(): "selu",
            nn.GELU(): "gelu",
            nn.SiLU(): "silu",
            nn.Mish(): "mish",
            nn.Softplus(): "softplus",
            nn.Tanh(): "tanh",
            nn.Sigmoid(): "sigmoid",
            nn.Hardswish(): "hardswish",
            nn.Hardsigmoid(): "hardsigmoid",
            nn.Softmax(dim=1): "softmax",
            nn.Identity(): "identity",
            nn.MaxPool2d(2): "max_pool",
            nn.AvgPool2d(2): "avg_pool",
            nn.AdaptiveAvgPool2d(1): "adaptive_avg_pool",
            nn.AdaptiveMaxPool2d(1): "adaptive_max_pool",
            nn.Embedding(3, 2): "embedding",
            nn.MultiheadAttention(4, 2): "attention",
            nn.Flatten(): "flatten",
            nn.Upsample(scale_factor=2): "upsample",
            nn.Sequential(): "other",
            nn.PixelShuffle(2): "other",
        }
        for module, kind in cases.items():
            self.assertEqual(kind_of(module), kind, type(module).__name__)

    def test_subclasses_and_name_patterns(self):
        class MyConv(nn.Conv2d):
            pass

        class FancyBatchNorm(nn.Module):
            pass

        class BertSelfAttention(nn.Module):
            pass

        self.assertEqual(kind_of(MyConv(1, 1, 1)), "conv2d")
        self.assertEqual(kind_of(FancyBatchNorm()), "batch_norm")
        self.assertEqual(kind_of(BertSelfAttention()), "attention")
        self.assertTrue(is_attention(BertSelfAttention()))
        self.assertFalse(is_attention(nn.Linear(1, 1)))

    def test_table_is_canonical(self):
        self.assertEqual(len(CANONICAL_KINDS), 37)
        self.assertLessEqual(set(KIND_BY_CLASS_NAME.values()), set(CANONICAL_KINDS))


try:
    import timm.layers as timm_layers
except ImportError:  # timm is an optional extra
    timm_layers = None


@unittest.skipIf(timm_layers is None, "timm not installed")
class TimmKindTest(unittest.TestCase):
    def test_timm_layers(self):
        cases = {
            timm_layers.BatchNormAct2d(4): "batch_norm",
            timm_layers.DropPath(0.1): "drop_path",
            timm_layers.StdConv2d(1, 1, 1): "conv2d",
            timm_layers.LayerNorm2d(4): "layer_norm",
            timm_layers.RmsNorm(4): "rms_norm",
            timm_layers.GroupNorm1(4): "group_norm",
            timm_layers.activations.Swish(): "silu",
            timm_layers.activations.HardSwish(): "hardswish",
            timm_layers.activations.HardSigmoid(): "hardsigmoid",
            timm_layers.activations.GELUTanh(): "gelu",
            timm_layers.Attention(8): "attention",
        }
        for module, kind in cases.items():
            self.assertEqual(kind_of(module), kind, type(module).__name__)


if __name__ == "__main__":
    unittest.main()
