import unittest


from gpucast_describe import SpecError, describe_spec, resolve_spec, total_params

try:
    import torchvision  # noqa: F401
except ImportError:
    torchvision = None
try:
    import timm  # noqa: F401
except ImportError:
    timm = None


def param_sum(description):
    return sum(layer["params"] for layer in description["layers"])


@unittest.skipIf(torchvision is None, "torchvision not installed")
class TorchvisionTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.resolved = resolve_spec("torchvision:resnet18")
        cls.desc = describe_spec("torchvision:resnet18", batch_size=32)

    def test_resnet18(self):
        first = self.desc["layers"][0]
        self.assertEqual((first["kind"], first["name"]), ("conv2d", "conv1"))
        self.assertEqual(first["output_size"], 64 * 112 * 112)
        self.assertEqual(first["params"], 64 * 3 * 7 * 7)
        last = self.desc["layers"][-1]
        self.assertEqual((last["kind"], last["output_size"], last["params"]), ("linear", 1000, 512 * 1000 + 1000))
        self.assertEqual(self.desc["family"], "cnn")
        self.assertEqual(self.desc["input_shape"], [3, 224, 224])
        self.assertEqual(self.desc["model"], "torchvision:resnet18")
        self.assertEqual(self.desc["batch_size"], 32)

    def test_params_sum_to_total(self):
        self.assertEqual(param_sum(self.desc), total_params(self.resolved.module))
        self.assertEqual(param_sum(self.desc), 11_689_512)

    def test_built_on_meta(self):
        self.assertTrue(all(p.is_meta for p in self.resolved.module.parameters()))

    def test_input_shape_override(self):
        desc = describe_spec("torchvision:resnet18", input_shape=[3, 64, 64])
        self.assertEqual(desc["layers"][0]["output_size"], 64 * 32 * 32)
        self.assertEqual(desc["input_shape"], [3, 64, 64])

    def test_vit_has_attention(self):
        desc = describe_spec("torchvision:vit_b_16")
        self.assertEqual(desc["family"], "transformer")
        self.assertEqual(sum(l["kind"] == "attention" for l in desc["layers"]), 12)
        self.assertEqual(param_sum(desc), total_params(resolve_spec("torchvision:vit_b_16").module))


@unittest.skipIf(timm is None, "timm not installed")
class TimmTest(unittest.TestCase):
    def test_default_input_size_from_pretrained_cfg(self):
        self.assertEqual(resolve_spec("timm:inception_v3").default_input_shape, [3, 299, 299])
        self.assertEqual(describe_spec("timm:resnet18")["input_shape"], [3, 224, 224])

    def test_vit(self):
        resolved = resolve_spec("timm:vit_tiny_patch16_224")
        desc = describe_spec("timm:vit_tiny_patch16_224")
        self.assertEqual(desc["family"], "transformer")
        attention = [l for l in desc["layers"] if l["kind"] == "attention"]
        self.assertEqual(len(attention), 12)
        self.assertEqual(attention[0]["output_size"], 197 * 192)
        self.assertEqual(param_sum(desc), total_params(resolved.module))
        # cls_token and pos_embed belong to the root module: one extra "other" layer
        root = [l for l in desc["layers"] if l["name"] == "(root)"]
        self.assertEqual(
            root, [{"kind": "other", "output_size": 0, "params": 192 + 197 * 192, "flops": 0, "name": "(root)"}]
        )

    def test_cnn_with_timm_layers(self):
        desc = describe_spec("timm:efficientnet_b0")
        kinds = {l["kind"] for l in desc["layers"]}
        self.assertEqual(desc["family"], "cnn")
        self.assertTrue({"conv2d", "batch_norm", "silu", "sigmoid"} <= kinds, kinds)
        self.assertNotIn("other", kinds)

    def test_batch_norm_after_global_pool(self):
        # BatchNorm1d on a [1, C] input: would fail in training mode with batch 1
        desc = describe_spec("timm:efficientvit_m0")
        self.assertEqual(desc["family"], "transformer")
        self.assertEqual(param_sum(desc), total_params(resolve_spec("timm:efficientvit_m0").module))


class SpecErrorTest(unittest.TestCase):
    def test_bad_specs(self):
        for spec in [
            "resnet18",
            "hub:resnet18",
            "timm:",
            "module:toy_models",
            "module:no_such_module:f",
            "module:toy_models:no_such_factory",
            "module:toy_models:not_a_module",
        ]:
            with self.assertRaises(SpecError, msg=spec):
                describe_spec(spec, input_shape=[3])

    @unittest.skipIf(timm is None, "timm not installed")
    def test_unknown_timm_model(self):
        with self.assertRaises(SpecError):
            resolve_spec("timm:no_such_model_xyz")

    def test_module_needs_input(self):
        with self.assertRaises(SpecError):
            describe_spec("module:toy_models:mlp")
        with self.assertRaises(SpecError):
            describe_spec("module:toy_models:mlp", input_shape=[20], seq_len=4)

    def test_module_factory(self):
        desc = describe_spec("module:toy_models:mlp", batch_size=8, input_shape=[20])
        self.assertEqual(desc["model"], "module:toy_models:mlp")
        self.assertEqual(desc["layers"][0]["output_size"], 30)

    def test_token_model(self):
        desc = describe_spec("module:toy_models:tiny_token_model", seq_len=12)
        self.assertEqual(desc["input_shape"], [12])
        self.assertEqual(desc["family"], "transformer")
        self.assertEqual(desc["layers"][1]["output_size"], 12 * 16)


if __name__ == "__main__":
    unittest.main()
