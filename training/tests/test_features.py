"""What training keeps of the estimators' inputs: the normalisation it fits and the manifest
records, the class bins, the CSV's jobs and group keys (stdlib). The features themselves are the
service's (`gpucast features --batch`: tests/cli/features.rs, tests/api/accuracy.rs; test_service.py).

Run from the repository root:  python3 -m unittest discover -s training/tests -t training
"""

import math
import unittest

from gpucast_training import features as gf


class FeaturesTest(unittest.TestCase):
    def test_normalise_value_transforms_then_standardises(self):
        self.assertAlmostEqual(gf.normalise_value(math.e - 1.0, {"transform": "log1p", "mean": 1.0, "std": 2.0}), 0.0)
        self.assertEqual(gf.normalise_value(5.0, {"transform": "identity", "mean": 1.0, "std": 2.0}), 2.0)
        with self.assertRaises(ValueError):
            gf.apply_transform(1.0, "sqrt")

    def test_every_feature_has_a_default_transform(self):
        self.assertEqual(set(gf.DEFAULT_TRANSFORMS), set(gf.ALL_AGGREGATE_FEATURES))
        self.assertEqual(set(gf.DEFAULT_TOKEN_TRANSFORMS), set(gf.TOKEN_FEATURES))

    def test_memory_class(self):
        self.assertEqual([gf.memory_class(v) for v in (1, 1000, 1001, 2000, 4925, 5000, 5001)], [0, 0, 1, 1, 4, 4, 5])

    def test_csv_row_to_job_keeps_the_csvs_spellings(self):
        row = {
            "Batch Size": "996",
            "Activations-Params": "[('linear', 1173, 2753031), ('batch_normalization', 1173, 2346), ('ReLU', 1173, 0)]",
        }
        self.assertEqual(
            gf.csv_row_to_job(row),
            {
                "family": "mlp",
                "batch_size": 996,
                "layers": [
                    {"kind": "linear", "output_size": 1173, "params": 2753031},
                    {"kind": "batch_normalization", "output_size": 1173, "params": 2346},
                    {"kind": "ReLU", "output_size": 1173, "params": 0},
                ],
            },
        )
        self.assertEqual(
            gf.group_key("input:1_output:2_depth:3_batch:996_act:relu.out"), "input:1_output:2_depth:3_act:relu"
        )


if __name__ == "__main__":
    unittest.main()
