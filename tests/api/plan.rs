//! `POST /v1/plan`: the reverse question, answered as a search over the estimates
//! `/v1/estimate` gives, so that a plan agrees with a bisection done by hand.

use serde_json::{json, Value};

use crate::helpers::{example_job, repo_root, spawn_app, spawn_app_with, test_config, TestApp};

/// QLoRA of Llama-3-8B on an RTX 4090 at 2048 tokens (the README's job at micro-batch 1).
fn llama_qlora_4090() -> Value {
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(
            repo_root()
                .join("tests/fixtures/transformer_configs/public/meta-llama__Meta-Llama-3-8B.json"),
        )
        .unwrap(),
    )
    .unwrap();
    json!({
        "transformer_config": config,
        "seq_len": 2048, "batch_size": 1, "precision": "bf16",
        "activation_checkpointing": "full",
        "lora": {"rank": 16, "alpha": 32, "target_modules": "all-linear", "base_weights": "nf4"},
        "gpu": "rtx-4090",
    })
}

/// Whether `/v1/estimate` says the job fits at micro-batch `m`.
async fn fits_at(app: &TestApp, job: &Value, m: u64) -> bool {
    let mut at = job.clone();
    at["micro_batch_size"] = json!(m);
    at["batch_size"] = json!(m);
    let answer = app.post_json_value("/v1/estimate", &at).await;
    answer["fit"]["fits"]
        .as_bool()
        .unwrap_or_else(|| panic!("{answer}"))
}

/// The largest micro-batch `/v1/estimate` says fits, bisected by hand (1 known to fit).
async fn bisected(app: &TestApp, job: &Value, max: u64) -> u64 {
    let (mut low, mut high) = (1, max + 1);
    while high - low > 1 {
        let middle = (low + high) / 2;
        if fits_at(app, job, middle).await {
            low = middle;
        } else {
            high = middle;
        }
    }
    low
}

#[tokio::test]
async fn the_largest_micro_batch_agrees_with_a_bisection_over_the_estimate_route() {
    let app = spawn_app().await;
    let job = llama_qlora_4090();
    let response = app
        .post_json("/v1/plan", &json!({"job": job, "setups": false}))
        .await;
    assert_eq!(response.status(), 200);
    let plan: Value = response.json().await.unwrap();
    let row = &plan["cards"][0];
    assert_eq!(row["gpu"], "rtx-4090");
    assert_eq!(plan["confidence"], 0.95);
    let largest = row["largest_micro_batch"].as_u64().expect("one fits");
    assert_eq!(largest, bisected(&app, &job, 64).await, "{plan}");
    assert!(fits_at(&app, &job, largest).await);
    assert!(!fits_at(&app, &job, largest + 1).await);
    // At the largest, the plan's figures are the estimate's there.
    let mut at = job.clone();
    at["micro_batch_size"] = json!(largest);
    at["batch_size"] = json!(largest);
    let answer = app.post_json_value("/v1/estimate", &at).await;
    assert_eq!(
        row["at_largest"]["upper_bound_mib"],
        answer["memory"]["upper_bound_mib"]
    );
    // A search, not a sweep: the job, doubling and bisecting back.
    let estimates = plan["estimates"].as_u64().unwrap();
    assert!(estimates <= 20, "{estimates} estimates");
}

#[tokio::test]
async fn a_plan_on_a_list_names_the_smallest_card_the_job_fits() {
    let app = spawn_app().await;
    let mut job = llama_qlora_4090();
    job["gpu"] = json!(["h100-80gb", "rtx-4090", {"name": "lab-card", "capacity_mib": 12000}]);
    let plan = app
        .post_json_value("/v1/plan", &json!({"job": job, "setups": false}))
        .await;
    let cards: Vec<&str> = plan["cards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["gpu"].as_str().unwrap())
        .collect();
    assert_eq!(cards[..2], ["h100-80gb", "rtx-4090"], "{plan}");
    // 12,000 MiB cannot hold the job; the 4090 is the smallest card that does.
    assert_eq!(plan["cards"][2]["fits"], false, "{plan}");
    assert_eq!(plan["smallest_fitting_gpu"], "rtx-4090", "{plan}");
    let (h100, rtx) = (&plan["cards"][0], &plan["cards"][1]);
    assert!(
        h100["largest_micro_batch"].as_u64() > rtx["largest_micro_batch"].as_u64(),
        "{plan}"
    );
}

#[tokio::test]
async fn a_dtype_sweep_is_one_plan_with_a_row_per_precision() {
    let app = spawn_app().await;
    let mut job = llama_qlora_4090();
    job.as_object_mut().unwrap().remove("precision");
    let plan = app
        .post_json_value(
            "/v1/plan",
            &json!({"job": job, "precisions": ["fp32", "bf16"], "setups": false}),
        )
        .await;
    let rows = plan["cards"].as_array().unwrap();
    let precisions: Vec<&str> = rows
        .iter()
        .map(|r| r["precision"].as_str().unwrap())
        .collect();
    assert_eq!(precisions, ["fp32", "bf16"], "{plan}");
    // fp32 holds more per sample: its largest micro-batch is no larger.
    let largest = |r: &Value| r["largest_micro_batch"].as_u64().unwrap_or(0);
    assert!(largest(&rows[0]) <= largest(&rows[1]), "{plan}");
}

#[tokio::test]
async fn the_longest_sequence_fits_and_one_more_step_does_not() {
    let app = spawn_app().await;
    let job = llama_qlora_4090();
    let plan = app
        .post_json_value(
            "/v1/plan",
            &json!({"job": job, "max_seq_len": 65536, "setups": false}),
        )
        .await;
    let longest = plan["seq_len"]["longest_seq_len"]
        .as_u64()
        .unwrap_or_else(|| panic!("{plan}"));
    assert!(longest >= 2048, "{plan}");
    let at = |s: u64| {
        let mut at = job.clone();
        at["seq_len"] = json!(s);
        at
    };
    let fits = app.post_json_value("/v1/estimate", &at(longest)).await;
    let beyond = app.post_json_value("/v1/estimate", &at(longest + 1)).await;
    assert_eq!(fits["fit"]["fits"], true);
    assert_eq!(beyond["fit"]["fits"], false);
}

#[tokio::test]
async fn the_setups_that_make_a_job_fit_are_ranked_fitting_first_by_time_per_sample() {
    let app = spawn_app().await;
    // Full fine-tuning of Llama-3-8B on 8 A100 80GB with DDP at 4096 tokens does not fit.
    let mut job = llama_qlora_4090();
    let object = job.as_object_mut().unwrap();
    object.remove("lora");
    object.remove("activation_checkpointing");
    object.insert("seq_len".into(), json!(4096));
    object.insert("gpu".into(), json!("a100-80gb"));
    object.insert(
        "parallelism".into(),
        json!({"strategy": "ddp", "world_size": 8}),
    );
    let plan = app.post_json_value("/v1/plan", &json!({"job": job})).await;
    let setups = plan["setups"]
        .as_array()
        .unwrap_or_else(|| panic!("{plan}"));
    let names: Vec<&str> = setups
        .iter()
        .map(|s| s["setup"].as_str().unwrap())
        .collect();
    for name in ["as_given", "activation_checkpointing", "lora", "zero3"] {
        assert!(names.contains(&name), "{name}: {plan}");
    }
    let given = setups.iter().find(|s| s["setup"] == "as_given").unwrap();
    assert_eq!(given["fits"], false, "{plan}");
    assert_eq!(setups[0]["fits"], true, "{plan}");
    let ranks: Vec<u64> = setups.iter().map(|s| s["rank"].as_u64().unwrap()).collect();
    assert_eq!(ranks, (1..=setups.len() as u64).collect::<Vec<_>>());
    let fitting: Vec<f64> = setups
        .iter()
        .filter(|s| s["fits"] == true)
        .map(|s| s["ms_per_sample"].as_f64().unwrap())
        .collect();
    assert!(fitting.windows(2).all(|w| w[0] <= w[1]), "{plan}");
    // An offloading setup says what it holds on the host, and pays for it in time: the CPU
    // steps the optimizer over its state (GBs of it here) while the GPU waits, so it is not
    // ranked as if free.
    let offload = setups
        .iter()
        .find(|s| s["setup"] == "offload_optimizer")
        .unwrap_or_else(|| panic!("{plan}"));
    assert!(
        offload["host_memory_mib"].as_f64().unwrap() > 0.0,
        "{offload}"
    );
    let per_sample = |s: &Value| s["ms_per_sample"].as_f64().unwrap();
    assert!(per_sample(offload) > 1.5 * per_sample(given), "{plan}");
    // Each figure is the estimate of the job with that change.
    let zero3 = setups.iter().find(|s| s["setup"] == "zero3").unwrap();
    let mut changed = job.clone();
    changed["parallelism"]["strategy"] = json!("zero3");
    let answer = app.post_json_value("/v1/estimate", &changed).await;
    assert_eq!(
        zero3["upper_bound_mib"],
        answer["memory"]["upper_bound_mib"]
    );
}

#[tokio::test]
async fn a_plan_priced_above_the_budget_is_refused_before_any_work() {
    let mut config = test_config(&crate::helpers::models_dir());
    config.max_request_cost = 100_000;
    let app = spawn_app_with(config).await;
    let response = app
        .post_json(
            "/v1/plan",
            &json!({"job": llama_qlora_4090(), "catalogue": true, "max_micro_batch": 1048576}),
        )
        .await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    let detail = problem["detail"].as_str().unwrap();
    assert!(
        detail.starts_with("the plan's") && detail.contains("above the budget"),
        "{detail}"
    );
}

#[tokio::test]
async fn a_bad_plan_names_its_field() {
    let app = spawn_app().await;
    for (body, field) in [
        (
            json!({"job": example_job(), "max_micro_batch": 0}),
            "max_micro_batch",
        ),
        (
            json!({"job": llama_qlora_4090(), "max_seq_len": 1_000_001}),
            "max_seq_len",
        ),
        (json!({"job": {"batch_size": "many"}}), "job.batch_size"),
        (
            json!({"job": example_job(), "precisions": []}),
            "precisions",
        ),
        (json!({"job": example_job(), "sweep": true}), "sweep"),
    ] {
        let response = app.post_json("/v1/plan", &body).await;
        assert_eq!(response.status(), 422, "{body}");
        let problem: Value = response.json().await.unwrap();
        assert!(
            problem["detail"].as_str().unwrap().contains(field),
            "{field}: {problem}"
        );
    }
}

/// A job without a sequence has none to free: `max_seq_len` is left out with a warning (the
/// schema cannot say which jobs have one), and the batch is still searched.
#[tokio::test]
async fn max_seq_len_on_a_job_without_a_sequence_is_left_out_and_said() {
    let app = spawn_app().await;
    let body = json!({"job": example_job(), "max_seq_len": 64, "setups": false});
    let response = app.post_json("/v1/plan", &body).await;
    assert_eq!(response.status(), 200);
    let plan: Value = response.json().await.unwrap();
    assert!(
        plan["warnings"].to_string().contains("max_seq_len"),
        "{plan}"
    );
    assert!(plan["cards"][0]["largest_micro_batch"].as_u64().unwrap() >= 1);
    assert!(plan["cards"][0]["longest_seq_len"].is_null(), "{plan}");
}

/// A plan's search points are not answers anyone asked for: the class counter and the
/// estimators' time count requests, so a plan of many estimates leaves them as they were.
#[tokio::test]
async fn a_plans_search_points_are_not_counted_as_answers() {
    let app = spawn_app().await;
    let classes = |text: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with("gpucast_predicted_class_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let before = classes(&app.get("/metrics").await.text().await.unwrap());
    let plan = app
        .post_json_value("/v1/plan", &json!({"job": example_job()}))
        .await;
    assert!(plan["estimates"].as_u64().unwrap() > 1, "{plan}");
    let after_plan = classes(&app.get("/metrics").await.text().await.unwrap());
    assert_eq!(after_plan, before);
    assert_eq!(
        app.post_json("/v1/estimate", &example_job()).await.status(),
        200
    );
    let after_estimate = classes(&app.get("/metrics").await.text().await.unwrap());
    assert_eq!(after_estimate, before + 1.0);
}
