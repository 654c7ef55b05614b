"""The training package's paths and shared constants (stdlib only).

Run from the repository root:  python3 -m unittest discover -s training/tests -t training
"""

import json
import os
import tempfile
import unittest
from unittest import mock

from gpucast_training import constants
from gpucast_training import data

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


ENV = ("GPUCAST_DATA_DIR", "GPUCAST_OUT_DIR", "GPUCAST_MLP_CSV", "GPUCAST_TIMM_CSV", "GPUCAST_PUBLIC_CSV")


def clean_env(**values):
    env = {k: v for k, v in os.environ.items() if k not in ENV}
    env.update(values)
    return mock.patch.dict(os.environ, env, clear=True)


class LayoutTest(unittest.TestCase):
    def test_defaults_are_relative_to_the_repository(self):
        with clean_env():
            layout = data.Layout()
        shared = os.path.normpath(os.path.join(REPO, "..", "shared", "data"))
        self.assertEqual(data.REPO, REPO)
        self.assertEqual(layout.data_dir, shared)
        self.assertEqual(layout.out_dir, REPO)
        self.assertEqual(layout.mlp_csv, os.path.join(shared, "gpumemnet_mlp_a100.csv"))
        self.assertEqual(layout.timm_csv, os.path.join(shared, "timm_a100_train.csv"))

    def test_environment_and_arguments(self):
        with clean_env(GPUCAST_DATA_DIR="/d", GPUCAST_TIMM_CSV="/t.csv"):
            layout = data.Layout()
            self.assertEqual(layout.mlp_csv, "/d/gpumemnet_mlp_a100.csv")
            self.assertEqual(layout.timm_csv, "/t.csv")
            layout = data.Layout(data_dir="/e", timm_csv="/u.csv")
            self.assertEqual((layout.mlp_csv, layout.timm_csv), ("/e/gpumemnet_mlp_a100.csv", "/u.csv"))

    def test_outputs_go_to_the_out_dir_and_inputs_fall_back_to_the_repository(self):
        with tempfile.TemporaryDirectory() as out, clean_env():
            layout = data.Layout(out_dir=out)
            manifest = ("models", "manifest.json")
            self.assertEqual(layout.read(*manifest), os.path.join(REPO, *manifest))
            path = layout.out(*manifest)
            self.assertEqual(path, os.path.join(out, *manifest))
            self.assertTrue(os.path.isdir(os.path.join(out, "models")))
            with open(path, "w") as handle:
                handle.write("{}")
            self.assertEqual(layout.read(*manifest), path)

    def test_gzip_layouts_are_byte_stable(self):
        rows = [{"id": i, "x": [i] * 3} for i in range(50)]
        with tempfile.TemporaryDirectory() as out:
            for one_write in (False, True):
                first, second = os.path.join(out, "a.jsonl.gz"), os.path.join(out, "b", "a.jsonl.gz")
                os.makedirs(os.path.dirname(second), exist_ok=True)
                data.write_jsonl_gz(first, rows, one_write)
                data.write_jsonl_gz(second, rows, one_write)
                with open(first, "rb") as a, open(second, "rb") as b:
                    self.assertEqual(a.read(), b.read())
                self.assertEqual(data.read_jsonl_gz(first), rows)


class ConstantsTest(unittest.TestCase):
    def test_the_manifest_has_the_shared_constants(self):
        with open(os.path.join(REPO, "models", "manifest.json")) as handle:
            manifest = json.load(handle)
        for entry in manifest["estimators"]:
            if entry["family"] == "mlp" and "class_bins_mib" in entry:
                self.assertEqual(entry["class_bins_mib"], constants.MLP_CLASS_BINS_MIB, entry["name"])
            elif "class_bins_mib" in entry:
                self.assertEqual(entry["class_bins_mib"], constants.REAL_CLASS_BINS_MIB, entry["name"])
            if "capacity_mib" in entry:
                self.assertEqual(entry["capacity_mib"], constants.CAPACITY_MIB, entry["name"])
            self.assertEqual(entry["version"], constants.VERSION)
        self.assertEqual(manifest["split"]["seed"], constants.SEED)
        self.assertEqual(manifest["split"]["folds"], constants.MLP_FOLDS)
        self.assertEqual(manifest["split_real"]["seed"], constants.SEED)
        self.assertEqual(manifest["split_real"]["folds"], constants.REAL_FOLDS)


if __name__ == "__main__":
    unittest.main()
