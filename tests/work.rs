//! Where estimate work runs and when it stops (issue 34, items 2 and 3), on the real server
//! spawned on port 0 with the committed models:
//!
//! - while estimates and batches take every estimate thread, `/healthz` and `/readyz` are still
//!   answered at once: no estimate runs on the async workers that answer them;
//! - work past the request timeout stops (the request answered 503) and is counted in
//!   `gpucast_cancelled_total`.
//!
//! The only timing assertion is a hang guard (a probe within 1 s) far above what it guards;
//! the latencies themselves are measured on a release build (docs/reports/hardening.md).

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{example_job, models_dir, post_bytes, spawn_app_with, test_config};
use gpucast::devices::sku::Catalogue;
use serde_json::{json, Value};

/// The example job ranked on 16 catalogued cards: 16 estimates, placements and rooflines.
fn ranked_job() -> Value {
    let cards: Vec<&str> = Catalogue::builtin()
        .all()
        .iter()
        .map(|sku| sku.id.as_str())
        .take(16)
        .collect();
    assert_eq!(cards.len(), 16, "the catalogue holds 16 cards");
    let mut job = example_job();
    job["gpu"] = json!(cards);
    job
}

/// A batch of 256 ranked jobs: 4,096 card estimates.
/// 256 distinct jobs (a batch answers a repeated item once), each ranked over 16 cards.
fn heavy_batch() -> Vec<u8> {
    let items: Vec<Value> = (1..=256)
        .map(|n| {
            let mut job = ranked_job();
            job["batch_size"] = json!(n);
            job
        })
        .collect();
    serde_json::to_vec(&json!({ "items": items })).unwrap()
}

fn cancelled(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter(|line| line.starts_with("gpucast_cancelled_total{"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn health_and_readiness_answer_at_once_while_estimates_take_every_thread() {
    let mut config = test_config(&models_dir());
    config.max_concurrent_batches = 4;
    let app = spawn_app_with(config).await;
    let batch = Arc::new(heavy_batch());
    let single = Arc::new(serde_json::to_vec(&ranked_job()).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicUsize::new(0));
    let mut attackers = Vec::new();
    for n in 0..10 {
        let (path, body) = if n < 6 {
            ("/v1/estimate/batch", Arc::clone(&batch))
        } else {
            ("/v1/estimate", Arc::clone(&single))
        };
        let url = format!("{}{path}", app.address);
        let (stop, answered) = (Arc::clone(&stop), Arc::clone(&answered));
        attackers.push(tokio::spawn(async move {
            let client = reqwest::Client::new();
            while !stop.load(Ordering::Relaxed) {
                let response = post_bytes(&client, &url, &body).await;
                assert!(
                    [200, 503].contains(&response.status().as_u16()),
                    "{}",
                    response.status()
                );
                let _ = response.bytes().await;
                answered.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    // Every estimate thread busy before the probes start.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let probe = reqwest::Client::new();
    let mut slowest = Duration::ZERO;
    let until = Instant::now() + Duration::from_secs(3);
    let mut probes = 0;
    while Instant::now() < until {
        for path in ["/healthz", "/readyz"] {
            let started = Instant::now();
            let response = tokio::time::timeout(
                Duration::from_secs(5),
                probe.get(format!("{}{path}", app.address)).send(),
            )
            .await
            .unwrap_or_else(|_| panic!("{path} unanswered after 5 s under load"))
            .expect("an answer");
            let elapsed = started.elapsed();
            assert_eq!(response.status(), 200, "{path}");
            slowest = slowest.max(elapsed);
            probes += 1;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for attacker in attackers {
        attacker.await.expect("the attacker does not panic");
    }
    eprintln!(
        "{probes} probes, slowest {slowest:?}; {} estimate requests answered",
        answered.load(Ordering::Relaxed)
    );
    assert!(
        slowest < Duration::from_secs(1),
        "a probe waited {slowest:?} behind estimate work"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn work_past_the_request_timeout_stops_and_is_counted_cancelled() {
    let mut config = test_config(&models_dir());
    config.request_timeout_secs = 1;
    config.max_concurrent_batches = 16;
    let app = spawn_app_with(config).await;
    let batch = Arc::new(heavy_batch());
    let url = format!("{}/v1/estimate/batch", app.address);
    let mut tasks = Vec::new();
    // 65,536 card estimates on a pool of a thread per core: far more than a second's work.
    for _ in 0..16 {
        let (client, url, batch) = (app.client.clone(), url.clone(), Arc::clone(&batch));
        tasks.push(tokio::spawn(async move {
            let response = post_bytes(&client, &url, &batch).await;
            let status = response.status().as_u16();
            let body: Value = response.json().await.expect("a JSON body");
            (status, body)
        }));
    }
    let mut timed_out = 0;
    for task in tasks {
        let (status, body) = task.await.expect("the task does not panic");
        match status {
            200 => {}
            503 => {
                assert_eq!(body["title"], "Timeout", "{body}");
                timed_out += 1;
            }
            other => panic!("unexpected status {other}: {body}"),
        }
    }
    assert!(timed_out > 0, "no batch outlasted the 1 s timeout");
    // The stopped work is counted once it stops: within one step of its deadline.
    let counted = Instant::now();
    loop {
        let metrics = app.get("/metrics").await.text().await.unwrap();
        if cancelled(&metrics) >= 1 {
            break;
        }
        assert!(
            counted.elapsed() < Duration::from_secs(2),
            "no cancelled work counted 2 s after the timeouts:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Nothing left running: a single estimate is answered at once.
    let response = app.post_json("/v1/estimate", &example_job()).await;
    assert_eq!(response.status(), 200);
}
