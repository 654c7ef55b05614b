//! Jobs from a Hugging Face `config.json` alone (issue 16): the Rust-built model against
//! describe's simulation of the same configuration built in transformers on meta tensors
//! (tests/fixtures/transformer_configs/, made by its simulate.py), and through the API.
//! `cargo test --test api transformer_config -- --nocapture` prints the table.

use serde_json::{json, Value};

use gpucast::api::types::EstimateRequest;
use gpucast::engine::validate::to_job_noting;
use gpucast::physics::step::analytic_step;

use crate::helpers::{repo_root, spawn_app};

fn fixtures() -> std::path::PathBuf {
    repo_root().join("tests/fixtures/transformer_configs")
}

pub fn config(name: &str) -> Value {
    let text = std::fs::read_to_string(fixtures().join(format!("{name}.json"))).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The request describe's case stands for.
fn request(case: &Value) -> Value {
    let mut body = json!({
        "transformer_config": config(case["config"].as_str().unwrap()),
        "seq_len": case["seq_len"],
        "batch_size": case["batch_size"],
    });
    for (key, value) in case["setup"].as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

const MIB: f64 = 1024.0 * 1024.0;

#[test]
fn config_jobs_agree_with_describes_simulation_per_category_within_5_percent() {
    let text = std::fs::read_to_string(fixtures().join("simulations.json")).unwrap();
    let cases: serde_json::Map<String, Value> = serde_json::from_str(&text).unwrap();
    assert!(cases.len() >= 10, "{} cases", cases.len());
    let mut failures = Vec::new();
    println!(
        "| case | parameters (count) | weights MiB rust / sim | gradients MiB | optimizer state MiB | activations MiB | temporaries MiB |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for (name, case) in &cases {
        let request: EstimateRequest = serde_json::from_value(request(case)).unwrap();
        let (job, _) = to_job_noting(&request).unwrap_or_else(|e| panic!("{name}: {e:?}"));
        let step = analytic_step(&job);
        let sim = &case["simulation"]["breakdown_at_peak"];
        let storage = job.precision().storage_bytes();
        let rust_params: u64 = job.layers().iter().map(|l| l.params).sum();
        let sim_params = case["params"].as_u64().unwrap();
        let sim_trainable = case["trainable_params"].as_f64().unwrap();
        // At the simulated peak (the start of backward, set_to_none before) no gradient is
        // alive: the gradients compared are all of them, as the optimizer's step holds them.
        let rows = [
            ("parameters", rust_params as f64, sim_params as f64),
            (
                "weights",
                step.parameters,
                sim["parameters"].as_f64().unwrap(),
            ),
            (
                "gradients",
                step.trainable_params * storage,
                sim_trainable * storage,
            ),
            (
                "optimizer_state",
                step.optimizer_state,
                sim["optimizer_state"].as_f64().unwrap(),
            ),
            (
                "activations",
                step.activations,
                sim["activations"].as_f64().unwrap(),
            ),
        ];
        let mut cells = Vec::new();
        for (category, rust, simulated) in rows {
            let error = rust / simulated - 1.0;
            let cell = if category == "parameters" {
                format!("{rust:.0} / {simulated:.0} ({:+.1} %)", 100.0 * error)
            } else {
                format!(
                    "{:.1} / {:.1} ({:+.1} %)",
                    rust / MIB,
                    simulated / MIB,
                    100.0 * error
                )
            };
            cells.push(cell);
            if error.abs() > 0.05 {
                failures.push(format!("{name} {category}: {:+.1} %", 100.0 * error));
            }
        }
        let temporaries = sim["temporaries"].as_f64().unwrap();
        cells.push(format!(
            "{:.1} / {:.1}",
            step.temporaries / MIB,
            temporaries / MIB
        ));
        println!("| {name} | {} |", cells.join(" | "));
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[tokio::test]
async fn a_transformer_config_is_answered_by_the_analytic_step_with_its_named_layers() {
    let app = spawn_app().await;
    let body = json!({
        "transformer_config": config("llama"),
        "seq_len": 512,
        "batch_size": 4,
        "precision": "amp_bf16",
        "lora": {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    });
    let response = app.post_json("/v1/estimate", &body).await;
    assert_eq!(response.status(), 200);
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["family"], "transformer");
    assert_eq!(answer["memory"]["breakdown_source"], "training_step");
    assert_eq!(answer["setup"]["learned_estimators_apply"], false);
    // 4 layers x (q, v) adapters of rank 8: 8 x (512 + 512) + 8 x (512 + 128).
    assert_eq!(answer["setup"]["lora_params"], 4 * (8 * 1024 + 8 * 640));
    assert!(answer["performance"]["step_time_ms"].as_f64().unwrap() > 0.0);
}

#[tokio::test]
async fn a_config_missing_essentials_is_refused_naming_them() {
    let app = spawn_app().await;
    let body = json!({
        "transformer_config": {"model_type": "llama", "hidden_size": 4096, "torch_dtype": "bfloat16"},
        "seq_len": 512,
        "batch_size": 4,
    });
    let response = app.post_json("/v1/estimate", &body).await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    let detail = problem["detail"].as_str().unwrap();
    for key in [
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
        "intermediate_size",
    ] {
        assert!(detail.contains(key), "{detail}");
    }
    // Hostile sizes are bounded, and a config needs seq_len.
    for (config, field) in [
        (
            json!({"hidden_size": 1_000_000, "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 10, "intermediate_size": 8}),
            "hidden_size",
        ),
        (
            json!({"hidden_size": 64, "num_hidden_layers": 100000, "num_attention_heads": 2, "vocab_size": 10, "intermediate_size": 8}),
            "num_hidden_layers",
        ),
        (
            json!({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 1e12, "intermediate_size": 8}),
            "vocab_size",
        ),
        (
            json!({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 10, "intermediate_size": 8, "num_local_experts": 100000}),
            "num_local_experts",
        ),
        (
            json!({"hidden_size": "big", "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 10, "intermediate_size": 8}),
            "hidden_size",
        ),
    ] {
        let body = json!({"transformer_config": config, "seq_len": 64, "batch_size": 1});
        let response = app.post_json("/v1/estimate", &body).await;
        assert_eq!(response.status(), 422, "{field}");
        let problem: Value = response.json().await.unwrap();
        assert!(
            problem["detail"].as_str().unwrap().contains(field),
            "{problem}"
        );
    }
    let body = json!({"transformer_config": config("gpt2"), "batch_size": 1});
    let response = app.post_json("/v1/estimate", &body).await;
    assert_eq!(response.status(), 422);
    // 512-expert MoE layers are one fused module each (as transformers 5 builds them); 512
    // of them make more modules than a job may have: a 422 that says so.
    let moe = |layers: u64| json!({"transformer_config": {"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": layers, "num_attention_heads": 2, "vocab_size": 10, "intermediate_size": 8, "num_local_experts": 512}, "seq_len": 1_000_000, "batch_size": 1});
    let response = app.post_json("/v1/estimate", &moe(400)).await;
    assert_eq!(response.status(), 200);
    let response = app.post_json("/v1/estimate", &moe(512)).await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    assert!(
        problem["detail"].as_str().unwrap().contains("4096"),
        "{problem}"
    );
}

/// The public runs of LLMs (data/public/setup_jobs.jsonl.gz) from their configurations alone:
/// each row's setup with `transformer_config` (tests/fixtures/transformer_configs/public/, the
/// published config.json values) instead of its traced layers, answered by the service and
/// compared like with like as `public_setups` does. Prints the median error per architecture
/// and per setup family.
#[tokio::test]
async fn public_llm_rows_are_answered_from_their_configs() {
    use std::collections::BTreeMap;

    use crate::helpers::median;
    use crate::public_setups::like_with_like;

    let app = spawn_app().await;
    let rows = crate::helpers::jsonl_gz("data/public/setup_jobs.jsonl.gz");
    let mut by_architecture: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut by_family: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut refused = Vec::new();
    let mut all = Vec::new();
    for line in &rows {
        let architecture = line["architecture"].as_str().unwrap_or_default();
        let path = fixtures()
            .join("public")
            .join(format!("{}.json", architecture.replace('/', "__")));
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let mut job = line["job"].clone();
        let object = job.as_object_mut().unwrap();
        let seq_len = object["input_shape"][0].clone();
        for key in [
            "layers",
            "saved_tensors",
            "simulation",
            "summary",
            "input_shape",
            "family",
        ] {
            object.remove(key);
        }
        object.insert(
            "transformer_config".into(),
            serde_json::from_str(&text).unwrap(),
        );
        object.insert("seq_len".into(), seq_len);
        let response = app.post_json("/v1/estimate", &job).await;
        let status = response.status();
        let answer: Value = response.json().await.unwrap();
        if status != 200 {
            refused.push(format!(
                "row {} {architecture}: {}",
                line["row"], answer["detail"]
            ));
            continue;
        }
        let measured = line["measured_mib"].as_f64().unwrap();
        let Some((figure, _)) = like_with_like(line["compare"].as_str().unwrap(), &answer) else {
            continue;
        };
        let error = figure / measured - 1.0;
        if std::env::var("GPUCAST_PUBLIC_ROWS").is_ok() {
            println!(
                "row {} {architecture} {}: measured {measured:.0}, config {figure:.0} ({:+.1} %)",
                line["row"],
                line["families"],
                100.0 * error
            );
        }
        all.push(error.abs());
        by_architecture
            .entry(architecture.to_string())
            .or_default()
            .push(error);
        for family in line["families"].as_array().unwrap() {
            by_family
                .entry(family.as_str().unwrap().to_string())
                .or_default()
                .push(error);
        }
    }
    let print = |title: &str, groups: &BTreeMap<String, Vec<f64>>| {
        println!("| {title} | rows | median abs error | median signed |");
        println!("| --- | --- | --- | --- |");
        for (name, errors) in groups {
            println!(
                "| {name} | {} | {:.1} % | {:+.1} % |",
                errors.len(),
                100.0 * median(errors.iter().map(|e| e.abs()).collect()),
                100.0 * median(errors.clone())
            );
        }
    };
    print("architecture", &by_architecture);
    print("setup family", &by_family);
    println!(
        "all {} rows answered from their configs: median abs error {:.1} %; {} refused: {refused:#?}",
        all.len(),
        100.0 * median(all.clone()),
        refused.len()
    );
    assert!(all.len() >= 80, "{} rows", all.len());
}

/// A config.json as the hub serves it (`architectures`, `torch_dtype`, `_name_or_path` and
/// all), the setup beside its keys: answered as the same config under `transformer_config`,
/// alone and as a batch item.
#[tokio::test]
async fn a_bare_hub_config_with_the_setup_beside_it_is_a_request() {
    let app = spawn_app().await;
    let mut config = config("public/meta-llama__Llama-3.2-1B");
    config["_name_or_path"] = "meta-llama/Llama-3.2-1B".into();
    config["transformers_version"] = "4.45.0".into();
    let setup = json!({"batch_size": 4, "seq_len": 1024, "precision": "bf16", "gpu": "rtx4090"});
    let mut bare = config.clone();
    for (k, v) in setup.as_object().unwrap() {
        bare[k] = v.clone();
    }
    let mut wrapped = setup.clone();
    wrapped["transformer_config"] = config;
    let from_bare: Value = app.post_json_value("/v1/estimate", &bare).await;
    let from_wrapped: Value = app.post_json_value("/v1/estimate", &wrapped).await;
    assert!(
        from_bare["memory"]["estimate_mib"].as_f64().is_some(),
        "{from_bare}"
    );
    assert_eq!(from_bare["memory"], from_wrapped["memory"]);
    assert_eq!(from_bare["fit"]["gpu"], "rtx-4090");
    let batch: Value = app
        .post_json_value("/v1/estimate/batch", &json!({"items": [bare]}))
        .await;
    assert_eq!(
        batch["items"][0]["estimate"]["memory"],
        from_wrapped["memory"]
    );
    // Not a config: the unknown field is still named.
    let response = app
        .post_json("/v1/estimate", &json!({"batch_size": 4, "hidden_sizes": 3}))
        .await;
    assert_eq!(response.status(), 422);
}
