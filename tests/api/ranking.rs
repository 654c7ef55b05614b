//! `gpu` as a list: the job on every card, ranked by fit and predicted step time.

use serde_json::{json, Value};

use crate::helpers::{example_job, spawn_app};

fn job_on(gpu: Value) -> Value {
    let mut job = example_job();
    job["gpu"] = gpu;
    job
}

#[tokio::test]
async fn a_list_ranks_the_fitting_cards_by_step_time_and_answers_for_the_best() {
    let app = spawn_app().await;
    let cards = json!([
        "t4",
        {"name": "lab card", "capacity_mib": 100_000},
        "h100-80gb",
        {"name": "tiny card", "capacity_mib": 100},
        "a100-40gb"
    ]);
    let response = app.post_json("/v1/estimate", &job_on(cards)).await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    let ranking = body["gpu_ranking"].as_array().expect("a ranking");
    let order: Vec<&str> = ranking.iter().map(|r| r["gpu"].as_str().unwrap()).collect();
    // Catalogue cards by their predicted step (the H100 is the fastest), then the card known
    // only by its memory (no prediction), then the card the job does not fit.
    assert_eq!(
        order,
        [
            "h100-80gb",
            "a100-40gb",
            "t4",
            "custom-lab-card-100000mib",
            "custom-tiny-card-100mib"
        ],
        "{ranking:#?}"
    );
    let times: Vec<f64> = ranking[..3]
        .iter()
        .map(|r| r["step_time_ms"].as_f64().unwrap())
        .collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    assert!(ranking[3]["step_time_ms"].is_null());
    assert_eq!(ranking[4]["fits"], false);
    assert_eq!(ranking[4]["max_colocated"], 0);
    for (rank, entry) in ranking.iter().enumerate() {
        assert_eq!(entry["rank"], rank + 1);
    }
    // The answer is the first card's, whole: fit, performance and figures agree with it.
    assert_eq!(body["fit"]["gpu"], "h100-80gb");
    assert_eq!(
        body["performance"]["step_time_ms"],
        ranking[0]["step_time_ms"]
    );
    assert_eq!(body["memory"]["estimate_mib"], ranking[0]["estimate_mib"]);
    // The same card asked alone gives the same figures, and no ranking.
    let alone: Value = app
        .post_json_value("/v1/estimate", &job_on(json!("h100-80gb")))
        .await;
    assert!(alone.get("gpu_ranking").is_none(), "{alone}");
    assert_eq!(
        alone["memory"]["estimate_mib"],
        body["memory"]["estimate_mib"]
    );
    assert_eq!(alone["performance"], body["performance"]);
}

#[tokio::test]
async fn a_list_of_one_card_is_ranked_too() {
    let app = spawn_app().await;
    let body = app
        .post_json_value("/v1/estimate", &job_on(json!(["l4"])))
        .await;
    assert_eq!(body["gpu_ranking"].as_array().unwrap().len(), 1, "{body}");
    assert_eq!(body["gpu_ranking"][0]["gpu"], "l4");
}

#[tokio::test]
async fn bad_lists_are_refused_naming_the_card() {
    let app = spawn_app().await;
    let too_many: Vec<Value> = (0..17).map(|_| json!("t4")).collect();
    for (gpu, says) in [
        (json!([]), "1 to 16 cards"),
        (json!(too_many), "1 to 16 cards"),
        (
            json!(["a100-40gb", "NVIDIA A100-SXM4-40GB"]),
            "gpu[1]: names 'a100-40gb' again",
        ),
        (json!(["t4", "no such card"]), "gpu[1]"),
        (json!(["t4", 7]), "gpu[1]"),
        (json!(["t4", {"name": "x", "capacity_mib": 0}]), "gpu[1]"),
    ] {
        let response = app.post_json("/v1/estimate", &job_on(gpu.clone())).await;
        assert_eq!(response.status(), 422, "{gpu}");
        let problem: Value = response.json().await.unwrap();
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.contains(says), "{gpu}: {detail}");
    }
}

#[tokio::test]
async fn batch_items_may_rank_lists_beside_single_cards() {
    let app = spawn_app().await;
    let batch = json!({"items": [
        job_on(json!("t4")),
        job_on(json!(["t4", "h100-80gb"])),
        job_on(json!(["t4", "t4"])),
        example_job(),
    ]});
    let body = app.post_json_value("/v1/estimate/batch", &batch).await;
    let items = body["items"].as_array().unwrap();
    assert_eq!(items[0]["estimate"]["fit"]["gpu"], "t4");
    assert!(items[0]["estimate"].get("gpu_ranking").is_none());
    assert_eq!(
        items[1]["estimate"]["fit"]["gpu"], "h100-80gb",
        "{}",
        items[1]
    );
    assert_eq!(
        items[1]["estimate"]["gpu_ranking"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    assert_eq!(items[2]["status"], 422);
    assert_eq!(items[3]["estimate"]["fit"]["gpu"], "a100-40gb");
}

#[tokio::test]
async fn an_observation_is_of_one_card() {
    let app = spawn_app().await;
    let observation = json!({
        "gpu": "t4",
        "observed_peak_mib": 2000,
        "job": job_on(json!(["t4", "l4"])),
    });
    let response = app
        .post_json("/v1/calibration/observations", &observation)
        .await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    assert!(
        problem["detail"].as_str().unwrap().contains("not a list"),
        "{problem}"
    );
}
