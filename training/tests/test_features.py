"""Feature extraction vs the golden fixture shared with the Rust service (stdlib only).

Run from the repository root:  python3 -m unittest discover -s training/tests -t training
"""

import json
import math
import os
import unittest

from gpucast_training import features as gf

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


GOLDEN = os.path.join(REPO, "tests", "fixtures", "golden_features.json")
MANIFEST = os.path.join(REPO, "models", "manifest.json")


def load_json(path):
    with open(path) as handle:
        return json.load(handle)


def estimator(manifest, name):
    return next(entry for entry in manifest["estimators"] if entry["name"] == name)


class GoldenFeaturesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.golden = load_json(GOLDEN)
        manifest = load_json(MANIFEST)
        cls.aggregate_entries = estimator(manifest, cls.golden["estimators"]["aggregate"])["input"]["features"]
        sequence_input = estimator(manifest, cls.golden["estimators"]["sequence"])["input"]
        cls.kind_vocab = sequence_input["kind_vocab"]
        cls.token_entries = sequence_input["token_features"]

    def assertClose(self, actual, expected, rel_tol, abs_tol, where):
        self.assertTrue(
            math.isclose(actual, expected, rel_tol=rel_tol, abs_tol=abs_tol), "%s: %r != %r" % (where, actual, expected)
        )

    def test_has_cases(self):
        self.assertGreaterEqual(len(self.golden["cases"]), 10)

    def test_raw_aggregate(self):
        for case in self.golden["cases"]:
            raw = gf.raw_aggregate_features(case["job"])
            self.assertEqual(sorted(raw), sorted(case["raw_aggregate"]), case["name"])
            for name, expected in case["raw_aggregate"].items():
                self.assertClose(raw[name], expected, 1e-9, 0.0, "%s %s" % (case["name"], name))

    def test_normalised_aggregate(self):
        for case in self.golden["cases"]:
            vector = gf.aggregate_vector(case["job"], self.aggregate_entries)
            self.assertEqual(len(vector), len(case["aggregate"]), case["name"])
            for index, (actual, expected) in enumerate(zip(vector, case["aggregate"])):
                self.assertClose(actual, expected, 1e-6, 1e-6, "%s column %d" % (case["name"], index))

    def test_tokens(self):
        for case in self.golden["cases"]:
            self.assertEqual(gf.kind_ids(case["job"], self.kind_vocab), case["kind_ids"], case["name"])
            tokens = gf.token_vectors(case["job"], self.token_entries)
            self.assertEqual(len(tokens), len(case["token_features"]), case["name"])
            for position, (row, expected_row) in enumerate(zip(tokens, case["token_features"])):
                self.assertEqual(len(row), len(expected_row))
                for actual, expected in zip(row, expected_row):
                    self.assertClose(actual, expected, 1e-6, 1e-6, "%s token %d" % (case["name"], position))


class RealGoldenFeaturesTest(unittest.TestCase):
    """The real-model (cnn / transformer) cases and every extra aggregate estimator's vectors."""

    @classmethod
    def setUpClass(cls):
        cls.golden = load_json(GOLDEN)
        cls.manifest = load_json(MANIFEST)

    def test_real_cases(self):
        names = self.golden.get("real_estimators")
        if names is None:
            self.skipTest("no real-model estimators in the fixture")
        self.assertGreaterEqual(len(self.golden["real_cases"]), 5)
        aggregate = estimator(self.manifest, names["aggregate"])["input"]["features"]
        sequence = estimator(self.manifest, names["sequence"])["input"]
        for case in self.golden["real_cases"]:
            raw = gf.raw_aggregate_features(case["job"])
            self.assertEqual(sorted(raw), sorted(case["raw_aggregate"]), case["name"])
            for name, expected in case["raw_aggregate"].items():
                self.assertTrue(math.isclose(raw[name], expected, rel_tol=1e-9), "%s %s" % (case["name"], name))
            for actual, expected in zip(gf.aggregate_vector(case["job"], aggregate), case["aggregate"]):
                self.assertTrue(math.isclose(actual, expected, rel_tol=1e-6, abs_tol=1e-6), case["name"])
            self.assertEqual(gf.kind_ids(case["job"], sequence["kind_vocab"]), case["kind_ids"], case["name"])
            tokens = gf.token_vectors(case["job"], sequence["token_features"])
            self.assertEqual(len(tokens), len(case["token_features"]))
            for row, expected_row in zip(tokens, case["token_features"]):
                for actual, expected in zip(row, expected_row):
                    self.assertTrue(math.isclose(actual, expected, rel_tol=1e-6, abs_tol=1e-6), case["name"])

    def test_extra_aggregate(self):
        for case in self.golden["cases"] + self.golden.get("real_cases", []):
            for name, expected_vector in case.get("extra_aggregate", {}).items():
                entries = estimator(self.manifest, name)["input"]["features"]
                vector = gf.aggregate_vector(case["job"], entries)
                self.assertEqual(len(vector), len(expected_vector), "%s %s" % (case["name"], name))
                for actual, expected in zip(vector, expected_vector):
                    self.assertTrue(
                        math.isclose(actual, expected, rel_tol=1e-6, abs_tol=1e-6), "%s %s" % (case["name"], name)
                    )


class HandCheckedTest(unittest.TestCase):
    def test_kind_aliases(self):
        for spelling, canonical in [
            ("Dense", "linear"),
            ("batch_normalization", "batch_norm"),
            ("BatchNorm1d", "batch_norm"),
            ("BN", "batch_norm"),
            ("batch normalization", "batch_norm"),
            ("LeakyReLU", "leaky_relu"),
            ("leaky-relu", "leaky_relu"),
            ("Swish", "silu"),
            ("SiLU", "silu"),
            ("PReLU", "prelu"),
            ("Identity", "identity"),
            ("Softmax", "softmax"),
        ]:
            self.assertEqual(gf.normalise_kind(spelling), canonical, spelling)
        for spelling, canonical in [
            ("Conv2d", "conv2d"),
            ("conv", "conv2d"),
            ("BatchNorm2d", "batch_norm"),
            ("LayerNorm", "layer_norm"),
            ("MultiheadAttention", "attention"),
            ("ReLU6", "relu6"),
            ("Hardswish", "hardswish"),
            ("DropPath", "drop_path"),
            ("AdaptiveAvgPool2d", "adaptive_avg_pool"),
            ("ConvTranspose2d", "conv_transpose2d"),
        ]:
            self.assertEqual(gf.normalise_kind(spelling), canonical, spelling)
        for kind in gf.ALL_KINDS:
            self.assertEqual(gf.normalise_kind(kind), kind)
        with self.assertRaises(ValueError):
            gf.normalise_kind("conv4d")

    def test_hidden_activation(self):
        self.assertEqual(gf.hidden_activation(["linear", "tanh", "linear", "gelu", "gelu", "tanh"]), "tanh")
        self.assertEqual(gf.hidden_activation(["linear", "gelu", "tanh", "tanh", "softmax", "softmax"]), "tanh")
        self.assertEqual(gf.hidden_activation(["linear", "sigmoid"]), "identity")
        self.assertEqual(gf.hidden_activation(["linear", "softmax"]), "identity")
        self.assertEqual(gf.hidden_activation(["linear"]), "identity")

    def test_aggregate_by_hand(self):
        job = {
            "batch_size": 4,
            "layers": [
                {"kind": "Dense", "output_size": 10, "params": 110},
                {"kind": "bn", "output_size": 10, "params": 20},
                {"kind": "ReLU", "output_size": 10, "params": 0},
                {"kind": "dropout", "output_size": 10, "params": 0},
                {"kind": "linear", "output_size": 3, "params": 33},
                {"kind": "Softmax", "output_size": 3, "params": 0},
            ],
        }
        raw = gf.raw_aggregate_features(job)
        self.assertEqual(list(raw), gf.ALL_AGGREGATE_FEATURES)
        expected = {
            "depth": 2,
            "n_layers": 6,
            "total_params": 163,
            "total_activations": 46,
            "batch_size": 4,
            "activations_x_batch": 184,
            "params_x_batch": 652,
            "max_output_size": 10,
            "n_batch_norm": 1,
            "n_dropout": 1,
            "n_activation": 2,
            "n_norm": 1,
            "act_relu": 1,
            # by kind: linear 10 + 3, batch_norm 10, relu 10 + softmax 3; x batch 4
            "linear_outputs_x_batch": 52,
            "norm_outputs_x_batch": 40,
            "activation_outputs_x_batch": 52,
            "first_principles_mib": 1300 + (163 * 16 + 184 * 4) / 2**20,
            "horus_mib": (163 * 4 + 184 * 4) / 2**20,
        }
        for name in gf.ALL_AGGREGATE_FEATURES:
            self.assertEqual(raw[name], float(expected.get(name, 0)), name)

    def test_analytic_formulas_by_hand(self):
        # The cases of Rust src/physics/analytic.rs: 2^20 params, 2,048 outputs x 256 samples.
        def job(**training):
            body = {
                "batch_size": 256,
                "layers": [
                    {"kind": "linear", "output_size": 1024, "params": 1 << 20},
                    {"kind": "relu", "output_size": 1024, "params": 0},
                ],
            }
            body.update(training)
            return body

        self.assertAlmostEqual(gf.first_principles_mib(job()), 1300 + 16 + 2, places=9)
        self.assertAlmostEqual(gf.first_principles_mib(job(optimizer="adamw", precision="fp32")), 1318, places=9)
        self.assertAlmostEqual(
            gf.first_principles_mib(job(optimizer="SGD", precision="amp_bf16")), 1300 + 10 + 1, places=9
        )
        # Pure bf16: weights and gradients in 2 bytes, Adam's state too.
        self.assertAlmostEqual(gf.first_principles_mib(job(optimizer="SGD", precision="bf16")), 1300 + 4 + 1, places=9)
        self.assertAlmostEqual(gf.first_principles_mib(job(precision="bf16")), 1300 + 8 + 1, places=9)
        self.assertAlmostEqual(gf.first_principles_mib(job(optimizer="momentum")), 1300 + 12 + 2, places=9)
        self.assertAlmostEqual(gf.first_principles_mib(job(precision="mixed16")), 1300 + 18 + 1, places=9)
        self.assertAlmostEqual(gf.horus_mib(job(optimizer="sgd", precision="fp16")), 4 + 2, places=9)
        with self.assertRaises(ValueError):
            gf.first_principles_mib(job(optimizer="lion"))
        with self.assertRaises(ValueError):
            gf.first_principles_mib(job(precision="int4"))

    def test_real_model_counts_by_hand(self):
        raw = gf.raw_aggregate_features(
            {
                "batch_size": 2,
                "input_shape": [3, 32, 32],
                "layers": [
                    {"kind": "Conv2d", "output_size": 100, "params": 10},
                    {"kind": "BatchNorm2d", "output_size": 100, "params": 2},
                    {"kind": "layer_norm", "output_size": 100, "params": 2},
                    {"kind": "attention", "output_size": 100, "params": 5},
                    {"kind": "embedding", "output_size": 100, "params": 5},
                    {"kind": "relu6", "output_size": 100, "params": 0},
                    {"kind": "conv_transpose2d", "output_size": 100, "params": 1},
                ],
            }
        )
        self.assertEqual(
            (raw["n_conv"], raw["n_attention"], raw["n_norm"], raw["n_embedding"], raw["n_batch_norm"]),
            (2.0, 1.0, 2.0, 1.0, 1.0),
        )
        self.assertEqual(raw["input_pixels"], 3072.0)
        self.assertEqual(raw["n_activation"], 1.0)
        # relu6 is the hidden activation but has no one-hot column.
        self.assertEqual(sum(raw["act_" + name] for name in gf.HIDDEN_ACTIVATIONS), 0.0)
        self.assertEqual(
            gf.normalise_job({"batch_size": 1, "layers": [{"kind": "attention", "output_size": 1, "params": 0}]})[
                "family"
            ],
            "transformer",
        )

    def test_no_activation_is_identity(self):
        raw = gf.raw_aggregate_features(
            {"batch_size": 2, "layers": [{"kind": "linear", "output_size": 5, "params": 30}]}
        )
        self.assertEqual(raw["act_identity"], 1.0)
        self.assertEqual(sum(raw["act_" + name] for name in gf.HIDDEN_ACTIVATIONS), 1.0)
        self.assertEqual(raw["n_activation"], 0.0)

    def test_tokens_by_hand(self):
        job = {
            "batch_size": 8,
            "layers": [
                {"kind": "linear", "output_size": 4, "params": 20},
                {"kind": "tanh", "output_size": 4, "params": 0},
                {"kind": "softmax", "output_size": 4, "params": 0},
            ],
        }
        self.assertEqual(gf.kind_ids(job), [1, 13, 15])
        self.assertEqual(
            gf.raw_token_features(job),
            [[4.0, 20.0, 8.0, 32.0, 0.0], [4.0, 0.0, 8.0, 32.0, 0.5], [4.0, 0.0, 8.0, 32.0, 1.0]],
        )
        single = gf.raw_token_features(
            {"batch_size": 1, "layers": [{"kind": "linear", "output_size": 4, "params": 20}]}
        )
        self.assertEqual(single[0][4], 0.0)
        entries = [
            {"name": "output_x_batch", "transform": "log1p", "mean": 1.0, "std": 2.0},
            {"name": "position", "transform": "identity", "mean": 0.0, "std": 1.0},
        ]
        self.assertEqual(gf.token_vectors(job, entries)[1], [(math.log1p(32.0) - 1.0) / 2.0, 0.5])

    def test_simulation_features_by_hand(self):
        mib = 1 << 20
        job = {
            "batch_size": 4,
            "optimizer": "adam",
            "precision": "fp32",
            "layers": [{"kind": "linear", "output_size": 10, "params": 110}],
        }
        raw = gf.raw_aggregate_features(job)
        self.assertEqual([raw[name] for name in gf.SIMULATION_FEATURES], [0.0] * 8)
        job["simulation"] = {
            "batch_size": 4,
            "optimizer": "Adam",
            "precision": "float32",
            "attention": "flash",
            "allocated_peak_bytes": 15 * mib + mib // 2,
            "reserved_peak_bytes": 20 * mib,
            "min_capacity_bytes": 16.0 * mib,
            "breakdown_at_peak": {
                "parameters": mib,
                "gradients": 2 * mib,
                "optimizer_state": 3 * mib,
                "activations": 4 * mib,
                "temporaries": 5 * mib + mib // 2,
            },
        }
        raw = gf.raw_aggregate_features(job)
        self.assertEqual(list(raw), gf.ALL_AGGREGATE_FEATURES)
        self.assertEqual([raw[name] for name in gf.SIMULATION_FEATURES], [15.5, 20.0, 16.0, 1.0, 2.0, 3.0, 4.0, 5.5])
        self.assertEqual(gf.normalise_job(gf.normalise_job(job)), gf.normalise_job(job))

    def test_inconsistent_simulations_are_refused_as_the_service_refuses_them(self):
        base = {"batch_size": 8, "layers": [{"kind": "linear", "output_size": 10, "params": 110}]}
        good = {
            "batch_size": 8,
            "allocated_peak_bytes": 15,
            "reserved_peak_bytes": 40,
            "min_capacity_bytes": 20,
            "breakdown_at_peak": {
                "parameters": 1,
                "gradients": 2,
                "optimizer_state": 3,
                "activations": 4,
                "temporaries": 5,
            },
        }
        gf.normalise_job(dict(base, simulation=good))
        bad = [
            dict(good, batch_size=16),
            dict(good, optimizer="adamw"),
            dict(good, precision="bf16"),
            dict(good, allocated_peak_bytes=41),
            dict(good, min_capacity_bytes=14),
            dict(good, min_capacity_bytes=41),
            dict(good, reserved_peak_bytes=1 << 45),
            dict(good, allocated_peak_bytes=15.5),
            dict(good, breakdown_at_peak=dict(good["breakdown_at_peak"], temporaries=6)),
        ]
        for simulation in bad:
            with self.assertRaises(ValueError, msg=str(simulation)):
                gf.normalise_job(dict(base, simulation=simulation))

    def test_memory_class(self):
        self.assertEqual([gf.memory_class(v) for v in (1, 1000, 1001, 2000, 4925, 5000, 5001)], [0, 0, 1, 1, 4, 4, 5])

    def test_csv_row_to_job(self):
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
                    {"kind": "batch_norm", "output_size": 1173, "params": 2346},
                    {"kind": "relu", "output_size": 1173, "params": 0},
                ],
            },
        )
        self.assertEqual(
            gf.group_key("input:1_output:2_depth:3_batch:996_act:relu.out"), "input:1_output:2_depth:3_act:relu"
        )


if __name__ == "__main__":
    unittest.main()
