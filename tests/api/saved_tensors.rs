//! Saved tensors derived from a layer list (physics::saved) against describe's traced ones, end
//! to end through the committed estimators on the held-out timm test rows (issue 12: a job
//! given as text has no trace). Figures: `cargo test --test api saved_tensors -- --nocapture`.

use std::io::{BufRead, BufReader};

use gpucast::api::types::EstimateRequest;
use gpucast::engine::validate::to_job;
use gpucast::estimators::Estimators;
use gpucast::job::Job;
use gpucast::physics::saved;
use serde_json::Value;

use crate::helpers::{models_dir, ort_dylib, repo_root};

/// The issue's target: a text job's median error within 1.5x of the traced job's.
const TARGET_FACTOR: f64 = 1.5;

struct Row {
    model: String,
    family: String,
    request: Value,
    measured_mib: f64,
}

/// The rows of data/timm/test.jsonl.gz that ran (an `oom` row's figure is not its need).
fn test_rows() -> Vec<Row> {
    let file = std::fs::File::open(repo_root().join("data/timm/test.jsonl.gz")).unwrap();
    BufReader::new(flate2::read::GzDecoder::new(file))
        .lines()
        .map(|line| serde_json::from_str::<Value>(&line.unwrap()).unwrap())
        .filter(|row| row["status"] == "ok")
        .map(|row| Row {
            model: row["job"]["model"].as_str().unwrap().to_string(),
            family: row["job"]["family"].as_str().unwrap().to_string(),
            request: row["job"].clone(),
            measured_mib: row["measured_peak_mib"].as_f64().unwrap(),
        })
        .collect()
}

fn job_of(request: &Value) -> Job {
    let request: EstimateRequest = serde_json::from_value(request.clone()).unwrap();
    to_job(&request).unwrap()
}

fn without_saved(request: &Value) -> Value {
    let mut request = request.clone();
    request.as_object_mut().unwrap().remove("saved_tensors");
    request
}

fn input_elements(job: &Job) -> Option<u64> {
    job.input_shape().map(|shape| shape.iter().product())
}

/// Absolute relative errors of the answered figures against the measured peaks.
fn errors(estimators: &Estimators, jobs: &[Job], rows: &[Row]) -> Vec<f64> {
    let items: Vec<(&Job, f64)> = jobs.iter().map(|job| (job, 0.95)).collect();
    estimators
        .estimate_many(&items)
        .into_iter()
        .zip(rows)
        .map(|(estimate, row)| {
            let figure = estimate.unwrap().mib.unwrap().estimate_mib;
            (figure / row.measured_mib - 1.0).abs()
        })
        .collect()
}

fn quantile(values: &[f64], q: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let at = q * (sorted.len() - 1) as f64;
    let (low, high) = (at.floor() as usize, at.ceil() as usize);
    sorted[low] + (sorted[high] - sorted[low]) * (at - low as f64)
}

fn describe(what: &str, errors: &[f64]) -> String {
    format!(
        "{what}: median {:.2} %, p90 {:.2} % ({} rows)",
        100.0 * quantile(errors, 0.5),
        100.0 * quantile(errors, 0.9),
        errors.len()
    )
}

#[test]
fn derived_saved_tensors_come_close_to_the_traced_ones_per_family() {
    let rows = test_rows();
    let mut models: Vec<&Row> = rows.iter().collect();
    models.sort_by(|a, b| a.model.cmp(&b.model));
    models.dedup_by(|a, b| a.model == b.model);
    for family in ["cnn", "transformer"] {
        let ratios: Vec<f64> = models
            .iter()
            .filter(|row| row.family == family)
            .map(|row| {
                let job = job_of(&row.request);
                let traced = job.saved_tensors().unwrap().per_sample_bytes as f64;
                let derived = saved::derive(job.layers(), input_elements(&job)).per_sample_bytes;
                derived as f64 / traced
            })
            .collect();
        let (p10, median, p90) = (
            quantile(&ratios, 0.1),
            quantile(&ratios, 0.5),
            quantile(&ratios, 0.9),
        );
        println!(
            "{family}: derived / traced per sample over {} test models: median {median:.3}, \
             p10 {p10:.3}, p90 {p90:.3}",
            ratios.len()
        );
        assert!((0.85..=1.15).contains(&median), "{family}: median {median}");
        assert!(p10 > 0.55 && p90 < 1.3, "{family}: p10 {p10}, p90 {p90}");
    }
}

#[test]
fn derived_saved_tensors_keep_the_traced_accuracy_within_the_issues_target() {
    let estimators = Estimators::load(&models_dir(), &ort_dylib(), 1).expect("models load");
    let rows = test_rows();
    assert!(rows.len() >= 400, "only {} test rows", rows.len());
    // (a) describe's job as it is, with the traced saved tensors.
    let traced: Vec<Job> = rows.iter().map(|row| job_of(&row.request)).collect();
    // (b) the same layers with the derived saved tensors instead.
    let derived: Vec<Job> = rows
        .iter()
        .map(|row| {
            let job = job_of(&without_saved(&row.request));
            let saved = saved::derive(job.layers(), input_elements(&job));
            job.with_saved_tensors(Some(saved)).unwrap()
        })
        .collect();
    // (c) the layers alone: today's text path.
    let plain: Vec<Job> = rows
        .iter()
        .map(|row| job_of(&without_saved(&row.request)))
        .collect();
    let (a, b, c) = (
        errors(&estimators, &traced, &rows),
        errors(&estimators, &derived, &rows),
        errors(&estimators, &plain, &rows),
    );
    println!("{}", describe("(a) traced saved tensors", &a));
    println!("{}", describe("(b) derived saved tensors", &b));
    println!("{}", describe("(c) layers only", &c));
    for family in ["cnn", "transformer"] {
        let of = |errors: &[f64]| -> Vec<f64> {
            errors
                .iter()
                .zip(&rows)
                .filter(|(_, row)| row.family == family)
                .map(|(e, _)| *e)
                .collect()
        };
        println!(
            "  {family}: {}; {}; {}",
            describe("(a)", &of(&a)),
            describe("(b)", &of(&b)),
            describe("(c)", &of(&c))
        );
    }
    let (median_a, median_b) = (quantile(&a, 0.5), quantile(&b, 0.5));
    assert!(
        median_b <= TARGET_FACTOR * median_a,
        "derived: median {median_b:.4} > {TARGET_FACTOR} x traced {median_a:.4}"
    );
}

/// The torchsummary printouts of the test models (tests/fixtures/summaries/printouts.jsonl.gz,
/// `set` `timm_test`), by model: (tool, text, input shape).
fn printouts(tool: &str) -> std::collections::BTreeMap<String, (String, Value)> {
    let file = std::fs::File::open(repo_root().join("tests/fixtures/summaries/printouts.jsonl.gz"))
        .unwrap();
    BufReader::new(flate2::read::GzDecoder::new(file))
        .lines()
        .map(|line| serde_json::from_str::<Value>(&line.unwrap()).unwrap())
        .filter(|row| row["set"] == "timm_test" && row["tool"] == tool)
        .map(|row| {
            (
                row["model"].as_str().unwrap().to_string(),
                (
                    row["text"].as_str().unwrap().to_string(),
                    row["input_shape"].clone(),
                ),
            )
        })
        .collect()
}

/// What (d) measures for one tool: on the test rows whose printout the service parses, the
/// errors of the traced job (a), of the parsed printout with its derived saved tensors (d), and
/// of the same printed layers without them (today's text path); and derived / traced saved
/// bytes per family.
struct Printouts {
    rows: usize,
    refused: Vec<String>,
    traced: Vec<f64>,
    printed: Vec<f64>,
    plain: Vec<f64>,
}

fn printout_figures(estimators: &Estimators, rows: &[Row], tool: &str) -> Printouts {
    let printed = printouts(tool);
    let mut parsed = Vec::new();
    let mut refused = Vec::new();
    for (index, row) in rows.iter().enumerate() {
        let Some((text, input_shape)) = printed.get(&row.model) else {
            continue;
        };
        let request = serde_json::json!({
            "summary": {"format": "torchsummary", "text": text},
            "batch_size": row.request["batch_size"],
            "input_shape": input_shape,
        });
        let request: EstimateRequest = serde_json::from_value(request).unwrap();
        match to_job(&request) {
            Ok(job) => parsed.push((index, job)),
            Err(e) => refused.push(format!("{}: {e}", row.model)),
        }
    }
    refused.dedup();
    let covered: Vec<Row> = parsed
        .iter()
        .map(|(index, _)| Row {
            model: rows[*index].model.clone(),
            family: rows[*index].family.clone(),
            request: rows[*index].request.clone(),
            measured_mib: rows[*index].measured_mib,
        })
        .collect();
    let traced: Vec<Job> = covered.iter().map(|row| job_of(&row.request)).collect();
    let printed: Vec<Job> = parsed.into_iter().map(|(_, job)| job).collect();
    let plain: Vec<Job> = printed
        .iter()
        .map(|job| {
            Job::from_layers(
                Some(job.family().as_str()),
                job.batch_size(),
                job.layers().to_vec(),
            )
            .unwrap()
        })
        .collect();
    println!(
        "{tool}: {} of {} rows parsed ({} models refused: {:?}), {} with derived saved tensors",
        covered.len(),
        rows.len(),
        refused.len(),
        refused.iter().take(5).collect::<Vec<_>>(),
        printed
            .iter()
            .filter(|job| job.saved_tensors().is_some())
            .count()
    );
    for family in ["cnn", "transformer"] {
        let mut seen = std::collections::BTreeSet::new();
        let ratios: Vec<f64> = printed
            .iter()
            .zip(&traced)
            .zip(&covered)
            .filter(|(_, row)| row.family == family && seen.insert(row.model.clone()))
            .filter_map(|((printed, traced), _)| {
                // None where the printout hides its computation (physics::saved::hidden_share).
                Some(
                    printed.saved_tensors()?.per_sample_bytes as f64
                        / traced.saved_tensors().unwrap().per_sample_bytes as f64,
                )
            })
            .collect();
        if !ratios.is_empty() {
            println!(
                "  {family}: derived from the printout / traced over {} models: median {:.3}, \
                 p10 {:.3}, p90 {:.3}",
                ratios.len(),
                quantile(&ratios, 0.5),
                quantile(&ratios, 0.1),
                quantile(&ratios, 0.9)
            );
        }
    }
    let figures = Printouts {
        rows: covered.len(),
        refused,
        traced: errors(estimators, &traced, &covered),
        printed: errors(estimators, &printed, &covered),
        plain: errors(estimators, &plain, &covered),
    };
    println!("  {}", describe("(a) traced, same rows", &figures.traced));
    println!(
        "  {}",
        describe(&format!("(d) {tool} printout"), &figures.printed)
    );
    println!(
        "  {}",
        describe(
            &format!("{tool} printout without derived saved tensors"),
            &figures.plain
        )
    );
    figures
}

/// (d) The issue's own case: each test model's torchsummary printout, parsed by the service,
/// is estimated better with the saved tensors derived from its printed shapes than from its
/// layers alone (figures for torchinfo's tables too).
#[test]
fn torchsummary_printouts_of_the_test_models_are_estimated_better_with_derived_saved_tensors() {
    let estimators = Estimators::load(&models_dir(), &ort_dylib(), 1).expect("models load");
    let rows = test_rows();
    let torchsummary = printout_figures(&estimators, &rows, "torchsummary");
    assert_eq!(torchsummary.rows, rows.len(), "{:?}", torchsummary.refused);
    let (derived, plain) = (
        quantile(&torchsummary.printed, 0.5),
        quantile(&torchsummary.plain, 0.5),
    );
    assert!(
        derived < plain,
        "derived: median {derived:.4}, layers alone {plain:.4}"
    );
    printout_figures(&estimators, &rows, "torchinfo");
}

/// The issue's target on (d), not met yet (torchsummary printouts: median 4.49 % against 2.95 %
/// traced, 1.52x, after norm-act rows were put back in running order (5.1 %, 1.74x, before); see the report of issue 12): `cargo test --test api saved_tensors --
/// --ignored --nocapture`.
#[test]
#[ignore = "issue 12 target not met on printouts yet: 1.52x the traced median error"]
fn torchsummary_printouts_of_the_test_models_come_within_the_issues_target() {
    let estimators = Estimators::load(&models_dir(), &ort_dylib(), 1).expect("models load");
    let rows = test_rows();
    let figures = printout_figures(&estimators, &rows, "torchsummary");
    let (traced, printed) = (
        quantile(&figures.traced, 0.5),
        quantile(&figures.printed, 0.5),
    );
    assert!(
        printed <= TARGET_FACTOR * traced,
        "printouts: median {printed:.4} > {TARGET_FACTOR} x traced {traced:.4}"
    );
}
