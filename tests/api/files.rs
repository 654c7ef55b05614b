//! The files users have, as they are (issue 35): a request carrying a Trainer's arguments,
//! PEFT's adapter config, a DeepSpeed config or how the model was loaded is answered as the
//! same setup stated by hand (tests/fixtures/recipes/, one folder per published recipe), each
//! value read is echoed in `setup.from_files`, and a value stated twice differently is refused
//! naming both places.

use serde_json::{json, Value};

use crate::helpers::{repo_root, spawn_app, TestApp};
use crate::setups::answer;

fn recipes() -> std::path::PathBuf {
    repo_root().join("tests/fixtures/recipes")
}

fn read_json(path: &std::path::Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The request of a recipe's job without its setup: model, sizes and other request fields.
fn base_request(job: &Value) -> Value {
    let config = job["config"].as_str().unwrap();
    let config = if config.starts_with("recipes/") {
        repo_root().join(format!("tests/fixtures/{config}.json"))
    } else {
        repo_root().join(format!("tests/fixtures/transformer_configs/{config}.json"))
    };
    let mut body = json!({
        "transformer_config": read_json(&config),
        "seq_len": job["seq_len"],
        "batch_size": job["batch_size"],
        "gpu": "h100-80gb",
    });
    if let Some(fields) = job.get("request").and_then(Value::as_object) {
        for (key, value) in fields {
            body[key] = value.clone();
        }
    }
    body
}

/// The same job twice: from the recipe's files, and with the setup stated by hand.
fn requests(folder: &std::path::Path) -> (Value, Value) {
    let job = read_json(&folder.join("job.json"));
    let mut from_files = base_request(&job);
    for (file, field) in [
        ("training_args.json", "training_arguments"),
        ("adapter_config.json", "adapter_config"),
        ("deepspeed.json", "deepspeed"),
        ("fsdp.json", "fsdp"),
        ("load.json", "load"),
    ] {
        let path = folder.join(file);
        if path.exists() {
            from_files[field] = read_json(&path);
        }
    }
    let mut hand_stated = base_request(&job);
    for (key, value) in job["hand_stated"].as_object().unwrap() {
        match (hand_stated.get_mut(key), value) {
            // `parallelism` merges with the job's world size.
            (Some(Value::Object(given)), Value::Object(more)) => {
                given.extend(more.clone());
            }
            _ => hand_stated[key] = value.clone(),
        }
    }
    (from_files, hand_stated)
}

/// The detail of a refusal (asserted to be a 422).
async fn refused(app: &TestApp, body: &Value) -> String {
    let response = app.post_json("/v1/estimate", body).await;
    let status = response.status();
    let problem: Value = response.json().await.unwrap();
    assert_eq!(status, 422, "{problem}");
    problem["detail"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn each_published_recipes_files_are_answered_as_its_setup_stated_by_hand() {
    let app = spawn_app().await;
    let mut folders: Vec<_> = std::fs::read_dir(recipes())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    folders.sort();
    assert!(folders.len() >= 10, "{} recipes", folders.len());
    for folder in folders {
        let name = folder.file_name().unwrap().to_string_lossy().to_string();
        let (from_files, hand_stated) = requests(&folder);
        let files = answer(&app, &from_files).await;
        let hand = answer(&app, &hand_stated).await;
        assert_eq!(files["memory"], hand["memory"], "{name}");
        assert_eq!(files["fit"], hand["fit"], "{name}");
        assert_eq!(files["performance"], hand["performance"], "{name}");
        let mut setup = files["setup"].clone();
        let read = setup
            .as_object_mut()
            .unwrap()
            .remove("from_files")
            .unwrap_or_else(|| panic!("{name}: no setup.from_files"));
        assert_eq!(setup, hand["setup"], "{name}");
        assert!(hand["setup"].get("from_files").is_none(), "{name}");
        // Every value read names its file.
        for entry in read.as_array().unwrap() {
            let from = entry["from"].as_str().unwrap();
            assert!(
                [
                    "training_arguments.",
                    "adapter_config.",
                    "deepspeed.",
                    "fsdp.",
                    "load."
                ]
                .iter()
                .any(|file| from.starts_with(file)),
                "{name}: {entry}"
            );
        }
        // What the hand-stated job states is what was read from the files.
        for (key, value) in hand_stated_setup(&folder) {
            let entry = read
                .as_array()
                .unwrap()
                .iter()
                .find(|e| e["field"] == key.as_str())
                .unwrap_or_else(|| panic!("{name}: {key} not in from_files {read}"));
            assert_eq!(entry["value"], value, "{name}: {key}");
        }
    }
}

/// The plain fields the recipe states by hand (the ones echoed one for one).
fn hand_stated_setup(folder: &std::path::Path) -> Vec<(String, Value)> {
    let job = read_json(&folder.join("job.json"));
    let stated = job["hand_stated"].as_object().unwrap();
    let mut fields = Vec::new();
    for key in [
        "precision",
        "optimizer",
        "optimizer_implementation",
        "activation_checkpointing",
        "master_weights",
    ] {
        if let Some(value) = stated.get(key) {
            fields.push((key.to_string(), value.clone()));
        }
    }
    for key in ["micro_batch_size", "gradient_accumulation_steps"] {
        if let Some(value) = stated.get(key) {
            fields.push((key.to_string(), Value::from(value.to_string())));
        }
    }
    if let Some(strategy) = stated.get("parallelism").and_then(|p| p.get("strategy")) {
        fields.push(("parallelism.strategy".into(), strategy.clone()));
    }
    if let Some(lora) = stated.get("lora") {
        fields.push(("lora.rank".into(), Value::from(lora["rank"].to_string())));
        if let Some(base) = lora.get("base_weights") {
            fields.push(("lora.base_weights".into(), base.clone()));
        }
    }
    fields
}

fn recipe_request(name: &str) -> Value {
    requests(&recipes().join(name)).0
}

#[tokio::test]
async fn a_value_stated_twice_differently_is_refused_naming_both_places() {
    let app = spawn_app().await;
    let cases = [
        // The request's micro-batch against the Trainer's.
        (
            "qlora-guanaco-7b",
            json!({"micro_batch_size": 2, "batch_size": 32}),
            "micro_batch_size",
            "training_arguments.per_device_train_batch_size",
        ),
        // The service's pure bf16 against the Trainer's autocast over fp32 weights.
        (
            "stanford-alpaca-fsdp",
            json!({"precision": "bf16"}),
            "precision",
            "training_arguments.bf16",
        ),
        // A lora block against the adapter config.
        (
            "trl-stack-llama-2-sft",
            json!({"lora": {"rank": 16, "target_modules": ["q_proj", "v_proj"]}}),
            "lora.rank",
            "adapter_config.r",
        ),
        (
            "trl-stack-llama-2-sft",
            json!({"optimizer": "adamw"}),
            "optimizer",
            "training_arguments.optim",
        ),
        (
            "alignment-handbook-zephyr-sft-full-zero3",
            json!({"parallelism": {"strategy": "fsdp", "world_size": 8}}),
            "parallelism.strategy",
            "deepspeed.zero_optimization.stage",
        ),
        (
            "axolotl-llama-2-qlora",
            json!({"activation_checkpointing": "none"}),
            "activation_checkpointing",
            "training_arguments.gradient_checkpointing",
        ),
        (
            "philschmid-2024-codellama-qlora",
            json!({"attention": "eager"}),
            "attention",
            "load.attn_implementation",
        ),
        // A batch that is not whole micro-batches.
        (
            "qlora-guanaco-7b",
            json!({"batch_size": 10}),
            "batch_size",
            "training_arguments.per_device_train_batch_size",
        ),
    ];
    for (recipe, over, field, place) in cases {
        let mut body = recipe_request(recipe);
        for (key, value) in over.as_object().unwrap() {
            body[key] = value.clone();
        }
        let detail = refused(&app, &body).await;
        assert!(
            detail.starts_with(&format!("{field}:")) && detail.contains(place),
            "{recipe} {over}: {detail}"
        );
    }
    // Two files: DeepSpeed's micro-batch against the Trainer's.
    let mut body = recipe_request("transformers-docs-zero2-offload");
    body["deepspeed"]["train_micro_batch_size_per_gpu"] = json!(4);
    let detail = refused(&app, &body).await;
    assert!(
        detail.starts_with("deepspeed.train_micro_batch_size_per_gpu:")
            && detail.contains("training_arguments.per_device_train_batch_size"),
        "{detail}"
    );
}

#[tokio::test]
async fn unknown_optimizers_and_hostile_values_are_refused_with_their_place() {
    let app = spawn_app().await;
    let mut body = recipe_request("trl-sft-qwen2-0.5b-full");
    body["training_arguments"]["optim"] = json!("lion_32bit");
    let detail = refused(&app, &body).await;
    assert!(
        detail.starts_with("training_arguments.optim: 'lion_32bit'")
            && detail.contains("adamw_torch_fused"),
        "{detail}"
    );
    for (file, key, value) in [
        (
            "training_arguments",
            "per_device_train_batch_size",
            json!(1e300),
        ),
        (
            "training_arguments",
            "gradient_checkpointing",
            json!("x".repeat(100_000)),
        ),
        ("training_arguments", "optim", json!(["adamw_torch"])),
    ] {
        let mut body = recipe_request("trl-sft-qwen2-0.5b-full");
        body[file][key] = value;
        let detail = refused(&app, &body).await;
        assert!(detail.starts_with(&format!("{file}.{key}:")), "{detail}");
        assert!(detail.len() < 500, "{detail}");
    }
    // A file that is not an object is the request's type error.
    let mut body = recipe_request("trl-sft-qwen2-0.5b-full");
    body["adapter_config"] = json!("adapter_config.json");
    assert!(refused(&app, &body).await.starts_with("adapter_config"));
}

#[tokio::test]
async fn lightning_precision_strings_are_answered_as_the_services_own() {
    let app = spawn_app().await;
    let base = base_request(
        &json!({"config": "public/meta-llama__Llama-3.2-1B", "seq_len": 512, "batch_size": 4}),
    );
    for (lightning, own) in [
        ("bf16-mixed", "amp_bf16"),
        ("16-mixed", "amp_fp16"),
        ("bf16-true", "bf16"),
        ("16-true", "fp16"),
        ("32-true", "fp32"),
    ] {
        let mut a = base.clone();
        a["precision"] = json!(lightning);
        let mut b = base.clone();
        b["precision"] = json!(own);
        let (a, b) = (answer(&app, &a).await, answer(&app, &b).await);
        assert_eq!(a["memory"], b["memory"], "{lightning}");
        assert_eq!(a["setup"]["precision"], own, "{lightning}");
    }
}

/// A load states the weights' dtype, the precision field how they train: fp32 weights agree
/// with fp32, tf32 and autocast; 16-bit weights under autocast train as pure 16-bit (as the
/// Trainer's `bf16=True` beside them is read), said back; pure bf16 over fp32 weights is a
/// contradiction naming both places.
#[tokio::test]
async fn a_load_and_the_precision_field_are_read_together() {
    let app = spawn_app().await;
    let base = base_request(
        &json!({"config": "public/meta-llama__Llama-3.2-1B", "seq_len": 512, "batch_size": 4}),
    );
    let with = |precision: &str, dtype: Option<&str>| {
        let mut body = base.clone();
        body["precision"] = json!(precision);
        if let Some(dtype) = dtype {
            body["load"] = json!({"torch_dtype": dtype});
        }
        body
    };
    for precision in ["fp32", "tf32", "amp_fp16", "amp_bf16"] {
        let loaded = answer(&app, &with(precision, Some("float32"))).await;
        let alone = answer(&app, &with(precision, None)).await;
        assert_eq!(loaded["memory"], alone["memory"], "{precision}");
        assert_eq!(loaded["setup"]["precision"], precision);
    }
    let amp_over_bf16 = answer(&app, &with("amp_bf16", Some("bfloat16"))).await;
    let pure = answer(&app, &with("bf16", None)).await;
    assert_eq!(amp_over_bf16["memory"], pure["memory"]);
    let warnings = amp_over_bf16["warnings"].as_array().unwrap();
    assert!(
        warnings.iter().any(|w| w
            .as_str()
            .unwrap()
            .contains("amp_bf16 over the bf16 weights load.torch_dtype loads")),
        "{warnings:?}"
    );
    // The files chose bf16: the warning about the word is not the caller's.
    assert!(
        !warnings
            .iter()
            .any(|w| w.as_str().unwrap().starts_with("precision: `bf16`")),
        "{warnings:?}"
    );
    let detail = refused(&app, &with("bf16", Some("float32"))).await;
    assert!(detail.contains("load.torch_dtype"), "{detail}");
}

#[tokio::test]
async fn a_batch_item_with_files_is_answered_as_alone_and_echoes_them() {
    let app = spawn_app().await;
    let (from_files, _) = requests(&recipes().join("qlora-guanaco-7b"));
    let alone = answer(&app, &from_files).await;
    let mut ranked = from_files.clone();
    ranked["gpu"] = json!(["h100-80gb", "a100-80gb"]);
    let body = json!({"items": [from_files, ranked]});
    let batch = app.post_json_value("/v1/estimate/batch", &body).await;
    let items = batch["items"].as_array().unwrap();
    assert_eq!(items[0]["status"], 200, "{}", items[0]);
    assert_eq!(items[0]["estimate"]["memory"], alone["memory"]);
    assert_eq!(
        items[0]["estimate"]["setup"]["from_files"],
        alone["setup"]["from_files"]
    );
    // A ranked item (a gpu list) echoes them too.
    assert_eq!(items[1]["status"], 200, "{}", items[1]);
    assert_eq!(
        items[1]["estimate"]["setup"]["from_files"],
        alone["setup"]["from_files"]
    );
}

#[tokio::test]
async fn the_batch_size_may_be_left_to_the_training_arguments() {
    let app = spawn_app().await;
    // qlora-guanaco-7b: per_device_train_batch_size 1 x gradient_accumulation_steps 16.
    let (stated, _) = requests(&recipes().join("qlora-guanaco-7b"));
    let mut left_out = stated.clone();
    left_out.as_object_mut().unwrap().remove("batch_size");
    let (stated, left_out) = (answer(&app, &stated).await, answer(&app, &left_out).await);
    assert_eq!(stated["memory"], left_out["memory"]);
    let read = left_out["setup"]["from_files"].as_array().unwrap();
    let batch = read.iter().find(|e| e["field"] == "batch_size").unwrap();
    assert_eq!(batch["value"], "16");
    assert_eq!(
        batch["from"],
        "training_arguments.per_device_train_batch_size x \
         training_arguments.gradient_accumulation_steps"
    );
    // Without files, it is still required.
    let mut bare = base_request(&json!({
        "config": "public/meta-llama__Llama-3.2-1B", "seq_len": 512, "batch_size": 4
    }));
    bare.as_object_mut().unwrap().remove("batch_size");
    assert!(refused(&app, &bare)
        .await
        .starts_with("batch_size: missing"));
}

/// An answer without its timings.
fn timeless(mut answer: Value) -> Value {
    answer.as_object_mut().unwrap().remove("latency_us");
    answer
}

/// accelerate writes YAML, and DeepSpeed configs are kept as YAML: a file's text is read as it
/// is (a string in a JSON request), and a whole job may come as YAML (`application/yaml`); each
/// answers as its JSON does, with the values it set in `setup.from_files`.
#[tokio::test]
async fn yaml_files_and_yaml_bodies_answer_as_their_json() {
    let app = spawn_app().await;
    let folder = recipes().join("alignment-handbook-zephyr-sft-full-fsdp");
    let job = read_json(&folder.join("job.json"));
    let mut request = base_request(&job);
    request["training_arguments"] = read_json(&folder.join("training_args.json"));
    request["fsdp"] = read_json(&folder.join("fsdp.json"));
    let from_json = app.post_json_value("/v1/estimate", &request).await;
    assert!(
        from_json["memory"]["estimate_mib"].is_number(),
        "{from_json}"
    );
    let fields: Vec<&str> = from_json["setup"]["from_files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["from"].as_str().unwrap())
        .collect();
    assert!(fields.iter().any(|f| f.starts_with("fsdp.")), "{fields:?}");

    let yaml_text = std::fs::read_to_string(folder.join("fsdp.yaml")).unwrap();
    let mut as_text = request.clone();
    as_text["fsdp"] = Value::from(yaml_text);
    let from_text = app.post_json_value("/v1/estimate", &as_text).await;
    assert_eq!(timeless(from_text), timeless(from_json.clone()));

    // The whole body as YAML (JSON is YAML too: its YAML rendering, written by hand here).
    let deepspeed = recipes().join("transformers-docs-zero3-offload");
    let body = format!(
        "# a job as YAML\ntransformer_config: {}\nseq_len: 512\nbatch_size: 2\ngpu: a100-80gb\n\
         parallelism:\n  world_size: 2\ntraining_arguments: {}\ndeepspeed: |\n{}",
        std::fs::read_to_string(
            repo_root().join("tests/fixtures/transformer_configs/public/bigscience__T0_3B.json")
        )
        .unwrap()
        .replace('\n', " "),
        std::fs::read_to_string(deepspeed.join("training_args.json"))
            .unwrap()
            .replace('\n', " "),
        std::fs::read_to_string(deepspeed.join("deepspeed.yaml"))
            .unwrap()
            .lines()
            .map(|l| format!("  {l}\n"))
            .collect::<String>(),
    );
    let response = app.post_raw("/v1/estimate", "application/yaml", body).await;
    assert_eq!(response.status(), 200);
    let from_yaml: Value = response.json().await.unwrap();
    let same = json!({
        "transformer_config": read_json(&repo_root().join("tests/fixtures/transformer_configs/public/bigscience__T0_3B.json")),
        "seq_len": 512, "batch_size": 2, "gpu": "a100-80gb",
        "parallelism": {"world_size": 2},
        "training_arguments": read_json(&deepspeed.join("training_args.json")),
        "deepspeed": read_json(&deepspeed.join("deepspeed.json")),
    });
    let from_json = app.post_json_value("/v1/estimate", &same).await;
    assert_eq!(timeless(from_yaml), timeless(from_json));
}

#[tokio::test]
async fn a_files_text_that_is_not_a_mapping_is_refused_naming_the_field() {
    let app = spawn_app().await;
    let folder = recipes().join("alignment-handbook-zephyr-sft-full-fsdp");
    let mut request = base_request(&read_json(&folder.join("job.json")));
    for (text, says) in [
        ("- just\n- a list\n", "no mapping"),
        ("a: [unclosed\n", "YAML"),
        ("{\"a\": ", "JSON"),
        ("a: 1\na: 2\n", "duplicate"),
    ] {
        request["fsdp"] = Value::from(text);
        let response = app.post_json("/v1/estimate", &request).await;
        assert_eq!(response.status(), 422, "{text}");
        let problem: Value = response.json().await.unwrap();
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.starts_with("fsdp"), "{detail}");
        assert!(detail.contains(says), "{detail}");
    }
    // Other media types stay refused, and the calibration writes take JSON only.
    let response = app.post_raw("/v1/estimate", "text/plain", "a: 1").await;
    assert_eq!(response.status(), 415);
    let response = app
        .post_raw("/v1/calibration/observations", "application/yaml", "a: 1")
        .await;
    assert_eq!(response.status(), 415);
}
