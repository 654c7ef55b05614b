"""service.py against the built gpucast (`gpucast features --batch`); skipped when none is built
(scripts/test.sh builds it first). Stdlib.

Run from the repository root:  python3 -m unittest discover -s training/tests -t training
"""

import math
import os
import unittest

from gpucast_training import features as gf
from gpucast_training import service

BUILT = bool(os.environ.get("GPUCAST_BINARY")) or any(
    (service.ROOT / "target" / build / "gpucast").exists() for build in ("release", "debug")
)

JOB = {
    "batch_size": 2,
    "layers": [
        {"kind": "Linear", "output_size": 3, "params": 12},
        {"kind": "ReLU", "output_size": 3, "params": 0},
        {"kind": "linear", "output_size": 1, "params": 4},
    ],
}


@unittest.skipUnless(BUILT, "no gpucast built (cargo build)")
class ServiceTest(unittest.TestCase):
    def test_features_are_the_services_by_name_with_canonical_kinds(self):
        (features,) = service.features([JOB])
        self.assertEqual(features["kinds"], ["linear", "relu", "linear"])
        self.assertEqual(set(features["aggregate"]), set(gf.ALL_AGGREGATE_FEATURES))
        self.assertEqual(features["aggregate"]["params_x_batch"], 32.0)
        self.assertEqual(features["aggregate"]["act_relu"], 1.0)
        self.assertEqual(service.canonical([JOB])[0]["layers"][1], {"kind": "relu", "output_size": 3, "params": 0})

    def test_tokens_and_kind_ids_follow_the_names_and_vocabulary_asked(self):
        self.assertEqual(service.raw_tokens([JOB], ["position", "params"]), [[[0.0, 12.0], [0.5, 0.0], [1.0, 4.0]]])
        self.assertEqual(service.kind_ids([JOB], gf.CANONICAL_KINDS), [[1, 4, 1]])
        entries = [{"name": "params", "transform": "log1p", "mean": 0.0, "std": 1.0}]
        self.assertEqual(gf.token_vectors([JOB], entries)[0][1], [0.0])

    def test_a_job_the_service_refuses_raises_with_its_detail(self):
        with self.assertRaisesRegex(service.InvalidJob, "batch_size"):
            service.features([dict(JOB, batch_size=0)])

    def test_fold_jobs_are_answered_by_the_services_rule(self):
        # A near job keeps its correction and bound; far (3 x the typical distance) and outside
        # the setups (no distance), the simulated figure with its bound widened at most (x2);
        # on a 40 GB card where the step runs, that bound is capped at the card. 300 jobs cross
        # a batch boundary.
        def job(ratio, simulated=11500.0):
            return {
                "log_learned": math.log(12000.0),
                "simulated_mib": simulated,
                "floor_mib": 6000.0,
                "distance": None if ratio is None else ratio * 1.5,
                "typical_distance": 1.5,
                "learned_log_ratio": 0.1,
                "simulated_log_ratio": 0.15,
                "runs_on_card": True,
                "capacity_mib": 40960,
                "measured_range": True,
            }

        jobs = [job(0.5), job(3.0), job(None), job(3.0, simulated=39000.0)] * 75
        answers = service.combine(jobs, 1.0, 2.0, 2.0)
        self.assertEqual(len(answers), 300)
        near, far, outside, capped = answers[:4]
        self.assertFalse(near["far"])
        self.assertAlmostEqual(near["figure_mib"], 12000.0, places=6)
        self.assertAlmostEqual(near["upper_bound_mib"], 12000.0 * math.exp(0.1), places=6)
        for answer in (far, outside):
            self.assertTrue(answer["far"])
            self.assertEqual(answer["figure_mib"], 11500.0)
            self.assertAlmostEqual(answer["upper_bound_mib"], 11500.0 * math.exp(0.3), places=6)
        self.assertEqual(capped["upper_bound_mib"], 40960.0)
        self.assertEqual(answers[4:8], answers[:4])

    def test_batches_stay_within_the_clis_limits(self):
        batches = list(service.chunks([{"n": i} for i in range(600)]))
        self.assertEqual([len(b) for b in batches], [256, 256, 88])


if __name__ == "__main__":
    unittest.main()
