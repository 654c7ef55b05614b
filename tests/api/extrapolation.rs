//! The learned correction of the simulated figure applies only near its training data: a
//! training domain (`simulated_domain.json`) beside a stand-in simulation regressor, and jobs
//! at, near, far from and outside it.

use std::path::Path;

use gpucast::domain::features::AggregateFeatures;
use gpucast::http::estimate::to_job;
use gpucast::http::types::EstimateRequest;
use gpucast::startup::Application;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::helpers::{spawn_app, spawn_app_with, test_config, training_description, TestApp};
use crate::simulation::{assert_breakdown_and_floor, figure, models_with_a_simulation_regressor, simulated_job};

const DOMAIN_FILE: &str = "simulated_domain.json";
const REGRESSOR: &str = "cnn_simulated_memory_regressor";
/// The committed `simulated` block's log ratio at 0.95.
const SIMULATED_Q95: f64 = 0.15;
const MAX_WIDEN: f64 = 2.0;

/// The coordinates of the pipeline's domain (training/simulated_pipeline.py).
const ORDER: [&str; 11] = [
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
];

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
    ORDER
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
    a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt()
}

/// A domain of the given points; its features are listed in reverse order (the points follow
/// `order`).
fn domain(points: &[Vec<f64>], typical_distance: f64) -> Value {
    let features: Vec<Value> = ORDER
        .iter()
        .rev()
        .map(|name| {
            let (transform, mean, std) = normalisation(name);
            json!({"name": name, "transform": transform, "mean": mean, "std": std})
        })
        .collect();
    json!({
        "features": features, "order": ORDER, "optimizers": ["adam"], "precisions": ["fp32"],
        "typical_distance": typical_distance, "near": 1.0, "far": 2.0, "max_widen": MAX_WIDEN,
        "points": points,
    })
}

/// Writes `domain` (as bytes) into `dir` and names it in the manifest with `sha256`.
fn install_domain(dir: &Path, bytes: &[u8], sha256: &str) {
    std::fs::write(dir.join(DOMAIN_FILE), bytes).unwrap();
    let path = dir.join("manifest.json");
    let mut manifest: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
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
    assert_eq!(own(&body, REGRESSOR), Some(figure(&body, "estimate_mib")), "the correction leads: {body}");
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
    assert_eq!((extrapolation["correction_applied"].clone(), extrapolation["bound_widened_by"].clone()), (json!(true), json!(1.5)));
    let estimate = figure(&body, "estimate_mib");
    assert_eq!(own(&body, REGRESSOR), Some(estimate));
    // The regressor's own log ratio at 0.95 (the stand-in's quantiles are the plain CNN
    // regressor's), times 1.5.
    let manifest: Value = serde_json::from_str(&std::fs::read_to_string(crate::helpers::models_dir().join("manifest.json")).unwrap()).unwrap();
    let q95 = manifest["estimators"].as_array().unwrap().iter().find(|e| e["name"] == "cnn_memory_regressor").unwrap()
        ["residual_quantiles"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["confidence"] == 0.95)
        .unwrap()["log_ratio"]
        .as_f64()
        .unwrap();
    let expected = estimate * (1.5 * q95).exp();
    assert!((figure(&body, "upper_bound_mib") - expected).abs() <= 1.0, "{} vs {expected}: {body}", figure(&body, "upper_bound_mib"));
}

#[tokio::test]
async fn a_job_far_from_the_training_data_gets_the_simulated_figure_and_a_wider_bound() {
    let (app, _models) = app_with_domain(&domain(&training_points(), 0.05)).await;
    let job = simulated_job(8);
    let body = answer(&app, &job).await;
    let extrapolation = &body["memory"]["extrapolation"];
    let expected_distance = distance(&vector(&job), &vector(&simulated_job(64)));
    assert!((extrapolation["distance"].as_f64().unwrap() - expected_distance).abs() < 1e-3, "{body}");
    assert!(extrapolation["ratio"].as_f64().unwrap() > 2.0);
    assert_eq!((extrapolation["correction_applied"].clone(), extrapolation["outside_setup"].clone()), (json!(false), json!(false)));
    assert_eq!(extrapolation["bound_widened_by"], MAX_WIDEN);
    // The simulated figure leads; the correction did not run.
    let simulated = own(&body, "simulated").unwrap();
    assert_eq!(figure(&body, "estimate_mib"), simulated, "{body}");
    assert!(own(&body, REGRESSOR).is_none(), "{body}");
    assert!(body["estimator_versions"].get(REGRESSOR).is_none());
    // Its own quantile, times max_widen (the card's capacity is far above).
    let expected = simulated * (MAX_WIDEN * SIMULATED_Q95).exp();
    assert!((figure(&body, "upper_bound_mib") - expected).abs() <= 1.0, "{body}");
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
    assert_eq!(figure(&body, "estimate_mib"), own(&body, "simulated").unwrap());
    assert!(own(&body, REGRESSOR).is_none());
}

#[tokio::test]
async fn jobs_without_a_simulation_or_models_without_a_domain_have_no_extrapolation() {
    let (app, _models) = app_with_domain(&domain(&training_points(), 0.05)).await;
    let mut traced = training_description("timm:resnet50");
    traced["batch_size"] = 64.into();
    let body = answer(&app, &traced).await;
    assert!(body["memory"].get("extrapolation").is_some_and(Value::is_null), "{body}");
    // What is loaded shows in GET /v1/estimators.
    let loaded: Value = app.get("/v1/estimators").await.json().await.unwrap();
    let domain = &loaded["simulated"]["domain"];
    assert_eq!((domain["file"].clone(), domain["points"].clone(), domain["max_widen"].clone()), (json!(DOMAIN_FILE), json!(3), json!(MAX_WIDEN)));
    assert_eq!(domain["features"], json!(ORDER));

    // The committed models name no domain: no extrapolation, the simulated figure as before.
    let committed = spawn_app().await;
    let body = answer(&committed, &simulated_job(64)).await;
    assert!(body["memory"]["extrapolation"].is_null(), "{body}");
    let loaded: Value = committed.get("/v1/estimators").await.json().await.unwrap();
    assert!(loaded["simulated"]["domain"].is_null());
}

async fn start_error(models: &Path) -> String {
    match Application::build(&test_config(models)).await {
        Ok(_) => panic!("the application started with a broken domain"),
        Err(e) => e.to_string(),
    }
}

#[tokio::test]
async fn a_domain_file_that_does_not_match_its_checksum_or_its_order_refuses_to_start_naming_the_file() {
    let bytes = domain(&training_points(), 0.05).to_string().into_bytes();
    let models = models_with_a_simulation_regressor();
    install_domain(models.path(), &bytes, &"0".repeat(64));
    let error = start_error(models.path()).await;
    assert!(error.contains(DOMAIN_FILE) && error.contains("sha256"), "{error}");
    assert_eq!(error.lines().count(), 1);

    // A point one coordinate short, with a checksum that matches.
    let mut short = domain(&training_points(), 0.05);
    short["points"][1].as_array_mut().unwrap().pop();
    let bytes = short.to_string().into_bytes();
    install_domain(models.path(), &bytes, &hex::encode(Sha256::digest(&bytes)));
    let error = start_error(models.path()).await;
    assert!(error.contains(DOMAIN_FILE) && error.contains("points[1] has 10 coordinates, order has 11"), "{error}");

    std::fs::remove_file(models.path().join(DOMAIN_FILE)).unwrap();
    let error = start_error(models.path()).await;
    assert!(error.contains(DOMAIN_FILE) && error.contains("cannot read"), "{error}");
}
