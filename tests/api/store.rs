//! The observation store on PostgreSQL, shared by replicas. Needs a server: the URL of a
//! database the tests may create databases from in `GPUCAST_TEST_DATABASE_URL`
//! (scripts/postgres-test.sh starts one; scripts/test.sh always does). Without it each test
//! says so and passes.

use std::sync::Arc;
use std::time::Duration;

use gpucast::calibration::db::{self, MIGRATIONS};
use gpucast::config::DatabaseUrl;
use gpucast::devices::NoDevices;
use serde_json::{json, Value};

use crate::helpers::{example_job, models_dir, spawn_app_with_devices, test_config};

/// A fresh database on the test server, its URL; `None` (with a note) without a server.
async fn fresh_database() -> Option<String> {
    let Ok(base) = std::env::var("GPUCAST_TEST_DATABASE_URL") else {
        eprintln!(
            "GPUCAST_TEST_DATABASE_URL is unset: PostgreSQL test skipped (scripts/test.sh runs it)"
        );
        return None;
    };
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let name = format!(
        "gpucast_test_{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let url = tokio::task::spawn_blocking(move || {
        let mut client = postgres::Client::connect(&base, postgres::NoTls).unwrap();
        client
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .unwrap();
        let (prefix, _) = base.rsplit_once('/').unwrap();
        format!("{prefix}/{name}")
    })
    .await
    .unwrap();
    Some(url)
}

async fn replica(url: &str, refresh_secs: u64) -> crate::common::TestApp {
    let mut config = test_config(&models_dir());
    config.database_url = Some(url.parse::<DatabaseUrl>().unwrap());
    config.profile_refresh_secs = refresh_secs;
    spawn_app_with_devices(config, Arc::new(NoDevices::new("none"))).await
}

fn observation(peak: f64, environment: Option<&str>) -> Value {
    let mut o = json!({"gpu": "l40s", "job": example_job(), "observed_peak_mib": peak});
    if let Some(e) = environment {
        o["environment"] = json!(e);
    }
    o
}

async fn count_rows(url: &str) -> i64 {
    let url = url.to_string();
    tokio::task::spawn_blocking(move || {
        let mut client = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        client
            .query_one("SELECT COUNT(*)::BIGINT FROM observations", &[])
            .unwrap()
            .get(0)
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn an_observation_posted_to_one_replica_is_served_by_the_other_after_a_refresh() {
    let Some(url) = fresh_database().await else {
        return;
    };
    let (a, b) = (replica(&url, 1).await, replica(&url, 1).await);
    let recorded = a
        .post_json(
            "/v1/calibration/observations",
            &observation(2100.0, Some("torch2.5-cu124")),
        )
        .await;
    assert_eq!(recorded.status(), 200);
    let mut seen = Value::Null;
    for _ in 0..50 {
        seen = b.get_json("/v1/calibration/profiles").await;
        if seen["profiles"].as_array().unwrap().len() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let keys: Vec<(String, Value)> = seen["profiles"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["gpu"].as_str().unwrap().to_string(),
                p["environment"].clone(),
            )
        })
        .collect();
    // The environment's own profile only: its observation moves no other.
    assert_eq!(
        keys,
        vec![("l40s".to_string(), json!("torch2.5-cu124"))],
        "{seen}"
    );
    let mut job = example_job();
    job["gpu"] = json!("l40s");
    job["environment"] = json!("torch2.5-cu124");
    let answer = b.post_json_value("/v1/estimate", &job).await;
    assert_eq!(answer["calibration"]["profile_used"], true, "{answer}");
    assert_eq!(answer["calibration"]["environment"], "torch2.5-cu124");
}

#[tokio::test]
async fn concurrent_posts_to_two_replicas_lose_nothing() {
    let Some(url) = fresh_database().await else {
        return;
    };
    let (a, b) = (replica(&url, 1).await, replica(&url, 1).await);
    // Twenty calls at once, alternating replicas, each on its own task.
    let posts: Vec<_> = (0..20)
        .map(|i| {
            let app = if i % 2 == 0 { &a } else { &b };
            let (client, url) = (
                app.client.clone(),
                format!("{}/v1/calibration/observations", app.address),
            );
            let body = json!([
                observation(2000.0 + i as f64, None),
                observation(2100.0, Some("env-x"))
            ]);
            tokio::spawn(async move { client.post(url).json(&body).send().await.unwrap().status() })
        })
        .collect();
    let mut statuses = Vec::new();
    for post in posts {
        statuses.push(post.await.unwrap());
    }
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert_eq!(count_rows(&url).await, 40);
    // Each replica serves all 40 after its own refresh: 20 in the GPU's own profile, 20 in
    // the environment's.
    for app in [&a, &b] {
        let mut observations = Value::Null;
        for _ in 0..50 {
            let profiles = app.get_json("/v1/calibration/profiles").await;
            observations = json!([
                profiles["profiles"][0]["observations"],
                profiles["profiles"][1]["observations"]
            ]);
            if observations == json!([20, 20]) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(observations, json!([20, 20]));
    }
}

#[tokio::test]
async fn migrations_apply_on_an_empty_and_on_an_up_to_date_database() {
    let Some(url) = fresh_database().await else {
        return;
    };
    let latest = MIGRATIONS.last().unwrap().version;
    let versions = tokio::task::spawn_blocking(move || {
        let first = db::open(std::path::Path::new("unused"), Some(&url)).unwrap();
        let again = db::open(std::path::Path::new("unused"), Some(&url)).unwrap();
        (
            first.schema_version().unwrap(),
            again.schema_version().unwrap(),
        )
    })
    .await
    .unwrap();
    assert_eq!(versions, (latest, latest));
}

#[tokio::test]
async fn refused_observations_leave_no_row() {
    let Some(url) = fresh_database().await else {
        return;
    };
    let app = replica(&url, 5).await;
    for body in [
        json!([observation(2100.0, None), observation(10_000_000.0, None)]),
        json!([observation(2100.0, None), observation(1.0, None)]),
        json!([
            observation(2100.0, None),
            observation(2100.0, Some("bad label"))
        ]),
    ] {
        let response = app.post_json("/v1/calibration/observations", &body).await;
        assert_eq!(response.status(), 422);
    }
    assert_eq!(count_rows(&url).await, 0);
}

/// Retention in bytes: jobs are stored as posted, so four posts of a job padded to ~600 KB
/// against a 1.3 MB store keep the newest two, whatever the row limits allow.
#[tokio::test]
async fn the_store_keeps_the_newest_observations_within_its_bytes() {
    let Some(url) = fresh_database().await else {
        return;
    };
    let mut config = test_config(&models_dir());
    config.database_url = Some(url.parse::<DatabaseUrl>().unwrap());
    config.max_store_bytes = 1_300_000;
    let app = spawn_app_with_devices(config, Arc::new(NoDevices::new("none"))).await;
    let job = serde_json::to_string(&example_job()).unwrap();
    let padded = format!("{}{}}}", &job[..job.len() - 1], " ".repeat(600_000));
    for peak in [2100.0, 2101.0, 2102.0, 2103.0] {
        let body = format!(r#"{{"gpu": "l40s", "observed_peak_mib": {peak}, "job": {padded}}}"#);
        let response = app
            .post_raw("/v1/calibration/observations", "application/json", body)
            .await;
        assert_eq!(response.status(), 200);
    }
    assert_eq!(count_rows(&url).await, 2);
}

/// The database goes away under a running replica: writes are answered 503 with Retry-After
/// (not 500) and store nothing, readiness stays true and reports the store apart, estimates go
/// on with the profiles last derived and say so; when the database is back, so is everything.
#[tokio::test]
async fn a_database_outage_refuses_writes_with_503_and_estimates_go_on() {
    let Some(url) = fresh_database().await else {
        return;
    };
    let app = replica(&url, 1).await;
    let recorded = app
        .post_json("/v1/calibration/observations", &observation(2100.0, None))
        .await;
    assert_eq!(recorded.status(), 200);
    let mut job = example_job();
    job["gpu"] = "l40s".into();
    let before: Value = app.post_json_value("/v1/estimate", &job).await;
    assert_eq!(before["calibration"]["profile_used"], true);

    // Take the database away: rename it, its connections cut.
    let (base, name) = url
        .rsplit_once('/')
        .map(|(b, n)| (b.to_string(), n.to_string()))
        .unwrap();
    let admin = format!("{base}/postgres");
    let sql = |statements: String| {
        let admin = admin.clone();
        tokio::task::spawn_blocking(move || {
            let mut client = postgres::Client::connect(&admin, postgres::NoTls).unwrap();
            client.batch_execute(&statements).unwrap();
        })
    };
    sql(format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}';
         ALTER DATABASE {name} RENAME TO {name}_away;"
    ))
    .await
    .unwrap();

    let refused = app
        .post_json("/v1/calibration/observations", &observation(2200.0, None))
        .await;
    assert_eq!(refused.status(), 503);
    assert!(refused.headers().contains_key("retry-after"));
    let ready = app.get("/readyz").await;
    assert_eq!(ready.status(), 200);
    let ready: Value = ready.json().await.unwrap();
    assert_eq!(
        (ready["ready"].clone(), ready["store"].clone()),
        (json!(true), json!(false)),
        "{ready}"
    );
    let during: Value = app.post_json_value("/v1/estimate", &job).await;
    assert_eq!(
        during["memory"]["estimate_mib"],
        before["memory"]["estimate_mib"]
    );
    assert_eq!(
        during["calibration"]["profiles_stale"], true,
        "{}",
        during["calibration"]
    );

    sql(format!("ALTER DATABASE {name}_away RENAME TO {name};"))
        .await
        .unwrap();
    let mut status = 0;
    for _ in 0..50 {
        status = app
            .post_json("/v1/calibration/observations", &observation(2300.0, None))
            .await
            .status()
            .as_u16();
        if status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(status, 200);
    assert_eq!(
        count_rows(&url).await,
        2,
        "the refused write stored nothing"
    );
    let ready: Value = app.get_json("/readyz").await;
    assert_eq!(ready["store"], true);
}
