"""The service's exported observations as extra training rows (stdlib only).

Run from the repository root:  python3 -m unittest discover -s training/tests -t training
"""

import os
import unittest

from gpucast_training import data

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "observations.jsonl")


class ObservationsTest(unittest.TestCase):
    def test_rows_whose_job_parses_become_training_records_and_the_rest_are_counted(self):
        records, skipped = data.load_observation_records(FIXTURE)
        # 1: a cnn; 2: a transformer (family inferred from attention); 3: a summary text;
        # 4: an mlp (the timm stage's regressors are cnn / transformer); 5: batch 0; 6: not JSON.
        self.assertEqual([r["id"] for r in records], ["observation-1@32", "observation-2@8"])
        self.assertEqual(skipped, 4)
        first = records[0]
        self.assertEqual(
            (first["family"], first["status"], first["peak"], first["group"]), ("cnn", "ok", 3934.0, "observations")
        )
        self.assertEqual(first["job"]["input_shape"], [3, 224, 224])
        self.assertEqual(first["environment"], "torch2.5-cu124")
        self.assertEqual(records[1]["family"], "transformer")
        self.assertEqual(set(records[1]["job"]["layers"][0]), {"kind", "output_size", "params"})

    def test_the_layout_carries_the_option(self):
        layout = data.Layout(data_dir="/nonexistent", observations=FIXTURE)
        self.assertEqual(layout.observations, FIXTURE)
        self.assertIsNone(data.Layout(data_dir="/nonexistent").observations)


if __name__ == "__main__":
    unittest.main()
