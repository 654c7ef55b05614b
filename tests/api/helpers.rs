//! The API tests' own helpers (the committed data and manifest), beside the shared ones of
//! `tests/common`.

use serde_json::Value;

pub use crate::common::{
    example_job, models_dir, ort_dylib, repo_root, spawn_app, spawn_app_with,
    spawn_app_with_devices, test_config, TestApp,
};

/// The JSON lines of a gzipped file of the repository (`data/...jsonl.gz`).
pub fn jsonl_gz(path: &str) -> Vec<Value> {
    use std::io::BufRead;
    let file = std::fs::File::open(repo_root().join(path)).expect(path);
    std::io::BufReader::new(flate2::read::GzDecoder::new(file))
        .lines()
        .map(|line| serde_json::from_str(&line.unwrap()).unwrap())
        .collect()
}

/// Jobs of the committed MLP held-out split with their measured peaks.
pub fn held_out_mlp_jobs() -> Vec<(Value, f64)> {
    use std::io::BufRead;
    let file = std::fs::File::open(repo_root().join("data/mlp/test.jsonl.gz")).unwrap();
    std::io::BufReader::new(flate2::read::GzDecoder::new(file))
        .lines()
        .map(|line| {
            let row: Value = serde_json::from_str(&line.unwrap()).unwrap();
            (
                row["job"].clone(),
                row["measured_peak_mib"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// The descriptions `describe` wrote for the timm training models, read once per test binary
/// (unoptimised, parsing them takes a good part of a second).
fn descriptions() -> &'static [Value] {
    static DESCRIPTIONS: std::sync::OnceLock<Vec<Value>> = std::sync::OnceLock::new();
    DESCRIPTIONS.get_or_init(|| jsonl_gz("data/timm/descriptions.jsonl.gz"))
}

pub fn training_descriptions() -> Vec<Value> {
    descriptions().to_vec()
}

pub fn training_description(model: &str) -> Value {
    descriptions()
        .iter()
        .find(|d| d["model"] == model)
        .expect("the model is described")
        .clone()
}

/// The committed models' manifest, as the service loads it.
pub fn committed_manifest() -> Value {
    serde_json::from_str(&std::fs::read_to_string(models_dir().join("manifest.json")).unwrap())
        .unwrap()
}

/// The committed `simulated` block's `cuda_context_mib`: what every simulated figure adds to the
/// reserved peak.
pub fn simulated_context_mib() -> f64 {
    committed_manifest()["simulated"]["cuda_context_mib"]
        .as_f64()
        .expect("simulated.cuda_context_mib")
}

/// Whether a manifest entry is a regressor that corrects the simulated figure.
pub fn requires_simulation(entry: &Value) -> bool {
    entry["requires"]
        .as_array()
        .is_some_and(|r| r.iter().any(|x| x == "simulation"))
}

/// A copy of the committed models without what corrects the simulated figure: the entries that
/// require a simulation, their graphs (unless another entry uses them), and the training domain
/// (`simulated.domain` and its file). Simulated jobs are answered by physics alone there,
/// whatever the committed models learned.
pub fn models_without_simulation_regressors() -> tempfile::TempDir {
    let models = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(models_dir()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), models.path().join(entry.file_name())).unwrap();
    }
    let manifest_path = models.path().join("manifest.json");
    let mut manifest = committed_manifest();
    let estimators = manifest["estimators"].as_array_mut().unwrap();
    let mut removed: Vec<String> = estimators
        .iter()
        .filter(|e| requires_simulation(e))
        .map(|e| e["file"].as_str().unwrap().to_string())
        .collect();
    removed.sort_unstable();
    removed.dedup();
    estimators.retain(|e| !requires_simulation(e));
    for file in removed
        .iter()
        .filter(|f| !estimators.iter().any(|e| e["file"] == f.as_str()))
    {
        std::fs::remove_file(models.path().join(file)).unwrap();
    }
    if let Some(domain) = manifest["simulated"]
        .as_object_mut()
        .and_then(|s| s.remove("domain"))
    {
        std::fs::remove_file(models.path().join(domain["file"].as_str().unwrap())).unwrap();
    }
    std::fs::write(&manifest_path, manifest.to_string()).unwrap();
    models
}

/// The simulation `gpucast_describe` wrote for `model` at `batch` (data/timm/simulations.jsonl.gz).
pub fn committed_simulation(model: &str, batch: u64) -> Value {
    use std::io::BufRead;
    let file = std::fs::File::open(repo_root().join("data/timm/simulations.jsonl.gz")).unwrap();
    std::io::BufReader::new(flate2::read::GzDecoder::new(file))
        .lines()
        .map(|line| serde_json::from_str::<Value>(&line.unwrap()).unwrap())
        .find(|entry| entry["model"] == model)
        .unwrap_or_else(|| panic!("{model} is not simulated"))["simulations"][batch.to_string()]
    .clone()
}

/// An answer says one thing: its memory class contains its MiB figure (to the figure's 0.1 MiB
/// rounding). Panics naming `what` otherwise.
pub fn assert_class_holds_figure(answer: &Value, what: &str) {
    let memory = &answer["memory"];
    let Some(figure) = memory["estimate_mib"].as_f64() else {
        return;
    };
    let lower = memory["class"]["lower_mib"].as_f64().unwrap();
    // null: the open top class
    let upper = memory["class"]["upper_mib"]
        .as_f64()
        .unwrap_or(f64::INFINITY);
    assert!(
        lower - 0.05 <= figure && figure <= upper + 0.05,
        "{what}: estimate {figure} MiB outside its class {lower}-{upper}"
    );
}

/// The median; NaN for no values.
pub fn median(mut values: Vec<f64>) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// Every choice of `k` of the indices below `n`.
pub fn combinations(n: usize, k: usize) -> Vec<Vec<usize>> {
    if k == 0 {
        return vec![vec![]];
    }
    if n < k {
        return vec![];
    }
    let mut with_last = combinations(n - 1, k - 1);
    for c in &mut with_last {
        c.push(n - 1);
    }
    let mut out = combinations(n - 1, k);
    out.extend(with_last);
    out
}

/// Checks an answer's bound against the rule of `bound::distribution`: its scores are the
/// committed ones (data/uncertainty.json) of the group it names, scaled by `widen`, and the
/// bound is the figure's terms times `exp(scale x score at 0.95 x share)` (rounded up).
pub fn assert_bound_is_the_distributions_at_95(body: &Value, widen: f64) {
    let committed: Value = serde_json::from_str(
        &std::fs::read_to_string(repo_root().join("data/uncertainty.json")).unwrap(),
    )
    .unwrap();
    let u = &body["memory"]["uncertainty"];
    let group = &committed["groups"][u["scores_group"].as_str().unwrap()];
    let levels = committed["levels"].as_array().unwrap();
    let at_95 = levels
        .iter()
        .position(|l| (l.as_f64().unwrap() - 0.95).abs() < 1e-9)
        .unwrap();
    let score = group["scores"][at_95].as_f64().unwrap();
    let f = |k: &str| u[k].as_f64().unwrap();
    assert!(
        (f("scale") - widen.max(1.0)).abs() < 1e-3,
        "{widen}: {body}"
    );
    assert!((u["score_quantiles"]["0.95"].as_f64().unwrap() - score).abs() < 1e-3);
    let figure = f("known_mib") + f("cuda_context_mib") + f("uncertain_mib");
    let bound = figure * (f("scale") * score * f("share")).exp();
    let estimate = body["memory"]["estimate_mib"].as_f64().unwrap();
    let answered = body["memory"]["upper_bound_mib"].as_f64().unwrap();
    // The terms are rounded to 0.1 MiB each in the answer.
    assert!(
        (answered - bound.max(estimate).ceil()).abs() <= 1.0 + 1e-3 * bound,
        "{bound}: {body}"
    );
}

/// The sum of the `/metrics` samples whose line starts with `prefix` (a metric's name, or its
/// name and labels).
pub fn counter(metrics: &str, prefix: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
