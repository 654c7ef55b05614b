"""The manifest's `runtime` field and the in-process estimators' weights: what the training
side writes and checks before writing the manifest (stdlib only; converting a graph needs
`onnx`, and those tests are skipped without it)."""

import copy
import os
import shutil
import tempfile
import unittest

from gpucast_training import manifest as mf
from gpucast_training import weights

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.path.join(REPO, "models")

try:
    import onnx  # noqa: F401

    HAVE_ONNX = True
except ImportError:
    HAVE_ONNX = False


def committed():
    return mf.read_json(os.path.join(MODELS, "manifest.json"))


class RuntimeTest(unittest.TestCase):
    def test_every_committed_estimator_names_the_runtime_of_its_input_and_its_file(self):
        manifest = committed()
        for entry in manifest["estimators"]:
            if entry["input"]["type"] == "aggregate":
                self.assertEqual(entry.get("runtime"), mf.IN_PROCESS, entry["name"])
                self.assertTrue(entry["file"].endswith(weights.SUFFIX), entry["name"])
                self.assertEqual(entry["graph"]["file"], entry["file"][: -len(weights.SUFFIX)] + ".onnx")
                self.assertEqual(entry["graph"]["sha256"], mf.sha256_of(os.path.join(MODELS, entry["graph"]["file"])))
            else:
                self.assertEqual(entry.get("runtime"), mf.ONNXRUNTIME, entry["name"])
                self.assertTrue(entry["file"].endswith(".onnx"), entry["name"])
                self.assertNotIn("graph", entry)
            self.assertEqual(entry["sha256"], mf.sha256_of(os.path.join(MODELS, entry["file"])), entry["name"])
        mf.check_runtimes(MODELS, manifest)

    def test_the_format_is_the_one_the_service_reads(self):
        with open(os.path.join(REPO, "src", "estimators", "feedforward.rs")) as f:
            source = f.read()
        self.assertIn('pub const FORMAT: &str = "%s";' % weights.FORMAT, source)
        self.assertIn("pub const VERSION: u32 = %d;" % weights.VERSION, source)

    def test_an_unknown_runtime_a_sequence_model_in_process_or_a_graph_in_process_is_refused(self):
        entry = next(e for e in committed()["estimators"] if e["name"] == "smact")
        sequence = {"name": "seq", "runtime": mf.IN_PROCESS, "input": {"type": "sequence"}, "file": "x.onnx"}
        narrower = copy.deepcopy(entry)
        narrower["input"]["features"].pop()
        for bad, words in (
            ({"name": "reg", "runtime": "tract", "input": {"type": "aggregate"}}, "'tract'"),
            ({"name": "reg", "input": {"type": "aggregate"}}, "None"),
            (sequence, "aggregate input only"),
            (dict(entry, file=entry["graph"]["file"]), "not smact.onnx"),
            (narrower, "read 22 features, the entry lists 21"),
        ):
            with self.assertRaises(ValueError) as raised:
                mf.check_runtimes(MODELS, {"estimators": [bad]})
            self.assertIn("estimator %s" % bad["name"], str(raised.exception))
            self.assertIn(words, str(raised.exception))

    def test_an_entry_pointed_at_its_weights_keeps_its_graph_and_its_keys_order(self):
        entry = {"name": "a", "file": "a.onnx", "sha256": "g", "input": {}, "runtime": mf.IN_PROCESS}
        out = mf.with_weights(entry, "g", "a.weights.json", "w")
        self.assertEqual(list(out), ["name", "file", "sha256", "graph", "input", "runtime"])
        self.assertEqual(out["graph"], {"file": "a.onnx", "sha256": "g"})
        self.assertEqual((out["file"], out["sha256"]), ("a.weights.json", "w"))


@unittest.skipUnless(HAVE_ONNX, "onnx is not installed (it comes with the retrain group)")
class ConvertTest(unittest.TestCase):
    def test_the_committed_graphs_convert_to_the_committed_weights(self):
        manifest = committed()
        with tempfile.TemporaryDirectory() as out:
            graphs = copy.deepcopy(manifest)
            for entry in graphs["estimators"]:
                if "graph" in entry:
                    entry["file"], entry["sha256"] = entry["graph"]["file"], entry["graph"]["sha256"]
                    del entry["graph"]
            mf.convert_in_process(out, graphs, read_dir=MODELS)
            self.assertEqual(graphs["estimators"], manifest["estimators"])
            for name in os.listdir(out):
                with open(os.path.join(out, name), "rb") as a, open(os.path.join(MODELS, name), "rb") as b:
                    self.assertEqual(a.read(), b.read(), name)

    def test_a_graph_of_another_architecture_is_refused_naming_the_estimator(self):
        manifest = committed()
        entry = next(e for e in manifest["estimators"] if e["name"] == "cnn_sequence_transformer")
        bad = dict(entry, runtime=mf.IN_PROCESS, input={"type": "aggregate", "features": []})
        with tempfile.TemporaryDirectory() as out:
            shutil.copy(os.path.join(MODELS, entry["file"]), out)
            with self.assertRaises(ValueError) as raised:
                mf.convert_in_process(out, {"estimators": [bad]})
        self.assertIn("estimator cnn_sequence_transformer", str(raised.exception))
        self.assertIn("name runtime onnxruntime", str(raised.exception))


if __name__ == "__main__":
    unittest.main()
