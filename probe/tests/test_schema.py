import ast
import csv
import os
import tempfile
import unittest
from pathlib import Path

from probe.gpucast_probe.generators import generate
from probe.gpucast_probe.schema import COLUMNS, EXTRA_COLUMNS, GPUMEMNET_COLUMNS, CsvWriter, row_for

SHARED_CSV = Path(__file__).resolve().parents[3] / "shared" / "data" / "gpumemnet_mlp_a100.csv"
METRICS = {"gputl": 87.5, "gract": 0.9, "smact": 0.8, "smocc": 0.4, "fp32a": 0.3, "drama": 0.25}


def a_row(spec, **overrides):
    fields = dict(peak_mib=2048, metrics=METRICS, gpu_sku="NVIDIA H100 80GB HBM3", driver="550.54.15", status="ok")
    fields.update(overrides)
    return row_for(spec, **fields)


class Schema(unittest.TestCase):
    @unittest.skipUnless(SHARED_CSV.exists(), "shared data not present")
    def test_columns_start_with_the_shared_header(self):
        with open(SHARED_CSV, newline="") as f:
            header = next(csv.reader(f))
        self.assertEqual(GPUMEMNET_COLUMNS, header)
        self.assertEqual(COLUMNS[: len(header)], header)
        for extra in ("gpu_sku", "driver", "drama"):
            self.assertIn(extra, EXTRA_COLUMNS)

    def test_a_row_carries_gpumemnet_totals(self):
        spec = next(generate(["mlp"], 4))
        row = a_row(spec)
        self.assertEqual(set(row), set(COLUMNS))
        layers = ast.literal_eval(row["Activations-Params"])
        self.assertEqual(row["Total Parameters"], sum(p for _, _, p in layers))
        self.assertEqual(row["Total Activations"], sum(n for _, n, _ in layers))
        self.assertEqual(row["Depth"], sum(1 for k, _, _ in layers if k == "linear"))
        self.assertEqual(row["Batch Normalization Layers"], sum(1 for k, _, _ in layers if k == "batch_normalization"))
        self.assertEqual(row["Dropout Layers"], sum(1 for k, _, _ in layers if k == "dropout"))

    def test_the_writer_writes_a_header_once_and_empty_cells_for_missing_metrics(self):
        specs = [s for s, _ in zip(generate(["mlp", "cnn", "transformer"], 9), range(3))]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "rows.csv")
            with CsvWriter(path) as writer:
                writer.write(a_row(specs[0]))
                writer.write(a_row(specs[1], metrics={"gputl": 50.0}, peak_mib=None, status="oom"))
            with CsvWriter(path) as writer:  # appending keeps one header
                writer.write(a_row(specs[2], metrics={"smact": float("nan")}))
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
            with open(path) as f:
                self.assertEqual(sum(1 for line in f if line.startswith("Filename,")), 1)
        self.assertEqual(len(rows), 3)
        self.assertEqual(rows[0]["drama"], "0.25")
        self.assertEqual(rows[0]["gpu_sku"], "NVIDIA H100 80GB HBM3")
        self.assertEqual(rows[1]["Avg SMACT"], "")
        self.assertEqual(rows[1]["Max GPU Memory (MiB)"], "")
        self.assertEqual(rows[1]["status"], "oom")
        self.assertEqual(rows[2]["Avg SMACT"], "", "NaN is written as an empty cell")
        self.assertEqual(rows[2]["family"], "transformer")

    def test_the_writer_refuses_a_file_with_another_header(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "other.csv")
            with open(path, "w") as f:
                f.write("a,b\n1,2\n")
            with self.assertRaises(ValueError):
                CsvWriter(path)


if __name__ == "__main__":
    unittest.main()
