//! Host memory: what an offloading job's ranks keep on the CPU (`setup.offload.host_memory_mib`),
//! as DeepSpeed's ZeRO-Offload holds it, and a node's host memory checked by the placement.

use serde_json::{json, Value};

use crate::helpers::{repo_root, spawn_app, TestApp};

const MIB: f64 = 1024.0 * 1024.0;

fn read(path: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(repo_root().join(path)).unwrap()).unwrap()
}

/// The transformers docs' ZeRO-2 or ZeRO-3 offload recipe: T0-3B on 2 GPUs, fp16, AdamW.
fn recipe(stage: &str) -> Value {
    let folder = format!("tests/fixtures/recipes/transformers-docs-{stage}-offload");
    json!({
        "transformer_config": read("tests/fixtures/transformer_configs/public/bigscience__T0_3B.json"),
        "seq_len": 512,
        "batch_size": 2,
        "parallelism": {"world_size": 2},
        "deepspeed": read(&format!("{folder}/deepspeed.json")),
        "training_arguments": read(&format!("{folder}/training_args.json")),
        "gpu": "a100-80gb",
    })
}

async fn offload_of(app: &TestApp, job: &Value) -> Value {
    let answer = app.post_json_value("/v1/estimate", job).await;
    answer["setup"]["offload"].clone()
}

#[tokio::test]
async fn zero_offload_holds_deepspeeds_bytes_per_parameter_on_the_host() {
    let app = spawn_app().await;
    // DeepSpeed's estimators: 16 bytes a parameter with the optimizer offloaded (fp32 master
    // 4, Adam's two moments 8, the fp32 gradient partition 4), 18 with the parameters too
    // (fp16 weights 2), over the ranks.
    for (stage, bytes) in [("zero2", 16.0), ("zero3", 18.0)] {
        let job = recipe(stage);
        let answer = app.post_json_value("/v1/estimate", &job).await;
        let offload = &answer["setup"]["offload"];
        let params = answer["setup"]["trainable_params"].as_f64().unwrap();
        let per_rank = params / 2.0 * bytes / MIB;
        let host = offload["host_memory_mib"]
            .as_f64()
            .unwrap_or_else(|| panic!("{offload}"));
        assert!(
            (host - per_rank).abs() < 1.0,
            "{stage}: {host} against {per_rank}"
        );
        let parts = &offload["host_breakdown"];
        let sum: f64 = ["optimizer_state", "gradients", "parameters"]
            .iter()
            .map(|k| parts[k].as_f64().unwrap())
            .sum();
        assert!((sum - host).abs() < 0.5, "{offload}");
    }
}

#[tokio::test]
async fn a_job_without_offload_has_no_host_figure() {
    let app = spawn_app().await;
    let mut job = recipe("zero2");
    job["deepspeed"]["zero_optimization"]
        .as_object_mut()
        .unwrap()
        .remove("offload_optimizer");
    let offload = offload_of(&app, &job).await;
    assert!(offload.get("host_memory_mib").is_none(), "{offload}");
}

#[tokio::test]
async fn a_node_too_small_for_the_offload_does_not_fit() {
    let app = spawn_app().await;
    let job = recipe("zero3");
    let alone = app.post_json_value("/v1/estimate", &job).await;
    assert_eq!(alone["fit"]["fits"], true, "{alone}");
    assert!(alone["fit"].get("host").is_none());
    let per_gpu = alone["setup"]["offload"]["host_memory_mib"]
        .as_f64()
        .unwrap();

    let mut small = job.clone();
    small["node"] = json!({"memory_mib": 32768});
    let answer = app.post_json_value("/v1/estimate", &small).await;
    let host = &answer["fit"]["host"];
    assert_eq!(host["gpus"], 2, "{answer}");
    assert!((host["needed_mib"].as_f64().unwrap() - 2.0 * per_gpu).abs() < 0.2);
    assert_eq!(host["fits"], false);
    assert_eq!(answer["fit"]["fits"], false);
    assert!(answer["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .any(|w| w.as_str().unwrap().starts_with("node:")));

    let mut large = job.clone();
    large["node"] = json!({"memory_mib": 131072, "gpus": 2});
    let answer = app.post_json_value("/v1/estimate", &large).await;
    assert_eq!(answer["fit"]["host"]["fits"], true, "{answer}");
    assert_eq!(answer["fit"]["fits"], true);
}

#[tokio::test]
async fn a_node_with_more_gpus_than_the_job_is_refused() {
    let app = spawn_app().await;
    let mut job = recipe("zero3");
    job["node"] = json!({"memory_mib": 131072, "gpus": 4});
    let response = app.post_json("/v1/estimate", &job).await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    assert!(problem["detail"].as_str().unwrap().starts_with("node.gpus"));
}
