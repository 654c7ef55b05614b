"""data/perf: the roofline model's measured rows (stdlib only).

Run from the repository root:  python3 -m unittest discover -s training/tests -t training
"""

import json
import os
import unittest

from gpucast_training import data, perf_data

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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

    def test_a_multi_gpu_throughput_one_gpu_could_not_reach_is_the_clusters(self):
        with open(os.path.join(REPO, "data", "gpus.json")) as handle:
            gpus = json.load(handle)["gpus"]
        self.assertEqual(perf_data.peak_tflops("A100 (40/80GB not stated)", gpus), 312.0)
        self.assertEqual(perf_data.peak_tflops("Tesla V100-SXM2 16GB", gpus), 125.0)
        with open(os.path.join(REPO, "data", "perf", "step_times.json")) as handle:
            rows = {r["row"]: r for r in json.load(handle)}
        # Llama-2-70B at 3,384 tokens/s on one A100 would need 4 x 69e9 x 3,384 = 934 TFLOP/s.
        self.assertTrue(rows[44]["throughput_of"].startswith("all 8 GPUs"))
        self.assertAlmostEqual(rows[44]["step_time_ms"], 8 * 1000.0 * 4 * 4096 / 3384, places=0)
        # Llama-2-7B at 1,388 tokens/s per 4090 is possible: one GPU's.
        self.assertEqual(rows[43]["throughput_of"], "one GPU")


if __name__ == "__main__":
    unittest.main()
