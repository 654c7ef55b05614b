"""Golden cases for jobs that carry `simulation` (describe's whole-step simulation).

    python3 -m gpucast_training golden     (from training/; after the mlp, timm and simulated stages)

Stdlib only; touches tests/fixtures/golden_features.json alone. The pipelines write the
fixture's cases; this recomputes every case's raw aggregate features (so that the simulation
features, 0 without a simulation, are pinned for every job) and adds `simulated_*` real cases:
held-out timm jobs of the fixture with a simulation built from their own numbers, whose
`sim_*` features both implementations must agree on. Every estimator of the manifest that
requires a simulation joins the real cases' `extra_aggregate`. Rerunning it gives the same
file.
"""

import os

from . import features as gf
from . import manifest as mf

GOLDEN = ("tests", "fixtures", "golden_features.json")
PREFIX = "simulated_"

# (new case, the real case whose job it extends, interpolated, bytes written as floats)
CASES = [
    ("simulated_timm_cnn_shortest", "timm_cnn_shortest", False, False),
    ("simulated_timm_cnn_shortest_momentum_mixed16", "timm_cnn_shortest_momentum_mixed16", True, False),
    ("simulated_timm_transformer_median", "timm_transformer_median", False, True),
]


def simulation_of(job, interpolated, as_floats):
    """A consistent simulation of `job` (allocated <= min capacity <= reserved, categories
    summing to the allocated peak), with counts that are no multiples of 2^20."""
    job = gf.normalise_job(job)
    params = sum(layer["params"] for layer in job["layers"])
    batch = job["batch_size"]
    weight_bytes = 4 if job["precision"] == "fp32" else 6
    saved = job["saved_tensors"]
    activations = (
        saved["per_sample_bytes"] * batch + saved["fixed_bytes"]
        if saved
        else sum(layer["output_size"] for layer in job["layers"]) * batch * 4
    ) + 12345
    breakdown = {
        "parameters": weight_bytes * params,
        "gradients": 4 * params,
        "optimizer_state": int(gf.OPTIMIZER_STATE_BYTES[job["optimizer"]]) * params,
        "activations": activations,
        "temporaries": 3 * params + 7777 + 1000 * batch,
    }
    allocated = sum(breakdown.values())
    reserved = allocated + allocated // 7 + (1 << 21) + 3
    simulation = {
        "batch_size": batch,
        "optimizer": job["optimizer"],
        "precision": job["precision"],
        "allocated_peak_bytes": allocated,
        "reserved_peak_bytes": reserved,
        "min_capacity_bytes": allocated + (reserved - allocated) // 2,
        "breakdown_at_peak": breakdown,
        "attention": "efficient",
        "interpolated": interpolated,
    }
    if as_floats:  # JSON writers that emit 29440.0 for 29440: both sides accept them
        simulation["reserved_peak_bytes"] = float(simulation["reserved_peak_bytes"])
        simulation["breakdown_at_peak"]["gradients"] = float(breakdown["gradients"])
    return simulation


def run(layout, threads=None):
    golden = mf.read_json(layout.read(*GOLDEN))
    manifest = mf.read_json(layout.read("models", "manifest.json"))
    by_name = mf.estimators_by_name(manifest)
    estimators = golden["real_estimators"]
    for entry in manifest["estimators"]:
        if "simulation" in entry.get("requires", []) and entry["name"] not in estimators["extra_aggregate"]:
            estimators["extra_aggregate"].append(entry["name"])
    real = [case for case in golden["real_cases"] if not case["name"].startswith(PREFIX)]
    jobs = {case["name"]: case["job"] for case in real}
    for name, source, interpolated, as_floats in CASES:
        job = dict(jobs[source], simulation=simulation_of(jobs[source], interpolated, as_floats))
        real.append(mf.manifest_golden_case(name, job, estimators, by_name))
    for case in real:
        case["raw_aggregate"] = gf.raw_aggregate_features(case["job"])
        for extra in estimators["extra_aggregate"]:
            if extra not in case["extra_aggregate"]:
                case["extra_aggregate"][extra] = gf.aggregate_vector(case["job"], by_name[extra]["input"]["features"])
    golden["real_cases"] = real
    for case in golden["cases"]:
        case["raw_aggregate"] = gf.raw_aggregate_features(case["job"])
    mf.write_json(layout.out(*GOLDEN), golden)
    print("%s: %d cases, %d with a simulation" % (os.path.join(*GOLDEN), len(golden["cases"]) + len(real), len(CASES)))
