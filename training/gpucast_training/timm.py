"""The timm stage: real-model (timm cnn / transformer) and MLP MiB estimators.

    python -m gpucast_training timm     (from training/; after the mlp stage, which writes the
                                         MLP classifiers, data/mlp/splits.json and the base manifest)

Writes data/timm/test.jsonl.gz, data/timm/cv_predictions.csv.gz, cv_quantiles.json and
pipeline_figures.json, models/timm_*.onnx, models/mlp_regressor.onnx, merges its entries into
models/manifest.json. Every feature comes from the service (`gpucast features --batch`, service.py).
(The evaluate stage writes docs/reports/training-real.md from these.)
"""

import json
import math
import os
import time

import numpy as np
import torch
from sklearn.model_selection import GroupKFold

from . import features as gf
from . import label_audit
from . import manifest as mf
from . import service
from . import timm_models as rm
from .constants import BOUND_CONFIDENCE, CAPACITY_MIB, CONFIDENCES, FAMILIES, MLP_FOLDS, SEED, VERSION
from .constants import REAL_CLASS_BINS_MIB as CLASS_BINS_MIB
from .constants import REAL_FOLDS as N_FOLDS
from .constants import REAL_MAX_TOKENS as MAX_TOKENS
from .constants import REAL_TEST_GROUP_FRACTION as TEST_GROUP_FRACTION
from .data import load_mlp_records, load_observation_records, load_timm, log, read_jsonl_gz, write_gz, write_jsonl_gz
from .onnx_export import export_onnx, median_latency_us, onnx_session

N_CLASSES = len(CLASS_BINS_MIB) + 1
THREADS = 2  # torch's threads; onnxruntime runs on one
TEST_FILE = "data/timm/test.jsonl.gz"
DESCRIPTIONS = "data/timm/descriptions.jsonl.gz"

# Features of the aggregate real-model estimators (all log1p + standardised; one-hots as-is).
# Outputs by layer kind: grouped CV median 7.3 % -> 6.9 %, but plain conv stacks (vgg, held out)
# came out 2x low, so half of the regressor's members do without them (REGRESSOR_KIND_BLIND).
KIND_OUTPUT_FEATURES = [
    "conv_outputs_x_batch",
    "norm_outputs_x_batch",
    "activation_outputs_x_batch",
    "linear_outputs_x_batch",
    "attention_outputs_x_batch",
    "other_outputs_x_batch",
]
REAL_FEATURES = (
    [
        "first_principles_mib",
        "horus_mib",
        "total_params",
        "total_activations",
        "batch_size",
        "activations_x_batch",
        "params_x_batch",
        "max_output_size",
        "n_layers",
        "depth",
        "n_conv",
        "n_attention",
        "n_norm",
        "n_batch_norm",
        "n_dropout",
        "n_activation",
        "n_embedding",
        "input_pixels",
    ]
    + KIND_OUTPUT_FEATURES
    + ["act_" + name for name in gf.HIDDEN_ACTIVATIONS]
)
# The traced regressor: the same, plus first_principles with describe's traced saved tensors as
# the activations (its base). Jobs that carry `saved_tensors` get it; others the plain one.
TRACED_FEATURES = REAL_FEATURES + ["traced_first_principles_mib"]
MLP_REG_FEATURES = [
    "first_principles_mib",
    "horus_mib",
    "total_params",
    "total_activations",
    "batch_size",
    "activations_x_batch",
    "params_x_batch",
    "max_output_size",
    "n_layers",
    "depth",
    "n_batch_norm",
    "n_dropout",
    "n_activation",
] + ["act_" + name for name in gf.HIDDEN_ACTIVATIONS]

# cap: the learned correction of first_principles stays within a factor e^1 (MemoryRegressor):
# without it, an unseen family at a large batch could get a 10x figure (resnet34 at batch 128 got
# 656,272 MiB out of fold).
REGRESSOR = dict(members=10, hidden=32, epochs=800, lr=1e-2, weight_decay=1e-3, oom_weight=3.0, cap=1.0)
REGRESSOR_KIND_BLIND = 5  # members 0..4 of a real-model regressor see no KIND_OUTPUT_FEATURES
CLASSIFIER = dict(members=5, hidden=32, epochs=800, lr=1e-2, weight_decay=1e-3, under_weight=1.0, regression_weight=1.0)
SEQUENCE = dict(
    d_model=32,
    n_heads=4,
    n_layers=1,
    pool=16,
    epochs=6,
    batch=64,
    lr=5e-3,
    weight_decay=1e-4,
    under_weight=1.0,
    regression_weight=1.0,
)
LOG_CAPACITY = math.log(CAPACITY_MIB)


# ----------------------------------------------------------------------------- data


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


def test_line(record):
    line = {"id": record["id"], "job": record["job"], "measured_peak_mib": record["peak"], "status": record["status"]}
    if "faketensor" in record:
        line["faketensor_estimate_mib"] = record["faketensor"]
    return line


def write_test_file(records, path):
    write_jsonl_gz(path, (test_line(record) for record in records))


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
    tokens = [token for tokens in service.raw_tokens(jobs, gf.TOKEN_FEATURES) for token in tokens]
    entries = []
    for index, name in enumerate(gf.TOKEN_FEATURES):
        transform = gf.DEFAULT_TOKEN_TRANSFORMS[name]
        values = np.array([gf.apply_transform(token[index], transform) for token in tokens])
        entries.append(
            {"name": name, "transform": transform, "mean": float(values.mean()), "std": float(values.std()) or 1.0}
        )
    return entries


def encode_tokens(jobs, entries):
    """Per job: kind ids [L] and normalised token features [L, T] (numpy)."""
    ids = service.kind_ids(jobs, gf.ALL_KINDS)
    feats = gf.token_vectors(jobs, entries)
    return [(np.array(i, dtype=np.int64), np.array(f, dtype=np.float32)) for i, f in zip(ids, feats)]


def pad_tokens(encoded, length=None):
    length = length or max(len(ids) for ids, _ in encoded)
    n, t = len(encoded), encoded[0][1].shape[1]
    kind_ids = np.zeros((n, length), dtype=np.int64)
    feats = np.zeros((n, length, t), dtype=np.float32)
    mask = np.zeros((n, length), dtype=np.float32)
    for row, (ids, f) in enumerate(encoded):
        kind_ids[row, : len(ids)] = ids
        feats[row, : len(ids)] = f
        mask[row, : len(ids)] = 1.0
    return kind_ids, feats, mask


def memory_class(peak):
    return gf.memory_class(peak, CLASS_BINS_MIB)


def targets(records):
    """log peak, censored flag (oom: true need >= capacity) and class (oom -> top class)."""
    log_peak = torch.tensor([math.log(r["peak"]) for r in records], dtype=torch.float32)
    oom = torch.tensor([r["status"] == "oom" for r in records], dtype=torch.bool)
    classes = torch.tensor(
        [N_CLASSES - 1 if r["status"] == "oom" else memory_class(r["peak"]) for r in records], dtype=torch.long
    )
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
    return (
        nll
        + cfg["under_weight"] * below_mass
        + cfg["regression_weight"] * regression_loss(mu.squeeze(-1), log_peak, oom)
    )


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


def base_of(entries, base_feature="first_principles_mib"):
    column = [e["name"] for e in entries].index(base_feature)
    return rm.LogBase(column, entries[column]["mean"], entries[column]["std"])


def train_regressor(x, records, entries, seed, base_feature="first_principles_mib"):
    torch.manual_seed(seed)
    names = [e["name"] for e in entries]
    member_inputs = np.ones((REGRESSOR["members"], len(names)), dtype=np.float32)
    member_inputs[:REGRESSOR_KIND_BLIND, [i for i, n in enumerate(names) if n in KIND_OUTPUT_FEATURES]] = 0.0
    model = rm.MemoryRegressor(
        x.shape[1],
        base_of(entries, base_feature),
        REGRESSOR["members"],
        REGRESSOR["hidden"],
        REGRESSOR.get("cap"),
        member_inputs,
    )
    xt = torch.as_tensor(x)
    log_peak, oom, _ = targets(records)
    return full_batch(
        model,
        lambda: regression_loss(model.member_outputs(xt).squeeze(-1), log_peak, oom),
        REGRESSOR["epochs"],
        REGRESSOR["lr"],
        REGRESSOR["weight_decay"],
    )


def train_aggregate_classifier(x, records, entries, seed):
    torch.manual_seed(seed)
    model = rm.AggregateClassifier(
        x.shape[1], base_of(entries), CLASS_BINS_MIB, CLASSIFIER["members"], CLASSIFIER["hidden"]
    )
    xt = torch.as_tensor(x)
    log_peak, oom, classes = targets(records)
    return full_batch(
        model,
        lambda: classification_loss(*model.member_outputs(xt), log_peak, oom, classes, CLASSIFIER),
        CLASSIFIER["epochs"],
        CLASSIFIER["lr"],
        CLASSIFIER["weight_decay"],
    )


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
    model = rm.SequenceClassifier(
        len(gf.ALL_KINDS),
        len(token_entries),
        raw_columns(token_entries),
        CLASS_BINS_MIB,
        d_model=cfg["d_model"],
        n_heads=cfg["n_heads"],
        n_layers=cfg["n_layers"],
        pool=cfg["pool"],
    )
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
        batches = [order[s : s + batch] for s in range(0, n, batch)]
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
            rows = order[s : s + batch]
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


def audit_rows(records):
    rows = []
    for r in records:
        model, batch = r["id"].rsplit("@", 1)
        rows.append((model, int(batch), r["status"], r["peak"]))
    return rows


def credible_oom(records):
    """oom rows that are credibly out of memory (label_audit.credible_oom)."""
    return np.array(label_audit.credible_oom(audit_rows(records)), dtype=bool)


def training_rows(records):
    """Rows the estimators learn from: every row but measurement accidents, i.e. ok rows no
    working run gives (`label_audit.failed_ok`) and oom rows that are not credible. Teaching
    crashed oom rows as "needs > 40 GB" made the final regressor put resnet50 at batch 64
    (measured 8,465 MiB) at 54,460 MiB, because resnetaa50d crashed at 10,151 MiB at that batch
    size; grouped CV without them: median error 8.5 % -> 7.3 %, p90 40 % -> 30 %. Scoring still
    uses every row as labelled."""
    statuses = np.array([r["status"] for r in records])
    failed = np.array(label_audit.failed_ok(audit_rows(records)), dtype=bool)
    return ~failed & ((statuses == "ok") | credible_oom(records))


def regression_figures(log_pred, records, quantiles):
    """Figures on measured (ok) rows and on oom rows (reported as not fitting). `quantiles`:
    family -> conformal quantiles (each row's bound uses its family's)."""
    log_pred = np.asarray(log_pred, dtype=np.float64).reshape(-1)
    q95 = np.array([log_ratio_at(quantiles[r.get("family", "mlp")], BOUND_CONFIDENCE) for r in records])
    ok = np.array([r["status"] == "ok" for r in records])
    peak = np.array([r["peak"] for r in records])
    pred = np.exp(log_pred)
    bound = pred * np.exp(q95)
    rel = np.abs(pred[ok] / peak[ok] - 1.0)
    figures = {
        "median_abs_rel_error": float(np.median(rel)),
        "p90_abs_rel_error": float(np.quantile(rel, 0.9)),
        "under_rate": float(np.mean(pred[ok] < peak[ok])),
        "class_accuracy": float(np.mean([memory_class(p) for p in pred] == true_classes(records))),
        "bound_exceeded_rate": float(np.mean(bound[ok] < peak[ok])),
        "oom_not_fit_rate": float(np.mean(bound[~ok] > CAPACITY_MIB)) if (~ok).any() else None,
        "ok_rows": int(ok.sum()),
        "oom_rows": int((~ok).sum()),
    }
    if (~ok).any():
        credible = credible_oom(records)
        figures["credible_oom_not_fit_rate"] = (
            float(np.mean(bound[credible] > CAPACITY_MIB)) if credible.any() else None
        )
        figures["credible_oom_rows"] = int(credible.sum())
    return figures


def true_classes(records):
    return np.array([N_CLASSES - 1 if r["status"] == "oom" else memory_class(r["peak"]) for r in records])


def class_figures(probabilities, records):
    labels = true_classes(records)
    predicted = np.argmax(probabilities, axis=1)
    ok = np.array([r["status"] == "ok" for r in records])
    return {
        "accuracy": float(np.mean(predicted == labels)),
        "below_rate": float(np.mean(predicted < labels)),
        "ok_accuracy": float(np.mean(predicted[ok] == labels[ok])),
        "oom_top_class_rate": float(np.mean(predicted[~ok] == N_CLASSES - 1)) if (~ok).any() else None,
    }


def prefixed(prefix, figures):
    return {prefix + k: v for k, v in figures.items() if k not in ("ok_rows", "oom_rows", "credible_oom_rows")}


# ----------------------------------------------------------------------------- export


def export(model, example_inputs, input_names, output_name, dynamic_axes, path):
    """export_onnx with this stage's token range (2..REAL_MAX_TOKENS)."""
    export_onnx(model, example_inputs, input_names, output_name, dynamic_axes, path, MAX_TOKENS, min_tokens=2)


def onnx_aggregate(session, jobs, entries):
    x = encode(service.raw_aggregate(jobs), entries)
    return session.run(None, {"features": x})[0]


def onnx_sequence(session, jobs, token_entries):
    """Each job run alone at its own length (N = 1, mask all ones), as the service does."""
    out = []
    for ids, feats in encode_tokens(jobs, token_entries):
        out.append(
            session.run(
                None,
                {
                    "kind_ids": ids[None],
                    "token_features": feats[None],
                    "mask": np.ones((1, len(ids)), dtype=np.float32),
                },
            )[0][0]
        )
    return np.array(out)


# ----------------------------------------------------------------------------- MLP regressor


def load_mlp(csv_path, splits_path):
    """The MLP rows as regression records, and the mlp stage's split."""
    records = [
        {"id": str(r["index"]), "group": r["group"], "status": "ok", "peak": float(r["peak"]), "job": r["job"]}
        for r in load_mlp_records(csv_path)
    ]
    return records, mf.read_json(splits_path)


def run_mlp_regressor(layout, threads):
    records, splits = load_mlp(layout.mlp_csv, layout.read("data", "mlp", "splits.json"))
    train = [records[i] for i in splits["train_rows"]]
    raws = service.raw_aggregate([r["job"] for r in train])
    folds = GroupKFold(n_splits=MLP_FOLDS, shuffle=True, random_state=SEED).split(
        np.zeros(len(train)), groups=[r["group"] for r in train]
    )
    oof = np.zeros(len(train))
    for k, (fit, val) in enumerate(folds):
        entries = fit_entries([raws[i] for i in fit], MLP_REG_FEATURES)
        model = train_regressor(encode([raws[i] for i in fit], entries), [train[i] for i in fit], entries, SEED + k)
        with torch.no_grad():
            oof[val] = model(torch.as_tensor(encode([raws[i] for i in val], entries))).numpy()[:, 0]
    peaks = np.array([r["peak"] for r in train])
    quantiles = conformal_quantiles(np.log(peaks) - oof)
    cv = regression_figures(oof, train, {"mlp": quantiles})
    entries = fit_entries(raws, MLP_REG_FEATURES)
    model = train_regressor(encode(raws, entries), train, entries, SEED)
    path = layout.out("models", "mlp_regressor.onnx")
    export(model, [encode(raws[:2], entries)], ["features"], "log_mib", [{0: "N"}], path)
    session = onnx_session(path, threads)
    test_file = "data/mlp/test.jsonl.gz"
    test = [
        {"status": "ok", "peak": float(line["measured_peak_mib"]), "job": line["job"]}
        for line in read_jsonl_gz(layout.read(test_file))
    ]
    test = [dict(r, id="%d@0" % i) for i, r in enumerate(test)]
    test_pred = onnx_aggregate(session, [r["job"] for r in test], entries)
    with torch.no_grad():
        torch_pred = model(torch.as_tensor(encode(service.raw_aggregate([r["job"] for r in test]), entries))).numpy()
    figures = {
        "cv": cv,
        "test": regression_figures(test_pred, test, {"mlp": quantiles}),
        "max_abs_diff": float(np.abs(torch_pred - test_pred).max()),
        "latency": median_latency_us(session, {"features": encode(raws[:1], entries)}),
    }
    entry = {
        "name": "mlp_memory_regressor",
        "version": VERSION,
        "family": "mlp",
        "kind": "memory_regressor",
        "file": "mlp_regressor.onnx",
        "sha256": mf.sha256_of(path),
        "input": {"type": "aggregate", "features": entries},
        "output": "log_mib",
        "runtime": mf.IN_PROCESS,
        "residual_quantiles": quantiles,
        "capacity_mib": CAPACITY_MIB,
        "test_file": test_file,
        "validation": {**prefixed("cv_", cv), **prefixed("test_", figures["test"])},
    }
    for key in ("cv_oom_not_fit_rate", "test_oom_not_fit_rate"):
        entry["validation"].pop(key, None)
    return entry, figures, entries


# ----------------------------------------------------------------------------- timm


def family_mask(records, family):
    return np.array([r["family"] == family for r in records])


def family_mask_or_all(records, family):
    return np.ones(len(records), bool) if family == "all" else family_mask(records, family)


def figures_of(records, mask, log_reg, log_traced, p_agg, p_seq, quantiles, traced_quantiles):
    """Every estimator's figures on the masked rows (regressors: log MiB; classifiers: probabilities)."""
    recs = subset(records, mask)
    return {
        "regressor": regression_figures(log_reg[mask], recs, quantiles),
        "traced_regressor": regression_figures(log_traced[mask], recs, traced_quantiles),
        "mlp_ensemble": class_figures(p_agg[mask], recs),
        "sequence_transformer": class_figures(p_seq[mask], recs),
        "combined": class_figures((p_agg[mask] + p_seq[mask]) / 2, recs),
    }


def subset(records, mask):
    return [r for r, m in zip(records, mask) if m]


def run_timm(layout, threads):
    records, dropped = load_timm(layout.timm_csv, layout.read(DESCRIPTIONS))
    test_groups = split_groups(records)
    train = [r for r in records if r["group"] not in test_groups]
    test = [r for r in records if r["group"] in test_groups]
    observation_rows, observations_skipped = [], 0
    if layout.observations:
        observation_rows, observations_skipped = load_observation_records(layout.observations)
        train += observation_rows
        log(
            "timm: %d rows from the service's observations (%s), %d skipped (job does not parse)"
            % (len(observation_rows), layout.observations, observations_skipped)
        )
    test_file = TEST_FILE
    write_test_file(test, layout.out(test_file))
    log(
        "timm: %d rows (%s dropped), train %d rows / test %d rows (%d groups held out)"
        % (len(records), dropped, len(train), len(test), len(test_groups))
    )
    raws = service.raw_aggregate([r["job"] for r in train])
    jobs = [r["job"] for r in train]
    groups = [r["group"] for r in train]
    folds = list(
        GroupKFold(n_splits=N_FOLDS, shuffle=True, random_state=SEED).split(np.zeros(len(train)), groups=groups)
    )
    oof_reg = np.zeros(len(train))
    oof_traced = np.zeros(len(train))
    oof_agg = np.zeros((len(train), N_CLASSES))
    oof_seq = np.zeros((len(train), N_CLASSES))
    usable = training_rows(train)
    log(
        "timm: learning from %d of %d training rows (%d crashed oom rows, %d failed ok rows dropped)"
        % (
            usable.sum(),
            len(train),
            sum(1 for r, u in zip(train, usable) if not u and r["status"] == "oom"),
            sum(1 for r, u in zip(train, usable) if not u and r["status"] == "ok"),
        )
    )
    for k, (fit, val) in enumerate(folds):
        fit = fit[usable[fit]]
        entries = fit_entries([raws[i] for i in fit], REAL_FEATURES)
        x_fit, x_val = encode([raws[i] for i in fit], entries), encode([raws[i] for i in val], entries)
        fit_records = [train[i] for i in fit]
        regressor = train_regressor(x_fit, fit_records, entries, SEED + k)
        classifier = train_aggregate_classifier(x_fit, fit_records, entries, SEED + k)
        traced_entries = fit_entries([raws[i] for i in fit], TRACED_FEATURES)
        traced = train_regressor(
            encode([raws[i] for i in fit], traced_entries),
            fit_records,
            traced_entries,
            SEED + k,
            "traced_first_principles_mib",
        )
        with torch.no_grad():
            oof_reg[val] = regressor(torch.as_tensor(x_val)).numpy()[:, 0]
            oof_agg[val] = classifier(torch.as_tensor(x_val)).numpy()
            oof_traced[val] = traced(torch.as_tensor(encode([raws[i] for i in val], traced_entries))).numpy()[:, 0]
        token_entries = fit_token_entries([jobs[i] for i in fit])
        encoded = encode_tokens(jobs, token_entries)
        sequence = train_sequence([encoded[i] for i in fit], fit_records, token_entries, SEED + k)
        oof_seq[val] = predict_sequence(sequence, [encoded[i] for i in val])
        log("fold %d done" % k)
    ok = np.array([r["status"] == "ok" for r in train])
    peaks = np.array([r["peak"] for r in train])
    # Conformal quantiles per family (cnn residuals are wider than transformer ones).
    quantiles = {
        family: conformal_quantiles((np.log(peaks) - oof_reg)[ok & family_mask(train, family)]) for family in FAMILIES
    }
    traced_quantiles = {
        family: conformal_quantiles((np.log(peaks) - oof_traced)[ok & family_mask(train, family)])
        for family in FAMILIES
    }
    cv = {
        family: figures_of(
            train, family_mask_or_all(train, family), oof_reg, oof_traced, oof_agg, oof_seq, quantiles, traced_quantiles
        )
        for family in FAMILIES + ["all"]
    }
    save_oof(layout, train, oof_reg, oof_traced, oof_agg, oof_seq, raws, quantiles)

    # Final models on the whole training part (its usable rows).
    learn = np.flatnonzero(usable)
    learn_records = [train[i] for i in learn]
    entries = fit_entries([raws[i] for i in learn], REAL_FEATURES)
    x = encode(raws, entries)
    regressor = train_regressor(x[learn], learn_records, entries, SEED)
    traced_entries = fit_entries([raws[i] for i in learn], TRACED_FEATURES)
    x_traced = encode(raws, traced_entries)
    traced = train_regressor(x_traced[learn], learn_records, traced_entries, SEED, "traced_first_principles_mib")
    classifier = train_aggregate_classifier(x[learn], learn_records, entries, SEED)
    token_entries = fit_token_entries([jobs[i] for i in learn])
    encoded = encode_tokens(jobs, token_entries)
    sequence = train_sequence([encoded[i] for i in learn], learn_records, token_entries, SEED)
    paths = {
        name: layout.out("models", name + ".onnx")
        for name in ("timm_regressor", "timm_traced_regressor", "timm_mlp_ensemble", "timm_sequence_transformer")
    }
    export(regressor, [x[:2]], ["features"], "log_mib", [{0: "N"}], paths["timm_regressor"])
    export(traced, [x_traced[:2]], ["features"], "log_mib", [{0: "N"}], paths["timm_traced_regressor"])
    export(classifier, [x[:2]], ["features"], "probabilities", [{0: "N"}], paths["timm_mlp_ensemble"])
    example = pad_tokens(encoded[:2])
    export(
        sequence,
        example,
        ["kind_ids", "token_features", "mask"],
        "probabilities",
        [{0: "N", 1: "L"}, {0: "N", 1: "L"}, {0: "N", 1: "L"}],
        paths["timm_sequence_transformer"],
    )

    # Test figures through onnxruntime, from the test file's job JSON.
    test_lines = read_jsonl_gz(layout.read(test_file))
    test_records = [
        {
            "id": l["id"],
            "family": l["job"]["family"],
            "status": l["status"],
            "peak": l["measured_peak_mib"],
            "job": l["job"],
        }
        for l in test_lines
    ]
    test_jobs = [r["job"] for r in test_records]
    sessions = {name: onnx_session(path, threads) for name, path in paths.items()}
    t_reg = onnx_aggregate(sessions["timm_regressor"], test_jobs, entries)[:, 0]
    t_traced = onnx_aggregate(sessions["timm_traced_regressor"], test_jobs, traced_entries)[:, 0]
    t_agg = onnx_aggregate(sessions["timm_mlp_ensemble"], test_jobs, entries)
    t_seq = onnx_sequence(sessions["timm_sequence_transformer"], test_jobs, token_entries)
    x_test = torch.as_tensor(encode(service.raw_aggregate(test_jobs), entries))
    with torch.no_grad():
        x_test_traced = torch.as_tensor(encode(service.raw_aggregate(test_jobs), traced_entries))
        diffs = {
            "timm_regressor": float(np.abs(regressor(x_test).numpy()[:, 0] - t_reg).max()),
            "timm_traced_regressor": float(np.abs(traced(x_test_traced).numpy()[:, 0] - t_traced).max()),
            "timm_mlp_ensemble": float(np.abs(classifier(x_test).numpy() - t_agg).max()),
            "timm_sequence_transformer": float(
                np.abs(predict_sequence(sequence, encode_tokens(test_jobs, token_entries)) - t_seq).max()
            ),
        }
    test_figures = {}
    for family in FAMILIES + ["all"]:
        mask = family_mask_or_all(test_records, family)
        recs = subset(test_records, mask)
        test_figures[family] = figures_of(
            test_records, mask, t_reg, t_traced, t_agg, t_seq, quantiles, traced_quantiles
        )
        ok_t = np.array([r["status"] == "ok" for r in recs])
        residual = np.log([r["peak"] for r in recs]) - t_reg[mask]
        if family != "all":
            test_figures[family]["coverage"] = {
                str(q["confidence"]): float(np.mean(residual[ok_t] <= q["log_ratio"])) for q in quantiles[family]
            }
    # Latency, N = 1; the sequence model at the longest description (1,630 layers) and at 4,096.
    longest = max(range(len(jobs)), key=lambda i: len(jobs[i]["layers"]))
    ids, feats = encoded[longest]
    latency = {
        "timm_regressor": median_latency_us(sessions["timm_regressor"], {"features": x[:1]}),
        "timm_traced_regressor": median_latency_us(sessions["timm_traced_regressor"], {"features": x_traced[:1]}),
        "timm_mlp_ensemble": median_latency_us(sessions["timm_mlp_ensemble"], {"features": x[:1]}),
        "timm_sequence_transformer@%d" % len(ids): median_latency_us(
            sessions["timm_sequence_transformer"],
            {"kind_ids": ids[None], "token_features": feats[None], "mask": np.ones((1, len(ids)), np.float32)},
            200,
        ),
    }
    reps = -(-MAX_TOKENS // len(ids))
    ids4, feats4 = np.tile(ids, reps)[:MAX_TOKENS], np.tile(feats, (reps, 1))[:MAX_TOKENS]
    latency["timm_sequence_transformer@%d" % MAX_TOKENS] = median_latency_us(
        sessions["timm_sequence_transformer"],
        {"kind_ids": ids4[None], "token_features": feats4[None], "mask": np.ones((1, MAX_TOKENS), np.float32)},
        100,
    )
    info = {
        "dropped": dropped,
        "rows": len(records),
        "train_rows": len(train),
        "test_rows": len(test),
        "learned_rows": int(usable.sum()),
        "test_groups": test_groups,
        "n_groups": len(set(r["group"] for r in records)),
        "train_models": len(set(r["model"] for r in train)),
        "test_models": len(set(r["model"] for r in test)),
        "test_file": test_file,
        "observation_rows": len(observation_rows),
        "observation_rows_skipped": observations_skipped,
    }
    return dict(
        info=info,
        cv=cv,
        test=test_figures,
        quantiles=quantiles,
        traced_quantiles=traced_quantiles,
        entries=entries,
        traced_entries=traced_entries,
        token_entries=token_entries,
        paths=paths,
        diffs=diffs,
        latency=latency,
        test_records=test_records,
    )


def save_oof(layout, train, oof_reg, oof_traced, oof_agg, oof_seq, raws, quantiles):
    header = (
        "id,group,family,status,batch_size,measured_peak_mib,faketensor_mib,first_principles_mib,"
        "horus_mib,regressor_mib,traced_first_principles_mib,traced_regressor_mib,"
        "p_mlp_ensemble,p_sequence_transformer\n"
    )
    rows = (
        "%s,%s,%s,%s,%d,%.1f,%.1f,%.3f,%.3f,%.3f,%.3f,%.3f,%s,%s\n"
        % (
            r["id"],
            r["group"],
            r["family"],
            r["status"],
            r["batch_size"],
            r["peak"],
            r["faketensor"],
            f["first_principles_mib"],
            f["horus_mib"],
            math.exp(reg),
            f["traced_first_principles_mib"],
            math.exp(traced),
            " ".join("%.5f" % p for p in agg),
            " ".join("%.5f" % p for p in seq),
        )
        for r, reg, traced, agg, seq, f in zip(train, oof_reg, oof_traced, oof_agg, oof_seq, raws)
    )
    write_gz(layout.out("data", "timm", "cv_predictions.csv.gz"), [header] + list(rows))
    mf.write_json(layout.out("data", "timm", "cv_quantiles.json"), quantiles, newline=False)


# ----------------------------------------------------------------------------- manifest

REAL_NAMES = {
    family: {
        "regressor": family + "_memory_regressor",
        "traced_regressor": family + "_traced_memory_regressor",
        "mlp_ensemble": family + "_mlp_ensemble",
        "sequence_transformer": family + "_sequence_transformer",
    }
    for family in FAMILIES
}
OUR_NAMES = {"mlp_memory_regressor"} | {n for names in REAL_NAMES.values() for n in names.values()}


def timm_entries(result):
    out = []
    sha = {name: mf.sha256_of(path) for name, path in result["paths"].items()}
    for family in FAMILIES:
        cv, test = result["cv"][family], result["test"][family]
        names = REAL_NAMES[family]
        common = {"version": VERSION, "family": family, "test_file": result["info"]["test_file"]}
        out.append(
            {
                "name": names["regressor"],
                **common,
                "kind": "memory_regressor",
                "file": "timm_regressor.onnx",
                "sha256": sha["timm_regressor"],
                "input": {"type": "aggregate", "features": result["entries"]},
                "output": "log_mib",
                "runtime": mf.IN_PROCESS,
                "residual_quantiles": result["quantiles"][family],
                "capacity_mib": CAPACITY_MIB,
                "validation": {**prefixed("cv_", cv["regressor"]), **prefixed("test_", test["regressor"])},
            }
        )
        out.append(
            {
                "name": names["traced_regressor"],
                **common,
                "kind": "memory_regressor",
                "file": "timm_traced_regressor.onnx",
                "sha256": sha["timm_traced_regressor"],
                "requires": ["saved_tensors"],
                "input": {"type": "aggregate", "features": result["traced_entries"]},
                "output": "log_mib",
                "runtime": mf.IN_PROCESS,
                "residual_quantiles": result["traced_quantiles"][family],
                "capacity_mib": CAPACITY_MIB,
                "validation": {
                    **prefixed("cv_", cv["traced_regressor"]),
                    **prefixed("test_", test["traced_regressor"]),
                },
            }
        )
        out.append(
            {
                "name": names["mlp_ensemble"],
                **common,
                "kind": "memory_classifier",
                "file": "timm_mlp_ensemble.onnx",
                "sha256": sha["timm_mlp_ensemble"],
                "input": {"type": "aggregate", "features": result["entries"]},
                "output": "probabilities",
                "runtime": mf.IN_PROCESS,
                "class_bins_mib": CLASS_BINS_MIB,
                "validation": {**prefixed("cv_", cv["mlp_ensemble"]), **prefixed("test_", test["mlp_ensemble"])},
            }
        )
        out.append(
            {
                "name": names["sequence_transformer"],
                **common,
                "kind": "memory_classifier",
                "file": "timm_sequence_transformer.onnx",
                "sha256": sha["timm_sequence_transformer"],
                "input": {
                    "type": "sequence",
                    "kind_vocab": gf.ALL_KINDS,
                    "max_tokens": MAX_TOKENS,
                    "token_features": result["token_entries"],
                },
                "output": "probabilities",
                "runtime": mf.ONNXRUNTIME,
                "class_bins_mib": CLASS_BINS_MIB,
                "validation": {
                    **prefixed("cv_", cv["sequence_transformer"]),
                    **prefixed("test_", test["sequence_transformer"]),
                },
            }
        )
    return out


def merge_manifest(layout, entries, timm_result):
    """The mlp stage's manifest with this stage's estimators, training data and split blocks."""
    timm_csv, mlp_csv = layout.timm_csv, layout.mlp_csv
    manifest = mf.replace_estimators(mf.read_json(layout.read("models", "manifest.json")), OUR_NAMES, entries)
    mlp_data = manifest["training_data"]
    if isinstance(mlp_data, list):
        mlp_data = next(d for d in mlp_data if d["file"] == os.path.basename(mlp_csv))
    info = timm_result["info"]
    manifest["training_data"] = [
        mlp_data,
        {
            "file": os.path.basename(timm_csv),
            "sha256": mf.sha256_of(timm_csv),
            "rows": info["rows"] + sum(info["dropped"].values()),
            "families": FAMILIES,
            "descriptions": DESCRIPTIONS,
            "descriptions_sha256": mf.sha256_of(layout.read(DESCRIPTIONS)),
        },
    ]
    manifest["split_real"] = {
        "protocol": (
            "group = timm model name without source prefixes (tf_, legacy_, gluon_, timm_, hf_) up to the "
            "first '_' or digit; %d of %d groups held out (seeded shuffle, ~15 %% of models) for the test "
            "file; %d-fold GroupKFold (shuffled, same seed) on the rest for CV, out-of-fold residuals of "
            "ok rows give the conformal quantiles; failed/anomalous rows excluded; oom rows censored "
            "(need > capacity), scored as 'not fitting' and as the top class"
        )
        % (len(info["test_groups"]), info["n_groups"], N_FOLDS),
        "seed": SEED,
        "test_file": info["test_file"],
        "test_groups": info["test_groups"],
        "train_rows": info["train_rows"],
        "test_rows": info["test_rows"],
        "folds": N_FOLDS,
        "excluded_rows": info["dropped"],
    }
    manifest["combined_by_family"] = {}
    for family in FAMILIES:
        names = REAL_NAMES[family]
        manifest["combined_by_family"][family] = {
            "members": [names["mlp_ensemble"], names["sequence_transformer"]],
            "rule": "mean_probabilities",
            "validation": {
                **prefixed("cv_", timm_result["cv"][family]["combined"]),
                **prefixed("test_", timm_result["test"][family]["combined"]),
            },
        }
    mf.write_manifest(layout.out("models", "manifest.json"), manifest)
    return manifest


def run(layout, threads=None):
    torch.set_num_threads(threads or THREADS)
    started = time.time()
    log("MLP memory regressor")
    mlp_entry, mlp_figures, _ = run_mlp_regressor(layout, 1)
    log("MLP regressor: cv %s test %s" % (mlp_figures["cv"], mlp_figures["test"]))
    timm = run_timm(layout, 1)
    merge_manifest(layout, [mlp_entry] + timm_entries(timm), timm)
    mf.write_json(
        layout.out("data", "timm", "pipeline_figures.json"),
        {
            "timm": {k: timm[k] for k in ("info", "cv", "test", "quantiles", "diffs", "latency")},
            "mlp_regressor": mlp_figures,
            "seconds": time.time() - started,
        },
        newline=False,
    )
    log("done in %.0f s" % (time.time() - started))
    print(json.dumps({k: timm[k] for k in ("cv", "test", "diffs", "latency")}, indent=1))
