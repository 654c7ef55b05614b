import json
import os
import subprocess
import sys
import unittest

from _paths import PACKAGE_ROOT, TESTS_DIR

try:
    import torchvision  # noqa: F401
except ImportError:
    torchvision = None


def run_cli(*args):
    """Run ``python -m gpucast_describe`` from the tests folder (so toy_models is importable)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run(
        [sys.executable, "-m", "gpucast_describe", *args],
        cwd=TESTS_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def lines(stdout):
    return [json.loads(line) for line in stdout.splitlines()]


class CliTest(unittest.TestCase):
    def test_single_body_is_one_line(self):
        result = run_cli("module:toy_models:mlp", "--batch-size", "16", "--input-shape", "20")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stdout.count("\n"), 1)
        [body] = lines(result.stdout)
        self.assertEqual(body["batch_size"], 16)
        self.assertEqual(body["family"], "mlp")
        self.assertEqual(
            [l["kind"] for l in body["layers"]], ["linear", "batch_norm", "relu", "dropout", "linear", "softmax"]
        )

    def test_json_lines_spec_major(self):
        result = run_cli(
            "module:toy_models:tiny_cnn",
            "module:toy_models:mlp",
            "--batch-size",
            "8",
            "16",
            "32",
            "--input-shape",
            "3,8,8",
        )
        # the mlp takes 20 features, not a 3x8x8 image: one spec fails, the other prints
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("module:toy_models:mlp", result.stderr)
        bodies = lines(result.stdout)
        self.assertEqual(
            [(b["model"], b["batch_size"]) for b in bodies], [("module:toy_models:tiny_cnn", n) for n in (8, 16, 32)]
        )
        self.assertEqual(bodies[0]["layers"], bodies[2]["layers"])

    def test_saved_tensors_in_every_body(self):
        result = run_cli("module:toy_models:small_mlp", "--batch-size", "2", "32", "--input-shape", "10")
        self.assertEqual(result.returncode, 0, result.stderr)
        for body in lines(result.stdout):
            self.assertEqual(body["saved_tensors"], {"per_sample_bytes": 120, "fixed_bytes": 0})

    def test_untraceable_saved_tensors_warn_and_still_print(self):
        result = run_cli("module:toy_models:grad_refusing", "--batch-size", "4", "--input-shape", "4")
        self.assertEqual(result.returncode, 0, result.stderr)
        [body] = lines(result.stdout)
        self.assertNotIn("saved_tensors", body)
        self.assertEqual([l["kind"] for l in body["layers"]], ["linear"])
        self.assertNotIn("simulation", body)
        # one warning for the saved-tensor trace, one for the simulated step
        traced, simulated = result.stderr.splitlines()
        self.assertTrue(traced.startswith("warning: module:toy_models:grad_refusing: "), traced)
        self.assertIn("simulation not run at batch 4", simulated)

    def test_each_body_carries_the_simulation_of_its_batch(self):
        result = run_cli(
            "module:toy_models:small_mlp", "--batch-size", "2", "32", "--input-shape", "10", "--optimizer", "sgd"
        )
        self.assertEqual(result.returncode, 0, result.stderr)
        bodies = lines(result.stdout)
        self.assertEqual([b["simulation"]["batch_size"] for b in bodies], [2, 32])
        self.assertEqual({b["optimizer"] for b in bodies}, {"sgd"})
        self.assertEqual({b["simulation"]["optimizer"] for b in bodies}, {"sgd"})

    def test_no_simulation_flag(self):
        result = run_cli("module:toy_models:small_mlp", "--batch-size", "2", "--input-shape", "10", "--no-simulation")
        self.assertEqual(result.returncode, 0, result.stderr)
        [body] = lines(result.stdout)
        self.assertNotIn("simulation", body)
        self.assertIn("saved_tensors", body)

    @unittest.skipIf(torchvision is None, "torchvision not installed")
    def test_several_specs_and_batch_sizes(self):
        result = run_cli(
            "torchvision:resnet18", "module:toy_models:tiny_cnn", "--batch-size", "8", "32", "--input-shape", "3,32,32"
        )
        self.assertEqual(result.returncode, 0, result.stderr)
        bodies = lines(result.stdout)
        self.assertEqual(
            [(b["model"], b["batch_size"]) for b in bodies],
            [
                ("torchvision:resnet18", 8),
                ("torchvision:resnet18", 32),
                ("module:toy_models:tiny_cnn", 8),
                ("module:toy_models:tiny_cnn", 32),
            ],
        )
        self.assertEqual(bodies[0]["layers"][0]["output_size"], 64 * 16 * 16)

    def test_batch_body_holds_every_job_as_items(self):
        result = run_cli(
            "module:toy_models:mlp", "--batch-size", "2", "32", "--input-shape", "20", "--no-simulation", "--batch-body"
        )
        self.assertEqual(result.returncode, 0, result.stderr)
        bodies = lines(result.stdout)
        self.assertEqual(len(bodies), 1)
        self.assertEqual(list(bodies[0]), ["items"])
        self.assertEqual(
            [(b["model"], b["batch_size"]) for b in bodies[0]["items"]],
            [("module:toy_models:mlp", 2), ("module:toy_models:mlp", 32)],
        )

    @unittest.skipIf(torchvision is None, "torchvision not installed")
    def test_torchvision_default_input(self):
        result = run_cli("torchvision:resnet18", "--batch-size", "4")
        self.assertEqual(result.returncode, 0, result.stderr)
        [body] = lines(result.stdout)
        self.assertEqual(body["input_shape"], [3, 224, 224])
        self.assertEqual(body["layers"][0]["output_size"], 64 * 112 * 112)

    def test_seq_len(self):
        result = run_cli("module:toy_models:tiny_token_model", "--batch-size", "2", "--seq-len", "7")
        self.assertEqual(result.returncode, 0, result.stderr)
        [body] = lines(result.stdout)
        self.assertEqual(body["input_shape"], [7])
        self.assertEqual(body["family"], "transformer")

    def test_errors(self):
        for args in [
            ("nope:thing", "--batch-size", "1"),
            ("module:toy_models:mlp", "--batch-size", "1"),  # no input shape
            ("module:toy_models:mlp", "--batch-size", "0", "--input-shape", "20"),
            ("module:toy_models:mlp", "--input-shape", "20"),  # no batch size
            ("module:toy_models:mlp", "--batch-size", "1", "--input-shape", "a,b"),
            ("module:toy_models:mlp", "--batch-size", "1", "--input-shape", "20", "--seq-len", "3"),
        ]:
            result = run_cli(*args)
            self.assertNotEqual(result.returncode, 0, args)
            self.assertEqual(result.stdout, "", args)
            self.assertTrue(result.stderr.strip(), args)


if __name__ == "__main__":
    unittest.main()
