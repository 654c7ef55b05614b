"""docs/reports/training-simulated.md from the simulated stage's figures
(data/timm/simulated_figures.json): stdlib only, so that `python -m gpucast_training simulated
--from-data` renders the page again without torch or the training data."""

import datetime
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ("data", "timm", "simulated_figures.json")
CAP = 0.3  # the learned correction stays within x/÷ e^CAP (simulated.REGRESSOR's cap)


def written_at(root=ROOT):
    """The date and the commit the checkout is at (with `+` when it has uncommitted changes)."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True, cwd=root
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            cwd=root,
        ).stdout.strip()
        return f"{stamp} at commit `{sha}{'+' if dirty else ''}`"
    except (OSError, subprocess.CalledProcessError):
        return stamp


def pct(value):
    return "" if value is None else "%.1f %%" % (100 * value)


def figure_table(rows):
    lines = [
        "| estimator | median abs rel error | p90 | under-estimated | bound exceeded (0.95) | "
        "8 GB class accuracy | oom reported not fitting |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, f in rows.items():
        lines.append(
            "| %s | %s | %s | %s | %s | %.3f | %s |"
            % (
                name,
                pct(f["median_abs_rel_error"]),
                pct(f["p90_abs_rel_error"]),
                pct(f["under_rate"]),
                pct(f.get("bound_exceeded_rate")),
                f["class_accuracy"],
                pct(f.get("oom_not_fit_rate")),
            )
        )
    return lines


NAMES_IN_REPORT = {
    "simulated_corrected": "**gpucast: simulated + learned correction (served)**",
    "simulated_alone": "simulation alone (reserved peak on the card + context)",
    "allocated_plus_context": "simulation's allocated peak + context (no allocator cache)",
}


def write_report(result, path):
    def renamed(figs):
        return {NAMES_IN_REPORT.get(k, k): v for k, v in figs.items()}

    cv, test, public = result["cv"], result["test"], result["public"]
    lines = (
        [
            "# Simulated training step: evaluation",
            "",
            "Written by `python -m gpucast_training simulated` (after the `timm` stage, "
            "`describe/scripts/simulate_timm_training_set.py` and `python -m gpucast_training public-rows`) "
            "on %s. Do not edit by hand. Every figure of the run, the published runs row by row "
            "included: [data/timm/simulated_figures.json](../../data/timm/simulated_figures.json), from "
            "which `python -m gpucast_training simulated --from-data` renders this page again."
            % result.get("written", "(date and commit not recorded)"),
            "",
            "The simulation: describe runs two training steps on meta tensors and replays every allocation "
            "and free through its model of PyTorch's CUDA caching allocator (describe/README.md). The "
            "served figure is the simulated reserved peak on the card + a CUDA context of %.0f MiB "
            "(fitted: median of measured - reserved over the ok rows at batch 8 and 16), corrected by a "
            "learned factor within x/÷ e^%.1f where the job lies near the timm training data, never below "
            "the physical floor (weights + gradients + optimizer state + activations at the simulated peak "
            "+ context)." % (result["served_context_mib"], CAP),
            "",
            "## Grouped 5-fold CV by model family (%d rows of the visible families)" % result["rows"]["train"],
            "",
        ]
        + figure_table(renamed(cv))
        + [
            "",
            "Rows far from the other folds' data (the correction not applied): %d."
            % cv["simulated_corrected"]["far_rows"],
            "",
            "## The 25 held-out families (%d rows; fitted on the training part, scored through onnxruntime)"
            % result["rows"]["test"],
            "",
        ]
        + figure_table(renamed(test))
        + [
            "",
            "Rows far from the training data: %d." % test["simulated_corrected"]["far_rows"],
            "",
        ]
    )
    if public:
        lines += [
            "## Out of distribution: public_training_memory.csv (published runs)",
            "",
            "Every row whose setup gpucast expresses (data/public/PROVENANCE.md lists what is left out "
            "and why), compared like with like: `allocated` rows with the simulation's allocated peak, "
            "`allocated_minus_weights` rows (TorchTracemalloc) with it less the parameters, `device` rows "
            "(nvidia-smi/NVML) with the served estimate and its bound; DDP rows simulated as one GPU.",
            "",
            "- median absolute error, all %d rows: %s; the %d single-GPU rows: %s"
            % (
                public["n"],
                pct(public["median_abs_rel_error"]),
                public["strict_n"],
                pct(public["strict_median_abs_rel_error"]),
            ),
            "- served bound exceeded: %s of %d device rows; %s of all %d rows (an allocated figure above "
            "the served device bound is a miss too)"
            % (
                public.get("device_bound_exceeded"),
                public.get("device_rows"),
                public.get("all_bound_exceeded"),
                public["n"],
            ),
            "",
        ]
    with open(path, "w") as handle:
        handle.write("\n".join(lines) + "\n")


def render(layout=None):
    """`simulated --from-data`: the page again from data/timm/simulated_figures.json."""
    root = Path(layout.out()) if layout is not None else ROOT
    with open(root.joinpath(*FIGURES)) as handle:
        result = json.load(handle)
    write_report(result, root / "docs" / "reports" / "training-simulated.md")
