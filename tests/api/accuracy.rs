//! The committed models, run by the Rust engine on the committed held-out split, reproduce the
//! figures the training pipeline wrote into the manifest; and the Rust features equal the
//! golden vectors the Python pipeline wrote.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};

use gpucast::domain::features::{AggregateFeatures, TokenFeatures};
use gpucast::domain::LayerKind;
use gpucast::estimators::manifest::InputSpec;
use gpucast::estimators::Estimators;
use gpucast::http::estimate::to_job;
use gpucast::http::types::EstimateRequest;
use serde::Deserialize;
use serde_json::Value;

use crate::helpers::{models_dir, ort_dylib, repo_root};

/// Figures are recomputed in f32 by another runtime build; allow rounding at class borders.
const TOLERANCE: f64 = 0.005;

#[derive(Deserialize)]
struct HeldOutJob {
    job: EstimateRequest,
    measured_peak_mib: f64,
    smact: f64,
    smocc: f64,
}

fn held_out_jobs(manifest_split: &Value) -> Vec<HeldOutJob> {
    let file = manifest_split["test_file"].as_str().expect("the manifest names its test file");
    let reader = BufReader::new(flate2::read::GzDecoder::new(std::fs::File::open(repo_root().join(file)).unwrap()));
    reader.lines().map(|line| serde_json::from_str(&line.unwrap()).unwrap()).collect()
}

fn figure(validation: &BTreeMap<String, Value>, name: &str) -> f64 {
    validation.get(name).and_then(Value::as_f64).unwrap_or_else(|| panic!("validation figure {name} missing"))
}

#[test]
fn committed_models_reproduce_the_manifest_held_out_figures() {
    let estimators = Estimators::load(&models_dir(), &ort_dylib(), 1).expect("models load");
    let jobs = held_out_jobs(&estimators.manifest().split);
    let bins = estimators.all().iter().find_map(|e| e.entry.class_bins_mib.clone()).expect("a classifier is loaded");
    let classes = gpucast::domain::MemoryClasses::new(bins).unwrap();
    assert!(jobs.len() >= 100, "only {} held-out jobs", jobs.len());

    let mut correct: BTreeMap<String, usize> = BTreeMap::new();
    let mut below: BTreeMap<String, usize> = BTreeMap::new();
    let mut abs_error: BTreeMap<String, f64> = BTreeMap::new();
    for held_out in &jobs {
        let job = to_job(&held_out.job).expect("held-out jobs are valid");
        let estimate = estimators.estimate(&job, 0.95).expect("held-out jobs are estimated");
        let true_class = classes.classify(held_out.measured_peak_mib).index;
        let mut answers: Vec<(String, usize)> =
            estimate.classifiers.iter().map(|(name, a)| (name.clone(), a.class.index)).collect();
        answers.push(("combined".into(), estimate.class.class.index));
        for (name, predicted) in answers {
            *correct.entry(name.clone()).or_default() += usize::from(predicted == true_class);
            *below.entry(name).or_default() += usize::from(predicted < true_class);
        }
        for (target, truth) in [("smact", held_out.smact), ("smocc", held_out.smocc)] {
            *abs_error.entry(target.into()).or_default() += (f64::from(estimate.utilization[target]) - truth).abs();
        }
    }
    let n = jobs.len() as f64;
    let manifest = estimators.manifest();
    for entry in &manifest.estimators {
        let name = entry.name.as_str();
        if let Some(&hits) = correct.get(name) {
            let accuracy = hits as f64 / n;
            let below_rate = below[name] as f64 / n;
            assert!((accuracy - figure(&entry.validation, "test_accuracy")).abs() <= TOLERANCE, "{name}: accuracy {accuracy}");
            assert!((below_rate - figure(&entry.validation, "test_below_rate")).abs() <= TOLERANCE, "{name}: below {below_rate}");
        } else {
            let mae = abs_error[entry.target.as_deref().unwrap()] / n;
            assert!((mae - figure(&entry.validation, "test_mae")).abs() <= TOLERANCE, "{name}: MAE {mae}");
            assert!(mae < figure(&entry.validation, "test_baseline_mae"), "{name} does not beat the mean baseline");
        }
    }
    let combined = manifest.combined.as_ref().expect("the manifest describes the combined answer");
    let accuracy = correct["combined"] as f64 / n;
    assert!((accuracy - figure(&combined.validation, "test_accuracy")).abs() <= TOLERANCE, "combined accuracy {accuracy}");
    let below_rate = below["combined"] as f64 / n;
    assert!((below_rate - figure(&combined.validation, "test_below_rate")).abs() <= TOLERANCE, "combined below {below_rate}");
}

#[derive(Deserialize)]
struct Golden {
    estimators: GoldenEstimators,
    cases: Vec<GoldenCase>,
}

#[derive(Deserialize)]
struct GoldenEstimators {
    aggregate: String,
    sequence: String,
}

#[derive(Deserialize)]
struct GoldenCase {
    name: String,
    job: EstimateRequest,
    raw_aggregate: BTreeMap<String, f64>,
    aggregate: Vec<f64>,
    kind_ids: Vec<i64>,
    token_features: Vec<Vec<f64>>,
}

fn close(a: f64, b: f64, relative: f64) -> bool {
    (a - b).abs() <= relative * a.abs().max(b.abs()).max(1.0)
}

#[test]
fn rust_features_equal_the_golden_vectors_written_by_python() {
    let golden: Golden =
        serde_json::from_str(&std::fs::read_to_string(repo_root().join("tests/fixtures/golden_features.json")).unwrap()).unwrap();
    let manifest: gpucast::estimators::manifest::Manifest =
        serde_json::from_str(&std::fs::read_to_string(models_dir().join("manifest.json")).unwrap()).unwrap();
    let entry = |name: &str| manifest.estimators.iter().find(|e| e.name == name).unwrap().input.clone();
    let InputSpec::Aggregate { features } = entry(&golden.estimators.aggregate) else { panic!("not aggregate") };
    let InputSpec::Sequence { kind_vocab, token_features, .. } = entry(&golden.estimators.sequence) else {
        panic!("not sequence")
    };
    let vocab: Vec<LayerKind> = kind_vocab.iter().map(|k| LayerKind::parse(k).unwrap()).collect();
    assert!(golden.cases.len() >= 5);
    for case in &golden.cases {
        let job = to_job(&case.job).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let raw = AggregateFeatures::of(&job);
        for (name, expected) in &case.raw_aggregate {
            let actual = raw.get(name).unwrap_or_else(|| panic!("{}: unknown feature {name}", case.name));
            assert!(close(actual, *expected, 1e-9), "{}: {name} = {actual}, golden {expected}", case.name);
        }
        let aggregate = raw.normalised(&features);
        assert_eq!(aggregate.len(), case.aggregate.len(), "{}", case.name);
        for (i, (a, e)) in aggregate.iter().zip(&case.aggregate).enumerate() {
            assert!(close(f64::from(*a), *e, 1e-6), "{}: aggregate[{i}] = {a}, golden {e}", case.name);
        }
        let tokens = TokenFeatures::of(&job, |k| vocab.iter().position(|v| *v == k), &token_features)
            .unwrap_or_else(|e| panic!("{}: {e:?}", case.name));
        assert_eq!(tokens.kind_ids, case.kind_ids, "{}", case.name);
        let golden_tokens: Vec<f64> = case.token_features.iter().flatten().copied().collect();
        assert_eq!(tokens.features.len(), golden_tokens.len(), "{}", case.name);
        for (i, (a, e)) in tokens.features.iter().zip(&golden_tokens).enumerate() {
            assert!(close(f64::from(*a), *e, 1e-6), "{}: token feature {i} = {a}, golden {e}", case.name);
        }
    }
}
