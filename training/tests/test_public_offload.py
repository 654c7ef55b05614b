"""The offload rows' rules (stdlib): each reads only a row that still says what it read, and
builds a job from a committed config.

Run from the repository root:  python3 -m unittest discover -s training/tests -t training
"""

import csv
import os
import tempfile
import unittest

from gpucast_training import public_offload

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


COLUMNS = [
    "source_url_or_repo_path",
    "model",
    "head_or_task",
    "framework",
    "batch_size",
    "micro_batch_size",
    "seq_len",
    "image_size",
    "optimizer",
    "precision",
    "grad_checkpointing",
    "grad_accum",
    "peft",
    "parallelism",
    "n_gpus",
    "gpu",
    "measured_mib",
    "measure_kind",
    "notes",
]


def write_csv(path, said):
    """A CSV whose rows of public_offload.ROWS say `said(index)`, the others nothing."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        for index in range(max(public_offload.ROWS) + 1):
            row = dict.fromkeys(COLUMNS, "")
            if index in public_offload.ROWS:
                row.update(
                    model=f"model {index}",
                    gpu="NVIDIA RTX 4090 24GB",
                    measured_mib="1000",
                    measure_kind="torch.cuda.max_memory_reserved()",
                    notes=said(index),
                )
            writer.writerow(row)


class OffloadRows(unittest.TestCase):
    def test_every_rule_builds_a_job_from_a_committed_config(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "rows.csv")
            write_csv(path, lambda i: " ".join(public_offload.ROWS[i]["says"]))
            jobs = public_offload.jobs(path)
        self.assertEqual([j["row"] for j in jobs], sorted(public_offload.ROWS))
        for job in jobs:
            self.assertIn("offload", job["families"])
            self.assertTrue(job["job"]["offload"]["parameters"])
            self.assertIn("model_type", job["job"]["transformer_config"])
            self.assertEqual(job["compare"], "reserved")

    def test_a_row_that_no_longer_says_what_its_rule_read_stops_the_stage(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "rows.csv")
            write_csv(path, lambda i: "something else")
            with self.assertRaises(SystemExit):
                public_offload.jobs(path)


if __name__ == "__main__":
    unittest.main()
