import ast
import csv
import json
import unittest
from pathlib import Path

from probe.gpucast_probe.generators import (
    ACTIVATIONS,
    JobSpec,
    generate,
    mlp_layers,
    mlp_widths,
    parse_families,
)

SHARED_CSV = Path(__file__).resolve().parents[3] / "shared" / "data" / "gpumemnet_mlp_a100.csv"


class MlpWidths(unittest.TestCase):
    def test_pyramid_halves_down_to_the_output_width(self):
        self.assertEqual(mlp_widths(2346, 197, 2, "pyramid"), [1173, 586])
        self.assertEqual(mlp_widths(1873, 453, 4, "pyramid"), [936, 468, 453, 453])

    def test_gradual_steps_evenly_towards_the_output(self):
        self.assertEqual(mlp_widths(280, 12, 7, "gradual"), [242, 204, 166, 128, 90, 52, 14])
        self.assertEqual(mlp_widths(6, 1, 6, "gradual"), [6] * 6)

    def test_uniform_keeps_the_input_width(self):
        self.assertEqual(mlp_widths(3742, 73, 3, "uniform"), [3742] * 3)

    def test_bottleneck_is_a_pyramid_one_layer_deeper(self):
        self.assertEqual(mlp_widths(591, 45, 2, "bottleneck"), [295, 147, 73])
        self.assertEqual(mlp_widths(25, 1, 7, "bottleneck"), [12, 6, 3, 1, 1, 1, 1, 1])

    def test_layer_list_matches_gpumemnet_accounting(self):
        layers = mlp_layers(2346, 197, [1173, 586], "ReLU", 0.3, True)
        self.assertEqual(layers[0], ("linear", 1173, 2753031))
        self.assertEqual(layers[1], ("batch_normalization", 1173, 2346))
        self.assertEqual(layers[-2], ("linear", 197, 115639))
        self.assertEqual(layers[-1], ("Softmax", 197, 0))

    @unittest.skipUnless(SHARED_CSV.exists(), "shared data not present")
    def test_every_row_of_the_shared_data_is_reproduced(self):
        checked = 0
        with open(SHARED_CSV, newline="") as f:
            for row in csv.DictReader(f):
                name = row["Filename"]
                fields = dict(part.split(":", 1) for part in name[: -len(".out")].split("_") if ":" in part)
                expected = ast.literal_eval(row["Activations-Params"])
                widths = mlp_widths(int(fields["input"]), int(fields["output"]), int(fields["depth"]), fields["arch"])
                act = expected[1 if fields["batchnorm"] == "False" else 2][0]
                dropout = 0.3 if fields["dropout"] == "True" else 0.0
                head = expected[-1][0]
                batchnorm = fields["batchnorm"] == "True"
                layers = mlp_layers(int(fields["input"]), int(fields["output"]), widths, act, dropout, batchnorm, head)
                self.assertEqual([tuple(l) for l in expected], layers, name)
                checked += 1
        self.assertEqual(checked, 3000)


class Generation(unittest.TestCase):
    def test_jobs_are_reproducible_from_the_seed(self):
        a = [s.to_json() for s, _ in zip(generate(["mlp", "cnn", "transformer", "real"], 7), range(20))]
        b = [s.to_json() for s, _ in zip(generate(["mlp", "cnn", "transformer", "real"], 7), range(20))]
        self.assertEqual(a, b)
        c = [s.to_json() for s, _ in zip(generate(["mlp"], 8), range(5))]
        self.assertNotEqual(a[:5], c)

    def test_families_take_turns(self):
        families = [s.family for s, _ in zip(generate(["mlp", "cnn", "transformer"], 1), range(9))]
        self.assertEqual(families, ["mlp", "cnn", "transformer"] * 3)

    def test_generated_jobs_are_within_gpumemnet_ranges(self):
        for spec, _ in zip(generate(["mlp"], 3), range(300)):
            c = spec.config
            self.assertTrue(5 <= c["input_size"] <= 4095)
            self.assertTrue(1 <= c["output_size"] <= 1012)
            self.assertTrue(2 <= spec.depth <= 12)
            self.assertTrue(4 <= spec.batch_size <= 1023)
            self.assertIn(spec.activation, ACTIVATIONS.values())
            self.assertTrue(spec.dropout == 0.0 or 0.1 <= spec.dropout <= 0.5)
            self.assertEqual(spec.total_params, sum(p for _, _, p in spec.layers))

    def test_cnn_and_transformer_layer_lists_are_consistent(self):
        for spec, _ in zip(generate(["cnn", "transformer"], 5), range(100)):
            self.assertTrue(spec.layers)
            self.assertTrue(all(n >= 0 and p >= 0 for _, n, p in spec.layers))
            if spec.family == "cnn":
                self.assertEqual(spec.layers[-1][0], "linear")
                self.assertEqual(spec.layers[-1][1], spec.config["classes"])
                self.assertGreaterEqual(spec.config["image"] // 2 ** spec.config["stages"], 1)
            else:
                c = spec.config
                self.assertEqual(c["d_model"] % c["heads"], 0)
                self.assertEqual(
                    spec.layers[-1], ("linear", c["seq"] * c["vocab"], c["d_model"] * c["vocab"] + c["vocab"])
                )
                attention = [l for l in spec.layers if l[0] == "multihead_attention"]
                self.assertEqual(len(attention), c["layers"])
                self.assertLessEqual(spec.batch_size * c["seq"] * c["vocab"] * 12, 8 * 2**30 * max(1, spec.batch_size))

    def test_real_jobs_name_a_model_and_a_batch(self):
        for spec, _ in zip(generate(["real"], 2), range(20)):
            self.assertIn(spec.config["source"], ("torchvision", "timm"))
            self.assertIn(spec.batch_size, (8, 16, 32, 64, 128))
            self.assertEqual(spec.layers, [])

    def test_specs_survive_a_json_round_trip(self):
        for spec, _ in zip(generate(["mlp", "cnn", "transformer", "real"], 11), range(8)):
            again = JobSpec.from_json(json.loads(json.dumps(spec.to_json())))
            self.assertEqual(again.layers, spec.layers)
            self.assertEqual(again.total_params, spec.total_params)

    def test_families_are_parsed_and_checked(self):
        self.assertEqual(parse_families("mlp, CNN,transformer"), ["mlp", "cnn", "transformer"])
        with self.assertRaises(ValueError):
            parse_families("mlp,rnn")
        with self.assertRaises(ValueError):
            parse_families(" , ")


if __name__ == "__main__":
    unittest.main()
