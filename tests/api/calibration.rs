//! GPUs of the host and per-GPU calibration, against a fake NVML device.

use std::sync::Arc;
use std::time::Duration;

use gpucast::config::ApiToken;
use gpucast::devices::{FakeDevices, GpuDevices, NoDevices};
use serde_json::{json, Value};

use crate::helpers::{
    example_job, held_out_mlp_jobs, median, models_dir, spawn_app, spawn_app_with,
    spawn_app_with_devices, test_config,
};

#[tokio::test]
async fn without_a_driver_devices_says_so_plainly_and_estimates_still_work() {
    let app = spawn_app_with_devices(
        test_config(&models_dir()),
        Arc::new(NoDevices::new("libnvidia-ml.so not found")),
    )
    .await;
    let response = app.get("/v1/devices").await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["nvml"], false);
    assert!(
        body["reason"]
            .as_str()
            .unwrap()
            .contains("no NVML device is present"),
        "{body}"
    );
    assert_eq!(body["devices"], json!([]));
    assert_eq!(
        app.post_json("/v1/estimate", &example_job()).await.status(),
        200
    );

    let mut job = example_job();
    job["gpu"] = "attached".into();
    let response = app.post_json("/v1/estimate", &job).await;
    assert_eq!(response.status(), 409);
}

#[tokio::test]
async fn the_attached_fake_gpu_is_listed_and_used_for_fit() {
    let devices: Arc<dyn GpuDevices> =
        Arc::new(FakeDevices::single("NVIDIA L4", 23_034).with_driver("550.54.15"));
    let app = spawn_app_with_devices(test_config(&models_dir()), devices).await;
    let body: Value = app.get_json("/v1/devices").await;
    assert_eq!(body["nvml"], true);
    assert_eq!(body["devices"][0]["sku"], "l4");
    assert_eq!(body["devices"][0]["memory_total_mib"], 23_034);

    let mut job = example_job();
    job["gpu"] = "attached".into();
    let body: Value = app.post_json_value("/v1/estimate", &job).await;
    let fit = &body["fit"];
    assert_eq!(fit["gpu"], "l4");
    assert_eq!(fit["capacity_mib"], 23_034);
    let bound = body["memory"]["upper_bound_mib"].as_f64().unwrap();
    assert_eq!(
        fit["max_colocated"].as_u64().unwrap(),
        (23_034.0 / bound).floor() as u64,
        "{body}"
    );
    assert_eq!(fit["fits"], true);
    assert_eq!(body["calibration"]["profile_used"], false);
}

#[tokio::test]
async fn unknown_gpus_are_refused() {
    let app = spawn_app().await;
    let mut job = example_job();
    job["gpu"] = "rtx-9999".into();
    let response = app.post_json("/v1/estimate", &job).await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    assert!(
        problem["detail"].as_str().unwrap().starts_with("gpu:"),
        "{problem}"
    );
}

#[tokio::test]
async fn observations_need_the_bearer_token_when_one_is_configured() {
    let mut config = test_config(&models_dir());
    config.token = Some(ApiToken::new("let-me-in"));
    let app = spawn_app_with_devices(config, Arc::new(NoDevices::new("none"))).await;
    let body = json!({"gpu": "h100-80gb", "job": example_job(), "observed_peak_mib": 2000});
    let url = format!("{}/v1/calibration/observations", app.address);
    let response = app.client.post(&url).json(&body).send().await.unwrap();
    assert_eq!(response.status(), 401);
    assert_eq!(response.headers()["www-authenticate"], "Bearer");
    let response = app
        .client
        .post(&url)
        .bearer_auth("wrong")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    let response = app
        .client
        .post(&url)
        .bearer_auth("let-me-in")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let recorded: Value = response.json().await.unwrap();
    assert_eq!(recorded["recorded"], 1);
    assert_eq!(recorded["profiles"][0]["gpu"], "h100-80gb");
}

#[tokio::test]
async fn bad_observations_record_nothing() {
    let app = spawn_app().await;
    let good = json!({"gpu": "t4", "job": example_job(), "observed_peak_mib": 2000});
    let bad = json!({"gpu": "t4", "job": example_job(), "observed_peak_mib": -5});
    let response = app
        .post_json("/v1/calibration/observations", &json!([good, bad]))
        .await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .starts_with("[1].observed_peak_mib"),
        "{problem}"
    );
    // The GPU named inside the job must not contradict the observation's.
    let mut job = example_job();
    job["gpu"] = "h100-80gb".into();
    let contradiction = json!({"gpu": "t4", "job": job, "observed_peak_mib": 2000});
    let response = app
        .post_json("/v1/calibration/observations", &contradiction)
        .await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    assert!(
        problem["detail"].as_str().unwrap().starts_with("job.gpu"),
        "{problem}"
    );
    // A peak no GPU job has (found by schemathesis: it once made the refit fail with a 500).
    let tiny = json!({"gpu": "t4", "job": example_job(), "observed_peak_mib": 5e-324});
    let response = app.post_json("/v1/calibration/observations", &tiny).await;
    assert_eq!(response.status(), 422);
    let profiles: Value = app.get_json("/v1/calibration/profiles").await;
    assert_eq!(profiles["profiles"], json!([]));
}

/// A GPU that needs 1.15x the A100's memory plus 700 MiB (context and workspaces) is learned
/// from 30 observations, sent as three updates: the calibrated median error on further jobs comes within 2 points of
/// the reference model's own median error on the A100.
#[tokio::test]
async fn a_constant_offset_and_scale_is_learned_from_30_observations() {
    let app = spawn_app().await;
    let jobs = held_out_mlp_jobs();
    let shifted = |measured: f64| 1.15 * measured + 700.0;
    let observations: Vec<Value> = jobs[..30]
        .iter()
        .map(|(job, measured)| json!({"gpu": "h100-80gb", "job": job, "observed_peak_mib": shifted(*measured)}))
        .collect();
    // Three updates of ten: one update moves a profile by a bounded step (a factor of 1.25),
    // and this shift needs more than one.
    for chunk in observations.chunks(10) {
        let response = app
            .post_json("/v1/calibration/observations", &json!(chunk))
            .await;
        assert_eq!(response.status(), 200);
    }

    let further = &jobs[30..230];
    let estimate = |gpu: Option<&str>| {
        let items: Vec<Value> = further
            .iter()
            .map(|(job, _)| {
                let mut job = job.clone();
                if let Some(gpu) = gpu {
                    job["gpu"] = gpu.into();
                }
                job
            })
            .collect();
        let app = &app;
        async move {
            let body: Value = app
                .post_json_value("/v1/estimate/batch", &json!({ "items": items }))
                .await;
            body["items"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i["estimate"]["memory"]["estimate_mib"].as_f64().unwrap())
                .collect::<Vec<_>>()
        }
    };
    let reference = estimate(None).await;
    let calibrated = estimate(Some("h100-80gb")).await;
    let reference_error = median(
        further
            .iter()
            .zip(&reference)
            .map(|((_, m), e)| (e - m).abs() / m)
            .collect(),
    );
    let uncalibrated_error = median(
        further
            .iter()
            .zip(&reference)
            .map(|((_, m), e)| (e - shifted(*m)).abs() / shifted(*m))
            .collect(),
    );
    let calibrated_error = median(
        further
            .iter()
            .zip(&calibrated)
            .map(|((_, m), e)| (e - shifted(*m)).abs() / shifted(*m))
            .collect(),
    );
    eprintln!("median |relative error|: reference model on the A100 {reference_error:.4}, uncalibrated on the shifted GPU {uncalibrated_error:.4}, calibrated {calibrated_error:.4}");
    assert!(
        calibrated_error <= reference_error + 0.02,
        "calibrated {calibrated_error:.4}, reference {reference_error:.4}, uncalibrated {uncalibrated_error:.4}"
    );
    assert!(
        uncalibrated_error > calibrated_error + 0.05,
        "the shift was not there to learn"
    );
    let profiles: Value = app.get_json("/v1/calibration/profiles").await;
    assert_eq!(profiles["profiles"][0]["observations"], 30);
}

#[tokio::test]
async fn a_watched_process_peak_becomes_an_observation() {
    let devices = Arc::new(FakeDevices::single("NVIDIA A100-SXM4-80GB", 81_920));
    devices.script_process(4242, [None, Some(900), Some(2600), Some(2400), None]);
    let app = spawn_app_with_devices(test_config(&models_dir()), devices).await;
    let body = json!({"pid": 4242, "job": example_job(), "interval_ms": 10});
    let response = app.post_json("/v1/calibration/watch", &body).await;
    assert_eq!(response.status(), 202);
    let accepted: Value = response.json().await.unwrap();
    assert_eq!(accepted["gpu"], "a100-80gb");
    for _ in 0..200 {
        let profiles: Value = app.get_json("/v1/calibration/profiles").await;
        if let Some(profile) = profiles["profiles"].as_array().unwrap().first() {
            assert_eq!(profile["gpu"], "a100-80gb");
            assert_eq!(profile["observations"], 1);
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the watch recorded nothing");
}

#[tokio::test]
async fn profiles_survive_a_restart_derived_from_the_stored_observations() {
    let config = test_config(&models_dir());
    let app = spawn_app_with_devices(config.clone(), Arc::new(NoDevices::new("none"))).await;
    let body = json!({"gpu": "l40s", "job": example_job(), "observed_peak_mib": 2100});
    assert_eq!(
        app.post_json("/v1/calibration/observations", &body)
            .await
            .status(),
        200
    );
    assert!(
        config.data_dir.join("gpucast.sqlite3-wal").exists(),
        "the SQLite store is in WAL mode"
    );

    let restarted = spawn_app_with_devices(config, Arc::new(NoDevices::new("none"))).await;
    let profiles: Value = restarted.get_json("/v1/calibration/profiles").await;
    let gpus: Vec<&str> = profiles["profiles"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["gpu"].as_str().unwrap())
        .collect();
    assert_eq!(gpus, vec!["l40s"]);
}

#[tokio::test]
async fn calibration_writes_are_refused_on_a_public_listener_without_a_token() {
    let mut config = test_config(&models_dir());
    config.listen = "0.0.0.0:0".parse().unwrap();
    let devices = Arc::new(FakeDevices::single("NVIDIA L4", 23_034));
    devices.set_process_memory(77, Some(1000));
    let app = spawn_app_with_devices(config, devices).await;
    let observation = json!({"gpu": "t4", "job": example_job(), "observed_peak_mib": 2000});
    let watch = json!({"pid": 77, "job": example_job()});
    for (path, body) in [
        ("/v1/calibration/observations", observation),
        ("/v1/calibration/watch", watch),
    ] {
        let response = app.post_json(path, &body).await;
        assert_eq!(response.status(), 403, "{path}");
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
        let problem: Value = response.json().await.unwrap();
        assert!(
            problem["detail"].as_str().unwrap().contains("--token"),
            "{problem}"
        );
    }
    // Reads and estimates are not writes.
    let profiles: Value = app.get_json("/v1/calibration/profiles").await;
    assert_eq!(profiles["profiles"], json!([]));
    assert_eq!(
        app.post_json("/v1/estimate", &example_job()).await.status(),
        200
    );
}

#[tokio::test]
async fn a_public_listener_with_a_token_takes_writes_with_it() {
    let mut config = test_config(&models_dir());
    config.listen = "0.0.0.0:0".parse().unwrap();
    config.token = Some(ApiToken::new("let-me-in"));
    let app = spawn_app_with_devices(config, Arc::new(NoDevices::new("none"))).await;
    let body = json!({"gpu": "t4", "job": example_job(), "observed_peak_mib": 2000});
    let url = format!("{}/v1/calibration/observations", app.address);
    let response = app.client.post(&url).json(&body).send().await.unwrap();
    assert_eq!(response.status(), 401);
    let response = app
        .client
        .post(&url)
        .bearer_auth("let-me-in")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
}

/// The poisoning of the issue: twenty peaks of 1 MiB once made every estimate on the GPU 1 MiB,
/// and one of 10,000,000 made nothing fit.
#[tokio::test]
async fn observations_below_the_physical_floor_or_above_the_card_are_refused() {
    let app = spawn_app().await;
    let mut on_t4 = example_job();
    on_t4["gpu"] = "t4".into();
    let before: Value = app.post_json_value("/v1/estimate", &on_t4).await;
    let tiny: Vec<Value> = (0..20)
        .map(|_| json!({"gpu": "t4", "job": example_job(), "observed_peak_mib": 1}))
        .collect();
    let huge = json!({"gpu": "t4", "job": example_job(), "observed_peak_mib": 10_000_000});
    let above_t4 = json!({"gpu": "t4", "job": example_job(), "observed_peak_mib": 16_000});
    for (body, prefix, says) in [
        (json!(tiny), "[0].observed_peak_mib", "physical floor"),
        (huge, "observed_peak_mib", "whole memory of t4"),
        (above_t4, "observed_peak_mib", "whole memory of t4"),
    ] {
        let response = app.post_json("/v1/calibration/observations", &body).await;
        assert_eq!(response.status(), 422);
        let problem: Value = response.json().await.unwrap();
        let detail = problem["detail"].as_str().unwrap();
        assert!(
            detail.starts_with(prefix) && detail.contains(says),
            "{problem}"
        );
    }
    let profiles: Value = app.get_json("/v1/calibration/profiles").await;
    assert_eq!(profiles["profiles"], json!([]));
    let after: Value = app.post_json_value("/v1/estimate", &on_t4).await;
    assert_eq!(after["memory"], before["memory"]);
    assert_eq!(after["fit"], before["fit"]);
}

/// A profile moves every estimate on its GPU, so one update moves it one bounded step, and
/// the answer says so; the observations are kept, so further updates move it further.
#[tokio::test]
async fn one_update_moves_a_profile_a_bounded_step_and_says_so() {
    let app = spawn_app().await;
    let mut on_t4 = example_job();
    on_t4["gpu"] = "t4".into();
    let estimate_on_t4 = || async {
        let body: Value = app.post_json_value("/v1/estimate", &on_t4).await;
        body["memory"]["estimate_mib"].as_f64().unwrap()
    };
    let uncalibrated = estimate_on_t4().await;
    // Three times the model's figure: within physics and the card, far from the model.
    let observed = (3.0 * uncalibrated).round();
    let observations: Vec<Value> = (0..5)
        .map(|_| json!({"gpu": "t4", "job": example_job(), "observed_peak_mib": observed}))
        .collect();
    let response = app
        .post_json("/v1/calibration/observations", &json!(observations))
        .await;
    assert_eq!(response.status(), 200);
    let recorded: Value = response.json().await.unwrap();
    assert_eq!(recorded["recorded"], 5);
    assert_eq!(recorded["limited"], json!(["t4"]));
    let once = estimate_on_t4().await;
    assert!(
        (once / uncalibrated - 1.25).abs() < 1e-3,
        "{uncalibrated} -> {once}"
    );
    let response = app
        .post_json("/v1/calibration/observations", &json!(observations))
        .await;
    let recorded: Value = response.json().await.unwrap();
    assert_eq!(recorded["limited"], json!(["t4"]));
    let twice = estimate_on_t4().await;
    assert!(
        (twice / once - 1.25).abs() < 1e-3,
        "{uncalibrated} -> {once} -> {twice}"
    );
    // A reading close to the model is learned at once, and nothing is reported.
    let app = spawn_app().await;
    let near = json!({"gpu": "t4", "job": example_job(), "observed_peak_mib": (1.1 * uncalibrated).round()});
    let recorded: Value = app
        .post_json_value("/v1/calibration/observations", &near)
        .await;
    assert_eq!(recorded["limited"], json!([]));
}

/// Watched processes that stay on the GPU (until `max_seconds`).
fn steady_processes(pids: std::ops::RangeInclusive<u32>) -> Arc<FakeDevices> {
    let devices = Arc::new(FakeDevices::single("NVIDIA A100-SXM4-80GB", 81_920));
    for pid in pids {
        devices.script_process(pid, [Some(1000)]);
        devices.set_process_memory(pid, Some(1000));
    }
    devices
}

fn watch_of(pid: u32) -> Value {
    json!({"pid": pid, "job": example_job(), "interval_ms": 10, "max_seconds": 5})
}

#[tokio::test]
async fn watches_beyond_the_cap_are_refused_with_retry_after() {
    let mut config = test_config(&models_dir());
    config.max_watches = 3;
    let app = spawn_app_with_devices(config, steady_processes(101..=104)).await;
    for pid in 101..=103 {
        let response = app.post_json("/v1/calibration/watch", &watch_of(pid)).await;
        assert_eq!(response.status(), 202, "pid {pid}");
    }
    let response = app.post_json("/v1/calibration/watch", &watch_of(104)).await;
    assert_eq!(response.status(), 429);
    assert!(response.headers().contains_key("retry-after"));
    let problem: Value = response.json().await.unwrap();
    assert!(
        problem["detail"].as_str().unwrap().contains('3'),
        "{problem}"
    );
}

#[tokio::test]
async fn a_process_is_watched_once() {
    let app = spawn_app_with_devices(test_config(&models_dir()), steady_processes(7..=7)).await;
    let response = app.post_json("/v1/calibration/watch", &watch_of(7)).await;
    assert_eq!(response.status(), 202);
    let response = app.post_json("/v1/calibration/watch", &watch_of(7)).await;
    assert_eq!(response.status(), 409);
    let problem: Value = response.json().await.unwrap();
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("watched already"),
        "{problem}"
    );
}

/// Threads of this test process whose name starts with `watch`.
fn watch_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|tasks| {
            tasks
                .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|name| name.starts_with("watch"))
                .count()
        })
        .unwrap_or(0)
}

/// 4,000 watches once made 4,004 threads: one thread now reads every watched process.
#[tokio::test]
async fn fifty_watches_share_one_sampler_thread() {
    let devices = steady_processes(1001..=1050);
    let app = spawn_app_with_devices(test_config(&models_dir()), devices.clone()).await;
    let before = watch_threads();
    for pid in 1001..=1050 {
        let response = app.post_json("/v1/calibration/watch", &watch_of(pid)).await;
        assert_eq!(response.status(), 202, "pid {pid}");
    }
    for _ in 0..500 {
        if (1001..=1050).all(|pid| devices.script_done(pid)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!((1001..=1050).all(|pid| devices.script_done(pid)));
    assert_eq!(devices.reader_threads(), 1);
    // Other tests of this binary may run their own sampler meanwhile; not one per watch.
    let after = watch_threads();
    assert!(after <= before + 2, "{before} -> {after} watch threads");
}

async fn observations_recorded(app: &crate::helpers::TestApp) -> u64 {
    let profiles: Value = app.get_json("/v1/calibration/profiles").await;
    profiles["profiles"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["observations"].as_u64().unwrap())
        .sum()
}

async fn post_with_key(
    app: &crate::helpers::TestApp,
    key: &str,
    body: &Value,
) -> reqwest::Response {
    app.client
        .post(format!("{}/v1/calibration/observations", app.address))
        .header("Idempotency-Key", key)
        .json(body)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_retry_with_the_same_idempotency_key_records_nothing_again() {
    let app = spawn_app().await;
    let body = json!({"gpu": "l40s", "job": example_job(), "observed_peak_mib": 2100});
    let first = post_with_key(&app, "batch-1", &body).await;
    assert_eq!(first.status(), 200);
    assert!(first.headers().get("idempotency-replayed").is_none());
    let first: Value = first.json().await.unwrap();
    let retry = post_with_key(&app, "batch-1", &body).await;
    assert_eq!(retry.status(), 200);
    assert_eq!(retry.headers()["idempotency-replayed"], "true");
    assert_eq!(retry.json::<Value>().await.unwrap(), first);
    assert_eq!(observations_recorded(&app).await, 1);
    // The same key with other observations is a client's mistake, not a retry.
    let other = json!({"gpu": "l40s", "job": example_job(), "observed_peak_mib": 2200});
    let response = post_with_key(&app, "batch-1", &other).await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .starts_with("idempotency-key"),
        "{problem}"
    );
    // A new key records; no key records every time.
    assert_eq!(post_with_key(&app, "batch-2", &body).await.status(), 200);
    assert_eq!(
        app.post_json("/v1/calibration/observations", &body)
            .await
            .status(),
        200
    );
    assert_eq!(observations_recorded(&app).await, 3);
    // A failed call records nothing and leaves its key free.
    let bad = json!({"gpu": "l40s", "job": example_job(), "observed_peak_mib": -1});
    assert_eq!(post_with_key(&app, "batch-3", &bad).await.status(), 422);
    let response = post_with_key(&app, "batch-3", &body).await;
    assert_eq!(response.status(), 200);
    assert!(response.headers().get("idempotency-replayed").is_none());
    assert_eq!(observations_recorded(&app).await, 4);
}

/// A call answered 503 by the timeout records nothing (the recording commits only with time
/// to spare before the timeout: issue 45), and its retry with the same key records it once.
#[tokio::test]
async fn a_call_answered_503_records_nothing_and_its_retry_records_once() {
    let mut config = test_config(&models_dir());
    config.request_timeout_secs = 1;
    let devices = Arc::new(FakeDevices::single("NVIDIA L4", 23_034));
    let app = spawn_app_with_devices(config, devices.clone()).await;
    // A driver slow enough that the recording outlasts the request timeout.
    devices.set_list_delay(Duration::from_millis(1200));
    let body = json!({"gpu": "attached", "job": example_job(), "observed_peak_mib": 2100});
    let response = post_with_key(&app, "slow-1", &body).await;
    assert_eq!(response.status(), 503);
    // The first call's work ends (past its deadline: nothing committed) and frees its key.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    devices.set_list_delay(Duration::ZERO);
    assert_eq!(observations_recorded(&app).await, 0);
    let retry = post_with_key(&app, "slow-1", &body).await;
    assert_eq!(retry.status(), 200);
    assert!(retry.headers().get("idempotency-replayed").is_none());
    let retry: Value = retry.json().await.unwrap();
    assert_eq!(retry["recorded"], 1);
    assert_eq!(observations_recorded(&app).await, 1);
}

/// Observations are priced like a batch of estimates before any work: a post whose jobs cost
/// more than the budget is refused, naming it, and records nothing.
#[tokio::test]
async fn observations_priced_above_the_budget_are_refused_before_any_work() {
    let mut config = test_config(&models_dir());
    config.max_request_cost = 100_000;
    let app = spawn_app_with(config).await;
    let one = json!({"gpu": "l40s", "job": example_job(), "observed_peak_mib": 2100});
    let body = Value::Array(vec![one; 300]);
    let response = app.post_json("/v1/calibration/observations", &body).await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("above the budget"),
        "{problem}"
    );
    assert_eq!(observations_recorded(&app).await, 0);
}

/// Three observations from an environment whose context is 500 MiB larger than physics' (all
/// kernel images loaded eagerly, say) teach its profile an environment fit: an estimate in
/// that environment for a job none of them described moves up, and the profiles list shows
/// the fit. (A smaller context is the same fit, but these small jobs sit within a few hundred
/// MiB of physics' floor, which counts physics' context: such peaks are refused.)
/// The first `n` held-out MLP jobs, asked about on `gpu` in `environment`.
fn jobs_in_environment(gpu: &str, environment: &str, n: usize) -> Vec<Value> {
    held_out_mlp_jobs()
        .into_iter()
        .map(|(mut job, _)| {
            job["gpu"] = json!(gpu);
            job["environment"] = json!(environment);
            job
        })
        .take(n)
        .collect()
}

/// Observations of `jobs` on `gpu` in `environment`, each `shift` MiB off the estimate in
/// `answered` (the job's `memory`).
fn observations_shifted(
    jobs: &[Value],
    answered: &[Value],
    gpu: &str,
    environment: &str,
    shift: f64,
) -> Value {
    let observations: Vec<Value> = jobs
        .iter()
        .zip(answered)
        .map(|(job, m)| {
            let mut job = job.clone();
            job.as_object_mut().unwrap().remove("gpu");
            job.as_object_mut().unwrap().remove("environment");
            json!({
                "gpu": gpu,
                "environment": environment,
                "job": job,
                "observed_peak_mib": m["estimate_mib"].as_f64().unwrap() + shift,
            })
        })
        .collect();
    json!(observations)
}

/// Issue 34: 60 concurrent writers each starting an environment on one card got 60 of them
/// past a cap of 32; the check and the write are now one, so the cap holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_environment_cap_holds_under_concurrent_writers() {
    let app = spawn_app().await;
    let mut job = example_job();
    job.as_object_mut().unwrap().remove("gpu");
    let answer: Value = app.post_json_value("/v1/estimate", &job).await;
    let peak = answer["memory"]["estimate_mib"].clone();
    let writes = (0..48).map(|i| {
        let (client, url) = (
            app.client.clone(),
            format!("{}/v1/calibration/observations", app.address),
        );
        let body = json!({"gpu": "l40s", "environment": format!("env{i}"),
                          "job": job, "observed_peak_mib": peak});
        tokio::spawn(async move { client.post(url).json(&body).send().await.unwrap().status() })
    });
    let mut taken = 0;
    for write in writes.collect::<Vec<_>>() {
        let status = write.await.unwrap();
        assert!(status == 200 || status == 422, "{status}");
        taken += usize::from(status == 200);
    }
    let profiles: Value = app.get_json("/v1/calibration/profiles").await;
    let environments = profiles["profiles"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["gpu"] == json!("l40s") && !p["environment"].is_null())
        .count();
    assert_eq!(environments, taken);
    assert_eq!(environments, 32);
}

#[tokio::test]
async fn an_environment_fit_learned_from_three_observations_moves_its_estimates() {
    const LARGER: f64 = 500.0;
    const ENVIRONMENT: &str = "torch2.5-cu124";
    let app = spawn_app().await;
    let jobs = jobs_in_environment("l40s", ENVIRONMENT, 4);
    let memory = |answer: &Value| answer["memory"].clone();
    let mut before = Vec::new();
    for job in &jobs {
        let answer: Value = app.post_json_value("/v1/estimate", job).await;
        assert_eq!(answer["calibration"]["profile_used"], false);
        before.push(memory(&answer));
    }
    let observations = observations_shifted(&jobs[..3], &before, "l40s", ENVIRONMENT, LARGER);
    let response = app
        .post_json("/v1/calibration/observations", &observations)
        .await;
    assert_eq!(response.status(), 200);

    let answer: Value = app.post_json_value("/v1/estimate", &jobs[3]).await;
    assert_eq!(answer["calibration"]["environment"], ENVIRONMENT);
    let (was, now) = (
        before[3]["estimate_mib"].as_f64().unwrap(),
        answer["memory"]["estimate_mib"].as_f64().unwrap(),
    );
    eprintln!("the fourth job: {was} MiB before, {now} MiB in the fitted environment");
    assert!(
        (150.0..=1.2 * LARGER).contains(&(now - was)),
        "moved from {was} to {now} MiB"
    );
    assert!(answer["memory"]["upper_bound_mib"].as_f64().unwrap() >= now);
    // An environment's observations never move the GPU's own answers (nor another
    // environment's): the job without the environment is answered as before.
    let mut on_gpu = jobs[3].clone();
    on_gpu.as_object_mut().unwrap().remove("environment");
    let line: Value = app.post_json_value("/v1/estimate", &on_gpu).await;
    assert_eq!(line["calibration"]["profile_used"], false, "{line}");
    assert_eq!(line["memory"]["estimate_mib"].as_f64().unwrap(), was);

    let profiles: Value = app.get_json("/v1/calibration/profiles").await;
    let profiles = profiles["profiles"].as_array().unwrap();
    assert!(profiles.iter().all(|p| !p["environment"].is_null()));
    let own = profiles
        .iter()
        .find(|p| p["environment"] == ENVIRONMENT)
        .unwrap();
    let fit = &own["environment_fit"];
    assert_eq!(fit["observations"], 3, "{own}");
    let context = before[0]["breakdown"]["cuda_context"].as_f64();
    assert!(
        fit["context_mib"].as_f64().unwrap() > context.unwrap(),
        "{fit}"
    );
    for key in ["allocator_fixed_mib", "activation_scale", "cache_scale"] {
        assert!(fit[key].is_f64(), "{key}: {fit}");
    }
}

/// An environment with a smaller CUDA context than physics assumes (lazy loading, a newer
/// driver): its observations sit below physics' floor, yet are real; they are accepted, and
/// its estimates go below that floor, to its own.
#[tokio::test]
async fn an_environment_with_a_smaller_context_is_learned_below_physics_floor() {
    const SMALLER: f64 = 600.0;
    const ENVIRONMENT: &str = "torch2.9-cu129-lazy";
    let app = spawn_app().await;
    let jobs = jobs_in_environment("l40s", ENVIRONMENT, 4);
    let mut before = Vec::new();
    for job in &jobs {
        let answer: Value = app.post_json_value("/v1/estimate", job).await;
        before.push(answer["memory"].clone());
    }
    let context = before[0]["breakdown"]["cuda_context"].as_f64().unwrap();
    assert!(context > SMALLER + 256.0, "physics' context {context} MiB");
    let observations = observations_shifted(&jobs[..3], &before, "l40s", ENVIRONMENT, -SMALLER);
    let response = app
        .post_json("/v1/calibration/observations", &observations)
        .await;
    assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    let answer: Value = app.post_json_value("/v1/estimate", &jobs[3]).await;
    assert_eq!(answer["calibration"]["environment"], ENVIRONMENT);
    let (was, now) = (
        before[3]["estimate_mib"].as_f64().unwrap(),
        answer["memory"]["estimate_mib"].as_f64().unwrap(),
    );
    eprintln!("the fourth job: {was} MiB before, {now} MiB in the smaller-context environment");
    assert!(
        (0.5 * SMALLER..=1.2 * SMALLER).contains(&(was - now)),
        "moved from {was} to {now} MiB"
    );
    assert!(answer["memory"]["upper_bound_mib"].as_f64().unwrap() >= now);
    // Below the model state and the smallest context, a reading is still refused.
    let mut job = jobs[0].clone();
    job.as_object_mut().unwrap().remove("gpu");
    job.as_object_mut().unwrap().remove("environment");
    let impossible = json!({"gpu": "l40s", "environment": ENVIRONMENT, "job": job,
        "observed_peak_mib": 100});
    let response = app
        .post_json("/v1/calibration/observations", &impossible)
        .await;
    assert_eq!(response.status(), 422);
}

/// The guarantee of docs/user/calibration.md, as a property: whatever an attacker posts (valid
/// observations only: above each job's floor, within the card), however many times and for
/// whichever jobs, every job's answer stays within `reach` of its uncalibrated answer:
/// (u - 1,024) / 1.5 <= estimate <= 1.5 u + 1,024 MiB, the bound within 1.5 b + 1,024. The
/// attacker is adaptive: each round it pushes in the direction that has moved the victims
/// least so far, with the tiny or the huge job that pulls hardest that way, and a value at the
/// edge of what physics accepts.
#[tokio::test]
async fn no_sequence_of_posts_moves_any_answer_beyond_its_reach() {
    let app = spawn_app().await;
    let sized = |batch: u64, gpu: &str, environment: Option<&str>| {
        let mut job = example_job();
        job["batch_size"] = batch.into();
        job["gpu"] = gpu.into();
        if let Some(e) = environment {
            job["environment"] = e.into();
        }
        job
    };
    let answer_of = |answer: &Value| {
        (
            answer["memory"]["estimate_mib"].as_f64().unwrap(),
            answer["memory"]["upper_bound_mib"].as_f64().unwrap(),
        )
    };
    // Victims on the attacked GPU (its own profile and an environment's) and on another GPU.
    let victims: Vec<Value> = vec![
        sized(8, "a100-40gb", None),
        sized(256, "a100-40gb", None),
        sized(2048, "a100-40gb", None),
        sized(256, "a100-40gb", Some("victim-env")),
        sized(256, "l4", None),
    ];
    let mut before = Vec::new();
    for v in &victims {
        before.push(answer_of(&app.post_json_value("/v1/estimate", v).await));
    }
    let floor_of = |answer: &Value| {
        let b = &answer["memory"]["breakdown"];
        ["parameters", "gradients", "optimizer_state"]
            .iter()
            .map(|k| b[*k].as_f64().unwrap())
            .sum::<f64>()
            + 300.0
    };
    let (tiny, huge) = (
        sized(1, "a100-40gb", None),
        sized(16_384, "a100-40gb", None),
    );
    let (mut up, mut down) = (0.0f64, 0.0f64);
    for round in 0..24 {
        // Push where the victims have moved least (in log terms), alternating job choices.
        let inflate = up <= down;
        let job = if inflate == (round % 4 < 2) {
            &tiny
        } else {
            &huge
        };
        let answered = app.post_json_value("/v1/estimate", job).await;
        let observed = if inflate {
            40_000.0
        } else {
            floor_of(&answered)
        };
        let observation = json!([{"gpu": "a100-40gb", "job": job, "observed_peak_mib": observed},
                                 {"gpu": "a100-40gb", "environment": "attacker", "job": job,
                                  "observed_peak_mib": observed}]);
        let response = app
            .post_json("/v1/calibration/observations", &observation)
            .await;
        assert!(
            response.status() == 200 || response.status() == 422,
            "{}",
            response.status()
        );
        for (v, &(u, b)) in victims.iter().zip(&before) {
            let (estimate, bound) = answer_of(&app.post_json_value("/v1/estimate", v).await);
            let (low, high) = ((u - 1024.0) / 1.5, 1.5 * u + 1024.0);
            assert!(
                estimate >= low.min(u) - 0.1 && estimate <= high + 0.1,
                "round {round}: {u} -> {estimate} MiB, beyond [{low}, {high}]"
            );
            assert!(
                bound <= 1.5 * b.max(u) + 1024.0 + 1.0,
                "round {round}: bound {b} -> {bound}"
            );
            up = up.max((estimate / u).ln());
            down = down.max((u / estimate).ln());
        }
    }
    // The attack did move the attacked GPU's answers (the property is not vacuous), moved the
    // other GPU's not at all, and another environment's only as the GPU's own profile (its
    // fallback), never through the attacker's environment.
    eprintln!("moved up by x{:.3}, down by x{:.3}", up.exp(), down.exp());
    assert!(up > 0.05 || down > 0.05, "up {up}, down {down}");
    let mut now = Vec::new();
    for v in &victims {
        now.push(answer_of(&app.post_json_value("/v1/estimate", v).await).0);
    }
    assert_eq!(
        now[3], now[1],
        "the environment follows the GPU's own profile only"
    );
    assert_eq!(now[4], before[4].0, "another GPU");
}

/// Issue 44: a stack the physics does not follow, stated and never observed, is bounded by the
/// spread between stacks (a wider bound, `basis: between_stacks`, a warning saying how to
/// narrow it); a stated modelled stack, or none, keeps the held-out bound; observations of
/// the stack's environment give it the environment's own bound.
#[tokio::test]
async fn an_unmodelled_stack_holds_the_spread_between_stacks_until_its_environment_is_observed() {
    const ENVIRONMENT: &str = "litgpt-cluster-a";
    let app = spawn_app().await;
    let jobs = jobs_in_environment("l40s", ENVIRONMENT, 4);
    let mut plain = jobs[3].clone();
    plain.as_object_mut().unwrap().remove("environment");
    let basis = |a: &Value| {
        a["memory"]["uncertainty"]["basis"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let width = |a: &Value| {
        a["memory"]["upper_bound_mib"].as_f64().unwrap()
            / a["memory"]["estimate_mib"].as_f64().unwrap()
    };

    let unsaid: Value = app.post_json_value("/v1/estimate", &plain).await;
    let mut stated = plain.clone();
    stated["stack"] = json!("transformers");
    let modelled: Value = app.post_json_value("/v1/estimate", &stated).await;
    stated["stack"] = json!("litgpt");
    let other: Value = app.post_json_value("/v1/estimate", &stated).await;
    assert_eq!(basis(&unsaid), "held_out_groups");
    assert_eq!(
        modelled["memory"], unsaid["memory"],
        "a modelled stack changes nothing"
    );
    assert_eq!(basis(&other), "between_stacks");
    assert_eq!(
        other["memory"]["estimate_mib"],
        unsaid["memory"]["estimate_mib"]
    );
    assert!(
        width(&other) > width(&unsaid),
        "{} vs {}",
        width(&other),
        width(&unsaid)
    );
    assert!(
        other["warnings"].to_string().contains("stack: litgpt"),
        "{}",
        other["warnings"]
    );

    let mut before = Vec::new();
    for job in &jobs[..3] {
        let answer: Value = app.post_json_value("/v1/estimate", job).await;
        before.push(answer["memory"].clone());
    }
    let observations = observations_shifted(&jobs[..3], &before, "l40s", ENVIRONMENT, 100.0);
    let response = app
        .post_json("/v1/calibration/observations", &observations)
        .await;
    assert_eq!(response.status(), 200);
    stated["environment"] = json!(ENVIRONMENT);
    let observed: Value = app.post_json_value("/v1/estimate", &stated).await;
    assert_eq!(basis(&observed), "environment", "{observed}");

    let mut unknown = plain.clone();
    unknown["stack"] = json!("internevo");
    let response = app.post_json("/v1/estimate", &unknown).await;
    assert_eq!(response.status(), 422);
}
