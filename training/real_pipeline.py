"""gpucast real-model pipeline: timm (cnn / transformer) and MLP MiB estimators.

Run from the repository root after training/pipeline.py (which writes the MLP classifiers and
the base manifest):   python training/real_pipeline.py
Writes data/timm/test.jsonl.gz, data/timm/cv_predictions.csv.gz, models/timm_*.onnx,
models/mlp_regressor.onnx, merges its entries into models/manifest.json, appends the real-model
golden cases to tests/fixtures/golden_features.json and writes training/report_real.md.
"""

import argparse
import csv
import datetime
import gzip
import hashlib
import json
import math
import os
import re
import sys
import time

import numpy as np
import onnxruntime as ort
import torch
from sklearn.model_selection import GroupKFold

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpucast_features as gf  # noqa: E402
import real_models as rm  # noqa: E402

SEED = 20260101
VERSION = "1.0.0"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMM_CSV = "/work/shared/data/timm_a100_train.csv"
MLP_CSV = "/work/shared/data/gpumemnet_mlp_a100.csv"
CAPACITY_MIB = 40960
CONFIDENCES = [0.5, 0.8, 0.9, 0.95, 0.975, 0.99]
BOUND_CONFIDENCE = 0.95
CLASS_BINS_MIB = [8000, 16000, 24000, 32000, 40960]
N_CLASSES = len(CLASS_BINS_MIB) + 1
N_FOLDS = 5
TEST_GROUP_FRACTION = 0.15
MAX_TOKENS = 4096
FAMILIES = ["cnn", "transformer"]
# Model-name prefixes that name a source or a port rather than an architecture family.
SOURCE_PREFIXES = ("tf_", "legacy_", "gluon_", "timm_", "hf_")

# Features of the aggregate real-model estimators (all log1p + standardised; one-hots as-is).
REAL_FEATURES = [
    "first_principles_mib", "horus_mib", "total_params", "total_activations", "batch_size",
    "activations_x_batch", "params_x_batch", "max_output_size", "n_layers", "depth",
    "n_conv", "n_attention", "n_norm", "n_batch_norm", "n_dropout", "n_activation",
    "n_embedding", "input_pixels",
] + ["act_" + name for name in gf.HIDDEN_ACTIVATIONS]
MLP_REG_FEATURES = [
    "first_principles_mib", "horus_mib", "total_params", "total_activations", "batch_size",
    "activations_x_batch", "params_x_batch", "max_output_size", "n_layers", "depth",
    "n_batch_norm", "n_dropout", "n_activation",
] + ["act_" + name for name in gf.HIDDEN_ACTIVATIONS]

REGRESSOR = dict(members=5, hidden=32, epochs=800, lr=1e-2, weight_decay=1e-3, oom_weight=1.0)
CLASSIFIER = dict(members=5, hidden=32, epochs=800, lr=1e-2, weight_decay=1e-3, under_weight=1.0,
                  regression_weight=1.0)
SEQUENCE = dict(d_model=32, n_heads=4, n_layers=1, pool=16, epochs=25, batch=32, lr=3e-3,
                weight_decay=1e-4, under_weight=1.0, regression_weight=1.0)
LOG_CAPACITY = math.log(CAPACITY_MIB)


def log(message):
    print("[%s] %s" % (time.strftime("%H:%M:%S"), message), flush=True)


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ----------------------------------------------------------------------------- data

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
                name, stripped = name[len(prefix):], True
    match = re.match(r"[a-z]+", name)
    return match.group(0) if match else name


def load_descriptions(path):
    descriptions = {}
    with gzip.open(path, "rt") as handle:
        for line in handle:
            description = json.loads(line)
            descriptions[description["model"].split(":", 1)[1]] = description
    return descriptions


def timm_job(description, batch_size):
    """The request body for one CSV row (layer names dropped: informational only)."""
    return {"model": description["model"], "family": description["family"], "batch_size": batch_size,
            "input_shape": description["input_shape"],
            "layers": [{"kind": l["kind"], "output_size": l["output_size"], "params": l["params"]}
                       for l in description["layers"]]}


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
            records.append({
                "id": "%s@%d" % (model, batch), "model": model, "group": family_group(model),
                "family": description["family"], "status": status, "batch_size": batch,
                "peak": float(row["measured_peak_mib"]), "faketensor": float(row["faketensor_estimate_mib"]),
                "job": timm_job(description, batch)})
    return records, dropped


def split_groups(records):
    """~15 % of the model-family groups (by model count) held out, chosen by a seeded shuffle;
    a group that would push the held-out share over 20 % of the models is skipped."""
    models = {}
    for record in records:
        models.setdefault(record["group"], set()).add(record["model"])
    groups = sorted(models)
    order = np.random.RandomState(SEED).permutation(len(groups))
    n_models = sum(len(v) for v in models.values())
    test, held = set(), 0
    for index in order:
        group = groups[index]
        if held >= TEST_GROUP_FRACTION * n_models:
            break
        if held + len(models[group]) > 0.20 * n_models:
            continue
        test.add(group)
        held += len(models[group])
    return sorted(test)


def write_test_file(records, path):
    with open(path, "wb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as handle:
            for record in records:
                line = {"id": record["id"], "job": record["job"], "measured_peak_mib": record["peak"],
                        "status": record["status"]}
                if "faketensor" in record:
                    line["faketensor_estimate_mib"] = record["faketensor"]
                handle.write((json.dumps(line, separators=(",", ":")) + "\n").encode())


def read_test_file(path):
    with gzip.open(path, "rt") as handle:
        return [json.loads(line) for line in handle]


# ----------------------------------------------------------------------------- features

def fit_entries(raws, names):
    entries = []
    for name in names:
        if name.startswith("act_"):
            entries.append({"name": name, "transform": "identity", "mean": 0.0, "std": 1.0})
            continue
        values = [math.log1p(raw[name]) for raw in raws]
        mean = math.fsum(values) / len(values)
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
        entries.append({"name": name, "transform": "log1p", "mean": mean, "std": std if std > 1e-9 else 1.0})
    return entries


def encode(raws, entries):
    return np.array([[gf.normalise_value(raw[e["name"]], e) for e in entries] for raw in raws], dtype=np.float32)


def fit_token_entries(jobs):
    tokens = [token for job in jobs for token in gf.raw_token_features(job)]
    entries = []
    for index, name in enumerate(gf.TOKEN_FEATURES):
        transform = gf.DEFAULT_TOKEN_TRANSFORMS[name]
        values = np.array([gf.apply_transform(token[index], transform) for token in tokens])
        entries.append({"name": name, "transform": transform, "mean": float(values.mean()),
                        "std": float(values.std()) or 1.0})
    return entries


def encode_tokens(jobs, entries):
    """Per job: kind ids [L] and normalised token features [L, T] (numpy)."""
    out = []
    for job in jobs:
        ids = np.array(gf.kind_ids(job, gf.ALL_KINDS), dtype=np.int64)
        feats = np.array(gf.token_vectors(job, entries), dtype=np.float32)
        out.append((ids, feats))
    return out


def pad_tokens(encoded, length=None):
    length = length or max(len(ids) for ids, _ in encoded)
    n, t = len(encoded), encoded[0][1].shape[1]
    kind_ids = np.zeros((n, length), dtype=np.int64)
    feats = np.zeros((n, length, t), dtype=np.float32)
    mask = np.zeros((n, length), dtype=np.float32)
    for row, (ids, f) in enumerate(encoded):
        kind_ids[row, :len(ids)] = ids
        feats[row, :len(ids)] = f
        mask[row, :len(ids)] = 1.0
    return kind_ids, feats, mask


def memory_class(peak):
    return gf.memory_class(peak, CLASS_BINS_MIB)


def targets(records):
    """log peak, censored flag (oom: true need >= capacity) and class (oom -> top class)."""
    log_peak = torch.tensor([math.log(r["peak"]) for r in records], dtype=torch.float32)
    oom = torch.tensor([r["status"] == "oom" for r in records], dtype=torch.bool)
    classes = torch.tensor([N_CLASSES - 1 if r["status"] == "oom" else memory_class(r["peak"])
                            for r in records], dtype=torch.long)
    return log_peak, oom, classes


# ----------------------------------------------------------------------------- losses/training

def regression_loss(pred, log_peak, oom):
    """pred [K, N]: L1 in log space on measured rows; one-sided (pred >= log capacity) on oom rows."""
    ok = ~oom
    loss = (pred[:, ok] - log_peak[ok]).abs().mean()
    if oom.any():
        loss = loss + REGRESSOR["oom_weight"] * torch.relu(LOG_CAPACITY + 0.05 - pred[:, oom]).mean()
    return loss


def classification_loss(mu, probs, log_peak, oom, classes, cfg):
    """Cross-entropy + under_weight x mass below the true class + regression of mu."""
    n_members = probs.shape[0]
    labels = classes.unsqueeze(0).expand(n_members, -1)
    nll = -torch.log(probs.gather(-1, labels.unsqueeze(-1))).mean()
    below = torch.arange(N_CLASSES).view(1, 1, -1) < labels.unsqueeze(-1)
    below_mass = (probs * below).sum(-1).mean()
    return nll + cfg["under_weight"] * below_mass + cfg["regression_weight"] * regression_loss(mu.squeeze(-1), log_peak, oom)


def full_batch(model, loss_fn, epochs, lr, weight_decay):
    optimiser = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, max_lr=lr, total_steps=epochs)
    model.train()
    for _ in range(epochs):
        optimiser.zero_grad()
        loss = loss_fn()
        loss.backward()
        optimiser.step()
        schedule.step()
    return model.eval()


def base_of(entries):
    column = [e["name"] for e in entries].index("first_principles_mib")
    return rm.LogBase(column, entries[column]["mean"], entries[column]["std"])


def train_regressor(x, records, entries, seed):
    torch.manual_seed(seed)
    model = rm.MemoryRegressor(x.shape[1], base_of(entries), REGRESSOR["members"], REGRESSOR["hidden"])
    xt = torch.as_tensor(x)
    log_peak, oom, _ = targets(records)
    return full_batch(model, lambda: regression_loss(model.member_outputs(xt).squeeze(-1), log_peak, oom),
                      REGRESSOR["epochs"], REGRESSOR["lr"], REGRESSOR["weight_decay"])


def train_aggregate_classifier(x, records, entries, seed):
    torch.manual_seed(seed)
    model = rm.AggregateClassifier(x.shape[1], base_of(entries), CLASS_BINS_MIB, CLASSIFIER["members"],
                                   CLASSIFIER["hidden"])
    xt = torch.as_tensor(x)
    log_peak, oom, classes = targets(records)
    return full_batch(model, lambda: classification_loss(*model.member_outputs(xt), log_peak, oom, classes, CLASSIFIER),
                      CLASSIFIER["epochs"], CLASSIFIER["lr"], CLASSIFIER["weight_decay"])


def raw_columns(token_entries):
    out = []
    for name in ("params", "output_x_batch"):
        index = gf.TOKEN_FEATURES.index(name)
        entry = token_entries[index]
        assert entry["name"] == name and entry["transform"] == "log1p"
        out.append((index, entry["mean"], entry["std"]))
    return out


def train_sequence(encoded, records, token_entries, seed):
    torch.manual_seed(seed)
    cfg = SEQUENCE
    model = rm.SequenceClassifier(len(gf.ALL_KINDS), len(token_entries), raw_columns(token_entries), CLASS_BINS_MIB,
                                  d_model=cfg["d_model"], n_heads=cfg["n_heads"], n_layers=cfg["n_layers"],
                                  pool=cfg["pool"])
    log_peak, oom, classes = targets(records)
    lengths = np.array([len(ids) for ids, _ in encoded])
    n, batch = len(records), cfg["batch"]
    steps = cfg["epochs"] * math.ceil(n / batch)
    optimiser = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, max_lr=cfg["lr"], total_steps=steps)
    rng = np.random.RandomState(seed)
    model.train()
    for _ in range(cfg["epochs"]):
        order = np.argsort(lengths + rng.rand(n))
        batches = [order[s:s + batch] for s in range(0, n, batch)]
        for b in rng.permutation(len(batches)):
            rows = batches[b]
            ids, feats, mask = (torch.as_tensor(a) for a in pad_tokens([encoded[i] for i in rows]))
            rows_t = torch.as_tensor(rows)
            optimiser.zero_grad()
            mu, probs = model.member_outputs(ids, feats, mask)
            loss = classification_loss(mu, probs, log_peak[rows_t], oom[rows_t], classes[rows_t], cfg)
            loss.backward()
            optimiser.step()
            schedule.step()
    return model.eval()


def predict_sequence(model, encoded, batch=64):
    order = np.argsort([len(ids) for ids, _ in encoded])
    out = np.zeros((len(encoded), N_CLASSES), dtype=np.float32)
    with torch.no_grad():
        for s in range(0, len(order), batch):
            rows = order[s:s + batch]
            out[rows] = model(*(torch.as_tensor(a) for a in pad_tokens([encoded[i] for i in rows]))).numpy()
    return out


# ----------------------------------------------------------------------------- scoring

def conformal_quantiles(residuals):
    """q(c) = the ceil((n+1)c)-th smallest residual (finite-sample corrected conformal quantile)."""
    r = np.sort(np.asarray(residuals, dtype=np.float64))
    n = len(r)
    out = []
    for c in CONFIDENCES:
        k = min(n, math.ceil((n + 1) * c))
        out.append({"confidence": c, "log_ratio": float(r[k - 1])})
    return out


def log_ratio_at(quantiles, confidence):
    levels = [(q["confidence"], q["log_ratio"]) for q in quantiles]
    return float(np.interp(confidence, [c for c, _ in levels], [q for _, q in levels]))


def regression_figures(log_pred, records, quantiles):
    """Figures on measured (ok) rows and on oom rows (reported as not fitting)."""
    log_pred = np.asarray(log_pred, dtype=np.float64).reshape(-1)
    ok = np.array([r["status"] == "ok" for r in records])
    peak = np.array([r["peak"] for r in records])
    pred = np.exp(log_pred)
    bound = pred * math.exp(log_ratio_at(quantiles, BOUND_CONFIDENCE))
    rel = np.abs(pred[ok] / peak[ok] - 1.0)
    figures = {
        "median_abs_rel_error": float(np.median(rel)),
        "p90_abs_rel_error": float(np.quantile(rel, 0.9)),
        "under_rate": float(np.mean(pred[ok] < peak[ok])),
        "bound_exceeded_rate": float(np.mean(bound[ok] < peak[ok])),
        "oom_not_fit_rate": float(np.mean(bound[~ok] > CAPACITY_MIB)) if (~ok).any() else None,
        "ok_rows": int(ok.sum()), "oom_rows": int((~ok).sum()),
    }
    return figures


def true_classes(records):
    return np.array([N_CLASSES - 1 if r["status"] == "oom" else memory_class(r["peak"]) for r in records])


def class_figures(probabilities, records):
    labels = true_classes(records)
    predicted = np.argmax(probabilities, axis=1)
    return {"accuracy": float(np.mean(predicted == labels)), "below_rate": float(np.mean(predicted < labels))}


def prefixed(prefix, figures):
    return {prefix + k: v for k, v in figures.items() if k not in ("ok_rows", "oom_rows")}


# ----------------------------------------------------------------------------- export

def export_onnx(model, example_inputs, input_names, output_name, dynamic_axes, path):
    dims = {"N": torch.export.Dim("N"), "L": torch.export.Dim("L", min=2, max=MAX_TOKENS)}
    dynamic_shapes = {name: {axis: dims[dim] for axis, dim in axes.items()}
                      for name, axes in zip(input_names, dynamic_axes)}
    torch.onnx.export(model, tuple(torch.as_tensor(a) for a in example_inputs), path, dynamo=True,
                      external_data=False, input_names=list(input_names), output_names=[output_name],
                      dynamic_shapes=dynamic_shapes, verbose=False, optimize=True)


def onnx_session(path, threads=1):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def latency_us(session, feeds, runs=1000):
    for _ in range(50):
        session.run(None, feeds)
    timings = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, feeds)
        timings.append(time.perf_counter() - start)
    timings.sort()
    return {"median_us": 1e6 * timings[len(timings) // 2], "p99_us": 1e6 * timings[int(len(timings) * 0.99)]}


def onnx_aggregate(session, jobs, entries):
    x = encode([gf.raw_aggregate_features(j) for j in jobs], entries)
    return session.run(None, {"features": x})[0]


def onnx_sequence(session, jobs, token_entries):
    """Each job run alone at its own length (N = 1, mask all ones), as the service does."""
    out = []
    for ids, feats in encode_tokens(jobs, token_entries):
        out.append(session.run(None, {"kind_ids": ids[None], "token_features": feats[None],
                                      "mask": np.ones((1, len(ids)), dtype=np.float32)})[0][0])
    return np.array(out)
