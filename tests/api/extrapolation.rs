//! The learned correction of the simulated figure applies only near its training data: a
//! training domain (`simulated_domain.json`) beside a stand-in simulation regressor, and jobs
//! at, near, far from and outside it; and the committed regressors and domain on a simulation
//! `gpucast_describe` wrote.

use std::path::Path;

use gpucast::api::types::EstimateRequest;
use gpucast::engine::validate::to_job;
use gpucast::estimators::features::AggregateFeatures;
use gpucast::startup::Application;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::helpers::{
    assert_bound_is_the_distributions_at_95, committed_manifest, committed_simulation, models_dir,
    models_without_simulation_regressors, simulated_context_mib, spawn_app, spawn_app_with,
    test_config, training_description, TestApp,
};
use crate::simulation::{
    assert_breakdown_and_floor, assert_no_simulation_regressor_answered, figure,
    models_with_a_simulation_regressor, simulated_job,
};

const DOMAIN_FILE: &str = "simulated_domain.json";
const REGRESSOR: &str = "cnn_simulated_memory_regressor";
/// The test domains' `max_widen`.
const MAX_WIDEN: f64 = 2.0;

/// The coordinates of the pipeline's domain (training/gpucast_training/simulated.py), as the
/// committed models' domain file lists them.
fn order() -> Vec<String> {
    let file = models_dir().join(DOMAIN_FILE);
    let domain: Value = serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    serde_json::from_value(domain["order"].clone()).unwrap()
}

/// `(transform, mean, std)` of a coordinate: log1p for all but the batch size, so both
/// transforms are exercised.
fn normalisation(name: &str) -> (&'static str, f64, f64) {
    if name == "batch_size" {
        ("identity", 64.0, 100.0)
    } else {
        ("log1p", 1.0, 2.0)
    }
}

/// The job's normalised vector, computed here from the raw features (not by the code under test).
fn vector(job: &Value) -> Vec<f64> {
    let request: EstimateRequest = serde_json::from_value(job.clone()).unwrap();
    let features = AggregateFeatures::of(&to_job(&request).unwrap());
    order()
        .iter()
        .map(|name| {
            let raw = features.get(name).unwrap();
            match normalisation(name) {
                ("identity", mean, std) => (raw - mean) / std,
                (_, mean, std) => (raw.ln_1p() - mean) / std,
            }
        })
        .collect()
}

fn distance(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y) * (x - y))
        .sum::<f64>()
        .sqrt()
}

/// A domain of the given points; its features are listed in reverse order (the points follow
/// `order`).
fn domain(points: &[Vec<f64>], typical_distance: f64) -> Value {
    let order = order();
    let features: Vec<Value> = order
        .iter()
        .rev()
        .map(|name| {
            let (transform, mean, std) = normalisation(name);
            json!({"name": name, "transform": transform, "mean": mean, "std": std})
        })
        .collect();
    json!({
        "features": features, "order": order, "optimizers": ["adam"], "precisions": ["fp32"],
        "typical_distance": typical_distance, "near": 1.0, "far": 2.0, "max_widen": MAX_WIDEN,
        "points": points,
    })
}

/// Writes `domain` (as bytes) into `dir` and names it in the manifest with `sha256`.
fn install_domain(dir: &Path, bytes: &[u8], sha256: &str) {
    std::fs::write(dir.join(DOMAIN_FILE), bytes).unwrap();
    let path = dir.join("manifest.json");
    let mut manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    manifest["simulated"]["domain"] = json!({"file": DOMAIN_FILE, "sha256": sha256});
    std::fs::write(&path, manifest.to_string()).unwrap();
}

/// The committed models, the stand-in simulation regressor and a domain; the directory lives
/// as long as the returned guard.
async fn app_with_domain(domain: &Value) -> (TestApp, tempfile::TempDir) {
    let models = models_with_a_simulation_regressor();
    let bytes = domain.to_string().into_bytes();
    install_domain(models.path(), &bytes, &hex::encode(Sha256::digest(&bytes)));
    (spawn_app_with(test_config(models.path())).await, models)
}

async fn answer(app: &TestApp, job: &Value) -> Value {
    let response = app.post_json("/v1/estimate", job).await;
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

fn own(body: &Value, name: &str) -> Option<f64> {
    body["memory"]["estimators"][name]["estimate_mib"].as_f64()
}

fn mib(bytes: &Value) -> f64 {
    bytes.as_u64().unwrap() as f64 / (1u64 << 20) as f64
}

/// Training points: resnet50 with its simulation at batch 64, and a few other models.
fn training_points() -> Vec<Vec<f64>> {
    let mut points = vec![vector(&simulated_job(64))];
    for model in ["timm:vit_base_patch16_224", "timm:efficientnet_b0"] {
        let mut job = training_description(model);
        job["batch_size"] = 32.into();
        points.push(vector(&job));
    }
    points
}

#[tokio::test]
async fn a_job_at_a_training_point_gets_the_correction_and_no_widening() {
    let (app, _models) = app_with_domain(&domain(&training_points(), 0.05)).await;
    let job = simulated_job(64);
    let body = answer(&app, &job).await;
    let extrapolation = &body["memory"]["extrapolation"];
    assert_eq!(
        *extrapolation,
        json!({"distance": 0.0, "typical_distance": 0.05, "ratio": 0.0, "outside_setup": false,
               "correction_applied": true, "bound_widened_by": 1.0}),
        "{body}"
    );
    assert_eq!(
        own(&body, REGRESSOR),
        Some(figure(&body, "estimate_mib")),
        "the correction leads: {body}"
    );
    assert!(body["latency_us"]["simulated"].as_f64().unwrap() > 0.0);

    // Figure and bound as without a domain.
    let models = models_with_a_simulation_regressor();
    let without = spawn_app_with(test_config(models.path())).await;
    let plain = answer(&without, &job).await;
    assert!(plain["memory"]["extrapolation"].is_null());
    for field in ["estimate_mib", "upper_bound_mib"] {
        assert_eq!(body["memory"][field], plain["memory"][field], "{field}");
    }
}

#[tokio::test]
async fn a_job_between_near_and_far_keeps_the_correction_with_a_proportionally_wider_bound() {
    let point = vector(&simulated_job(64));
    let job = simulated_job(48);
    // The typical distance that puts the job at 1.5 typical distances from its nearest point.
    let typical = distance(&vector(&job), &point) / 1.5;
    let (app, _models) = app_with_domain(&domain(&[point], typical)).await;
    let body = answer(&app, &job).await;
    let extrapolation = &body["memory"]["extrapolation"];
    assert_eq!(extrapolation["ratio"], 1.5, "{body}");
    assert_eq!(
        (
            extrapolation["correction_applied"].clone(),
            extrapolation["bound_widened_by"].clone()
        ),
        (json!(true), json!(1.5))
    );
    let estimate = figure(&body, "estimate_mib");
    assert_eq!(own(&body, REGRESSOR), Some(estimate));
    // The regressor's own log ratio at 0.95 (the stand-in's quantiles are the plain CNN
    // regressor's), times 1.5.
    assert_bound_is_the_distributions_at_95(&body, 1.5);
}

#[tokio::test]
async fn a_job_far_from_the_training_data_gets_the_simulated_figure_and_a_wider_bound() {
    let (app, _models) = app_with_domain(&domain(&training_points(), 0.05)).await;
    let job = simulated_job(8);
    let body = answer(&app, &job).await;
    let extrapolation = &body["memory"]["extrapolation"];
    let expected_distance = distance(&vector(&job), &vector(&simulated_job(64)));
    assert!(
        (extrapolation["distance"].as_f64().unwrap() - expected_distance).abs() < 1e-3,
        "{body}"
    );
    assert!(extrapolation["ratio"].as_f64().unwrap() > 2.0);
    assert_eq!(
        (
            extrapolation["correction_applied"].clone(),
            extrapolation["outside_setup"].clone()
        ),
        (json!(false), json!(false))
    );
    assert_eq!(extrapolation["bound_widened_by"], MAX_WIDEN);
    // The simulated figure leads; the correction did not run.
    let simulated = own(&body, "simulated").unwrap();
    assert_eq!(figure(&body, "estimate_mib"), simulated, "{body}");
    assert!(own(&body, REGRESSOR).is_none(), "{body}");
    assert!(body["estimator_versions"].get(REGRESSOR).is_none());
    // Its own quantile (the `simulated` block's), times max_widen (the card's capacity is far
    // above).
    assert_bound_is_the_distributions_at_95(&body, MAX_WIDEN);
    assert_breakdown_and_floor(&body);
}

#[tokio::test]
async fn an_sgd_job_is_outside_the_trained_setups_whatever_its_distance() {
    let (app, _models) = app_with_domain(&domain(&training_points(), 0.05)).await;
    // At a training point in features, but trained with SGD.
    let mut job = simulated_job(64);
    job["optimizer"] = "sgd".into();
    job["simulation"]["optimizer"] = "sgd".into();
    let body = answer(&app, &job).await;
    assert_eq!(
        body["memory"]["extrapolation"],
        json!({"distance": null, "typical_distance": 0.05, "ratio": null, "outside_setup": true,
               "correction_applied": false, "bound_widened_by": MAX_WIDEN}),
        "{body}"
    );
    assert_eq!(
        figure(&body, "estimate_mib"),
        own(&body, "simulated").unwrap()
    );
    assert!(own(&body, REGRESSOR).is_none());
}

#[tokio::test]
async fn jobs_without_a_simulation_or_models_without_a_domain_have_no_extrapolation() {
    let (app, _models) = app_with_domain(&domain(&training_points(), 0.05)).await;
    let mut traced = training_description("timm:resnet50");
    traced["batch_size"] = 64.into();
    let body = answer(&app, &traced).await;
    assert!(
        body["memory"]
            .get("extrapolation")
            .is_some_and(Value::is_null),
        "{body}"
    );
    // What is loaded shows in GET /v1/estimators.
    let loaded: Value = app.get_json("/v1/estimators").await;
    let domain = &loaded["simulated"]["domain"];
    assert_eq!(
        (
            domain["file"].clone(),
            domain["points"].clone(),
            domain["max_widen"].clone()
        ),
        (json!(DOMAIN_FILE), json!(3), json!(MAX_WIDEN))
    );
    assert_eq!(domain["features"], json!(order()));

    // Models that name no domain (the committed ones less their domain and the regressors that
    // require a simulation): no extrapolation, the simulated figure as without a domain.
    let models = models_without_simulation_regressors();
    let without = spawn_app_with(test_config(models.path())).await;
    let job = simulated_job(64);
    let body = answer(&without, &job).await;
    assert!(
        body["memory"]
            .get("extrapolation")
            .is_some_and(Value::is_null),
        "{body}"
    );
    let expected = mib(&job["simulation"]["reserved_peak_bytes"]) + simulated_context_mib();
    assert!(
        (figure(&body, "estimate_mib") - expected).abs() < 0.05,
        "{expected}: {body}"
    );
    let loaded: Value = without.get_json("/v1/estimators").await;
    assert!(
        loaded["simulated"].is_object() && loaded["simulated"]["domain"].is_null(),
        "{loaded}"
    );
}

async fn start_error(models: &Path) -> String {
    match Application::build(&test_config(models)).await {
        Ok(_) => panic!("the application started with a broken domain"),
        Err(e) => e.to_string(),
    }
}

#[tokio::test]
async fn a_domain_file_that_does_not_match_its_checksum_or_its_order_refuses_to_start_naming_the_file(
) {
    let bytes = domain(&training_points(), 0.05).to_string().into_bytes();
    let models = models_with_a_simulation_regressor();
    install_domain(models.path(), &bytes, &"0".repeat(64));
    let error = start_error(models.path()).await;
    assert!(
        error.contains(DOMAIN_FILE) && error.contains("sha256"),
        "{error}"
    );
    assert_eq!(error.lines().count(), 1);

    // A point one coordinate short, with a checksum that matches.
    let mut short = domain(&training_points(), 0.05);
    short["points"][1].as_array_mut().unwrap().pop();
    let bytes = short.to_string().into_bytes();
    install_domain(models.path(), &bytes, &hex::encode(Sha256::digest(&bytes)));
    let error = start_error(models.path()).await;
    assert!(
        error.contains(DOMAIN_FILE) && error.contains("points[1] has 10 coordinates, order has 11"),
        "{error}"
    );

    std::fs::remove_file(models.path().join(DOMAIN_FILE)).unwrap();
    let error = start_error(models.path()).await;
    assert!(
        error.contains(DOMAIN_FILE) && error.contains("cannot read"),
        "{error}"
    );
}

/// resnet50's measured peak at batch 64 on the A100 40 GB: timm_a100_train.csv, row
/// `resnet50,64,8465,ok` (the file is outside the repository; real_models.rs cites it too).
const RESNET50_AT_64_MEASURED_MIB: f64 = 8465.0;

/// On the committed models and their domain: resnet50 at batch 64, described and simulated by
/// `gpucast_describe` (data/timm), is near the data the committed simulation regressors were
/// trained on, so their correction leads, near the measured peak and at or above the floor. The
/// same job trained with SGD is outside the trained setups: the simulated figure leads.
#[tokio::test]
async fn the_committed_correction_leads_for_a_simulated_resnet50_near_its_data_but_not_for_sgd() {
    let app = spawn_app().await;
    // The committed domain is what is loaded: the file the manifest names, with all its points.
    let manifest = committed_manifest();
    let loaded: Value = app.get_json("/v1/estimators").await;
    let domain = &loaded["simulated"]["domain"];
    let file = manifest["simulated"]["domain"]["file"]
        .as_str()
        .expect("the committed models name a domain");
    assert_eq!(domain["file"], file, "{loaded}");
    let committed: Value =
        serde_json::from_slice(&std::fs::read(models_dir().join(file)).unwrap()).unwrap();
    assert_eq!(
        domain["points"],
        committed["points"].as_array().unwrap().len(),
        "{loaded}"
    );
    let max_widen = domain["max_widen"].as_f64().unwrap();

    let simulation = committed_simulation("timm:resnet50", 64);
    assert_eq!(simulation["batch_size"], 64, "{simulation}");
    let mut job = training_description("timm:resnet50");
    job["batch_size"] = 64.into();
    job["optimizer"] = simulation["optimizer"].clone();
    job["precision"] = simulation["precision"].clone();
    job["simulation"] = simulation;
    let body = answer(&app, &job).await;
    let extrapolation = &body["memory"]["extrapolation"];
    assert_eq!(extrapolation["outside_setup"], false, "{body}");
    assert_eq!(extrapolation["correction_applied"], true, "{body}");
    assert!(
        extrapolation["ratio"].as_f64().unwrap() <= domain["far"].as_f64().unwrap(),
        "{body}"
    );
    let estimate = figure(&body, "estimate_mib");
    assert!(
        (estimate / RESNET50_AT_64_MEASURED_MIB - 1.0).abs() < 0.15,
        "{estimate} MiB, measured {RESNET50_AT_64_MEASURED_MIB}: {body}"
    );
    assert_eq!(body["memory"]["breakdown_source"], "simulation");
    assert_breakdown_and_floor(&body); // the estimate is at least the floor
    assert_eq!(body["memory"]["floored"], false, "{body}");
    assert_eq!(
        own(&body, REGRESSOR),
        Some(estimate),
        "the correction leads: {body}"
    );
    let simulated = own(&body, "simulated").unwrap();
    let expected = mib(&job["simulation"]["reserved_peak_bytes"]) + simulated_context_mib();
    assert!((simulated - expected).abs() < 0.05, "{expected}: {body}");
    assert!(estimate != simulated, "{body}");

    // Trained with SGD (and simulated so): outside the setups, the simulated figure leads, the
    // bound widened by max_widen.
    let mut sgd = job.clone();
    sgd["optimizer"] = "sgd".into();
    sgd["simulation"]["optimizer"] = "sgd".into();
    let body = answer(&app, &sgd).await;
    let mut extrapolation = body["memory"]["extrapolation"].clone();
    let typical = extrapolation["typical_distance"].take().as_f64().unwrap();
    assert!(
        (typical - domain["typical_distance"].as_f64().unwrap()).abs() < 1e-3,
        "{body}"
    );
    assert_eq!(
        extrapolation,
        json!({"distance": null, "typical_distance": null, "ratio": null, "outside_setup": true,
               "correction_applied": false, "bound_widened_by": max_widen}),
        "{body}"
    );
    assert_eq!(
        figure(&body, "estimate_mib"),
        simulated,
        "the simulated figure leads: {body}"
    );
    assert_eq!(own(&body, "simulated"), Some(simulated));
    assert_no_simulation_regressor_answered(&body);
    assert_bound_is_the_distributions_at_95(&body, max_widen);
    assert_breakdown_and_floor(&body);
}
