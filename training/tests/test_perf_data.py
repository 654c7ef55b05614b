"""data/perf: the roofline model's measured rows (stdlib only).

Run from the repository root:  python3 -m unittest discover -s training/tests
"""

import json
import os
import sys
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "training"))

from gpucast_training import data, perf_data  # noqa: E402


class PerfDataTest(unittest.TestCase):
    def test_the_shape_is_read_from_the_run_name(self):
        self.assertEqual(perf_data.shape_of("input:1003_output:190_depth:9_arch:gradual_batch:4_act:elu"), "gradual")
        with self.assertRaises(ValueError):
            perf_data.shape_of("input:1003_output:190_depth:9_arch:round_batch:4")

    def test_the_committed_utilization_rows_are_exactly_the_train_split(self):
        with open(os.path.join(REPO, "data", "mlp", "splits.json")) as handle:
            splits = json.load(handle)
        rows = data.read_jsonl_gz(os.path.join(REPO, "data", "perf", "mlp_train_utilization.jsonl.gz"))
        self.assertEqual([r["row"] for r in rows], splits["train_rows"])
        self.assertFalse(set(splits["test_rows"]) & {r["row"] for r in rows})
        self.assertEqual({r["shape"] for r in rows}, set(perf_data.SHAPES))
        for r in rows:
            self.assertTrue(0.0 <= r["smact"] <= 1.0 and 0.0 <= r["smocc"] <= 1.0)

    def test_each_step_time_is_its_quoted_throughput(self):
        with open(os.path.join(REPO, "data", "perf", "step_times.json")) as handle:
            rows = json.load(handle)
        self.assertEqual([r["row"] for r in rows], perf_data.STEP_TIME_ROWS)
        for r in rows:
            self.assertIn(("%g" % r["throughput"]).split(".")[0][:3], r["quote"].replace(",", ""))
            if r["in_setup_jobs"]:
                self.assertGreater(r["step_time_ms"], 0)


if __name__ == "__main__":
    unittest.main()
