//! The admission webhook as users run it (issue 46): a distributed job's world size from the
//! GPUs its pods ask for, and every decision counted in `/metrics`.

use serde_json::{json, Value};

use crate::helpers::{models_dir, spawn_app_with, test_config, TestApp};

const ROUTE: &str = "/v1/kubernetes/admission";

async fn admission_app() -> TestApp {
    let mut config = test_config(&models_dir());
    config.admission = true;
    config.admission_products = ["NVIDIA-A100-SXM4-80GB", "NVIDIA-H100-80GB-HBM3", "Tesla-T4"]
        .iter()
        .map(|p| p.to_string())
        .collect();
    spawn_app_with(config).await
}

/// A review of `object`, a `kind` (group, kind) being created.
fn review(kind: (&str, &str), object: Value) -> Value {
    let (group, kind) = kind;
    let version = "v1";
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "b6e6e2b1-0000-4000-8000-000000000046",
            "kind": {"group": group, "version": version, "kind": kind},
            "resource": {"group": group, "version": version, "resource": format!("{}s", kind.to_lowercase())},
            "operation": "CREATE",
            "namespace": "team-a",
            "object": object,
        }
    })
}

/// A pod (template) of one container asking for `gpus`, annotated with `job`.
fn pod(job: &Value, gpus: u64) -> Value {
    json!({
        "metadata": {"annotations": {"gpucast.dev/job": job.to_string()}},
        "spec": {"containers": [{"name": "trainer", "image": "trainer:1",
            "resources": {"limits": {"nvidia.com/gpu": gpus.to_string()}}}]}
    })
}

/// Full fine-tuning of Llama-3-8B with FSDP, no world size stated: the pods say it.
fn fsdp_job() -> Value {
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(
            crate::helpers::repo_root()
                .join("tests/fixtures/transformer_configs/public/meta-llama__Meta-Llama-3-8B.json"),
        )
        .unwrap(),
    )
    .unwrap();
    json!({"transformer_config": config, "seq_len": 2048, "batch_size": 1,
        "precision": "bf16", "activation_checkpointing": "full",
        "parallelism": {"strategy": "fsdp"}})
}

async fn response(app: &TestApp, review: &Value) -> Value {
    let answer = app.post_json(ROUTE, review).await;
    assert_eq!(answer.status(), 200);
    let body: Value = answer.json().await.unwrap();
    body["response"].clone()
}

#[tokio::test]
async fn a_pod_of_8_gpus_with_fsdp_is_placed_at_world_size_8() {
    let app = admission_app().await;
    let job = fsdp_job();
    let mut object = pod(&job, 8);
    object["apiVersion"] = "v1".into();
    object["kind"] = "Pod".into();
    let answer = response(&app, &review(("", "Pod"), object)).await;
    assert_eq!(answer["allowed"], true, "{answer}");
    assert!(answer["patch"].is_string(), "{answer}");
    // The same job at world size 8 through /v1/estimate gives the annotated figure.
    let mut at_8 = job.clone();
    at_8["parallelism"]["world_size"] = json!(8);
    at_8["gpu"] = json!("h100-80gb");
    let estimate = app.post_json_value("/v1/estimate", &at_8).await;
    let figure = estimate["memory"]["estimate_mib"].as_f64().unwrap().ceil();
    let warnings = answer["warnings"].as_array().unwrap();
    assert!(
        warnings
            .iter()
            .any(|w| w.as_str().unwrap().contains(&format!("{figure:.0} MiB"))),
        "{figure}: {answer}"
    );
}

#[tokio::test]
async fn a_job_of_2_replicas_of_4_gpus_runs_on_8() {
    let app = admission_app().await;
    let job = fsdp_job();
    let object = json!({"apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "train"},
        "spec": {"parallelism": 2, "template": pod(&job, 4)}});
    let answer = response(&app, &review(("batch", "Job"), object)).await;
    assert_eq!(answer["allowed"], true, "{answer}");
    let pytorch = json!({"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": "train"},
        "spec": {"pytorchReplicaSpecs": {
            "Master": {"replicas": 1, "template": pod(&job, 4)},
            "Worker": {"replicas": 1, "template": pod(&job, 4)}}}});
    let from_pytorch = response(&app, &review(("kubeflow.org", "PyTorchJob"), pytorch)).await;
    assert_eq!(from_pytorch["allowed"], true, "{from_pytorch}");
    assert_eq!(
        from_pytorch["warnings"][0]
            .as_str()
            .map(|w| w.split(": ").nth(2)),
        answer["warnings"][0].as_str().map(|w| w.split(": ").nth(2))
    );
}

fn decisions(metrics: &str, decision: &str) -> f64 {
    let key = format!("gpucast_admission_decisions_total{{decision=\"{decision}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&key))
        .unwrap_or_else(|| panic!("no {key} in /metrics"))
        .trim()
        .parse()
        .unwrap()
}

#[tokio::test]
async fn decisions_and_denials_are_counted_in_metrics() {
    let app = admission_app().await;
    let metrics = app.get("/metrics").await.text().await.unwrap();
    for decision in ["placed", "allowed", "denied"] {
        assert_eq!(decisions(&metrics, decision), 0.0, "{decision}");
    }
    // Placed: the FSDP job on 8 GPUs.
    let mut placed = pod(&fsdp_job(), 8);
    placed["kind"] = "Pod".into();
    assert_eq!(
        response(&app, &review(("", "Pod"), placed)).await["allowed"],
        true
    );
    // Allowed as it is: no annotation.
    let plain = json!({"kind": "Pod", "spec": {"containers": []}});
    assert_eq!(
        response(&app, &review(("", "Pod"), plain)).await["allowed"],
        true
    );
    // Denied: full fine-tuning of Llama-3-8B on one GPU fits no card of the cluster.
    let mut alone = fsdp_job();
    alone.as_object_mut().unwrap().remove("parallelism");
    let mut denied = pod(&alone, 1);
    denied["kind"] = "Pod".into();
    let answer = response(&app, &review(("", "Pod"), denied)).await;
    assert_eq!(answer["allowed"], false, "{answer}");
    let metrics = app.get("/metrics").await.text().await.unwrap();
    assert_eq!(decisions(&metrics, "placed"), 1.0);
    assert_eq!(decisions(&metrics, "allowed"), 1.0);
    assert_eq!(decisions(&metrics, "denied"), 1.0);
}
