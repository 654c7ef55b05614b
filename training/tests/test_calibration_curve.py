"""The committed bounds are calibrated on both sides: the held-out calibration curve that
`python -m gpucast_training decisions` wrote beside data/uncertainty.json
(data/calibration_curve.json: each source and family answered with quantiles computed without
it) leaves about 1 - c of each kind's measured peaks above the bound at confidence c. A bound
too wide fails here as one too narrow does (issue 33's targets).

Run from the repository root:  python3 -m unittest discover -s training/tests -t training
"""

import hashlib
import json
import math
import os
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read(path):
    with open(os.path.join(REPO, path)) as f:
        return f.read()


class CalibrationCurve(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.curve = json.loads(read("data/calibration_curve.json"))

    def test_the_curve_was_computed_with_the_committed_quantiles(self):
        digest = hashlib.sha256(read("data/uncertainty.json").encode()).hexdigest()
        self.assertEqual(
            self.curve["uncertainty_sha256"],
            digest,
            "data/uncertainty.json changed without its curve: rerun python -m gpucast_training decisions",
        )

    def test_every_kind_of_model_is_calibrated_on_both_sides(self):
        kinds = self.curve["curve"]["kind"]
        self.assertEqual(sorted(kinds), ["image", "llm", "mlp"])
        for kind, by_confidence in kinds.items():
            for confidence, (low, high) in {"0.5": (0.4, 0.6), "0.8": (0.1, 0.3)}.items():
                cell = by_confidence[confidence]
                share = cell["above"] / cell["rows"]
                self.assertTrue(low <= share <= high, f"{kind} at {confidence}: {share:.3f} above")
            cell = by_confidence["0.95"]
            share = cell["above"] / cell["rows"]
            # Too narrow past 0.08; too wide below 0.05 by more than two binomial standard
            # errors of its row count.
            too_wide = 0.05 - 2 * math.sqrt(0.05 * 0.95 / cell["rows"])
            self.assertTrue(too_wide <= share <= 0.08, f"{kind} at 0.95: {share:.3f} above of {cell['rows']}")


if __name__ == "__main__":
    unittest.main()
