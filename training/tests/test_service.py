"""service.py against the built gpucast (`gpucast features --batch`); skipped when none is built
(scripts/test.sh builds it first). Stdlib.

Run from the repository root:  python3 -m unittest discover -s training/tests -t training
"""

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

    def test_batches_stay_within_the_clis_limits(self):
        batches = list(service.chunks([{"n": i} for i in range(600)]))
        self.assertEqual([len(b) for b in batches], [256, 256, 88])


if __name__ == "__main__":
    unittest.main()
