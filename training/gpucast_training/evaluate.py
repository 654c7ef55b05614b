"""Evaluate the real-model (timm cnn / transformer) MiB estimators beside the baselines.

    python -m gpucast_training evaluate      # writes docs/reports/training-real.md and .json

Reads the out-of-fold predictions of the grouped cross-validation that the timm stage
wrote (data/timm/cv_predictions.csv.gz, data/timm/cv_quantiles.json) and its held-out figures
(data/timm/pipeline_figures.json, computed through onnxruntime on data/timm/test.jsonl.gz).
Standard library only.
"""

import csv
import gzip
import math
import os
import statistics

from . import features as gf
from . import label_audit
from . import manifest as mf
from . import pages
from .constants import CAPACITY_MIB
from .constants import REAL_CLASS_BINS_MIB as CLASS_BINS_MIB
from .simulated_report import written_at

TOP = len(CLASS_BINS_MIB)
PAGE = ("docs", "reports", "training-real.md")
# The sections (by the start of their heading) and blocks the page keeps; every one is in
# docs/reports/training-real.json.
KEEP = {"Grouped CV, all": None, "Held-out test split": [0, 2, 3, 4]}


def memory_class(mib):
    return gf.memory_class(mib, CLASS_BINS_MIB)


def quantile(values, q):
    values = sorted(values)
    position = q * (len(values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def conformal(residuals, confidence):
    r = sorted(residuals)
    k = min(len(r), math.ceil((len(r) + 1) * confidence))
    return r[k - 1]


def load(layout):
    with gzip.open(layout.read("data", "timm", "cv_predictions.csv.gz"), "rt") as handle:
        rows = list(csv.DictReader(handle))
    return rows, mf.read_json(layout.read("data", "timm", "cv_quantiles.json"))


def true_class(row):
    return TOP if row["status"] == "oom" else memory_class(float(row["measured_peak_mib"]))


def audit_rows(rows):
    return [(r["id"].rsplit("@", 1)[0], int(r["batch_size"]), r["status"], float(r["measured_peak_mib"])) for r in rows]


def credible_oom_ids(rows):
    """oom rows from a model's first oom reading >= 90 % of the capacity on (label_audit.credible_oom)."""
    return {r["id"] for r, flag in zip(rows, label_audit.credible_oom(audit_rows(rows))) if flag}


def audit_lines(rows, quantiles):
    """What the labels themselves allow: failed ok rows, and oom rows whose own readings say the
    job fits, with the best oom-not-fit share an estimator can reach without calling them
    'does not fit'."""
    audit = audit_rows(rows)
    failed = label_audit.failed_ok(audit)
    fitting = label_audit.fitting_oom(audit)
    n_ok = sum(r["status"] == "ok" for r in rows)
    oom = [i for i, r in enumerate(rows) if r["status"] == "oom"]
    q95 = {
        family: next(q["log_ratio"] for q in levels if q["confidence"] == 0.95) for family, levels in quantiles.items()
    }
    traced_q95 = traced_bound(rows)
    flagged = {
        column: sum(
            float(rows[i][column]) * math.exp(bound[rows[i]["family"]]) > CAPACITY_MIB for i in oom if fitting[i]
        )
        for column, bound in (("regressor_mib", q95), ("traced_regressor_mib", traced_q95))
    }
    trusted = [r for r, f in zip(rows, failed) if not f]
    f = figure_row(trusted, "regressor_mib", q95)
    t = figure_row(trusted, "traced_regressor_mib", traced_q95)
    examples = [rows[i]["id"] for i in oom if fitting[i]][:4]
    return [
        "## What the labels allow (`training/gpucast_training/label_audit.py`)",
        "",
        "- ok rows no working run gives (reading not above the model's last trusted reading at a smaller "
        "batch, or above it x the batch ratio + 10 %%, or repeated by a neighbouring batch size): %d of %d. The estimators do not learn from them "
        "(nor from oom rows that are not credible); every table above still scores them as labelled."
        % (sum(failed), n_ok),
        "- oom rows whose model's own trusted readings extrapolate to under 90 %% of the card (crashes, "
        "not a need above 40 GB; e.g. %s): %d of %d. An estimator that says these fit (their measured "
        "need) reaches at most %s oom not fit; 95 %% needs calling at least %d of them 'does not fit'. "
        "gpucast's bound calls %d of them 'does not fit'."
        % (
            ", ".join("`%s`" % e for e in examples),
            sum(fitting),
            len(oom),
            pct(1 - sum(fitting) / len(oom)),
            math.ceil(0.95 * len(oom)) - (len(oom) - sum(fitting)),
            flagged["regressor_mib"],
        )
        + " The traced regressor's bound calls %d of them so." % flagged["traced_regressor_mib"],
        "- On the trusted ok rows and every oom row: gpucast memory_regressor median %s, p90 %s, bound "
        "exceeded %s, 8 GB class accuracy %.3f; traced_memory_regressor median %s, p90 %s, bound exceeded %s, "
        "8 GB class accuracy %.3f."
        % (
            pct(f["median"]),
            pct(f["p90"]),
            pct(f["bound_under"]),
            f["class_accuracy"],
            pct(t["median"]),
            pct(t["p90"]),
            pct(t["bound_under"]),
            t["class_accuracy"],
        ),
        "",
    ]


def figure_row(rows, figure, log_bound):
    """Figures of a MiB estimate (column name) with an upper bound estimate x exp(log_bound);
    `log_bound` is a number or a dict family -> number."""
    if not isinstance(log_bound, dict):
        log_bound = {"cnn": log_bound, "transformer": log_bound}
    log_bound = {"cnn": 0.0, "transformer": 0.0, **log_bound}
    bounds = {r["id"]: float(r[figure]) * math.exp(log_bound[r["family"]]) for r in rows}
    ok = [r for r in rows if r["status"] == "ok"]
    oom = [r for r in rows if r["status"] == "oom"]
    rel = [abs(float(r[figure]) / float(r["measured_peak_mib"]) - 1) for r in ok]
    credible = credible_oom_ids(rows)
    return {
        "median": statistics.median(rel),
        "p90": quantile(rel, 0.9),
        "under": sum(float(r[figure]) < float(r["measured_peak_mib"]) for r in ok) / len(ok),
        "bound_under": sum(bounds[r["id"]] < float(r["measured_peak_mib"]) for r in ok) / len(ok),
        "class_accuracy": sum(memory_class(float(r[figure])) == true_class(r) for r in rows) / len(rows),
        "class_below": sum(memory_class(float(r[figure])) < true_class(r) for r in rows) / len(rows),
        "oom_not_fit": sum(bounds[r["id"]] > CAPACITY_MIB for r in oom) / len(oom),
        "credible_not_fit": rate([bounds[r["id"]] > CAPACITY_MIB for r in oom if r["id"] in credible]),
    }


def rate(flags):
    return sum(flags) / len(flags) if flags else None


def classifier_row(rows, column):
    predicted = []
    for r in rows:
        if column == "combined":
            a = [float(v) for v in r["p_mlp_ensemble"].split()]
            b = [float(v) for v in r["p_sequence_transformer"].split()]
            p = [(x + y) / 2 for x, y in zip(a, b)]
        else:
            p = [float(v) for v in r[column].split()]
        predicted.append(max(range(len(p)), key=lambda i: (p[i], -i)))
    labels = [true_class(r) for r in rows]
    credible = credible_oom_ids(rows)
    return {
        "class_accuracy": sum(p == t for p, t in zip(predicted, labels)) / len(rows),
        "class_below": sum(p < t for p, t in zip(predicted, labels)) / len(rows),
        # "does not fit" = top class predicted
        "oom_not_fit": sum(p == TOP for p, r in zip(predicted, rows) if r["status"] == "oom")
        / max(1, sum(r["status"] == "oom" for r in rows)),
        "credible_not_fit": rate([p == TOP for p, r in zip(predicted, rows) if r["id"] in credible]),
    }


def pct(value):
    return "" if value is None else "%.1f %%" % (100 * value)


def traced_bound(rows):
    """The traced regressor's log bound at 0.95 by family: the pipeline's conformal rule on its
    own out-of-fold residuals (ok rows of all families, as the manifest's quantiles are)."""
    ok = [r for r in rows if r["status"] == "ok"]
    return {
        family: conformal(
            [
                math.log(float(r["measured_peak_mib"]) / float(r["traced_regressor_mib"]))
                for r in ok
                if r["family"] == family
            ],
            0.95,
        )
        for family in ("cnn", "transformer")
        if any(r["family"] == family for r in ok)
    }


def table(rows, quantiles):
    q95 = {
        family: next(q["log_ratio"] for q in levels if q["confidence"] == 0.95) for family, levels in quantiles.items()
    }
    ok = [r for r in rows if r["status"] == "ok"]
    lines = [
        "| estimator | median abs rel err | p90 abs rel err | under (figure) | under (bound) | 8 GB class acc | class below | oom not fit | credible oom not fit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    traced_q95 = traced_bound(rows)
    baselines = [
        ("gpucast memory_regressor (bound at 0.95)", "regressor_mib", q95),
        (
            "gpucast traced_memory_regressor, with describe's saved tensors (bound at 0.95)",
            "traced_regressor_mib",
            traced_q95,
        ),
    ]
    for name, column in (
        ("first_principles (formula)", "first_principles_mib"),
        ("traced first_principles (formula, describe's saved tensors)", "traced_first_principles_mib"),
        ("Horus (formula)", "horus_mib"),
        ("FakeTensor (CSV column)", "faketensor_mib"),
    ):
        baselines.append((name, column, 0.0))
    fp_bound = {}
    for family in ("cnn", "transformer"):
        residuals = [
            math.log(float(r["measured_peak_mib"]) / float(r["first_principles_mib"]))
            for r in ok
            if r["family"] == family
        ]
        fp_bound[family] = conformal(residuals, 0.95) if residuals else 0.0
    baselines.append(("first_principles + its own conformal bound (in-sample)", "first_principles_mib", fp_bound))
    for name, column, bound in baselines:
        f = figure_row(rows, column, bound)
        lines.append(
            "| %s | %s | %s | %s | %s | %.3f | %s | %s | %s |"
            % (
                name,
                pct(f["median"]),
                pct(f["p90"]),
                pct(f["under"]),
                pct(f["bound_under"]),
                f["class_accuracy"],
                pct(f["class_below"]),
                pct(f["oom_not_fit"]),
                pct(f["credible_not_fit"]),
            )
        )
    for name, column in (
        ("gpucast mlp_ensemble (classifier)", "p_mlp_ensemble"),
        ("gpucast sequence_transformer (classifier)", "p_sequence_transformer"),
        ("gpucast combined classifiers (mean)", "combined"),
    ):
        f = classifier_row(rows, column)
        lines.append(
            "| %s | | | | | %.3f | %s | %s | %s |"
            % (name, f["class_accuracy"], pct(f["class_below"]), pct(f["oom_not_fit"]), pct(f["credible_not_fit"]))
        )
    lines.append("| GPUMemNet (published, its own CNN/Transformer data) | | | | | ~0.80 | ~7 % | | |")
    return lines


def run(layout, threads=None):
    rows, quantiles = load(layout)
    out = [
        "# gpucast real-model estimators (timm cnn / transformer): evaluation",
        "",
        "Written by `python -m gpucast_training evaluate` on %s from the out-of-fold predictions of "
        "the `timm` stage (5-fold GroupKFold on the visible timm data, grouped by model-family "
        "name prefix; no model family is ever in both the fitting and the scored part). Do not edit by hand."
        % written_at(),
        "",
        "- Scored rows: `ok` rows for the errors; `oom` rows (true need > 40,960 MiB, censored) count as the top "
        "class and for *oom not fit* (upper bound, or the figure for formulas without a bound, above 40,960 MiB; "
        "for classifiers: the top class predicted). `failed`/`anomalous` rows are excluded.",
        "- *credible oom*: oom rows from a model's first oom reading >= 90 % of the capacity on. The other oom "
        "rows read far below the capacity at every batch size (e.g. `vit_base_patch16_clip_quickgelu_224`: 2,929 MiB "
        "ok at batch 8, then 2,301 MiB 'oom' at 16..128): crashes rather than a measured need, which no estimator "
        "can call 'does not fit' without over-reserving for the model everywhere.",
        "- *under (figure)*: share of ok jobs whose figure is below the measured peak; *under (bound)*: share "
        "whose upper bound (0.95) is below it (the bound exceeded rate).",
        "",
    ]
    for family in ("all", "cnn", "transformer"):
        subset = rows if family == "all" else [r for r in rows if r["family"] == family]
        n_ok = sum(r["status"] == "ok" for r in subset)
        out.append(
            "## Grouped CV, %s (%d ok rows, %d oom rows, %d groups)"
            % (family, n_ok, len(subset) - n_ok, len(set(r["group"] for r in subset)))
        )
        out.append("")
        out.extend(table(subset, quantiles))
        out.append("")
    out.extend(audit_lines(rows, quantiles))
    for family, levels in quantiles.items():
        out.append(
            "Conformal quantiles of log(measured / predicted), %s (out-of-fold, ok rows): " % family
            + ", ".join("%.3g: %.3f" % (q["confidence"], q["log_ratio"]) for q in levels)
        )
        out.append("")
    out.append("")
    figures_path = layout.read("data", "timm", "pipeline_figures.json")
    if os.path.exists(figures_path):
        figures = mf.read_json(figures_path)
        timm = figures["timm"]
        info = timm["info"]
        out += [
            "## Held-out test split (onnxruntime on `data/timm/test.jsonl.gz`)",
            "",
            "%d rows of %d models in %d held-out groups: %s. Excluded rows: %s."
            % (
                info["test_rows"],
                info["test_models"],
                len(info["test_groups"]),
                ", ".join(info["test_groups"]),
                info["dropped"],
            ),
            "",
            "Training rows from the service's stored observations (`--observations`): %d (%d skipped: "
            "job does not parse)." % (info.get("observation_rows", 0), info.get("observation_rows_skipped", 0)),
            "",
            "| family | median abs rel err | p90 | under (figure) | bound exceeded (0.95) | oom not fit | credible oom not fit | "
            "mlp_ensemble acc / below | sequence acc / below | combined acc / below |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for family in ("all", "cnn", "transformer"):
            t = timm["test"][family]
            r = t["regressor"]
            out.append(
                "| %s | %s | %s | %s | %s | %s | %s | %.3f / %s | %.3f / %s | %.3f / %s |"
                % (
                    family,
                    pct(r["median_abs_rel_error"]),
                    pct(r["p90_abs_rel_error"]),
                    pct(r["under_rate"]),
                    pct(r["bound_exceeded_rate"]),
                    pct(r["oom_not_fit_rate"]),
                    pct(r.get("credible_oom_not_fit_rate")),
                    t["mlp_ensemble"]["accuracy"],
                    pct(t["mlp_ensemble"]["below_rate"]),
                    t["sequence_transformer"]["accuracy"],
                    pct(t["sequence_transformer"]["below_rate"]),
                    t["combined"]["accuracy"],
                    pct(t["combined"]["below_rate"]),
                )
            )
        out += [
            "",
            "The same held-out jobs through the traced regressor (`traced_memory_regressor`, the figure "
            "for jobs that carry describe's `saved_tensors`):",
            "",
            "| family | median abs rel err | p90 | under (figure) | bound exceeded (0.95) | oom not fit | 8 GB class acc (figure) |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for family in ("all", "cnn", "transformer"):
            traced = timm["test"][family].get("traced_regressor")
            if traced:
                out.append(
                    "| %s | %s | %s | %s | %s | %s | %s |"
                    % (
                        family,
                        pct(traced["median_abs_rel_error"]),
                        pct(traced["p90_abs_rel_error"]),
                        pct(traced["under_rate"]),
                        pct(traced["bound_exceeded_rate"]),
                        pct(traced["oom_not_fit_rate"]),
                        "%.3f" % traced["class_accuracy"] if "class_accuracy" in traced else "",
                    )
                )
        out += ["", "Coverage of the conformal bounds on the test split (share of ok rows with measured <= bound):", ""]
        for family in ("cnn", "transformer"):
            cov = timm["test"][family]["coverage"]
            out.append("- %s: " % family + ", ".join("%s -> %.3f" % (c, v) for c, v in cov.items()))
        mlp = figures["mlp_regressor"]
        out += [
            "",
            "## MLP family memory regressor (`mlp_memory_regressor`)",
            "",
            "3-fold GroupKFold CV on the MLP training split / held-out `data/mlp/test.jsonl.gz` via onnxruntime:",
            "",
            "| split | median abs rel err | p90 | under (figure) | bound exceeded (0.95) |",
            "| --- | --- | --- | --- | --- |",
        ]
        for split in ("cv", "test"):
            r = mlp[split]
            out.append(
                "| %s | %s | %s | %s | %s |"
                % (
                    split,
                    pct(r["median_abs_rel_error"]),
                    pct(r["p90_abs_rel_error"]),
                    pct(r["under_rate"]),
                    pct(r["bound_exceeded_rate"]),
                )
            )
        out += [
            "",
            "## ONNX",
            "",
            "| model | max abs diff vs torch (test) | median latency N=1, 1 thread | p99 |",
            "| --- | --- | --- | --- |",
        ]
        for name, lat in sorted(timm["latency"].items()):
            out.append(
                "| `%s` | %s | %.0f us | %.0f us |"
                % (name, "%.1e" % timm["diffs"].get(name.split("@")[0], float("nan")), lat["median_us"], lat["p99_us"])
            )
        out.append(
            "| `mlp_regressor` | %.1e | %.0f us | %.0f us |"
            % (mlp["max_abs_diff"], mlp["latency"]["median_us"], mlp["latency"]["p99_us"])
        )
        out.append("")
    print(pages.write(layout.out(*PAGE), "\n".join(out) + "\n", KEEP, "evaluate"))


def render(layout):
    """`evaluate --from-data`: the page again from docs/reports/training-real.json."""
    print(pages.render(layout.out(*PAGE), KEEP, "evaluate"))
