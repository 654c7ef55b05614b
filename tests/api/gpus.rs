//! `GET /v1/gpus`, catalogue GPUs beyond the first nine, custom cards and `--gpus FILE`.

use serde_json::{json, Value};

use crate::helpers::{example_job, models_dir, spawn_app, spawn_app_with, test_config};

async fn fit_for(app: &crate::helpers::TestApp, gpu: Value) -> Value {
    let mut job = example_job();
    job["gpu"] = gpu;
    let body = app.post_json_value("/v1/estimate", &job).await;
    body["fit"].clone()
}

#[tokio::test]
async fn cards_beyond_the_first_nine_answer_with_their_capacity() {
    let app = spawn_app().await;
    for (gpu, id, capacity) in [
        ("rtx 4090", "rtx-4090", 24_564),
        ("NVIDIA GeForce RTX 4090", "rtx-4090", 24_564),
        ("b200", "b200", 184_320),
        ("a10g", "a10g", 23_028),
    ] {
        let fit = fit_for(&app, gpu.into()).await;
        assert_eq!(fit["gpu"], id, "{gpu}: {fit}");
        assert_eq!(fit["capacity_mib"], capacity, "{gpu}: {fit}");
        assert_eq!(fit["fits"], true, "{gpu}: {fit}");
    }
}

#[tokio::test]
async fn the_catalogue_is_listed_with_its_figures_and_sources() {
    let app = spawn_app().await;
    let body = app.get_json("/v1/gpus").await;
    let gpus = body["gpus"].as_array().unwrap();
    assert!(gpus.len() >= 25, "{}", gpus.len());
    let l4 = gpus.iter().find(|g| g["id"] == "l4").unwrap();
    assert_eq!(l4["memory_mib"], 23_034);
    assert_eq!(l4["peaks"]["sm_count"], 58);
    assert_eq!(l4["peaks"]["fp8_tflops"], 242.0);
    assert_eq!(l4["from_file"], false);
    assert!(l4["source"]["url"]
        .as_str()
        .unwrap()
        .starts_with("https://"));
    assert!(l4["aliases"]
        .as_array()
        .unwrap()
        .contains(&json!("NVIDIA L4")));
}

#[tokio::test]
async fn a_custom_card_is_estimated_and_observed_under_its_own_key() {
    let app = spawn_app().await;
    let card = json!({"name": "Lab Card 2", "capacity_mib": 12_000});
    let fit = fit_for(&app, card.clone()).await;
    assert_eq!(fit["gpu"], "custom-lab-card-2-12000mib", "{fit}");
    assert_eq!(fit["capacity_mib"], 12_000);
    // Named like a catalogue card, it is still its own card.
    let twin = fit_for(&app, json!({"name": "a100-40gb", "capacity_mib": 30_000})).await;
    assert_eq!(twin["gpu"], "custom-a100-40gb-30000mib", "{twin}");
    assert_eq!(twin["capacity_mib"], 30_000);
    // A whole number written as a float, as JSON Schema's integer admits (issue 45: `322.0`).
    let float = fit_for(
        &app,
        json!({"name": "Lab Card 2", "capacity_mib": 12_000.0}),
    )
    .await;
    assert_eq!(float["gpu"], "custom-lab-card-2-12000mib", "{float}");
    let mut job = example_job();
    job["gpu"] = json!({"name": "Lab Card 2", "capacity_mib": 12_000.5});
    assert_eq!(app.post_json("/v1/estimate", &job).await.status(), 422);

    let observation = json!({"gpu": card, "job": example_job(), "observed_peak_mib": 2100});
    let response = app
        .post_json("/v1/calibration/observations", &observation)
        .await;
    assert_eq!(response.status(), 200);
    let profiles = app.get_json("/v1/calibration/profiles").await;
    assert!(
        profiles["profiles"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["gpu"] == "custom-lab-card-2-12000mib"),
        "{profiles}"
    );
    assert_eq!(
        app.state
            .engine
            .profiles
            .get("custom-lab-card-2-12000mib")
            .unwrap()
            .observations,
        1
    );
}

#[tokio::test]
async fn bad_custom_cards_and_values_are_422s_naming_gpu() {
    let app = spawn_app().await;
    for gpu in [
        json!({"name": "../etc/passwd", "capacity_mib": 1000}),
        json!({"name": "card", "capacity_mib": 0}),
        json!({"name": "card", "capacity_mib": 2_000_000}),
        json!({"name": "x".repeat(65), "capacity_mib": 1000}),
        json!({"name": "card"}),
        json!({"name": "card", "capacity_mib": 1000, "extra": 1}),
        json!(42),
        json!("rtx 4090 please"),
        json!("a100"),
    ] {
        let mut job = example_job();
        job["gpu"] = gpu.clone();
        let response = app.post_json("/v1/estimate", &job).await;
        assert_eq!(response.status(), 422, "{gpu}");
        let problem: Value = response.json().await.unwrap();
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.starts_with("gpu"), "{gpu}: {detail}");
        assert!(detail.len() < 600, "{detail}");
    }
}

#[tokio::test]
async fn a_gpus_file_adds_a_card_and_replaces_another() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpus.json");
    let entry = |id: &str, alias: &str, memory_mib: u64| {
        json!({
            "id": id, "name": format!("NVIDIA {alias}"), "aliases": [alias],
            "memory_mib": memory_mib, "memory_gb": 32, "sm_count": 170, "max_warps_per_sm": 48,
            "boost_clock_mhz": 2407, "memory_bandwidth_gb_s": 1792.0, "fp32_tflops": 104.8,
            "fp16_tflops": 209.5, "compute_capability": "12.0",
            "source": {"title": "a test", "url": "https://example.com"}
        })
    };
    let file = json!({"gpus": [
        entry("rtx-5090", "RTX 5090", 32_607),
        entry("t4", "T4", 15_000),
    ]});
    std::fs::write(&path, file.to_string()).unwrap();
    let mut config = test_config(&models_dir());
    config.gpus = Some(path);
    let app = spawn_app_with(config).await;
    let fit = fit_for(&app, "NVIDIA GeForce RTX 5090".into()).await;
    assert_eq!(
        (&fit["gpu"], &fit["capacity_mib"]),
        (&json!("rtx-5090"), &json!(32_607))
    );
    let fit = fit_for(&app, "Tesla T4".into()).await;
    assert_eq!(fit["capacity_mib"], 15_000, "{fit}");
    let listed = app.get_json("/v1/gpus").await;
    let from_file: Vec<&str> = listed["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|g| g["from_file"] == true)
        .map(|g| g["id"].as_str().unwrap())
        .collect();
    assert_eq!(from_file, ["rtx-5090", "t4"]);
}

#[tokio::test]
async fn a_bad_gpus_file_stops_the_start_naming_the_entry() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpus.json");
    std::fs::write(
        &path,
        json!({"gpus": [{"id": "x", "name": "X", "memory_mib": 0}]}).to_string(),
    )
    .unwrap();
    let mut config = test_config(&models_dir());
    config.gpus = Some(path);
    let error = gpucast::startup::Application::build(&config)
        .await
        .err()
        .expect("refused");
    assert!(error.to_string().contains("gpus.json"), "{error}");
}

#[tokio::test]
async fn an_attached_card_the_catalogue_lacks_shows_peaks_derived_from_nvml() {
    use gpucast::devices::FakeDevices;
    let devices = FakeDevices::single("NVIDIA RTX PRO 6000 Blackwell", 97_887).with_hardware(
        Some("12.0"),
        Some(188),
        Some(2617),
        Some(14_001),
        Some(512),
    );
    let app = crate::helpers::spawn_app_with_devices(
        test_config(&models_dir()),
        std::sync::Arc::new(devices),
    )
    .await;
    let listed = app.get_json("/v1/devices").await;
    let device = &listed["devices"][0];
    assert_eq!(device["sku"], Value::Null);
    assert_eq!(device["multiprocessor_count"], 188);
    assert_eq!(device["derived_peaks"]["sm_count"], 188);
    let fit = fit_for(&app, "attached".into()).await;
    assert_eq!(fit["gpu"], "rtx-pro-6000-blackwell");
    assert_eq!(fit["capacity_mib"], 97_887);
}

#[tokio::test]
async fn custom_cards_with_profiles_are_bounded() {
    let app = spawn_app().await;
    let observations: Vec<Value> = (0..257)
        .map(|i| {
            json!({
                "gpu": {"name": format!("card {i}"), "capacity_mib": 40_000},
                "job": example_job(),
                "observed_peak_mib": 2100
            })
        })
        .collect();
    let response = app
        .post_json("/v1/calibration/observations", &Value::Array(observations))
        .await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("at most 256 custom cards"),
        "{problem}"
    );
    assert!(app.get_json("/v1/calibration/profiles").await["profiles"]
        .as_array()
        .unwrap()
        .is_empty());
}

/// The spellings people and drivers use resolve; AMD Instinct cards answer memory with their
/// capacity and say utilization is not modelled for them.
#[tokio::test]
async fn every_spelling_resolves_and_amd_cards_answer_memory_only() {
    let app = spawn_app().await;
    for (name, id) in [
        ("rtx4090", "rtx-4090"),
        ("RTX4090", "rtx-4090"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("mi300x", "mi300x"),
        ("AMD Instinct MI250X", "mi250x"),
    ] {
        assert_eq!(fit_for(&app, json!(name)).await["gpu"], id, "{name}");
    }
    let mut job = example_job();
    job["gpu"] = "mi300x".into();
    let answer: Value = app.post_json_value("/v1/estimate", &job).await;
    assert_eq!(answer["fit"]["capacity_mib"], 196_608);
    assert!(answer["memory"]["estimate_mib"].as_f64().unwrap() > 0.0);
    assert!(answer["performance"].is_null());
    let why = answer["performance_null_reason"].as_str().unwrap();
    assert!(why.contains("AMD"), "{why}");
    let gpus: Value = app.get_json("/v1/gpus").await;
    let amd = gpus["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|g| g["vendor"] == "amd")
        .count();
    assert_eq!(amd, 5);
}
