use serde_json::{json, Value};

use crate::helpers::{example_job, held_out_mlp_jobs, jsonl_gz, spawn_app};

#[tokio::test]
async fn a_batch_answers_in_order_with_per_item_errors() {
    let app = spawn_app().await;
    let bad_kind =
        json!({"batch_size": 8, "layers": [{"kind": "nope", "output_size": 1, "params": 0}]});
    let wrong_type = json!({"batch_size": "many", "layers": []});
    let body = json!({"items": [example_job(), bad_kind, example_job(), wrong_type]});
    let response = app.post_json("/v1/estimate/batch", &body).await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    let items = body["items"].as_array().unwrap();
    assert_eq!(items.len(), 4);
    for (i, item) in items.iter().enumerate() {
        assert_eq!(item["index"], i);
    }
    assert_eq!(items[0]["status"], 200);
    assert_eq!(items[0]["estimate"]["memory"]["class"]["index"], 1);
    assert_eq!(items[1]["status"], 422);
    assert!(items[1]["error"]["detail"]
        .as_str()
        .unwrap()
        .contains("layers[0].kind"));
    assert_eq!(items[2]["status"], 200);
    assert_eq!(items[3]["status"], 422);
    assert!(
        items[3]["error"]["detail"]
            .as_str()
            .unwrap()
            .contains("items[3].batch_size"),
        "{}",
        items[3]
    );
}

#[tokio::test]
async fn a_batch_must_hold_between_one_and_the_limit_of_items() {
    let app = spawn_app().await;
    let response = app
        .post_json("/v1/estimate/batch", &json!({"items": []}))
        .await;
    assert_eq!(response.status(), 422);
    let items: Vec<Value> = (0..257).map(|_| example_job()).collect();
    let response = app
        .post_json("/v1/estimate/batch", &json!({ "items": items }))
        .await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    assert!(problem["detail"].as_str().unwrap().starts_with("items:"));
    let response = app
        .post_json("/v1/estimate/batch", &json!({"jobs": []}))
        .await;
    assert_eq!(response.status(), 422);
}

/// An answer without its timings, the one part that may differ between two runs.
fn without_latency(mut answer: Value) -> Value {
    answer.as_object_mut().unwrap().remove("latency_us");
    answer
}

#[tokio::test]
async fn a_job_is_answered_the_same_alone_and_inside_a_batch() {
    // Held-out timm jobs with their simulations, and MLP jobs asking for the classifiers'
    // opinions too (the aggregate ensemble in process, the sequence classifier on ONNX
    // Runtime), 40 to a batch. Batched inference once moved 16 of 874 answers by a digit.
    let app = spawn_app().await;
    let simulated = jsonl_gz("data/timm/test_simulated.jsonl.gz");
    let timm = simulated.iter().take(80).map(|row| row["job"].clone());
    let mlp = held_out_mlp_jobs()
        .into_iter()
        .take(40)
        .map(|(mut job, _)| {
            job["estimators"] = json!("all");
            job
        });
    let jobs: Vec<Value> = timm.chain(mlp).collect();
    for chunk in jobs.chunks(40) {
        let batch = app
            .post_json_value("/v1/estimate/batch", &json!({ "items": chunk }))
            .await;
        let items = batch["items"].as_array().unwrap();
        assert_eq!(items.len(), chunk.len());
        for (job, item) in chunk.iter().zip(items) {
            assert_eq!(item["status"], 200, "{item}");
            let alone = app.post_json_value("/v1/estimate", job).await;
            assert_eq!(
                without_latency(item["estimate"].clone()),
                without_latency(alone),
                "item {}",
                item["index"]
            );
        }
    }
}

#[tokio::test]
async fn repeated_items_are_answered_as_alone_and_refused_under_their_own_index() {
    // An item repeating an earlier one's JSON is read and answered once; every copy is still
    // the answer the job gets alone, and a repeated invalid item names its own index.
    let app = spawn_app().await;
    let config = json!({
        "transformer_config": {
            "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
            "num_hidden_layers": 4, "num_attention_heads": 16, "vocab_size": 32000
        },
        "batch_size": 2, "seq_len": 512, "gpu": "rtx-4090",
        "lora": {"rank": 8, "target_modules": "all-linear", "base_weights": "nf4"}
    });
    let wrong_type = json!({"batch_size": "many", "layers": []});
    let items = json!([
        example_job(),
        config.clone(),
        wrong_type.clone(),
        example_job(),
        config.clone(),
        wrong_type,
        example_job()
    ]);
    let batch = app
        .post_json_value("/v1/estimate/batch", &json!({ "items": items }))
        .await;
    let answered = batch["items"].as_array().unwrap();
    assert_eq!(answered.len(), 7);
    for (index, (job, item)) in items.as_array().unwrap().iter().zip(answered).enumerate() {
        assert_eq!(item["index"], index);
        if job["batch_size"] == "many" {
            assert_eq!(item["status"], 422, "{item}");
            let detail = item["error"]["detail"].as_str().unwrap();
            assert!(
                detail.contains(&format!("items[{index}].batch_size")),
                "{detail}"
            );
            continue;
        }
        assert_eq!(item["status"], 200, "{item}");
        let alone = app.post_json_value("/v1/estimate", job).await;
        assert_eq!(
            without_latency(item["estimate"].clone()),
            without_latency(alone),
            "item {index}"
        );
    }
}
