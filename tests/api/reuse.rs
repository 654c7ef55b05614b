//! Answers kept for reuse (`src/engine/memo.rs`): a body asked again is answered as before
//! without estimating, until an observation moves the profiles it read.

use std::sync::Arc;

use gpucast::devices::{FakeDevices, GpuDevices};
use serde_json::{json, Value};

use crate::helpers::{
    counter, example_job, models_dir, spawn_app, spawn_app_with, spawn_app_with_devices,
    test_config, TestApp,
};

const REUSED: &str = "gpucast_answers_reused_total";

async fn reused(app: &TestApp) -> f64 {
    counter(&app.get("/metrics").await.text().await.unwrap(), REUSED)
}

/// The answer to `job` without its times (a computed answer's are its own).
async fn answer(app: &TestApp, job: &Value) -> Value {
    let response = app.post_json("/v1/estimate", job).await;
    assert_eq!(response.status(), 200);
    let mut body: Value = response.json().await.unwrap();
    body["latency_us"] = Value::Null;
    body
}

#[tokio::test]
async fn a_body_asked_again_is_answered_alike_until_an_observation_moves_its_profile() {
    let app = spawn_app().await;
    let mut job = example_job();
    job["gpu"] = "h100-80gb".into();
    let first = answer(&app, &job).await;
    assert_eq!(reused(&app).await, 0.0);
    let again = answer(&app, &job).await;
    assert_eq!(again, first, "a kept answer is the answer computed");
    assert_eq!(reused(&app).await, 1.0);

    // An observation on the card: the profiles the kept answer read are no longer current.
    let observation =
        json!({"gpu": "h100-80gb", "job": example_job(), "observed_peak_mib": 3000.0});
    let recorded = app
        .post_json("/v1/calibration/observations", &json!([observation]))
        .await;
    assert_eq!(recorded.status(), 200);
    let after = answer(&app, &job).await;
    assert_eq!(
        reused(&app).await,
        1.0,
        "computed again after the observation"
    );
    assert_ne!(after["calibration"], first["calibration"], "{after}");
    // And kept again: the next ask reuses the new answer.
    assert_eq!(answer(&app, &job).await, after);
    assert_eq!(reused(&app).await, 2.0);
}

#[tokio::test]
async fn an_answer_on_the_attached_card_is_computed_each_time() {
    let devices: Arc<dyn GpuDevices> = Arc::new(FakeDevices::single("NVIDIA L4", 23_034));
    let app = spawn_app_with_devices(test_config(&models_dir()), devices).await;
    let mut job = example_job();
    job["gpu"] = json!(["attached", "h100-80gb"]);
    answer(&app, &job).await;
    answer(&app, &job).await;
    assert_eq!(reused(&app).await, 0.0);
}

#[tokio::test]
async fn with_the_memo_off_every_answer_is_computed() {
    let mut config = test_config(&models_dir());
    config.answer_memo_mib = 0;
    let app = spawn_app_with(config).await;
    let first = answer(&app, &example_job()).await;
    assert_eq!(answer(&app, &example_job()).await, first);
    assert_eq!(reused(&app).await, 0.0);
}

#[tokio::test]
async fn a_refused_body_is_refused_again() {
    let app = spawn_app().await;
    let mut job = example_job();
    job["batch_size"] = 0.into();
    for _ in 0..2 {
        assert_eq!(app.post_json("/v1/estimate", &job).await.status(), 422);
    }
    assert_eq!(reused(&app).await, 0.0);
}

#[tokio::test]
async fn batch_items_are_answered_alike_from_kept_answers_and_keep_theirs() {
    let app = spawn_app().await;
    let mut other = example_job();
    other["batch_size"] = 64.into();
    let batch = json!({"items": [example_job(), other]});
    let items = |body: Value| -> Vec<Value> {
        body["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|item| {
                let mut estimate = item["estimate"].clone();
                estimate["latency_us"] = Value::Null;
                estimate
            })
            .collect()
    };
    let computed = items(app.post_json_value("/v1/estimate/batch", &batch).await);
    assert_eq!(reused(&app).await, 0.0);
    // A single estimate of an item's JSON reuses the batch's answer, and a batch the single's.
    assert_eq!(answer(&app, &example_job()).await, computed[0]);
    assert_eq!(reused(&app).await, 1.0);
    let again = items(app.post_json_value("/v1/estimate/batch", &batch).await);
    assert_eq!(again, computed);
    assert_eq!(reused(&app).await, 3.0);
}
