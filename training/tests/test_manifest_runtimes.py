"""The manifest's `runtime` field: what the training side writes and checks before writing it."""

import os
import re
import unittest
from types import SimpleNamespace

from gpucast_training import manifest as mf

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def node(op_type, inputs=2, domain="", attributes=()):
    return SimpleNamespace(
        op_type=op_type,
        domain=domain,
        input=["x%d" % i for i in range(inputs)],
        attribute=[SimpleNamespace(name=name) for name in attributes],
    )


class RuntimeTest(unittest.TestCase):
    def test_every_committed_estimator_names_the_runtime_of_its_input(self):
        manifest = mf.read_json(os.path.join(REPO, "models", "manifest.json"))
        for entry in manifest["estimators"]:
            expected = mf.IN_PROCESS if entry["input"]["type"] == "aggregate" else mf.ONNXRUNTIME
            self.assertEqual(entry.get("runtime"), expected, entry["name"])

    def test_the_known_ops_are_those_the_service_evaluates(self):
        with open(os.path.join(REPO, "src", "estimators", "feedforward.rs")) as f:
            source = f.read()
        op_of = source[source.index("fn op_of(") : source.index("fn constant_of(")]
        self.assertEqual(set(re.findall(r'^\s*"(\w+)" (?:=>|if)', op_of, re.M)), mf.IN_PROCESS_OPS)

    def test_a_graph_is_refused_for_each_op_or_form_the_evaluator_does_not_read(self):
        self.assertEqual(mf.in_process_refusals([node("Gemm", 3), node("Sigmoid", 1), node("Slice", 5)]), [])
        refusals = mf.in_process_refusals(
            [
                node("Softsign", 1),
                node("QuickGelu", 1, domain="com.microsoft"),
                node("Unsqueeze", 1),
                node("ReduceMean", 1, attributes=["axes"]),
            ]
        )
        self.assertEqual(
            refusals,
            [
                "op QuickGelu of domain com.microsoft",
                "op ReduceMean in its opset < 18 form",
                "op Softsign",
                "op Unsqueeze in its opset < 13 form",
            ],
        )

    def test_an_unknown_runtime_or_a_sequence_model_in_process_is_refused_with_its_name(self):
        sequence = {"name": "seq", "runtime": mf.IN_PROCESS, "input": {"type": "sequence"}, "file": "x.onnx"}
        for entry, words in (
            ({"name": "reg", "runtime": "tract", "input": {"type": "aggregate"}}, "'tract'"),
            ({"name": "reg", "input": {"type": "aggregate"}}, "None"),
            (sequence, "aggregate input only"),
        ):
            with self.assertRaises(ValueError) as raised:
                mf.check_runtimes(REPO, {"estimators": [entry]})
            self.assertIn("estimator %s" % entry["name"], str(raised.exception))
            self.assertIn(words, str(raised.exception))


if __name__ == "__main__":
    unittest.main()
