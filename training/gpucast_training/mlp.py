"""The mlp stage: data -> split -> CV -> final models -> ONNX -> manifest/report.

    python -m gpucast_training mlp      (from training/; retrain.sh runs it first)

Writes models/{mlp_ensemble,sequence_transformer,smact,smocc}.onnx, data/mlp/, the base
models/manifest.json, and docs/reports/training-mlp.md. Every feature comes from the service
(`gpucast features --batch`, service.py).
"""

import json
import math
import os
import time

import numpy as np
import onnxruntime as ort
import torch
from sklearn.model_selection import GroupKFold, GroupShuffleSplit

from . import features as gf
from . import manifest as mf
from . import mlp_models as gm
from . import pages
from . import service
from .constants import MLP_CLASS_BINS_MIB as CLASS_BINS_MIB
from .constants import MLP_FOLDS as N_FOLDS
from .constants import MLP_MAX_TOKENS as MAX_TOKENS
from .constants import MLP_TEST_FRACTION as TEST_FRACTION
from .constants import SEED, VERSION
from .data import load_mlp_records, log, read_jsonl_gz, write_jsonl_gz
from .mlp_report import KEEP, PAGE
from .onnx_export import export_onnx, median_latency_us, onnx_session
from .simulated_report import written_at

N_CLASSES = len(CLASS_BINS_MIB) + 1
TEST_FILE = "data/mlp/test.jsonl.gz"
THREADS = 1
# Under-predicting memory makes a scheduler overcommit a GPU; that costs more than reserving
# too much, so the classifiers' loss adds this weight x the probability mass below the true class.
UNDER_WEIGHT = 1.0  # chosen by CV among 0, 0.5, 1, 2 (best combined CV accuracy)
# Weight of the memory-estimate regression (GiB units) in the classifiers' loss.
REGRESSION_WEIGHT = 1.0
# Count features the models also see on a linear scale (memory is ~linear in them).
LINEAR_SCALE_FEATURES = [
    "total_params",
    "activations_x_batch",
    "params_x_batch",
    "total_activations",
    "batch_size",
    "max_output_size",
]
LINEAR_SCALE_TOKENS = ["params", "output_x_batch"]

ENSEMBLE = dict(members=5, hidden=32, epochs=1000, lr=1e-2, weight_decay=1e-3)
TRANSFORMER = dict(d_model=32, n_heads=4, n_layers=2, d_ff=64, epochs=40, batch=64, lr=3e-3, weight_decay=1e-4)
# Independently seeded transformers averaged inside the exported graph (seeds seed, seed+1, ...).
# Chosen by grouped CV among the member counts whose N=1 latency (L=46, one thread) stays within
# ~250 us: K=1 had the best CV accuracy (0.9904), NLL and combined accuracy of K <= 3; K=5
# scored 0.9917 (3 jobs of 2,400, within noise) but took ~360 us.
SEQUENCE_MEMBERS = 1
REGRESSOR = dict(members=3, hidden=32, epochs=500, lr=1e-2, weight_decay=1e-3)


# ----------------------------------------------------------------------------- data


def split_train_test(records):
    groups = [record["group"] for record in records]
    splitter = GroupShuffleSplit(n_splits=1, test_size=TEST_FRACTION, random_state=SEED)
    train, test = next(splitter.split(np.zeros(len(records)), groups=groups))
    return sorted(train.tolist()), sorted(test.tolist())


def cv_folds(train_records):
    groups = [record["group"] for record in train_records]
    folds = GroupKFold(n_splits=N_FOLDS, shuffle=True, random_state=SEED)
    return list(folds.split(np.zeros(len(train_records)), groups=groups))


# ----------------------------------------------------------------------------- features


def fit_entries(raw_columns, names, transforms):
    """Manifest feature entries with mean/std of the transformed training values."""
    entries = []
    for name, values in zip(names, raw_columns):
        transform = transforms[name]
        if transform == "identity" and name.startswith("act_"):
            entries.append({"name": name, "transform": "identity", "mean": 0.0, "std": 1.0})
            continue
        transformed = [gf.apply_transform(value, transform) for value in values]
        mean = math.fsum(transformed) / len(transformed)
        std = math.sqrt(math.fsum((value - mean) ** 2 for value in transformed) / len(transformed))
        entries.append({"name": name, "transform": transform, "mean": mean, "std": std if std > 0 else 1.0})
    return entries


def fit_aggregate_entries(jobs):
    raws = service.raw_aggregate(jobs)
    columns = [[raw[name] for raw in raws] for name in gf.AGGREGATE_FEATURES]
    return fit_entries(columns, gf.AGGREGATE_FEATURES, gf.DEFAULT_TRANSFORMS)


def fit_token_entries(jobs):
    tokens = [token for tokens in service.raw_tokens(jobs, gf.TOKEN_FEATURES) for token in tokens]
    columns = [[token[i] for token in tokens] for i in range(len(gf.TOKEN_FEATURES))]
    return fit_entries(columns, gf.TOKEN_FEATURES, gf.DEFAULT_TOKEN_TRANSFORMS)


def encode_aggregate(jobs, entries):
    return np.array(gf.aggregate_vectors(jobs, entries), dtype=np.float32)


def encode_sequence(jobs, entries, kind_vocab, length=None):
    ids = service.kind_ids(jobs, kind_vocab)
    tokens = gf.token_vectors(jobs, entries)
    length = length or max(len(row) for row in ids)
    kind_ids = np.zeros((len(jobs), length), dtype=np.int64)
    token_features = np.zeros((len(jobs), length, len(entries)), dtype=np.float32)
    mask = np.zeros((len(jobs), length), dtype=np.float32)
    for row, (job_ids, job_tokens) in enumerate(zip(ids, tokens)):
        kind_ids[row, : len(job_ids)] = job_ids
        token_features[row, : len(job_ids)] = job_tokens
        mask[row, : len(job_ids)] = 1.0
    return kind_ids, token_features, mask


def aggregate_linear_scale(entries, x):
    columns = [i for i, entry in enumerate(entries) if entry["name"] in LINEAR_SCALE_FEATURES]
    return make_linear_scale(entries, columns, x)


def make_linear_scale(entries, columns, x_columns):
    means = [entries[c]["mean"] for c in columns]
    stds = [entries[c]["std"] for c in columns]
    layer = gm.LinearScaleInputs(columns, means, stds, [1.0] * len(columns))
    with torch.no_grad():
        raw = layer.raw(torch.as_tensor(x_columns)).reshape(-1, len(columns))
        # Scale by the training mean so linear-scale inputs are O(1).
        layer.scales.copy_(raw.mean(dim=0).clamp(min=1e-6))
    return layer


# ----------------------------------------------------------------------------- training


def below_mass(probabilities, labels):
    """Probability assigned to classes below the true one (the under-prediction risk)."""
    classes = torch.arange(probabilities.shape[-1])
    return (probabilities * (classes[None, :] < labels[:, None])).sum(dim=-1)


def classifier_loss(outputs, targets):
    """Class NLL + under-prediction penalty + regression of the memory estimate on the peak."""
    probabilities, memory_gib = outputs
    labels, peak_gib = targets
    nll = -torch.log(probabilities.gather(1, labels[:, None]).clamp(min=1e-7)).mean()
    regression = torch.nn.functional.smooth_l1_loss(memory_gib, peak_gib, beta=0.05)
    return nll + UNDER_WEIGHT * below_mass(probabilities, labels).mean() + REGRESSION_WEIGHT * regression


def train_full_batch(model, inputs, targets, loss_fn, epochs, lr, weight_decay):
    optimiser = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, T_max=epochs)
    model.train()
    for _ in range(epochs):
        optimiser.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimiser.step()
        schedule.step()
    return model.eval()


def classifier_targets(records):
    return (
        torch.as_tensor([r["label"] for r in records], dtype=torch.long),
        torch.as_tensor([r["peak"] / 1000.0 for r in records], dtype=torch.float32),
    )


def train_ensemble(x, records, entries, seed):
    x_t, y_t = torch.as_tensor(x), classifier_targets(records)
    members = []
    for member in range(ENSEMBLE["members"]):
        torch.manual_seed(seed + member)
        model = gm.AggregateMemoryModel(
            x.shape[1], aggregate_linear_scale(entries, x), ENSEMBLE["hidden"], CLASS_BINS_MIB
        )
        members.append(
            train_full_batch(
                model, x_t, y_t, classifier_loss, ENSEMBLE["epochs"], ENSEMBLE["lr"], ENSEMBLE["weight_decay"]
            )
        )
    return gm.ProbabilityEnsemble(members).eval()


def train_regressor(x, targets, entries, seed):
    x_t = torch.as_tensor(x)
    y_t = torch.as_tensor(np.asarray(targets, dtype=np.float32))[:, None]
    members = []
    for member in range(REGRESSOR["members"]):
        torch.manual_seed(seed + member)
        model = gm.AggregateMLP(x.shape[1], aggregate_linear_scale(entries, x), REGRESSOR["hidden"], 1)
        # L1 on the sigmoid output: the reported figure is MAE.
        loss = lambda out, y: (torch.sigmoid(out) - y).abs().mean()  # noqa: E731
        members.append(
            train_full_batch(model, x_t, y_t, loss, REGRESSOR["epochs"], REGRESSOR["lr"], REGRESSOR["weight_decay"])
        )
    return gm.SigmoidEnsemble(members).eval()


def token_linear_scale(token_entries, token_features, mask):
    columns = [gf.TOKEN_FEATURES.index(name) for name in LINEAR_SCALE_TOKENS]
    real = token_features[mask > 0]
    layer = make_linear_scale(token_entries, columns, real)
    with torch.no_grad():
        sums = (layer.raw(torch.as_tensor(token_features)) * torch.as_tensor(mask)[..., None]).sum(dim=1)
        layer.scales.copy_(sums.mean(dim=0).clamp(min=1e-6))
        log_sums = torch.log1p(sums)
    return layer, log_sums.mean(dim=0).tolist(), log_sums.std(dim=0).clamp(min=1e-6).tolist()


def length_bucketed_batches(lengths, batch, generator):
    """Batches of similar length (less padding to compute), in random order."""
    jitter = torch.rand(len(lengths), generator=generator)  # random order within a length
    order = torch.argsort(lengths + jitter)
    batches = [order[start : start + batch] for start in range(0, len(order), batch)]
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


def train_transformer(kind_ids, token_features, mask, records, token_entries, seed, members=None):
    """SEQUENCE_MEMBERS transformers seeded seed, seed + 1, ...; one member exports as itself, more
    as one graph with stacked weights (gm.StackedSequenceEnsemble, mean of the probabilities)."""
    members = members or SEQUENCE_MEMBERS
    trained = [
        train_transformer_member(kind_ids, token_features, mask, records, token_entries, seed + m)
        for m in range(members)
    ]
    if members == 1:
        return gm.SequenceProbabilities(trained[0]).eval()
    return gm.StackedSequenceEnsemble(trained).eval()


def train_transformer_member(kind_ids, token_features, mask, records, token_entries, seed):
    torch.manual_seed(seed)
    scale, log_mean, log_std = token_linear_scale(token_entries, token_features, mask)
    model = gm.SequenceTransformer(
        len(gf.CANONICAL_KINDS),
        token_features.shape[-1],
        scale,
        log_mean,
        log_std,
        CLASS_BINS_MIB,
        d_model=TRANSFORMER["d_model"],
        n_heads=TRANSFORMER["n_heads"],
        n_layers=TRANSFORMER["n_layers"],
        d_ff=TRANSFORMER["d_ff"],
    )
    labels, peaks = classifier_targets(records)
    tensors = [torch.as_tensor(kind_ids), torch.as_tensor(token_features), torch.as_tensor(mask), labels, peaks]
    n, batch, epochs = len(labels), TRANSFORMER["batch"], TRANSFORMER["epochs"]
    steps = epochs * math.ceil(n / batch)  # bucketing keeps the batch count at ceil(n / batch)
    optimiser = torch.optim.AdamW(model.parameters(), lr=TRANSFORMER["lr"], weight_decay=TRANSFORMER["weight_decay"])
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, max_lr=TRANSFORMER["lr"], total_steps=steps)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    lengths = tensors[2].sum(dim=1)
    for _ in range(epochs):
        for rows in length_bucketed_batches(lengths, batch, generator):
            ids, feats, msk, y, peak = (t[rows] for t in tensors)
            length = int(msk.sum(dim=1).max())  # trim padding shared by the whole batch
            optimiser.zero_grad()
            loss = classifier_loss(model(ids[:, :length], feats[:, :length], msk[:, :length]), (y, peak))
            loss.backward()
            optimiser.step()
            schedule.step()
    return model.eval()


# ----------------------------------------------------------------------------- scoring


def classification_figures(probabilities, labels):
    predicted = np.asarray(probabilities).argmax(axis=1)
    labels = np.asarray(labels)
    return {"accuracy": float((predicted == labels).mean()), "below_rate": float((predicted < labels).mean())}


def predict(model, *arrays):
    with torch.no_grad():
        return model(*(torch.as_tensor(a) for a in arrays)).numpy()


def run_cross_validation(train_records):
    """Out-of-fold predictions of every estimator on the training part (3-fold GroupKFold)."""
    n = len(train_records)
    oof = {
        "ensemble": np.zeros((n, N_CLASSES)),
        "transformer": np.zeros((n, N_CLASSES)),
        "smact": np.zeros(n),
        "smocc": np.zeros(n),
    }
    for fold, (fit_idx, val_idx) in enumerate(cv_folds(train_records)):
        log("CV fold %d: %d fit / %d validation rows" % (fold, len(fit_idx), len(val_idx)))
        fit = [train_records[i] for i in fit_idx]
        val = [train_records[i] for i in val_idx]
        fit_jobs, val_jobs = [r["job"] for r in fit], [r["job"] for r in val]
        agg_entries, tok_entries = fit_aggregate_entries(fit_jobs), fit_token_entries(fit_jobs)
        x_fit, x_val = encode_aggregate(fit_jobs, agg_entries), encode_aggregate(val_jobs, agg_entries)
        seed = SEED + 1000 * (fold + 1)
        oof["ensemble"][val_idx] = predict(train_ensemble(x_fit, fit, agg_entries, seed), x_val)
        transformer = train_transformer(
            *encode_sequence(fit_jobs, tok_entries, gf.CANONICAL_KINDS), fit, tok_entries, seed
        )
        oof["transformer"][val_idx] = predict(transformer, *encode_sequence(val_jobs, tok_entries, gf.CANONICAL_KINDS))
        for target in ("smact", "smocc"):
            regressor = train_regressor(x_fit, [r[target] for r in fit], agg_entries, seed)
            oof[target][val_idx] = predict(regressor, x_val)[:, 0]
    labels = [r["label"] for r in train_records]
    figures = {name: classification_figures(oof[name], labels) for name in ("ensemble", "transformer")}
    figures["combined"] = classification_figures((oof["ensemble"] + oof["transformer"]) / 2, labels)
    for target in ("smact", "smocc"):
        figures[target] = {"mae": float(np.abs(oof[target] - np.array([r[target] for r in train_records])).mean())}
    return figures


# ----------------------------------------------------------------------------- outputs


def write_test_file(test_records, path):
    write_jsonl_gz(
        path,
        (
            {"id": r["id"], "job": r["job"], "measured_peak_mib": r["peak"], "smact": r["smact"], "smocc": r["smocc"]}
            for r in test_records
        ),
        one_write=True,
    )


def run(layout, threads=None):
    torch.set_num_threads(threads or THREADS)
    torch.manual_seed(SEED)
    np.random.seed(SEED)
    started = time.time()
    csv_path = layout.mlp_csv

    records = load_mlp_records(csv_path)
    train_idx, test_idx = split_train_test(records)
    train, test = [records[i] for i in train_idx], [records[i] for i in test_idx]
    log(
        "%d rows, %d groups; train %d rows, test %d rows"
        % (len(records), len({r["group"] for r in records}), len(train), len(test))
    )
    test_path = layout.out(TEST_FILE)
    write_test_file(test, test_path)
    with open(layout.out("data", "mlp", "splits.json"), "w") as handle:
        json.dump(
            {
                "seed": SEED,
                "protocol": split_protocol(),
                "csv": os.path.basename(csv_path),
                "train_rows": train_idx,
                "test_rows": test_idx,
                "train_groups": sorted({r["group"] for r in train}),
                "test_groups": sorted({r["group"] for r in test}),
            },
            handle,
            indent=0,
        )
        handle.write("\n")

    cv = run_cross_validation(train)
    log("CV: %s" % json.dumps(cv))

    # Final models on the whole training part.
    train_jobs = [r["job"] for r in train]
    agg_entries, tok_entries = fit_aggregate_entries(train_jobs), fit_token_entries(train_jobs)
    x_train = encode_aggregate(train_jobs, agg_entries)
    log("training final models")
    ensemble = train_ensemble(x_train, train, agg_entries, SEED)
    transformer = train_transformer(
        *encode_sequence(train_jobs, tok_entries, gf.CANONICAL_KINDS), train, tok_entries, SEED
    )
    regressors = {
        target: train_regressor(x_train, [r[target] for r in train], agg_entries, SEED) for target in ("smact", "smocc")
    }

    # Export, then score everything through onnxruntime on the test file, as the service would.
    test_rows = read_jsonl_gz(test_path)
    test_jobs = [row["job"] for row in test_rows]
    test_labels = np.array([gf.memory_class(row["measured_peak_mib"]) for row in test_rows])
    x_test = encode_aggregate(test_jobs, agg_entries)
    seq_test = encode_sequence(test_jobs, tok_entries, gf.CANONICAL_KINDS)
    paths = {
        name: layout.out("models", name + ".onnx")
        for name in ("mlp_ensemble", "sequence_transformer", "smact", "smocc")
    }
    export_onnx(ensemble, [x_train[:2]], ["features"], "probabilities", [{0: "N"}], paths["mlp_ensemble"], MAX_TOKENS)
    export_onnx(
        transformer,
        [a[:2] for a in encode_sequence(train_jobs[:2], tok_entries, gf.CANONICAL_KINDS)],
        ["kind_ids", "token_features", "mask"],
        "probabilities",
        [{0: "N", 1: "L"}] * 3,
        paths["sequence_transformer"],
        MAX_TOKENS,
    )
    for target, model in regressors.items():
        export_onnx(model, [x_train[:2]], ["features"], "value", [{0: "N"}], paths[target], MAX_TOKENS)

    sessions = {name: onnx_session(path) for name, path in paths.items()}  # one thread, as the service
    seq_feeds = dict(zip(["kind_ids", "token_features", "mask"], seq_test))
    onnx_out = {
        "mlp_ensemble": sessions["mlp_ensemble"].run(None, {"features": x_test})[0],
        "sequence_transformer": sessions["sequence_transformer"].run(None, seq_feeds)[0],
        "smact": sessions["smact"].run(None, {"features": x_test})[0],
        "smocc": sessions["smocc"].run(None, {"features": x_test})[0],
    }
    torch_out = {
        "mlp_ensemble": predict(ensemble, x_test),
        "sequence_transformer": predict(transformer, *seq_test),
        "smact": predict(regressors["smact"], x_test),
        "smocc": predict(regressors["smocc"], x_test),
    }
    max_diff = {name: float(np.abs(onnx_out[name] - torch_out[name]).max()) for name in paths}
    log("ONNX vs torch max abs diff: %s" % max_diff)
    assert all(diff < 1e-4 for diff in max_diff.values()), max_diff

    # Per-job N=1 runs at the job's own length (what the service does) must agree with the batch.
    single = np.concatenate(
        [
            sessions["sequence_transformer"].run(
                None,
                dict(
                    zip(["kind_ids", "token_features", "mask"], encode_sequence([job], tok_entries, gf.CANONICAL_KINDS))
                ),
            )[0]
            for job in test_jobs
        ]
    )
    padding_diff = float(np.abs(single - onnx_out["sequence_transformer"]).max())
    log("transformer N=1 unpadded vs padded batch max abs diff: %g" % padding_diff)
    assert padding_diff < 1e-4

    test_figures = {
        "mlp_ensemble": classification_figures(onnx_out["mlp_ensemble"], test_labels),
        "sequence_transformer": classification_figures(onnx_out["sequence_transformer"], test_labels),
        "combined": classification_figures(
            (onnx_out["mlp_ensemble"] + onnx_out["sequence_transformer"]) / 2, test_labels
        ),
    }
    peaks = np.array([row["measured_peak_mib"] for row in test_rows])
    margins = np.abs(peaks[:, None] - np.array(CLASS_BINS_MIB)[None, :]).min(axis=1)
    wrong = np.zeros(len(test_rows), dtype=bool)
    for name in ("mlp_ensemble", "sequence_transformer"):
        wrong |= onnx_out[name].argmax(axis=1) != test_labels
    test_figures["max_error_margin_mib"] = int(margins[wrong].max()) if wrong.any() else 0
    for target in ("smact", "smocc"):
        truth = np.array([row[target] for row in test_rows])
        baseline = float(np.mean([r[target] for r in train]))
        test_figures[target] = {
            "mae": float(np.abs(onnx_out[target][:, 0] - truth).mean()),
            "baseline_mae": float(np.abs(baseline - truth).mean()),
            "train_mean": baseline,
        }
    log("test: %s" % json.dumps(test_figures))

    longest = max(test_jobs, key=lambda job: len(job["layers"]))
    latency = {
        "mlp_ensemble": median_latency_us(sessions["mlp_ensemble"], {"features": x_test[:1]}),
        "sequence_transformer": median_latency_us(
            sessions["sequence_transformer"],
            dict(
                zip(["kind_ids", "token_features", "mask"], encode_sequence([longest], tok_entries, gf.CANONICAL_KINDS))
            ),
        ),
        "smact": median_latency_us(sessions["smact"], {"features": x_test[:1]}),
        "smocc": median_latency_us(sessions["smocc"], {"features": x_test[:1]}),
    }
    latency["sequence_transformer"]["tokens"] = len(longest["layers"])
    log("latency: %s" % json.dumps(latency))

    manifest = build_manifest(
        csv_path, len(records), len(train), len(test), paths, agg_entries, tok_entries, cv, test_figures
    )
    mf.write_manifest(layout.out("models", "manifest.json"), manifest)
    write_report(
        layout.out(*PAGE),
        len(records),
        len(train),
        len(test),
        cv,
        test_figures,
        max_diff,
        padding_diff,
        latency,
        time.time() - started,
    )
    log("done in %.0f s" % (time.time() - started))


def split_protocol():
    return (
        "group = Filename without its '_batch:<n>' part; GroupShuffleSplit test_size=%.1f seed=%d "
        "for the held-out test; %d-fold GroupKFold (shuffled, same seed) on the training part for CV"
        % (TEST_FRACTION, SEED, N_FOLDS)
    )


def build_manifest(csv_path, n_rows, n_train, n_test, paths, agg_entries, tok_entries, cv, test):
    def file_entry(name):
        return {"file": os.path.basename(paths[name]), "sha256": mf.sha256_of(paths[name])}

    aggregate_input = {"type": "aggregate", "features": agg_entries}
    estimators = [
        dict(
            name="mlp_ensemble",
            version=VERSION,
            family="mlp",
            kind="memory_classifier",
            **file_entry("mlp_ensemble"),
            input=aggregate_input,
            output="probabilities",
            runtime=mf.IN_PROCESS,
            class_bins_mib=CLASS_BINS_MIB,
            validation={
                "cv_accuracy": cv["ensemble"]["accuracy"],
                "cv_below_rate": cv["ensemble"]["below_rate"],
                "test_accuracy": test["mlp_ensemble"]["accuracy"],
                "test_below_rate": test["mlp_ensemble"]["below_rate"],
            },
        ),
        dict(
            name="sequence_transformer",
            version=VERSION,
            family="mlp",
            kind="memory_classifier",
            **file_entry("sequence_transformer"),
            input={
                "type": "sequence",
                "kind_vocab": gf.CANONICAL_KINDS,
                "max_tokens": MAX_TOKENS,
                "token_features": tok_entries,
            },
            output="probabilities",
            runtime=mf.ONNXRUNTIME,
            class_bins_mib=CLASS_BINS_MIB,
            validation={
                "cv_accuracy": cv["transformer"]["accuracy"],
                "cv_below_rate": cv["transformer"]["below_rate"],
                "test_accuracy": test["sequence_transformer"]["accuracy"],
                "test_below_rate": test["sequence_transformer"]["below_rate"],
            },
        ),
    ]
    for target in ("smact", "smocc"):
        estimators.append(
            dict(
                name=target,
                version=VERSION,
                family="mlp",
                kind="utilization_regressor",
                target=target,
                **file_entry(target),
                input=aggregate_input,
                output="value",
                runtime=mf.IN_PROCESS,
                validation={
                    "cv_mae": cv[target]["mae"],
                    "test_mae": test[target]["mae"],
                    "test_baseline_mae": test[target]["baseline_mae"],
                },
            )
        )
    return {
        "schema_version": 1,
        "generated_at": None,  # stamped by manifest.write_manifest
        "training_data": {"file": os.path.basename(csv_path), "sha256": mf.sha256_of(csv_path), "rows": n_rows},
        "split": {
            "protocol": split_protocol(),
            "seed": SEED,
            "test_file": TEST_FILE,
            "train_rows": n_train,
            "test_rows": n_test,
            "folds": N_FOLDS,
        },
        "estimators": estimators,
        "combined": {
            "members": ["mlp_ensemble", "sequence_transformer"],
            "rule": "mean_probabilities",
            "validation": {
                "test_accuracy": test["combined"]["accuracy"],
                "test_below_rate": test["combined"]["below_rate"],
            },
        },
    }


def write_report(path, n_rows, n_train, n_test, cv, test, max_diff, padding_diff, latency, seconds):
    pct = lambda value: "%.2f %%" % (100 * value)  # noqa: E731
    lines = [
        "# gpucast estimators: training report",
        "",
        "Written by `training/retrain.sh` (stage `python -m gpucast_training mlp`, seed %d, %.0f s on CPU) on %s."
        % (SEED, seconds, written_at()),
        "",
        "## Protocol",
        "",
        "- Data: `gpumemnet_mlp_a100.csv`, %d synthetic MLP jobs measured on an A100 40 GB." % n_rows,
        "- Groups: the run name without `_batch:<n>` (one architecture at several batch sizes is one group;",
        "  in this file every group has a single row, as the dropout rate in the name is random).",
        "- Held-out test: %d rows (20 %% of groups, `GroupShuffleSplit`), written to `data/mlp/test.jsonl.gz`;"
        % n_test,
        "  the remaining %d rows train the models. CV: 3-fold `GroupKFold` on the training part" % n_train,
        "  (feature mean/std refitted on each fold's training rows). Final models are trained on the",
        "  whole training part; **all test figures come from the exported ONNX files run by onnxruntime**",
        "  on features computed from the test file's job JSON (the service's path).",
        "- Classes: 1 GiB-wide bins `(0,1000], (1000,2000], ..., (5000,inf)` MiB; prediction = argmax.",
        "  *Below* = share of jobs put in a class below the true one (under-reservation).",
        "- Both classifiers estimate peak memory (a linear term on linear-scale counts plus an MLP /",
        "  Transformer correction) and turn it into class probabilities with soft class boundaries.",
        "  Loss: class NLL + %.1f x probability mass below the true class (under-prediction is the" % UNDER_WEIGHT,
        "  costly error for a scheduler; weight chosen by CV among 0, 0.5, 1, 2) + %.1f x smooth-L1 of"
        % REGRESSION_WEIGHT,
        "  the memory estimate vs the measured peak (GiB).",
        "",
        "## Memory classifiers",
        "",
        "| estimator | CV accuracy | CV below | test accuracy | test below |",
        "| --- | --- | --- | --- | --- |",
        "| GPUMemNet MLP ensemble (published, 3-fold CV) | 0.976 | 1.8 % | | |",
        "| GPUMemNet Transformer (published, 3-fold CV) | 0.984 | 0.8 % | | |",
        "| gpucast `mlp_ensemble` | %.4f | %s | %.4f | %s |"
        % (
            cv["ensemble"]["accuracy"],
            pct(cv["ensemble"]["below_rate"]),
            test["mlp_ensemble"]["accuracy"],
            pct(test["mlp_ensemble"]["below_rate"]),
        ),
        "| gpucast `sequence_transformer` | %.4f | %s | %.4f | %s |"
        % (
            cv["transformer"]["accuracy"],
            pct(cv["transformer"]["below_rate"]),
            test["sequence_transformer"]["accuracy"],
            pct(test["sequence_transformer"]["below_rate"]),
        ),
        "| gpucast combined (mean probabilities) | %.4f | %s | %.4f | %s |"
        % (
            cv["combined"]["accuracy"],
            pct(cv["combined"]["below_rate"]),
            test["combined"]["accuracy"],
            pct(test["combined"]["below_rate"]),
        ),
        "",
        "The test split has %d jobs, so one job is %.2f points of accuracy. Every misclassified test"
        % (n_test, 100.0 / n_test),
        "job lies within %d MiB of a class boundary (measurement-noise range)." % test["max_error_margin_mib"],
        "",
        "## Utilization regressors (mean absolute error, fractions 0..1)",
        "",
        "| target | CV MAE | test MAE | test MAE of the training mean (baseline) |",
        "| --- | --- | --- | --- |",
    ]
    for target in ("smact", "smocc"):
        lines.append(
            "| %s | %.4f | %.4f | %.4f |"
            % (target.upper(), cv[target]["mae"], test[target]["mae"], test[target]["baseline_mae"])
        )
    lines += [
        "",
        "## ONNX",
        "",
        "| model | max abs diff vs torch (test split) | median latency N=1, 1 thread | p99 |",
        "| --- | --- | --- | --- |",
    ]
    for name in ("mlp_ensemble", "sequence_transformer", "smact", "smocc"):
        suffix = " (L=%d)" % latency[name]["tokens"] if "tokens" in latency[name] else ""
        lines.append(
            "| `%s.onnx`%s | %.1e | %.0f us | %.0f us |"
            % (name, suffix, max_diff[name], latency[name]["median_us"], latency[name]["p99_us"])
        )
    lines += [
        "",
        "Transformer run per job at its own length (N=1, no padding) vs the padded test batch: max abs",
        "diff %.1e. Latency measured with onnxruntime %s, Python API (includes its per-call overhead),"
        % (padding_diff, ort.__version__),
        "on a shared 2-core machine.",
        "",
    ]
    pages.write(path, "\n".join(lines), KEEP, "mlp")
