//! What a request leaves unsaid (issue 33, part 2; issue 44, item 3): each field an analytic
//! step's answer assumes is listed with the figure's range over the values it could take, that
//! range is the figure answered with the other value, and a request that states the field
//! drops it.

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
    // Widest first (the unsaid stack last: stating it narrows nothing).
    let widths: Vec<f64> = list
        .iter()
        .filter(|a| a["field"] != "stack")
        .map(|a| mib(&a["high_mib"]) - mib(&a["low_mib"]))
        .collect();
    assert!(widths.windows(2).all(|w| w[0] >= w[1]), "{widths:?}");
}

#[tokio::test]
async fn a_request_that_states_every_field_is_bounded_by_model_error_alone() {
    let app = spawn_app().await;
    let unstated = app.post_json_value("/v1/estimate", &llama_job()).await;
    let mut stated_job = llama_job();
    for (key, value) in [
        ("loss_implementation", "upcast_fp32"),
        ("optimizer_implementation", "foreach"),
        ("activation_checkpointing", "none"),
        ("attention", "sdpa"),
        ("master_weights", "none"),
        ("stack", "transformers"),
    ] {
        stated_job = with(stated_job, key, json!(value));
    }
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

/// Unsaid, the stack is listed last with what the other stacks would answer; it is not in the
/// bound, so stating the assumed one changes nothing, and a stated stack the physics does not
/// follow is not listed: its bound holds the spread between stacks instead.
#[tokio::test]
async fn an_unsaid_stack_is_listed_with_the_spread_between_stacks() {
    let app = spawn_app().await;
    let unsaid = app.post_json_value("/v1/estimate", &llama_job()).await;
    let list = assumed(&unsaid);
    let stack = list
        .last()
        .unwrap_or_else(|| panic!("{}", unsaid["memory"]));
    assert_eq!(stack["field"], "stack", "{list:?}");
    assert_eq!(stack["assumed"], "transformers");
    let figure = mib(&unsaid["memory"]["estimate_mib"]);
    let (low, high) = (mib(&stack["low_mib"]), mib(&stack["high_mib"]));
    assert!(
        low < 0.8 * figure && high > 1.25 * figure,
        "{stack} around {figure}"
    );
    let stated = app
        .post_json_value(
            "/v1/estimate",
            &with(llama_job(), "stack", json!("transformers")),
        )
        .await;
    assert!(field(&assumed(&stated), "stack").is_none());
    for key in ["estimate_mib", "upper_bound_mib"] {
        assert_eq!(unsaid["memory"][key], stated["memory"][key], "{key}");
    }
    assert_eq!(
        unsaid["memory"]["uncertainty"]["assumed_log_range"],
        stated["memory"]["uncertainty"]["assumed_log_range"]
    );
    let other = app
        .post_json_value("/v1/estimate", &with(llama_job(), "stack", json!("litgpt")))
        .await;
    assert!(field(&assumed(&other), "stack").is_none());
    assert_eq!(other["memory"]["uncertainty"]["basis"], "between_stacks");
    assert!(mib(&other["memory"]["upper_bound_mib"]) > mib(&unsaid["memory"]["upper_bound_mib"]));
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

/// Llama-3-8B with PEFT's LoRA under the Trainer's `bf16=True`, as a new user sends it: the
/// files and the config, no `load` block.
fn llama3_8b_from_files() -> Value {
    let text = std::fs::read_to_string(
        "tests/fixtures/transformer_configs/public/meta-llama__Meta-Llama-3-8B.json",
    )
    .unwrap();
    let config: Value = serde_json::from_str(&text).unwrap();
    json!({
        "transformer_config": config, "seq_len": 2048, "gpu": "h100-80gb",
        "training_arguments": {"bf16": true, "per_device_train_batch_size": 1},
        "adapter_config": {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "lora_dropout": 0.05},
    })
}

#[tokio::test]
async fn an_unsaid_load_dtype_is_the_configs_as_transformers_5_loads_and_fp32_is_listed() {
    let app = spawn_app().await;
    let unsaid = app
        .post_json_value("/v1/estimate", &llama3_8b_from_files())
        .await;
    let bf16 = app
        .post_json_value(
            "/v1/estimate",
            &with(
                llama3_8b_from_files(),
                "load",
                json!({"torch_dtype": "bfloat16"}),
            ),
        )
        .await;
    let fp32 = app
        .post_json_value(
            "/v1/estimate",
            &with(
                llama3_8b_from_files(),
                "load",
                json!({"torch_dtype": "float32"}),
            ),
        )
        .await;
    // The config's bf16, trained as pure bf16: the answer of the stated bf16 load, and it fits
    // an H100 where fp32 weights under autocast do not.
    assert_eq!(unsaid["setup"]["precision"], "bf16", "{}", unsaid["setup"]);
    let figure = mib(&unsaid["memory"]["estimate_mib"]);
    assert_eq!(figure, mib(&bf16["memory"]["estimate_mib"]));
    let fp32_figure = mib(&fp32["memory"]["estimate_mib"]);
    assert!(fp32_figure > 1.8 * figure, "{fp32_figure} vs {figure}");
    assert_eq!(unsaid["fit"]["fits"], true, "{}", unsaid["fit"]);
    assert_eq!(fp32["fit"]["fits"], false, "{}", fp32["fit"]);
    let warnings = unsaid["warnings"].to_string();
    assert!(
        warnings.contains("load.torch_dtype: not given"),
        "{warnings}"
    );
    // transformers 4's fp32 is listed: the range's top is the fp32 answer.
    let list = assumed(&unsaid);
    let dtype = field(&list, "load.torch_dtype").unwrap_or_else(|| panic!("{list:?}"));
    assert_eq!(dtype["assumed"], "bfloat16");
    assert!(
        (mib(&dtype["high_mib"]) - fp32_figure).abs() <= 0.2,
        "{dtype} vs {fp32_figure}"
    );
    assert!((mib(&dtype["low_mib"]) - figure).abs() <= 0.2, "{dtype}");
    // Stated, it is not listed; a request that states its precision keeps it.
    assert!(field(&assumed(&bf16), "load.torch_dtype").is_none());
    let stated = app
        .post_json_value(
            "/v1/estimate",
            &with(llama3_8b_from_files(), "precision", json!("amp_bf16")),
        )
        .await;
    assert_eq!(stated["setup"]["precision"], "amp_bf16");
    assert_eq!(mib(&stated["memory"]["estimate_mib"]), fp32_figure);
}

/// Config jobs that state only part of their setup: each default that moves the figure by
/// more than 5 % is listed, its range the answer with the field stated otherwise.
#[tokio::test]
async fn every_unstated_setup_field_that_moves_the_figure_is_listed() {
    let app = spawn_app().await;
    let stated = |extra: Value| {
        let mut job = json!({
            "transformer_config": config("llama"), "batch_size": 1,
            "loss_implementation": "upcast_fp32", "optimizer_implementation": "fused",
        });
        job.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        job
    };
    // Nothing of the setup stated; the fp32 default is GQA's math path already, so the
    // kernel is checked under pure bf16 (flash) below.
    let bare = stated(json!({"seq_len": 512}));
    let bf16 = stated(json!({
        "seq_len": 2048, "precision": "bf16", "optimizer": "adamw",
        "activation_checkpointing": "none",
    }));
    for (job, name, assumed_value, other, bound) in [
        (&bare, "precision", "fp32", json!("bf16"), "low_mib"),
        (&bare, "optimizer", "adam", json!("sgd"), "low_mib"),
        (
            &bare,
            "activation_checkpointing",
            "none",
            json!("full"),
            "low_mib",
        ),
        (&bf16, "attention", "sdpa", json!("eager"), "high_mib"),
        (&bf16, "master_weights", "none", json!("fp32"), "high_mib"),
    ] {
        let answer = app.post_json_value("/v1/estimate", job).await;
        let figure = mib(&answer["memory"]["estimate_mib"]);
        let list = assumed(&answer);
        let entry = field(&list, name).unwrap_or_else(|| panic!("{name} in {list:?}"));
        assert_eq!(entry["assumed"], assumed_value, "{entry}");
        let moved = app
            .post_json_value("/v1/estimate", &with(job.clone(), name, other))
            .await;
        let other_figure = mib(&moved["memory"]["estimate_mib"]);
        assert!(
            (mib(&entry[bound]) - other_figure).abs() <= 0.2,
            "{entry} vs {other_figure}"
        );
        assert!(
            (other_figure - figure).abs() > 0.05 * figure,
            "{name}: {other_figure} vs {figure}"
        );
        // Stated, it is no longer listed.
        assert!(field(&assumed(&moved), name).is_none(), "{name}");
    }
}

/// ZeRO-3 without its buffer sizes: DeepSpeed's defaults are assumed, and Hugging Face's
/// `"auto"` values from the hidden size bound the range (the same figure as stating them).
#[tokio::test]
async fn unsaid_zero3_buffers_are_listed_with_hugging_faces_auto_values() {
    let app = spawn_app().await;
    let job = json!({
        "transformer_config": config("llama"),
        "seq_len": 2048, "batch_size": 1, "precision": "bf16", "optimizer": "adamw",
        "parallelism": {"strategy": "zero3", "world_size": 8},
    });
    let unsaid = app.post_json_value("/v1/estimate", &job).await;
    let list = assumed(&unsaid);
    let zero = field(&list, "zero").unwrap_or_else(|| panic!("{}", unsaid["memory"]));
    assert_eq!(zero["assumed"], "deepspeed_defaults");
    let hidden = config("llama")["hidden_size"].as_u64().unwrap();
    let auto = json!({"reduce_bucket_size": hidden * hidden,
                      "prefetch_bucket_size": hidden * hidden * 9 / 10,
                      "param_persistence_threshold": 10 * hidden});
    let stated = app
        .post_json_value("/v1/estimate", &with(job.clone(), "zero", auto))
        .await;
    assert!(field(&assumed(&stated), "zero").is_none());
    let figure = mib(&stated["memory"]["estimate_mib"]);
    assert!(
        (mib(&zero["low_mib"]) - figure).abs() <= 1.0,
        "{zero} vs {figure}"
    );
    assert!(figure < mib(&unsaid["memory"]["estimate_mib"]));
}
