use serde_json::Value;

use crate::helpers::{counter, example_job, spawn_app};

#[tokio::test]
async fn health_and_readiness_answer_ok() {
    let app = spawn_app().await;
    let health: Value = app.get_json("/healthz").await;
    assert_eq!(health["status"], "ok");
    let response = app.get("/readyz").await;
    assert_eq!(response.status(), 200);
    let ready: Value = response.json().await.unwrap();
    assert_eq!(ready["ready"], true);
    assert_eq!(ready["estimates"], true);
    assert_eq!(ready["store"], true);
}

#[tokio::test]
async fn metrics_count_requests_by_route_template_and_inference_by_estimator() {
    let app = spawn_app().await;
    let before = app.get("/metrics").await.text().await.unwrap();
    let route =
        "gpucast_http_requests_total{method=\"POST\",route=\"/v1/estimate\",status=\"200\"}";
    assert_eq!(counter(&before, route), 0.0);
    // The same body twice: the second is the first's answer again, its estimators not run.
    for _ in 0..2 {
        assert_eq!(
            app.post_json("/v1/estimate", &example_job()).await.status(),
            200
        );
    }
    // The classifiers run only when asked for.
    let mut all = example_job();
    all["estimators"] = "all".into();
    assert_eq!(app.post_json("/v1/estimate", &all).await.status(), 200);
    let after = app.get("/metrics").await.text().await.unwrap();
    assert_eq!(counter(&after, route), 3.0, "{after}");
    for (estimator, runs) in [
        ("mlp_ensemble", 1.0),
        ("sequence_transformer", 1.0),
        ("smact", 2.0),
        // SMOCC is the roofline's wherever there is one: its regressor runs only for all.
        ("smocc", 1.0),
    ] {
        let count =
            format!("gpucast_inference_duration_seconds_count{{estimator=\"{estimator}\"}}");
        assert_eq!(counter(&after, &count), runs, "{estimator}");
    }
    assert_eq!(
        counter(
            &after,
            "gpucast_predicted_class_total{class=\"1\",family=\"mlp\"}"
        ),
        3.0,
        "{after}"
    );
    assert!(after.contains("gpucast_http_request_duration_seconds_bucket"));
    assert!(after.contains("gpucast_build_info{"));
}

#[tokio::test]
async fn the_estimators_route_lists_what_is_loaded_with_validation_figures() {
    let app = spawn_app().await;
    let body: Value = app.get_json("/v1/estimators").await;
    let estimators = body["estimators"].as_array().unwrap();
    let names: Vec<&str> = estimators
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    for name in ["mlp_ensemble", "sequence_transformer", "smact", "smocc"] {
        assert!(names.contains(&name), "{names:?}");
    }
    for estimator in estimators {
        assert_eq!(estimator["sha256"].as_str().unwrap().len(), 64);
        assert!(!estimator["validation"].as_object().unwrap().is_empty());
        // The feed-forward graphs are evaluated in process, the sequence models by ONNX Runtime.
        let runtime = match estimator["input"].as_str().unwrap() {
            "aggregate" => "in_process",
            _ => "onnxruntime",
        };
        assert_eq!(estimator["runtime"], runtime, "{estimator}");
    }
    // Provenance: every training file with its checksum.
    let files = body["training_data"].as_array().unwrap();
    assert!(
        !files.is_empty()
            && files
                .iter()
                .all(|f| f["sha256"].as_str().is_some_and(|h| h.len() == 64)),
        "{body}"
    );
}

#[tokio::test]
async fn graceful_shutdown_stops_the_server() {
    let mut app = spawn_app().await;
    assert_eq!(app.get("/healthz").await.status(), 200);
    app.shutdown.take().unwrap().send(()).unwrap();
    let result = tokio::time::timeout(std::time::Duration::from_secs(5), &mut app.server).await;
    assert!(
        matches!(result, Ok(Ok(Ok(())))),
        "server did not stop cleanly: {result:?}"
    );
}

#[tokio::test]
async fn unknown_paths_and_methods_are_answered_as_problems() {
    let app = spawn_app().await;
    let long = "x".repeat(500);
    let response = app.get(&format!("/v1/nowhere/{long}")).await;
    assert_eq!(response.status(), 404);
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    let problem: Value = response.json().await.unwrap();
    assert_eq!(problem["status"], 404);
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("/v1/nowhere/x"), "{detail}");
    assert!(detail.len() < 200, "the path is echoed cut short: {detail}");

    let response = app.get("/v1/estimate").await;
    assert_eq!(response.status(), 405);
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    let allow = response.headers()["allow"].to_str().unwrap().to_string();
    assert!(allow.contains("POST"), "{allow}");
    let problem: Value = response.json().await.unwrap();
    assert_eq!(problem["status"], 405);
    assert!(problem["detail"].as_str().unwrap().contains("GET"));
}

/// Each recorded observation lands in the observed / estimated histogram of its GPU and
/// environment, and every series the Grafana dashboard reads is one the service exports.
#[tokio::test]
async fn observations_feed_the_error_histogram_and_the_dashboard_reads_exported_series() {
    let app = spawn_app().await;
    let answer: Value = app
        .post_json("/v1/estimate", &example_job())
        .await
        .json()
        .await
        .unwrap();
    let figure = answer["memory"]["estimate_mib"].as_f64().unwrap();
    let observation = serde_json::json!({"gpu": "h100-80gb", "job": example_job(),
        "observed_peak_mib": (figure * 1.12).round(), "environment": "team-a"});
    let posted = app
        .post_json("/v1/calibration/observations", &observation)
        .await;
    assert_eq!(posted.status(), 200);
    let metrics = app.get("/metrics").await.text().await.unwrap();
    let series = "gpucast_calibration_observed_over_estimated";
    let labels = "environment=\"team-a\",gpu=\"h100-80gb\"";
    assert_eq!(
        counter(&metrics, &format!("{series}_count{{{labels}}}")),
        1.0,
        "{metrics}"
    );
    // The ratio is against the uncalibrated figure: between 1.1 and 1.15 here.
    let at = |le: &str| {
        counter(
            &metrics,
            &format!("{series}_bucket{{{labels},le=\"{le}\"}}"),
        )
    };
    assert_eq!((at("1.1"), at("1.15")), (0.0, 1.0), "{metrics}");

    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("deploy/grafana/gpucast.json")).unwrap(),
    )
    .unwrap();
    let mut read = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap_or_default();
            for name in expr
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("gpucast_"))
            {
                let family = ["_bucket", "_count", "_sum"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s))
                    .unwrap_or(name);
                assert!(
                    metrics.contains(&format!("# TYPE {family} ")),
                    "panel {}: {name} is not exported",
                    panel["title"]
                );
                read += 1;
            }
        }
    }
    assert!(read > 10, "{read} series read");
}
