"""Where a run reads its data and writes its outputs, and the gzip'd JSON-lines files.

Standard library only (the MLP CSV's layer kinds are read by the built gpucast: service.py).

- Measured data (read-only CSVs): `--data-dir`, else `$GPUCAST_DATA_DIR`, else
  `<repository root>/../shared/data`; one file can be named on its own (`--mlp-csv` /
  `$GPUCAST_MLP_CSV`, `--timm-csv` / `$GPUCAST_TIMM_CSV`, `--public-csv` / `$GPUCAST_PUBLIC_CSV`).
- Outputs: under `--out-dir`, else `$GPUCAST_OUT_DIR`, else the repository root, at the paths
  the repository has them (models/, data/mlp/, data/timm/, docs/reports/training-*.md).
- Project files a stage reads (committed inputs such as data/timm/descriptions.jsonl.gz, and
  what an earlier stage wrote, such as models/manifest.json): from the output directory when
  it has them, else from the repository. A stage run alone into an empty directory thus
  starts from the committed state of the files it does not make itself.
"""

import csv
import gzip
import io
import json
import os
import re
import time

from . import features as gf
from . import service

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MLP_CSV = "gpumemnet_mlp_a100.csv"
TIMM_CSV = "timm_a100_train.csv"
PUBLIC_CSV = "public_training_memory.csv"
# Model-name prefixes that name a source or a port rather than an architecture family.
SOURCE_PREFIXES = ("tf_", "legacy_", "gluon_", "timm_", "hf_")


def log(message):
    print("[%s] %s" % (time.strftime("%H:%M:%S"), message), flush=True)


def default_data_dir():
    return os.environ.get("GPUCAST_DATA_DIR") or os.path.normpath(os.path.join(REPO, "..", "shared", "data"))


class Layout:
    """The input and output paths of one run (see the module doc)."""

    def __init__(
        self,
        data_dir=None,
        out_dir=None,
        mlp_csv=None,
        timm_csv=None,
        public_csv=None,
        simulations=None,
        observations=None,
    ):
        self.data_dir = os.path.abspath(data_dir or default_data_dir())
        self.out_dir = os.path.abspath(out_dir or os.environ.get("GPUCAST_OUT_DIR") or REPO)
        self.mlp_csv = mlp_csv or os.environ.get("GPUCAST_MLP_CSV") or os.path.join(self.data_dir, MLP_CSV)
        self.timm_csv = timm_csv or os.environ.get("GPUCAST_TIMM_CSV") or os.path.join(self.data_dir, TIMM_CSV)
        self.public_csv = public_csv or os.environ.get("GPUCAST_PUBLIC_CSV") or os.path.join(self.data_dir, PUBLIC_CSV)
        # describe's simulations of the timm rows (committed; describe/scripts/simulate_timm_training_set.py)
        self.simulations = simulations or self.read("data", "timm", "simulations.jsonl.gz")
        # The service's stored observations (`gpucast observations export`): extra training rows
        # of the timm stage's memory regressors; None for none.
        self.observations = observations

    def out(self, *parts):
        """An output path (repository-relative parts); its directory is created."""
        path = os.path.join(self.out_dir, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def read(self, *parts):
        """A project file to read: the output directory's copy if there is one, else the repository's."""
        path = os.path.join(self.out_dir, *parts)
        return path if os.path.exists(path) else os.path.join(REPO, *parts)


def write_gz(path, lines, one_write=False):
    """gzip'd text lines (each ending in a newline), mtime 0 so reruns give the same bytes.
    Two byte layouts, kept so the committed files stay byte-identical: `one_write` (data/mlp:
    one write, no file name in the gzip header) and line by line with the file's name in the
    header (data/timm, data/public)."""
    if one_write:
        buffer = io.BytesIO()
        with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, filename="") as handle:
            handle.write("".join(lines).encode())
        with open(path, "wb") as handle:
            handle.write(buffer.getvalue())
        return
    with open(path, "wb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as handle:
            for line in lines:
                handle.write(line.encode())


def write_jsonl_gz(path, rows, one_write=False):
    write_gz(path, (json.dumps(row, separators=(",", ":")) + "\n" for row in rows), one_write)


def read_jsonl_gz(path):
    with gzip.open(path, "rt") as handle:
        return [json.loads(line) for line in handle if line.strip()]


# ----------------------------------------------------------------------------- the measured data


def load_mlp_records(csv_path):
    """The rows of gpumemnet_mlp_a100.csv as records (job, peak, class, utilization, group)."""
    with open(csv_path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    # The kinds as the service reads the CSV's spellings: the jobs written to data/mlp/ are canonical.
    jobs = service.canonical([gf.csv_row_to_job(row) for row in rows])
    records = []
    for index, (row, job) in enumerate(zip(rows, jobs)):
        peak = int(row["Max GPU Memory (MiB)"])
        records.append(
            {
                "index": index,
                "id": row["Filename"][: -len(".out")] if row["Filename"].endswith(".out") else row["Filename"],
                "group": gf.group_key(row["Filename"]),
                "job": job,
                "peak": peak,
                "label": gf.memory_class(peak),
                "smact": float(row["Avg SMACT"]),
                "smocc": float(row["Avg SMOCC"]),
                "raw_row": row,
            }
        )
    return records


def family_group(model):
    """Group of a timm model: its name without source prefixes (tf_, legacy_, gluon_, ...), up
    to the first '_' or digit: resnet50d -> resnet, vit_base_patch16_224 -> vit,
    tf_efficientnet_b0 -> efficientnet, convnext_tiny -> convnext, mobilenetv3_large_100 ->
    mobilenetv."""
    name = model.lower()
    stripped = True
    while stripped:
        stripped = False
        for prefix in SOURCE_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix) :], True
    match = re.match(r"[a-z]+", name)
    return match.group(0) if match else name


def load_descriptions(path):
    """describe's descriptions of the timm models, by model name."""
    return {description["model"].split(":", 1)[1]: description for description in read_jsonl_gz(path)}


def timm_job(description, batch_size):
    """The request body for one CSV row (layer names dropped: informational only)."""
    job = {
        "model": description["model"],
        "family": description["family"],
        "batch_size": batch_size,
        "input_shape": description["input_shape"],
        "layers": [
            {"kind": l["kind"], "output_size": l["output_size"], "params": l["params"]} for l in description["layers"]
        ],
    }
    if "saved_tensors" in description:
        job["saved_tensors"] = description["saved_tensors"]
    return job


OBSERVATION_FAMILIES = ("cnn", "transformer")


def observation_job(job):
    """The layer-list job of an exported observation (`gpucast observations export`), normalised
    as timm_job writes them, or None when it does not parse: no layer list (a summary text), a
    layer without kind / output_size / params, a batch size that is not a positive whole
    number, or a family outside OBSERVATION_FAMILIES (inferred as the service does when absent:
    attention makes a transformer, convolutions a CNN)."""
    if not isinstance(job, dict):
        return None
    layers, batch = job.get("layers"), job.get("batch_size")
    if not isinstance(layers, list) or not layers or not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        return None
    clean = []
    for layer in layers:
        if not isinstance(layer, dict) or not isinstance(layer.get("kind"), str):
            return None
        size, params = layer.get("output_size"), layer.get("params")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (size, params)):
            return None
        clean.append({"kind": layer["kind"], "output_size": size, "params": params})
    family = job.get("family")
    if family is None:
        kinds = {l["kind"] for l in clean}
        family = (
            "transformer"
            if any("attention" in k for k in kinds)
            else "cnn"
            if any(k.startswith("conv") for k in kinds)
            else "mlp"
        )
    if family not in OBSERVATION_FAMILIES:
        return None
    out = {"model": str(job.get("model") or "observation"), "family": family, "batch_size": batch, "layers": clean}
    if isinstance(job.get("input_shape"), list):
        out["input_shape"] = job["input_shape"]
    if "saved_tensors" in job:
        out["saved_tensors"] = job["saved_tensors"]
    return out


def load_observation_records(path):
    """Records (as load_timm's) from a JSON Lines export of the service's stored observations:
    the rows whose job parses (observation_job) and whose observed peak is a positive number.
    Returns (records, skipped). Each observation is its own model and all share the group
    `observations`, so they join the training part and never the held-out test split."""
    records, skipped = [], 0
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                skipped += 1
                continue
            job = observation_job(row.get("job")) if isinstance(row, dict) else None
            peak = row.get("observed_peak_mib") if job is not None else None
            if job is None or not isinstance(peak, (int, float)) or isinstance(peak, bool) or not peak > 0:
                skipped += 1
                continue
            model = "observation-%s" % row.get("id", number)
            records.append(
                {
                    "id": "%s@%d" % (model, job["batch_size"]),
                    "model": model,
                    "group": "observations",
                    "family": job["family"],
                    "status": "ok",
                    "batch_size": job["batch_size"],
                    "peak": float(peak),
                    "faketensor": float("nan"),
                    "job": job,
                    "gpu": row.get("gpu"),
                    "environment": row.get("environment"),
                }
            )
    return records, skipped


def load_timm(csv_path, descriptions_path):
    descriptions = load_descriptions(descriptions_path)
    records, dropped = [], {"failed": 0, "anomalous": 0}
    with open(csv_path, newline="") as handle:
        for row in csv.DictReader(handle):
            status = row["status"]
            if status in dropped:
                dropped[status] += 1
                continue
            model, batch = row["model"], int(row["batch_size"])
            description = descriptions[model]
            records.append(
                {
                    "id": "%s@%d" % (model, batch),
                    "model": model,
                    "group": family_group(model),
                    "family": description["family"],
                    "status": status,
                    "batch_size": batch,
                    "peak": float(row["measured_peak_mib"]),
                    "faketensor": float(row["faketensor_estimate_mib"]),
                    "job": timm_job(description, batch),
                }
            )
    return records, dropped
