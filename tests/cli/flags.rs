//! The request's fields as flags and files: every field has one, each answers as the JSON
//! would; saved model directories, job files, YAML configs and `gpucast plan`.

use super::*;

/// Each field of the API's request (openapi/openapi.json's EstimateRequest) is given on the
/// command line: by a flag of its own name, or the flags or file that write it.
#[test]
fn every_request_field_has_a_flag() {
    let help = gpucast(&["estimate", "--help"], None);
    let help = String::from_utf8_lossy(&help.stdout).to_string();
    let spec: Value =
        serde_json::from_slice(&std::fs::read(root().join("openapi/openapi.json")).unwrap())
            .unwrap();
    let schema = &spec["components"]["schemas"]["EstimateRequest"];
    let fields: Vec<&String> = schema["allOf"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|part| part["properties"].as_object())
        .flat_map(|properties| properties.keys())
        .collect();
    assert!(fields.len() > 30, "{fields:?}");
    // Fields given another way: the job file holds a model's layers or printout, and these
    // flags write the rest.
    let written_by = |field: &str| -> Vec<&'static str> {
        match field {
            "layers" | "summary" => vec!["[FILE]"],
            "transformer_config" => vec!["--config"],
            "training_arguments" => vec!["--training-args"],
            "lora" => vec!["--lora-rank", "--lora-dropout", "--group-size"],
            "parallelism" => vec!["--strategy", "--world-size", "--tensor-parallel"],
            "trainable" => vec!["--trainable-params", "--trainable-modules"],
            // ZeRO's buffer sizes come from the DeepSpeed config users have.
            "zero" => vec!["--deepspeed"],
            "node" => vec!["--node-memory-mib", "--node-gpus"],
            _ => vec![],
        }
    };
    for field in fields {
        let flags = match written_by(field) {
            none if none.is_empty() => vec![format!("--{}", field.replace('_', "-"))],
            some => some.into_iter().map(String::from).collect(),
        };
        for flag in flags {
            assert!(
                help.contains(&format!("{flag} ")) || help.contains(&format!("{flag}\n")),
                "{field}: no {flag} in gpucast estimate --help"
            );
        }
    }
}

#[test]
fn the_flags_give_what_the_request_gives() {
    let zero3 = "tests/fixtures/recipes/alignment-handbook-zephyr-sft-full-zero3";
    let config_path = "tests/fixtures/transformer_configs/public/mistralai__Mistral-7B-v0.1.json";
    let config: Value =
        serde_json::from_slice(&std::fs::read(root().join(config_path)).unwrap()).unwrap();
    // A DeepSpeed config with the world size from its flag (it used to need a job file).
    let output = gpucast(
        &[
            "estimate",
            "--config",
            config_path,
            "--seq-len",
            "2048",
            "--batch-size",
            "128",
            "--training-args",
            &format!("{zero3}/training_args.json"),
            "--deepspeed",
            &format!("{zero3}/deepspeed.json"),
            "--load",
            &format!("{zero3}/load.json"),
            "--world-size",
            "8",
        ],
        None,
    );
    assert!(output.status.success(), "{output:?}");
    let answer = json(&output);
    assert_eq!(answer["setup"]["parallelism"]["strategy"], "zero3");
    assert_eq!(answer["setup"]["parallelism"]["world_size"], 8);

    // The rest of the setup, each flag as its field.
    let from_flags = json(&gpucast(
        &[
            "estimate",
            "--config",
            config_path,
            "--seq-len",
            "1024",
            "--batch-size",
            "4",
            "--precision",
            "bf16",
            "--master-weights",
            "fp32",
            "--optimizer",
            "adamw",
            "--optimizer-implementation",
            "fused",
            "--loss-implementation",
            "chunked",
            "--attention",
            "eager",
            "--strategy",
            "fsdp",
            "--world-size",
            "4",
            "--offload",
            "optimizer_state",
            "--confidence",
            "0.9",
            "--gpu",
            "h100-80gb,lab-card:49152",
            "--environment",
            "torch2.5-cu124",
            "--model",
            "mistral-7b",
            "--family",
            "transformer",
        ],
        None,
    ));
    let request = serde_json::json!({
        "transformer_config": config, "seq_len": 1024, "batch_size": 4, "precision": "bf16",
        "master_weights": "fp32", "optimizer": "adamw", "optimizer_implementation": "fused",
        "loss_implementation": "chunked", "attention": "eager",
        "parallelism": {"strategy": "fsdp", "world_size": 4},
        "offload": {"optimizer_state": true}, "confidence": 0.9,
        "gpu": ["h100-80gb", {"name": "lab-card", "capacity_mib": 49152}],
        "environment": "torch2.5-cu124", "model": "mistral-7b", "family": "transformer",
    });
    let from_json = answer_of(&request);
    assert!(
        from_flags["memory"]["estimate_mib"].as_f64().is_some(),
        "{from_flags}"
    );
    assert_eq!(from_flags["memory"], from_json["memory"]);
    assert_eq!(from_flags["setup"], from_json["setup"]);
    assert_eq!(from_flags["gpu_ranking"], from_json["gpu_ranking"]);

    // --torch-dtype writes load.torch_dtype over --load's; a bad --offload word is named.
    let dir = tempfile_dir("torch-dtype");
    let load = write_temp(
        &dir,
        "load.json",
        &serde_json::json!({"torch_dtype": "float32"}),
    );
    let adapter = write_temp(
        &dir,
        "adapter_config.json",
        &serde_json::json!({"peft_type": "LORA", "r": 8}),
    );
    let dtype = json(&gpucast(
        &[
            "estimate",
            "--config",
            config_path,
            "--seq-len",
            "512",
            "--batch-size",
            "1",
            "--adapter-config",
            &adapter,
            "--load",
            &load,
            "--torch-dtype",
            "bfloat16",
        ],
        None,
    ));
    assert_eq!(dtype["setup"]["precision"], "bf16", "{}", dtype["setup"]);
    let bad = gpucast(
        &[
            "estimate",
            "--config",
            config_path,
            "--seq-len",
            "8",
            "--batch-size",
            "1",
            "--offload",
            "weights",
        ],
        None,
    );
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--offload: 'weights'"));
}

/// What save_pretrained writes, a directory holding config.json (and PEFT's
/// adapter_config.json), is a --config; a job file takes --config as its transformer_config.
#[test]
fn a_saved_model_directory_and_a_job_file_take_config() {
    let config_path = "tests/fixtures/transformer_configs/public/meta-llama__Llama-3.2-1B.json";
    let config: Value =
        serde_json::from_slice(&std::fs::read(root().join(config_path)).unwrap()).unwrap();
    let dir = tempfile_dir("saved");
    write_temp(&dir, "config.json", &config);
    let adapter = serde_json::json!({"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]});
    write_temp(&dir, "adapter_config.json", &adapter);
    let dir_arg = dir.to_string_lossy().into_owned();
    let from_dir = gpucast(
        &[
            "estimate",
            "--config",
            &dir_arg,
            "--seq-len",
            "512",
            "--batch-size",
            "2",
            "--precision",
            "bf16",
        ],
        None,
    );
    assert!(from_dir.status.success(), "{from_dir:?}");
    let request = serde_json::json!({
        "transformer_config": config, "adapter_config": adapter, "seq_len": 512,
        "batch_size": 2, "precision": "bf16",
    });
    assert_eq!(json(&from_dir)["memory"], answer_of(&request)["memory"]);

    // A job file with --config: the file's setup, the config's model.
    let job = write_temp(
        &tempfile_dir("job"),
        "job.json",
        &serde_json::json!({"seq_len": 512, "batch_size": 2, "precision": "bf16",
            "adapter_config": adapter}),
    );
    let combined = gpucast(&["estimate", &job, "--config", &dir_arg], None);
    assert!(combined.status.success(), "{combined:?}");
    assert_eq!(json(&combined)["memory"], answer_of(&request)["memory"]);

    // A directory with neither file is named.
    let empty = tempfile_dir("empty");
    let output = gpucast(
        &[
            "estimate",
            "--config",
            &empty.to_string_lossy(),
            "--seq-len",
            "8",
            "--batch-size",
            "1",
        ],
        None,
    );
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("without config.json"));
}

/// accelerate writes its config as YAML, and DeepSpeed configs are kept as YAML too: each is
/// read from its flag as it is, and answers as its JSON does.
#[test]
fn yaml_configs_answer_as_their_json() {
    let fsdp = "tests/fixtures/recipes/alignment-handbook-zephyr-sft-full-fsdp";
    let zero3 = "tests/fixtures/recipes/transformers-docs-zero3-offload";
    let cases = [
        (
            "tests/fixtures/transformer_configs/public/mistralai__Mistral-7B-v0.1.json",
            "--fsdp",
            format!("{fsdp}/fsdp"),
            format!("{fsdp}/training_args.json"),
            "8",
        ),
        (
            "tests/fixtures/transformer_configs/public/bigscience__T0_3B.json",
            "--deepspeed",
            format!("{zero3}/deepspeed"),
            format!("{zero3}/training_args.json"),
            "2",
        ),
    ];
    for (config, flag, file, arguments, world) in cases {
        let answer = |ext: &str| {
            let path = format!("{file}.{ext}");
            let output = gpucast(
                &[
                    "estimate",
                    "--config",
                    config,
                    "--seq-len",
                    "512",
                    "--world-size",
                    world,
                    "--training-args",
                    &arguments,
                    flag,
                    &path,
                ],
                None,
            );
            assert!(output.status.success(), "{path}: {output:?}");
            json(&output)
        };
        let (yaml, from_json) = (answer("yaml"), answer("json"));
        assert_eq!(yaml["memory"], from_json["memory"], "{file}");
        assert_eq!(yaml["setup"], from_json["setup"], "{file}");
        assert!(
            !yaml["setup"]["from_files"].as_array().unwrap().is_empty(),
            "{yaml}"
        );
    }
}

#[test]
fn plan_answers_the_largest_micro_batch_as_a_table_and_as_json() {
    let config = "tests/fixtures/transformer_configs/public/meta-llama__Meta-Llama-3-8B.json";
    let args = [
        "plan",
        "--config",
        config,
        "--seq-len",
        "2048",
        "--batch-size",
        "1",
        "--precision",
        "bf16",
        "--lora-rank",
        "16",
        "--base-weights",
        "nf4",
        "--activation-checkpointing",
        "full",
        "--gpu",
        "rtx4090",
        "--no-setups",
    ];
    let output = gpucast(&args, None);
    assert!(output.status.success(), "{output:?}");
    let plan = json(&output);
    let largest = plan["cards"][0]["largest_micro_batch"].as_u64().unwrap();
    let mut table_args = args.to_vec();
    table_args.extend(["--format", "table"]);
    let table = String::from_utf8(gpucast(&table_args, None).stdout).unwrap();
    assert!(table.contains("rtx-4090"), "{table}");
    assert!(
        table.lines().any(|l| l.starts_with("rtx-4090")
            && l.split_whitespace().nth(5) == Some(&largest.to_string())),
        "{table}"
    );
    // A batch is not a plan.
    let mut batch = args.to_vec();
    batch.push("--batch");
    assert_eq!(gpucast(&batch, None).status.code(), Some(1));
}
