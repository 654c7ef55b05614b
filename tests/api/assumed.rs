//! What a request leaves unsaid (issue 33, part 2): each field an analytic step's answer
//! assumes is listed with the figure's range over the values it could take, that range is the
//! figure answered with the other value, and a request that states the field drops it.

use serde_json::{json, Value};

use crate::helpers::{held_out_mlp_jobs, spawn_app};
use crate::transformer_config::config;

/// Llama-3.2-1B-shaped QLoRA at 2,048 tokens: a 128k vocabulary, where the loss matters.
fn llama_job() -> Value {
    json!({
        "transformer_config": config("llama"),
        "seq_len": 2048, "batch_size": 4, "precision": "bf16", "optimizer": "adamw",
        "lora": {"rank": 16, "alpha": 32, "target_modules": "all-linear", "base_weights": "nf4"},
    })
}

fn with(mut job: Value, key: &str, value: Value) -> Value {
    job[key] = value;
    job
}

fn assumed(answer: &Value) -> Vec<Value> {
    answer["memory"]["uncertainty"]["assumed"]
        .as_array()
        .unwrap_or_else(|| panic!("memory.uncertainty.assumed in {answer}"))
        .clone()
}

fn field<'a>(list: &'a [Value], name: &str) -> Option<&'a Value> {
    list.iter().find(|a| a["field"] == name)
}

fn mib(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[tokio::test]
async fn an_unstated_loss_is_listed_with_the_figures_of_its_other_values() {
    let app = spawn_app().await;
    let answer = app.post_json_value("/v1/estimate", &llama_job()).await;
    let list = assumed(&answer);
    let loss = field(&list, "loss_implementation").unwrap_or_else(|| panic!("{answer}"));
    assert_eq!(loss["assumed"], "upcast_fp32");
    let estimate = mib(&answer["memory"]["estimate_mib"]);
    // The assumed loss is the one that keeps the most: the figure is the range's top, and the
    // fused loss's figure its bottom.
    assert!(
        (mib(&loss["high_mib"]) - estimate).abs() <= 0.2,
        "{loss} vs {estimate}"
    );
    let fused = app
        .post_json_value(
            "/v1/estimate",
            &with(llama_job(), "loss_implementation", json!("fused")),
        )
        .await;
    let fused_estimate = mib(&fused["memory"]["estimate_mib"]);
    assert!(
        fused_estimate < estimate - 100.0,
        "{fused_estimate} vs {estimate}"
    );
    assert!(
        (mib(&loss["low_mib"]) - fused_estimate).abs() <= 0.2,
        "{loss} vs the fused answer {fused_estimate}"
    );
    // Widest first.
    let widths: Vec<f64> = list
        .iter()
        .map(|a| mib(&a["high_mib"]) - mib(&a["low_mib"]))
        .collect();
    assert!(widths.windows(2).all(|w| w[0] >= w[1]), "{widths:?}");
}

#[tokio::test]
async fn a_request_that_states_every_field_is_bounded_by_model_error_alone() {
    let app = spawn_app().await;
    let unstated = app.post_json_value("/v1/estimate", &llama_job()).await;
    let stated_job = with(
        with(llama_job(), "loss_implementation", json!("upcast_fp32")),
        "optimizer_implementation",
        json!("foreach"),
    );
    let stated = app.post_json_value("/v1/estimate", &stated_job).await;
    // The same values, so the same figure; nothing left open.
    assert_eq!(
        unstated["memory"]["estimate_mib"],
        stated["memory"]["estimate_mib"]
    );
    let u = &stated["memory"]["uncertainty"];
    assert!(assumed(&stated).is_empty(), "{u}");
    assert_eq!(mib(&u["assumed_log_range"]), 0.0);
    assert_eq!(mib(&u["assumed_factor"]), 1.0);
    let range = mib(&unstated["memory"]["uncertainty"]["assumed_log_range"]);
    assert!(range > 0.05, "{range}");
    // The unstated doubt never narrows the bound.
    assert!(
        mib(&unstated["memory"]["upper_bound_mib"]) >= mib(&stated["memory"]["upper_bound_mib"])
    );
}

/// A full fine-tune answered by the training step: the optimizer's step is its peak, so how
/// the optimizer runs (foreach copies the state, fused does not) moves the figure.
#[tokio::test]
async fn an_unstated_optimizer_implementation_is_listed_where_it_moves_the_figure() {
    let app = spawn_app().await;
    let job = json!({
        "transformer_config": config("gpt2"),
        "seq_len": 128, "batch_size": 1, "precision": "fp32", "optimizer": "adamw",
        "loss_implementation": "upcast_fp32",
    });
    let answer = app.post_json_value("/v1/estimate", &job).await;
    let list = assumed(&answer);
    let implementation =
        field(&list, "optimizer_implementation").unwrap_or_else(|| panic!("{}", answer["memory"]));
    assert_eq!(implementation["assumed"], "foreach");
    let fused = app
        .post_json_value(
            "/v1/estimate",
            &with(job.clone(), "optimizer_implementation", json!("fused")),
        )
        .await;
    assert!(
        (mib(&implementation["low_mib"]) - mib(&fused["memory"]["estimate_mib"])).abs() <= 0.2,
        "{implementation} vs {}",
        fused["memory"]["estimate_mib"]
    );
    // A job answered by a learned regressor lists nothing: its errors were measured with it.
    let (mlp_job, _) = held_out_mlp_jobs().swap_remove(0);
    let mlp = app.post_json_value("/v1/estimate", &mlp_job).await;
    assert!(assumed(&mlp).is_empty(), "{}", mlp["memory"]["uncertainty"]);
}
