//! The committed models, run by the Rust engine on the committed held-out split, reproduce the
//! figures the training pipeline wrote into the manifest; and every estimator's input for known
//! jobs is the features pinned for them (tests/fixtures/features.json), normalised as the
//! manifest says.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};

use gpucast::api::types::EstimateRequest;
use gpucast::engine::validate::to_job;
use gpucast::estimators::features::{AggregateFeatures, TokenFeatures};
use gpucast::estimators::manifest::{EstimatorKind, InputSpec};
use gpucast::estimators::{Estimate, Estimators};
use gpucast::job::LayerKind;
use gpucast::job::{Family, Job, MemoryClasses, ResidualQuantiles};
use serde::Deserialize;
use serde_json::Value;

use crate::helpers::{median, models_dir, ort_dylib, repo_root};

/// Figures are recomputed in f32 by another runtime build; allow rounding at class borders.
const TOLERANCE: f64 = 0.005;

#[derive(Deserialize)]
struct HeldOutJob {
    job: EstimateRequest,
    measured_peak_mib: f64,
    /// `ok`, or `oom` (the true need exceeds the card); absent means ok.
    #[serde(default)]
    status: Option<String>,
    #[serde(default)]
    smact: Option<f64>,
    #[serde(default)]
    smocc: Option<f64>,
}

impl HeldOutJob {
    fn ok(&self) -> bool {
        self.status.as_deref().is_none_or(|s| s == "ok")
    }
}

fn held_out_jobs(file: &str) -> Vec<HeldOutJob> {
    let reader = BufReader::new(flate2::read::GzDecoder::new(
        std::fs::File::open(repo_root().join(file)).unwrap(),
    ));
    reader
        .lines()
        .map(|line| serde_json::from_str(&line.unwrap()).unwrap())
        .collect()
}

fn figure(validation: &BTreeMap<String, Value>, name: &str) -> f64 {
    validation
        .get(name)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("validation figure {name} missing"))
}

fn assert_close(what: &str, actual: f64, validation: &BTreeMap<String, Value>, name: &str) {
    let expected = figure(validation, name);
    assert!(
        (actual - expected).abs() <= TOLERANCE,
        "{what}: {name} is {actual:.4} in Rust, {expected:.4} in the manifest"
    );
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    sum / n as f64
}

/// Class accuracy and below-rate; an `oom` job's true class is the top one (does not fit).
fn class_figures(
    rows: &[(&HeldOutJob, &Estimate)],
    classes: &MemoryClasses,
    predicted: impl Fn(&Estimate) -> usize,
) -> (f64, f64) {
    let truth = |row: &HeldOutJob| {
        if row.ok() {
            classes.classify(row.measured_peak_mib).index
        } else {
            classes.len() - 1
        }
    };
    let accuracy = mean(
        rows.iter()
            .map(|(row, e)| f64::from(u8::from(predicted(e) == truth(row)))),
    );
    let below = mean(
        rows.iter()
            .map(|(row, e)| f64::from(u8::from(predicted(e) < truth(row)))),
    );
    (accuracy, below)
}

#[test]
fn committed_models_reproduce_the_manifest_held_out_figures() {
    let estimators = Estimators::load(&models_dir(), &ort_dylib(), 1).expect("models load");
    let manifest = estimators.manifest();
    let default_file = manifest.split["test_file"]
        .as_str()
        .expect("the manifest names its test file")
        .to_string();
    let file_of = |e: &gpucast::estimators::manifest::EstimatorEntry| {
        e.test_file.clone().unwrap_or_else(|| default_file.clone())
    };
    let mut files: Vec<String> = manifest.estimators.iter().map(file_of).collect();
    files.sort();
    files.dedup();
    let mut checked = 0;
    for file in files {
        let rows = held_out_jobs(&file);
        assert!(
            rows.len() >= 100,
            "{file}: only {} held-out jobs",
            rows.len()
        );
        let jobs: Vec<Job> = rows
            .iter()
            .map(|r| to_job(&r.job).expect("held-out jobs are valid"))
            .collect();
        let items: Vec<(&Job, f64)> = jobs.iter().map(|job| (job, 0.95)).collect();
        let estimates: Vec<Estimate> = estimators
            .estimate_many(&items)
            .into_iter()
            .map(|e| e.expect("held-out jobs are estimated"))
            .collect();
        for estimator in estimators
            .all()
            .iter()
            .filter(|e| file_of(&e.entry) == file)
        {
            let entry = &estimator.entry;
            let name = entry.name.as_str();
            let family_rows: Vec<(&HeldOutJob, &Estimate)> = rows
                .iter()
                .zip(&estimates)
                .filter(|(_, e)| e.family == estimator.family)
                .collect();
            let ok_rows: Vec<&(&HeldOutJob, &Estimate)> =
                family_rows.iter().filter(|(row, _)| row.ok()).collect();
            match entry.kind {
                EstimatorKind::MemoryClassifier => {
                    let classes =
                        MemoryClasses::new(entry.class_bins_mib.clone().unwrap()).unwrap();
                    let (accuracy, below) =
                        class_figures(&family_rows, &classes, |e| e.classifiers[name].class.index);
                    assert_close(name, accuracy, &entry.validation, "test_accuracy");
                    assert_close(name, below, &entry.validation, "test_below_rate");
                }
                EstimatorKind::MemoryRegressor => {
                    // A simulation regressor runs only near its data and where the step runs on
                    // its card (estimators::combine); its figures are over the rows it answered.
                    let answered_rows = family_rows
                        .iter()
                        .filter(|(_, e)| e.mib_estimators.contains_key(name))
                        .count();
                    assert!(
                        answered_rows * 5 >= family_rows.len() * 4,
                        "{name} answered {answered_rows} of {} rows",
                        family_rows.len()
                    );
                    let family_rows: Vec<(&HeldOutJob, &Estimate)> = family_rows
                        .iter()
                        .copied()
                        .filter(|(_, e)| e.mib_estimators.contains_key(name))
                        .collect();
                    let ok_rows: Vec<&(&HeldOutJob, &Estimate)> =
                        family_rows.iter().filter(|(row, _)| row.ok()).collect();
                    let errors = ok_rows
                        .iter()
                        .map(|(row, e)| {
                            (e.mib_estimators[name] / row.measured_peak_mib - 1.0).abs()
                        })
                        .collect();
                    assert_close(
                        name,
                        median(errors),
                        &entry.validation,
                        "test_median_abs_rel_error",
                    );
                    // This regressor's own bound (a job's answer may come from the traced one).
                    let levels = entry
                        .residual_quantiles
                        .as_ref()
                        .unwrap()
                        .iter()
                        .map(|l| (l.confidence, l.log_ratio))
                        .collect();
                    let factor = ResidualQuantiles::new(levels)
                        .unwrap()
                        .log_ratio_at(0.95)
                        .unwrap()
                        .exp();
                    let exceeded = mean(ok_rows.iter().map(|(row, e)| {
                        f64::from(u8::from(
                            e.mib_estimators[name] * factor < row.measured_peak_mib,
                        ))
                    }));
                    assert_close(
                        name,
                        exceeded,
                        &entry.validation,
                        "test_bound_exceeded_rate",
                    );
                    if !entry.requires.is_empty() {
                        // Traced jobs: the answer is this regressor's, held to the physics floor
                        // (model state, the traced activations, context), and so is the class.
                        let answered =
                            |e: &Estimate| e.mib_estimators[name].max(e.physics.floor_mib());
                        assert!(family_rows
                            .iter()
                            .all(|(_, e)| e.mib.unwrap().estimate_mib == answered(e)));
                        let (accuracy, _) = class_figures(
                            &family_rows,
                            &MemoryClasses::new(vec![8000, 16000, 24000, 32000, 40960]).unwrap(),
                            |e| e.class.class.index,
                        );
                        // The manifest's accuracy was measured with a floor of model state and
                        // context; the traced activations joined it later (issue 33) and raise
                        // the few answers the regressor put below them: no worse (0.9212 against
                        // the manifest's 0.9158 for the CNN regressor when they joined).
                        let manifest = figure(&entry.validation, "test_class_accuracy");
                        assert!(
                            accuracy >= manifest - TOLERANCE,
                            "{name}: class accuracy {accuracy:.4}, {manifest:.4} in the manifest"
                        );
                    }
                }
                EstimatorKind::UtilizationRegressor => {
                    let target = entry.target.as_deref().unwrap();
                    let truth = |row: &HeldOutJob| {
                        if target == "smact" {
                            row.smact
                        } else {
                            row.smocc
                        }
                    };
                    let mae = mean(ok_rows.iter().map(|(row, e)| {
                        (f64::from(e.utilization[target]) - truth(row).unwrap()).abs()
                    }));
                    assert_close(name, mae, &entry.validation, "test_mae");
                    assert!(
                        mae < figure(&entry.validation, "test_baseline_mae"),
                        "{name} does not beat the mean baseline"
                    );
                }
            }
            checked += 1;
        }
        // The combined class of each family (mean of its classifiers' probabilities).
        for family in [Family::Mlp, Family::Cnn, Family::Transformer] {
            let combined = match family {
                Family::Mlp => manifest.combined.as_ref(),
                other => manifest.combined_by_family.get(other.as_str()),
            };
            let Some(combined) = combined else { continue };
            let member = estimators
                .all()
                .iter()
                .find(|e| e.name() == combined.members[0])
                .unwrap();
            if file_of(&member.entry) != file {
                continue;
            }
            let family_rows: Vec<(&HeldOutJob, &Estimate)> = rows
                .iter()
                .zip(&estimates)
                .filter(|(_, e)| e.family == family)
                .collect();
            let classes = MemoryClasses::new(member.entry.class_bins_mib.clone().unwrap()).unwrap();
            // The classifiers' own combined class, as the service computes it (the answer's
            // class follows the MiB figure instead).
            let mean_class = |e: &Estimate| {
                e.classifiers_combined()
                    .expect("a family with classifiers")
                    .class
                    .index
            };
            let (accuracy, below) = class_figures(&family_rows, &classes, mean_class);
            assert_close(
                &format!("combined {family}"),
                accuracy,
                &combined.validation,
                "test_accuracy",
            );
            assert_close(
                &format!("combined {family}"),
                below,
                &combined.validation,
                "test_below_rate",
            );
        }
    }
    assert_eq!(checked, manifest.estimators.len());
}

/// A known job and the raw features pinned for it (tests/fixtures/features.json).
#[derive(Deserialize)]
struct PinnedCase {
    name: String,
    job: EstimateRequest,
    aggregate: BTreeMap<String, f64>,
    kinds: Vec<String>,
    tokens: Vec<Vec<f64>>,
}

fn close(a: f64, b: f64, relative: f64) -> bool {
    (a - b).abs() <= relative * a.abs().max(b.abs()).max(1.0)
}

fn assert_vector(case: &str, what: &str, actual: &[f32], expected: &[f64]) {
    assert_eq!(actual.len(), expected.len(), "{case}: {what} length");
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert!(
            close(f64::from(*a), *e, 1e-6),
            "{case}: {what}[{i}] = {a}, expected {e}"
        );
    }
}

/// Every committed estimator's input for the pinned jobs is the pinned raw features, normalised
/// as its manifest entry says: the features the service computes, the names and the order it
/// reads them in, the kinds' vocabulary ids.
#[test]
fn every_estimators_input_is_the_pinned_features_normalised_as_its_manifest_says() {
    let text = std::fs::read_to_string(repo_root().join("tests/fixtures/features.json")).unwrap();
    let fixture: Value = serde_json::from_str(&text).unwrap();
    let cases: Vec<PinnedCase> = serde_json::from_value(fixture["cases"].clone()).unwrap();
    assert!(cases.len() >= 10);
    let manifest: gpucast::estimators::manifest::Manifest =
        serde_json::from_str(&std::fs::read_to_string(models_dir().join("manifest.json")).unwrap())
            .unwrap();
    let (mut aggregate_checks, mut sequence_checks) = (0, 0);
    for case in &cases {
        let name = case.name.as_str();
        let job = to_job(&case.job).unwrap_or_else(|e| panic!("{name}: {e}"));
        let raw = AggregateFeatures::of(&job);
        for (feature, expected) in &case.aggregate {
            let actual = raw
                .get(feature)
                .unwrap_or_else(|| panic!("{name}: unknown feature {feature}"));
            assert!(
                close(actual, *expected, 1e-12),
                "{name}: {feature} = {actual}, pinned {expected}"
            );
        }
        for estimator in &manifest.estimators {
            match &estimator.input {
                InputSpec::Aggregate { features } => {
                    let expected: Vec<f64> = features
                        .iter()
                        .map(|spec| spec.normalise(case.aggregate[&spec.name]))
                        .collect();
                    assert_vector(name, &estimator.name, &raw.normalised(features), &expected);
                    aggregate_checks += 1;
                }
                InputSpec::Sequence {
                    kind_vocab,
                    token_features,
                    ..
                } => {
                    let vocab: Vec<LayerKind> = kind_vocab
                        .iter()
                        .map(|k| LayerKind::parse(k).unwrap())
                        .collect();
                    let ids: Option<Vec<i64>> = case
                        .kinds
                        .iter()
                        .map(|k| kind_vocab.iter().position(|v| v == k).map(|i| i as i64 + 1))
                        .collect();
                    let tokens = TokenFeatures::of(
                        &job,
                        |k| vocab.iter().position(|v| *v == k),
                        token_features,
                    );
                    let Some(ids) = ids else {
                        assert!(tokens.is_err(), "{name}: a kind outside {}", estimator.name);
                        continue;
                    };
                    let tokens = tokens.unwrap_or_else(|e| panic!("{name}: {e:?}"));
                    assert_eq!(tokens.kind_ids, ids, "{name}: {}", estimator.name);
                    let columns = [
                        "output_size",
                        "params",
                        "batch_size",
                        "output_x_batch",
                        "position",
                    ];
                    let expected: Vec<f64> = case
                        .tokens
                        .iter()
                        .flat_map(|token| {
                            token_features.iter().map(|spec| {
                                let column = columns.iter().position(|c| *c == spec.name).unwrap();
                                spec.normalise(token[column])
                            })
                        })
                        .collect();
                    assert_vector(name, &estimator.name, &tokens.features, &expected);
                    sequence_checks += 1;
                }
            }
        }
    }
    assert!(aggregate_checks > 0 && sequence_checks > 0);
}
