"""gpucast simulated-step estimators: physics first, learning second.

    python -m gpucast_training simulated      (from training/; after the timm stage)

The MiB figure of a job that carries `simulation` (describe's two simulated training steps,
replayed through the caching-allocator model) starts from physics:

    simulated_mib = reserved peak (on the card) + cuda_context_mib

`cuda_context_mib` (CUDA context, cuBLAS/cuDNN handles: what a process holds outside PyTorch's
allocator) is fitted on the training rows. A small learned correction (an ensemble of MLPs
whose log correction is capped at +-CAP by a tanh inside the graph) covers what the simulation
cannot see (cuDNN workspaces, kernel choices); it is trained on the timm A100 data and applies
only to jobs near that data (`domain`: the training points in a normalised feature space, Adam
fp32 jobs only). In the service the answer never goes below the physical floor: parameters +
gradients + optimizer state + activations at the simulated peak + context.

Evaluation (same split as the timm stage): grouped 5-fold CV by model family on the visible
training part, the 25 held-out families, and the out-of-distribution rows of
public_training_memory.csv that gpucast can express (data/public/jobs.jsonl.gz, made by
`python -m gpucast_training public-rows`). Then the served correction is refitted on every visible timm row;
the CV and held-out figures stay in the manifest. Writes models/timm_simulated_regressor.onnx,
models/simulated_domain.json, merges the entries and the `simulated` block into
models/manifest.json, and writes data/timm/simulated_figures.json and
docs/reports/training-simulated.md. The features are the built gpucast's (`gpucast features
--batch`, service.py).
"""

import gzip
import json
import math
import os
import time

import numpy as np
import torch
from sklearn.model_selection import GroupKFold
from torch import nn

from . import features as gf
from . import manifest as mf
from . import timm as rp
from . import service
from . import timm_models as rm
from .cards import capacity_of, card_of
from .constants import BOUND_CONFIDENCE, CAPACITY_MIB, FAMILIES, MIB, SEED, VERSION
from .constants import REAL_FOLDS as N_FOLDS
from .data import load_timm, log, read_jsonl_gz
from .onnx_export import onnx_session
from .simulated_report import CAP, written_at, write_report

THREADS = 1
# The domain's thresholds (written into models/simulated_domain.json, which the service reads):
# beyond NEAR x the typical distance of a new family the bound widens (by ratio / NEAR, at most
# MAX_WIDEN); beyond FAR x it, or for another optimizer or precision than the data's, the
# correction is not applied at all (the simulated figure leads).
NEAR, FAR, MAX_WIDEN = 1.0, 2.0, 2.0
SIM_FEATURES = [
    "sim_allocated_mib",
    "sim_reserved_mib",
    "sim_min_capacity_mib",
    "sim_parameters_mib",
    "sim_gradients_mib",
    "sim_optimizer_state_mib",
    "sim_activations_mib",
    "sim_temporaries_mib",
]
FEATURES = rp.REAL_FEATURES + ["traced_first_principles_mib"] + SIM_FEATURES
# The space in which a job's distance to the training data is measured (normalised log1p).
DOMAIN_FEATURES = [
    "sim_reserved_mib",
    "sim_activations_mib",
    "total_params",
    "activations_x_batch",
    "batch_size",
    "n_layers",
    "n_conv",
    "n_attention",
    "n_norm",
    "n_embedding",
    "max_output_size",
]
# |log correction| < CAP: the learned part moves the simulated figure by at most x/÷ e^CAP
# (1.35); the simulation alone is within 0.93-1.10 of the measured peak for 80 % of the rows.
REGRESSOR = dict(members=10, hidden=32, epochs=800, lr=1e-2, weight_decay=1e-3, cap=CAP)
NAMES = {family: family + "_simulated_memory_regressor" for family in FAMILIES}
ONNX_FILE = "timm_simulated_regressor.onnx"
DOMAIN_FILE = "simulated_domain.json"
TEST_FILE = "data/timm/test_simulated.jsonl.gz"


class SimulatedBase(nn.Module):
    """log(sim_reserved_mib + cuda_context_mib) from the normalised log1p column."""

    def __init__(self, column, mean, std, context_mib):
        super().__init__()
        self.column = column
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32))
        self.register_buffer("context", torch.tensor(context_mib, dtype=torch.float32))

    def forward(self, x):
        reserved = torch.expm1(x[:, self.column : self.column + 1] * self.std + self.mean)
        return torch.log(reserved.clamp(min=0.0) + self.context)


def load_simulations(path):
    return {entry["model"].split(":", 1)[1]: entry["simulations"] for entry in read_jsonl_gz(path)}


def attach(records, sims):
    """Records whose model was simulated at their batch size, with `simulation` in the job."""
    kept = []
    for record in records:
        sim = sims.get(record["model"], {}).get(str(record["batch_size"]))
        if sim is None:
            continue
        record["job"] = dict(record["job"], simulation=sim, optimizer="adam", precision="fp32")
        kept.append(record)
    return kept


def sim_mib(job, key):
    return job["simulation"][key] / MIB


def fit_context(records):
    """The fixed cost outside the allocator: median of measured - reserved over the ok rows at
    the two smallest batch sizes (least affected by workspaces that grow with the batch)."""
    diffs = [
        r["peak"] - sim_mib(r["job"], "reserved_peak_bytes")
        for r in records
        if r["status"] == "ok" and r["batch_size"] <= 16
    ]
    return float(np.clip(np.median(diffs), 300.0, 3000.0))


# The service's simulated figure, floor and card check with a context fitted here per fold: the
# stage scores models the service does not serve, whose context the binary cannot know.
def reserved_on_card(job, context, capacity=CAPACITY_MIB):
    """The reserved peak the card shows: capped at the usable memory when the step fits (the
    allocator frees its cache before an allocation fails)."""
    reserved = sim_mib(job, "reserved_peak_bytes")
    fits = sim_mib(job, "min_capacity_bytes") + context <= capacity
    return min(reserved, capacity - context) if fits else reserved


def simulated_figure(job, context, capacity=CAPACITY_MIB):
    return reserved_on_card(job, context, capacity) + context


def floor_figure(job, context):
    b = job["simulation"]["breakdown_at_peak"]
    return (b["parameters"] + b["gradients"] + b["optimizer_state"] + b["activations"]) / MIB + context


def train_regressor(x, records, entries, context, seed):
    torch.manual_seed(seed)
    names = [e["name"] for e in entries]
    column = names.index("sim_reserved_mib")
    base = SimulatedBase(column, entries[column]["mean"], entries[column]["std"], context)
    model = rm.MemoryRegressor(x.shape[1], base, REGRESSOR["members"], REGRESSOR["hidden"], REGRESSOR["cap"])
    xt = torch.as_tensor(x)
    log_peak, oom, _ = rp.targets(records)
    rp.full_batch(
        model,
        lambda: rp.regression_loss(model.member_outputs(xt).squeeze(-1), log_peak, oom),
        REGRESSOR["epochs"],
        REGRESSOR["lr"],
        REGRESSOR["weight_decay"],
    )
    return model.eval()


def domain_vectors(raws, entries):
    by_name = {e["name"]: e for e in entries}
    return np.array(
        [[gf.normalise_value(raw[n], by_name[n]) for n in DOMAIN_FEATURES] for raw in raws], dtype=np.float64
    )


def nearest_distances(points, queries, exclude_groups=None, groups=None, query_groups=None):
    """Euclidean distance from each query to its nearest point (optionally of another group)."""
    out = np.empty(len(queries))
    for i, q in enumerate(queries):
        d = np.sqrt(((points - q) ** 2).sum(axis=1))
        if exclude_groups:
            d = np.where(groups == query_groups[i], np.inf, d)
        out[i] = d.min()
    return out


def runs_on_card(job, context, capacity=CAPACITY_MIB):
    return sim_mib(job, "min_capacity_bytes") + context <= capacity


def figures(pred, bound, records):
    pred = np.asarray(pred, dtype=np.float64)
    bound = None if bound is None else np.asarray(bound, dtype=np.float64)
    ok = np.array([r["status"] == "ok" for r in records])
    peak = np.array([r["peak"] for r in records])
    rel = np.abs(pred[ok] / peak[ok] - 1.0)
    out = {
        "median_abs_rel_error": float(np.median(rel)),
        "p90_abs_rel_error": float(np.quantile(rel, 0.9)),
        "under_rate": float(np.mean(pred[ok] < peak[ok])),
        "class_accuracy": float(np.mean(np.array([rp.memory_class(p) for p in pred]) == rp.true_classes(records))),
        "ok_rows": int(ok.sum()),
        "oom_rows": int((~ok).sum()),
    }
    if bound is not None and len(bound):
        out["bound_exceeded_rate"] = float(np.mean(bound[ok] < peak[ok]))
        out["oom_not_fit_rate"] = float(np.mean(bound[~ok] > CAPACITY_MIB)) if (~ok).any() else None
    return out


def run_stage(layout):
    started = time.time()
    records, dropped = load_timm(layout.timm_csv, layout.read(rp.DESCRIPTIONS))
    sims = load_simulations(layout.simulations)
    n_all = len(records)
    test_groups = rp.split_groups(records)  # the same split as the timm stage, on every row
    records = attach(records, sims)
    train = [r for r in records if r["group"] not in test_groups]
    test = [r for r in records if r["group"] in test_groups]
    log("simulated: %d of %d rows simulated; train %d / test %d" % (len(records), n_all, len(train), len(test)))
    raws = service.raw_aggregate([r["job"] for r in train])
    test_raws = service.raw_aggregate([r["job"] for r in test])
    groups = np.array([r["group"] for r in train])
    usable = rp.training_rows(train)
    folds = list(
        GroupKFold(n_splits=N_FOLDS, shuffle=True, random_state=SEED).split(np.zeros(len(train)), groups=groups)
    )
    oof = np.zeros(len(train))
    oof_context = np.zeros(len(train))
    for k, (fit, val) in enumerate(folds):
        fit = fit[usable[fit]]
        fit_records = [train[i] for i in fit]
        context = fit_context(fit_records)
        entries = rp.fit_entries([raws[i] for i in fit], FEATURES)
        model = train_regressor(rp.encode([raws[i] for i in fit], entries), fit_records, entries, context, SEED + k)
        with torch.no_grad():
            oof[val] = model(torch.as_tensor(rp.encode([raws[i] for i in val], entries))).numpy()[:, 0]
        oof_context[val] = context
        log("fold %d: context %.0f MiB" % (k, context))
    ok = np.array([r["status"] == "ok" for r in train])
    peaks = np.array([r["peak"] for r in train])
    fam = {f: np.array([r["family"] == f for r in train]) for f in FAMILIES}
    context = fit_context([train[i] for i in np.flatnonzero(usable)])
    sim_cv = np.array([simulated_figure(r["job"], c) for r, c in zip(train, oof_context)])
    quantiles = {f: rp.conformal_quantiles((np.log(peaks) - oof)[ok & fam[f]]) for f in FAMILIES}
    sim_quantiles = rp.conformal_quantiles((np.log(peaks) - np.log(sim_cv))[ok])

    # Distances: the typical distance of a new family = 95th percentile, over the training rows,
    # of the distance to the nearest row of another group (what CV's held-out folds look like).
    entries_all = rp.fit_entries([raws[i] for i in np.flatnonzero(usable)], FEATURES)
    points = domain_vectors(raws, entries_all)
    cross = nearest_distances(points, points, True, groups, groups)
    typical = float(np.quantile(cross, 0.95))

    def served(jobs):
        """(figure, bound, far) of each (log_learned, job, context, distance, family[,
        capacity]) as the service would answer it: its rule, through `gpucast combine`."""
        fold = []
        for log_learned, job, ctx, distance, family, *capacity in jobs:
            capacity = capacity[0] if capacity else CAPACITY_MIB
            fold.append(
                {
                    "log_learned": float(log_learned),
                    "simulated_mib": float(simulated_figure(job, ctx, capacity)),
                    "floor_mib": float(floor_figure(job, ctx)),
                    "distance": float(distance) if math.isfinite(distance) else None,
                    "typical_distance": typical,
                    "learned_log_ratio": rp.log_ratio_at(quantiles[family], BOUND_CONFIDENCE),
                    "simulated_log_ratio": rp.log_ratio_at(sim_quantiles, BOUND_CONFIDENCE),
                    "runs_on_card": bool(runs_on_card(job, ctx, capacity)),
                    "capacity_mib": int(capacity),
                    "measured_range": bool(runs_on_card(job, ctx, CAPACITY_MIB)),
                }
            )
        answers = service.combine(fold, NEAR, FAR, MAX_WIDEN)
        return [(a["figure_mib"], a["upper_bound_mib"], a["far"]) for a in answers]

    cv_final = served(
        (oof[i], train[i]["job"], oof_context[i], cross[i], train[i]["family"]) for i in range(len(train))
    )
    baselines = served_baselines(layout)
    cv = {
        "simulated_alone": figures(sim_cv, sim_cv * math.exp(rp.log_ratio_at(sim_quantiles, BOUND_CONFIDENCE)), train),
        "simulated_corrected": figures([f for f, _, _ in cv_final], [b for _, b, _ in cv_final], train),
        "allocated_plus_context": figures(
            [sim_mib(r["job"], "allocated_peak_bytes") + c for r, c in zip(train, oof_context)], None, train
        ),
    }
    cv.update(cv_baselines(layout, train, baselines))
    cv["simulated_corrected"]["far_rows"] = int(sum(far for _, _, far in cv_final))
    log("CV: simulated alone %s" % cv["simulated_alone"])
    log("CV: corrected %s" % cv["simulated_corrected"])

    # Held-out families: a model fitted on the whole training part, scored through onnxruntime.
    learn = np.flatnonzero(usable)
    learn_records = [train[i] for i in learn]
    model = train_regressor(rp.encode([raws[i] for i in learn], entries_all), learn_records, entries_all, context, SEED)
    path = layout.out("models", ONNX_FILE)
    rp.export(model, [rp.encode(raws[:2], entries_all)], ["features"], "log_mib", [{0: "N"}], path)
    session = onnx_session(path, 1)
    t_log = session.run(None, {"features": rp.encode(test_raws, entries_all)})[0][:, 0]
    t_dist = nearest_distances(points, domain_vectors(test_raws, entries_all))
    t_sim = np.array([simulated_figure(r["job"], context) for r in test])
    t_final = served((t_log[i], test[i]["job"], context, t_dist[i], test[i]["family"]) for i in range(len(test)))
    held = {
        "simulated_alone": figures(t_sim, t_sim * math.exp(rp.log_ratio_at(sim_quantiles, BOUND_CONFIDENCE)), test),
        "simulated_corrected": figures([f for f, _, _ in t_final], [b for _, b, _ in t_final], test),
        "allocated_plus_context": figures(
            [sim_mib(r["job"], "allocated_peak_bytes") + context for r in test], None, test
        ),
    }
    held.update(test_baselines(test, test_raws, baselines))
    held["simulated_corrected"]["far_rows"] = int(sum(far for _, _, far in t_final))
    log("held out: simulated alone %s" % held["simulated_alone"])
    log("held out: corrected %s" % held["simulated_corrected"])

    public = evaluate_public(layout, session, entries_all, points, context, served)

    # Serve what was evaluated: refit on every visible row (training part + held-out families).
    everything = train + test
    all_raws = raws + test_raws
    every_usable = np.concatenate([usable, rp.training_rows(test)])
    idx = np.flatnonzero(every_usable)
    final_context = fit_context([everything[i] for i in idx])
    final_entries = rp.fit_entries([all_raws[i] for i in idx], FEATURES)
    final = train_regressor(
        rp.encode([all_raws[i] for i in idx], final_entries),
        [everything[i] for i in idx],
        final_entries,
        final_context,
        SEED,
    )
    rp.export(final, [rp.encode(all_raws[:2], final_entries)], ["features"], "log_mib", [{0: "N"}], path)
    final_points = domain_vectors(all_raws, final_entries)
    # The held-out rows with their simulations, for the service's reproduction test.
    rp.write_test_file(test, layout.out(TEST_FILE))
    served_log = onnx_session(path, 1).run(None, {"features": rp.encode(test_raws, final_entries)})[0][:, 0]
    final_quantiles = quantiles
    served_test = {}
    served_context = round(final_context, 1)  # as the manifest holds it
    for family in FAMILIES:
        # The rows the served regressor answers: the step runs on its card (near the data: the
        # test rows are among the domain's points).
        mask = np.array([r["family"] == family and runs_on_card(r["job"], served_context) for r in test])
        recs = [r for r, m in zip(test, mask) if m]
        served_test[family] = rp.regression_figures(served_log[mask], recs, final_quantiles)
        # The answer's class is that of the figure held to the floor.
        answered = [max(math.exp(v), floor_figure(r["job"], served_context)) for v, r in zip(served_log[mask], recs)]
        served_test[family]["class_accuracy"] = float(
            np.mean(np.array([rp.memory_class(a) for a in answered]) == rp.true_classes(recs))
        )
    domain = {
        "features": [e for e in final_entries if e["name"] in DOMAIN_FEATURES],
        "order": DOMAIN_FEATURES,
        "optimizers": ["adam"],
        "precisions": ["fp32"],
        "typical_distance": typical,
        "near": NEAR,
        "far": FAR,
        "max_widen": MAX_WIDEN,
        "points": [[round(float(v), 4) for v in p] for p in final_points],
    }
    domain_path = layout.out("models", DOMAIN_FILE)
    mf.write_json(domain_path, domain, indent=None, newline=False, separators=(",", ":"))
    result = {
        "context_mib": context,
        "served_context_mib": final_context,
        "typical_distance": typical,
        "cv": cv,
        "test": held,
        "public": public,
        "served_test": served_test,
        "quantiles": quantiles,
        "sim_quantiles": sim_quantiles,
        "rows": {
            "train": len(train),
            "test": len(test),
            "learned": int(usable.sum()),
            "served_learned": int(every_usable.sum()),
        },
        "seconds": time.time() - started,
        "written": written_at(),
    }
    merge_manifest(layout, result, final_entries, path, domain_path)
    mf.write_json(layout.out("data", "timm", "simulated_figures.json"), result, newline=False)
    return result


def served_baselines(layout):
    """What gpucast served before the simulation (the traced regressor, from the timm stage's
    manifest and ONNX file) and its residual quantiles."""
    by_name = mf.estimators_by_name(mf.read_json(layout.read("models", "manifest.json")))
    traced = {f: by_name[rp.REAL_NAMES[f]["traced_regressor"]] for f in FAMILIES}
    session = onnx_session(layout.read("models", mf.graph_file(traced["cnn"])), 1)
    return {"traced": traced, "session": session}


def traced_bounds(values, records, baselines):
    return [
        v * math.exp(rp.log_ratio_at(baselines["traced"][r["family"]]["residual_quantiles"], BOUND_CONFIDENCE))
        for v, r in zip(values, records)
    ]


def cv_baselines(layout, train, baselines):
    """The baselines' out-of-fold figures on the same rows (data/timm/cv_predictions.csv.gz,
    written by the timm stage's grouped CV with the same folds)."""
    import csv

    with gzip.open(layout.read("data", "timm", "cv_predictions.csv.gz"), "rt") as handle:
        by_id = {row["id"]: row for row in csv.DictReader(handle)}
    rows = [by_id[r["id"]] for r in train]
    traced = [float(row["traced_regressor_mib"]) for row in rows]
    return {
        "traced_regressor (served before)": figures(traced, traced_bounds(traced, train, baselines), train),
        "traced_first_principles": figures([float(row["traced_first_principles_mib"]) for row in rows], None, train),
        "horus": figures([float(row["horus_mib"]) for row in rows], None, train),
        "faketensor": figures([float(row["faketensor_mib"]) for row in rows], None, train),
    }


def test_baselines(test, test_raws, baselines):
    entries = baselines["traced"]["cnn"]["input"]["features"]
    traced = np.exp(baselines["session"].run(None, {"features": rp.encode(test_raws, entries)})[0][:, 0])
    return {
        "traced_regressor (served before)": figures(traced, traced_bounds(traced, test, baselines), test),
        "traced_first_principles": figures([raw["traced_first_principles_mib"] for raw in test_raws], None, test),
        "horus": figures([raw["horus_mib"] for raw in test_raws], None, test),
        "faketensor": figures([r["faketensor"] for r in test], None, test),
    }


def card_capacity(name):
    """The memory of the card a published row names (its `gpu` text): the catalogue's
    (data/gpus.json) for the card `cards.card_of` reads there, as the decisions evaluation reads
    the same rows; the reference card where the row does not say."""
    return capacity_of(card_of(name)) or CAPACITY_MIB


def evaluate_public(layout, session, entries, points, context, served):
    path = layout.read("data", "public", "jobs.jsonl.gz")
    if not os.path.exists(path):
        log("no %s: run python -m gpucast_training public-rows" % path)
        return None
    rows = read_jsonl_gz(path)
    out = []
    raws = service.raw_aggregate([r["job"] for r in rows])
    log_learned = session.run(None, {"features": rp.encode(raws, entries)})[0][:, 0]
    distances = nearest_distances(points, domain_vectors(raws, entries))
    asked = []
    for row, learned, distance in zip(rows, log_learned, distances):
        job = row["job"]
        family = job["family"] if job["family"] in FAMILIES else "transformer"
        in_domain = job.get("optimizer") == "adam" and job.get("precision") == "fp32"
        dist = distance if in_domain else float("inf")
        asked.append((learned, job, context, dist, family, card_capacity(row["gpu"])))
    for row, raw, (total, bound, far) in zip(rows, raws, served(asked)):
        job = row["job"]
        b = job["simulation"]["breakdown_at_peak"]
        compare = row["compare"]
        # Like with like: allocated figures against the allocator's allocated peak (from the
        # simulation; the learned correction is of device totals), device totals against the answer.
        if compare == "allocated":
            predicted, upper = sim_mib(job, "allocated_peak_bytes"), None
        elif compare == "allocated_minus_weights":
            predicted, upper = sim_mib(job, "allocated_peak_bytes") - b["parameters"] / MIB, None
        elif compare == "reserved":
            predicted, upper = sim_mib(job, "reserved_peak_bytes"), None
        else:
            predicted, upper = total, bound
        out.append(
            {
                "row": row["row"],
                "model": row["model"],
                "compare": compare,
                "ddp": row["ddp"],
                "measured_mib": row["measured_mib"],
                "predicted_mib": predicted,
                "upper_mib": upper,
                "estimate_mib": total,
                "upper_bound_mib": bound,
                "far": bool(far),
                "first_principles_mib": raw["first_principles_mib"],
                "horus_mib": raw["horus_mib"],
                "traced_first_principles_mib": raw["traced_first_principles_mib"],
            }
        )
    errors = [abs(o["predicted_mib"] / o["measured_mib"] - 1) for o in out]
    strict = [abs(o["predicted_mib"] / o["measured_mib"] - 1) for o in out if not o["ddp"]]
    device = [o for o in out if o["compare"] == "device"]
    summary = {
        "rows": out,
        "n": len(out),
        "median_abs_rel_error": float(np.median(errors)) if errors else None,
        "strict_n": len(strict),
        "strict_median_abs_rel_error": float(np.median(strict)) if strict else None,
        "all_bound_exceeded": int(sum(o["upper_bound_mib"] < o["measured_mib"] for o in out)),
        "device_rows": len(device),
        "device_bound_exceeded": int(sum(o["upper_bound_mib"] < o["measured_mib"] for o in device)),
    }
    log("public rows: %s" % {k: v for k, v in summary.items() if k != "rows"})
    return summary


def merge_manifest(layout, result, entries, onnx_path, domain_path):
    """The timm stage's manifest with this stage's estimators and the `simulated` block."""
    manifest = mf.read_json(layout.read("models", "manifest.json"))
    sha = mf.sha256_of(onnx_path)
    ours = []
    for family in FAMILIES:
        # cv_ and heldout_: the served rule (correction near the data, floor, widened bound)
        # before the refit; test_: the served model's own figure on the test file after the
        # refit on every visible row (in-sample, what tests/api/accuracy.rs reproduces).
        validation = {
            **rp.prefixed("cv_", result["cv"]["simulated_corrected"]),
            **rp.prefixed("heldout_", result["test"]["simulated_corrected"]),
            **rp.prefixed("test_", result["served_test"][family]),
            "refit_on_every_visible_row": True,
        }
        ours.append(
            {
                "name": NAMES[family],
                "version": VERSION,
                "family": family,
                "kind": "memory_regressor",
                "file": ONNX_FILE,
                "sha256": sha,
                "requires": ["simulation"],
                "input": {"type": "aggregate", "features": entries},
                "output": "log_mib",
                "runtime": mf.IN_PROCESS,
                "residual_quantiles": result["quantiles"][family],
                "capacity_mib": CAPACITY_MIB,
                "test_file": TEST_FILE,
                "validation": validation,
            }
        )
    mf.replace_estimators(manifest, NAMES.values(), ours)
    manifest["simulated"] = {
        "version": VERSION,
        "cuda_context_mib": round(result["served_context_mib"], 1),
        "residual_quantiles": result["sim_quantiles"],
        "correction_cap_log": REGRESSOR["cap"],
        "domain": {"file": DOMAIN_FILE, "sha256": mf.sha256_of(domain_path)},
        "simulations": "data/timm/simulations.jsonl.gz",
        "simulations_sha256": mf.sha256_of(layout.simulations),
        "validation": {
            **rp.prefixed("cv_", result["cv"]["simulated_alone"]),
            **rp.prefixed("test_", result["test"]["simulated_alone"]),
        },
    }
    mf.write_manifest(layout.out("models", "manifest.json"), manifest)


def run(layout, threads=None):
    torch.set_num_threads(threads or THREADS)
    result = run_stage(layout)
    write_report(result, layout.out("docs", "reports", "training-simulated.md"))
    print(json.dumps({k: result[k] for k in ("context_mib", "typical_distance", "cv", "test")}, indent=1))
