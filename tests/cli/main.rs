//! `gpucast estimate`: the built binary answers job descriptions from the command line, the
//! same JSON as the API, exit status 2 with the problem JSON on bad input.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

mod features;
mod flags;
mod hub;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn gpucast(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpucast"))
        .args(args)
        .current_dir(root())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    if let Some(bytes) = stdin {
        child.stdin.take().unwrap().write_all(bytes).unwrap();
    }
    drop(child.stdin.take());
    child.wait_with_output().unwrap()
}

fn json(output: &Output) -> Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

#[test]
fn a_job_file_is_answered_with_the_apis_json() {
    let output = gpucast(&["estimate", "tests/fixtures/cli/llama_job.json"], None);
    assert!(output.status.success(), "{output:?}");
    let answer = json(&output);
    assert_eq!(answer["family"], "transformer");
    assert_eq!(answer["fit"]["gpu"], "h100-80gb");
    assert_eq!(answer["memory"]["breakdown_source"], "training_step");
    assert!(answer["memory"]["estimate_mib"].as_f64().unwrap() > 1300.0);
}

/// The CLI's figures are printed as the service sends them: an `f32` utilization in its
/// shortest form, never widened (`0.07800000160932541`).
#[test]
fn figures_print_as_the_http_answer_rounds_them() {
    let output = gpucast(&["estimate", "tests/fixtures/cli/llama_job.json"], None);
    assert!(output.status.success());
    let text = String::from_utf8_lossy(&output.stdout);
    let utilization = &json(&output)["utilization"];
    let mut checked = 0;
    for metric in ["smact", "smocc", "drama"] {
        let Some(value) = utilization[metric].as_f64() else {
            continue;
        };
        checked += 1;
        let printed = format!("\"{metric}\": {value}");
        assert!(text.contains(&printed), "{printed} not in the output");
        // What an f32 prints as: at most 9 significant digits.
        let digits = value
            .to_string()
            .chars()
            .filter(char::is_ascii_digit)
            .count();
        assert!(digits <= 10, "{metric}: {value}");
    }
    assert!(checked > 0, "no utilization figure: {utilization}");
}

#[test]
fn standard_input_is_read_from_a_dash() {
    let body = std::fs::read(root().join("tests/fixtures/cli/llama_job.json")).unwrap();
    let from_file = json(&gpucast(
        &["estimate", "tests/fixtures/cli/llama_job.json"],
        None,
    ));
    let from_stdin = json(&gpucast(&["estimate", "-"], Some(&body)));
    assert_eq!(from_file["memory"], from_stdin["memory"]);
}

#[test]
fn bad_input_exits_2_with_the_problem_json() {
    let output = gpucast(&["estimate", "tests/fixtures/cli/bad_job.json"], None);
    assert_eq!(output.status.code(), Some(2));
    let problem = json(&output);
    assert_eq!(problem["status"], 422);
    assert!(problem["detail"]
        .as_str()
        .unwrap()
        .contains("num_hidden_layers"));
    let output = gpucast(&["estimate", "-"], Some(b"{not json"));
    assert_eq!(output.status.code(), Some(2));
    assert_eq!(json(&output)["status"], 400);
}

#[test]
fn a_batch_gets_one_outcome_per_item_and_an_array_is_a_batch_too() {
    let output = gpucast(
        &["estimate", "--batch", "tests/fixtures/cli/batch.json"],
        None,
    );
    assert!(output.status.success(), "{output:?}");
    let answer = json(&output);
    let items = answer["items"].as_array().unwrap();
    assert_eq!(items.len(), 2);
    assert_eq!(items[0]["status"], 200);
    assert_eq!(items[1]["status"], 422);
    let batch: Value = serde_json::from_slice(
        &std::fs::read(root().join("tests/fixtures/cli/batch.json")).unwrap(),
    )
    .unwrap();
    let array = serde_json::to_vec(&batch["items"]).unwrap();
    let output = gpucast(&["estimate", "--batch", "-"], Some(&array));
    assert_eq!(json(&output)["items"].as_array().unwrap().len(), 2);
}

#[test]
fn the_table_format_prints_the_breakdown_for_people() {
    let output = gpucast(
        &[
            "estimate",
            "--format",
            "table",
            "tests/fixtures/cli/llama_job.json",
        ],
        None,
    );
    assert!(output.status.success(), "{output:?}");
    let text = String::from_utf8(output.stdout).unwrap();
    for expected in [
        "memory",
        "activations",
        "optimizer_state",
        "cuda_context",
        "step",
    ] {
        assert!(text.contains(expected), "{text}");
    }
}

#[test]
fn other_quantiles_move_the_bound_and_the_decision_not_the_figure() {
    let job = "tests/fixtures/cli/llama_job.json";
    let committed = json(&gpucast(&["estimate", job], None));
    let mut calibration: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("data/uncertainty.json")).unwrap(),
    )
    .unwrap();
    for group in calibration["groups"].as_object_mut().unwrap().values_mut() {
        for score in group["scores"].as_array_mut().unwrap() {
            *score = (score.as_f64().unwrap() * 2.0 + 0.1).into();
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let wider = dir.path().join("wider.json");
    std::fs::write(&wider, calibration.to_string()).unwrap();
    let answer = json(&gpucast(
        &["estimate", "--uncertainty", wider.to_str().unwrap(), job],
        None,
    ));
    let memory = |a: &Value, k: &str| a["memory"][k].as_f64().unwrap();
    assert_eq!(
        memory(&answer, "estimate_mib"),
        memory(&committed, "estimate_mib")
    );
    assert!(memory(&answer, "upper_bound_mib") > memory(&committed, "upper_bound_mib"));
    assert!(
        answer["fit"]["oom_probability"].as_f64().unwrap()
            >= committed["fit"]["oom_probability"].as_f64().unwrap()
    );
    // A calibration file that is not one is refused, naming the flag, and nothing is answered.
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, r#"{"min_share": 1, "min_rows": 1, "levels": [0, 1]}"#).unwrap();
    let refused = gpucast(
        &["estimate", "--uncertainty", bad.to_str().unwrap(), job],
        None,
    );
    assert_eq!(refused.status.code(), Some(1));
    assert!(refused.stdout.is_empty());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--uncertainty"));
}

#[test]
fn input_beyond_the_body_limit_is_refused_unread() {
    let output = gpucast(
        &[
            "estimate",
            "--max-body-bytes",
            "100",
            "tests/fixtures/cli/llama_job.json",
        ],
        None,
    );
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("larger than --max-body-bytes"),
        "{output:?}"
    );
}

/// The common questions as flags over a hub config answer what the same request as JSON does.
#[test]
fn setup_flags_over_a_config_answer_as_the_request_would() {
    let config = "tests/fixtures/transformer_configs/public/meta-llama__Llama-3.2-1B.json";
    let from_flags = json(&gpucast(
        &[
            "estimate",
            "--config",
            config,
            "--seq-len",
            "1024",
            "--batch-size",
            "8",
            "--micro-batch-size",
            "2",
            "--gradient-accumulation-steps",
            "4",
            "--precision",
            "bf16",
            "--lora-rank",
            "16",
            "--base-weights",
            "nf4",
            "--gpu",
            "rtx4090",
        ],
        None,
    ));
    let text = std::fs::read_to_string(root().join(config)).unwrap();
    let request = serde_json::json!({
        "transformer_config": serde_json::from_str::<Value>(&text).unwrap(),
        "seq_len": 1024, "batch_size": 8, "micro_batch_size": 2, "gradient_accumulation_steps": 4,
        "precision": "bf16",
        "lora": {"rank": 16, "alpha": 32.0, "target_modules": "all-linear", "base_weights": "nf4"},
        "gpu": "rtx-4090",
    });
    let from_json = json(&gpucast(
        &["estimate", "-"],
        Some(request.to_string().as_bytes()),
    ));
    assert!(
        from_flags["memory"]["estimate_mib"].as_f64().is_some(),
        "{from_flags}"
    );
    assert_eq!(from_flags["memory"], from_json["memory"]);
    assert!(from_flags["setup"]["lora_params"].as_f64().unwrap() > 0.0);
    assert_eq!(from_flags["fit"]["gpu"], "rtx-4090");
    let neither = gpucast(&["estimate"], None);
    assert_eq!(neither.status.code(), Some(1));
}

/// The README's command-line showcase, QLoRA of Llama-3-8B with checkpointing on an RTX 4090
/// (a setup known to run in about 12 GB), is admitted on that card.
#[test]
fn the_readmes_qlora_showcase_fits_its_24_gb_card() {
    let answer = json(&gpucast(
        &[
            "estimate",
            "--config",
            "tests/fixtures/transformer_configs/public/meta-llama__Meta-Llama-3-8B.json",
            "--seq-len",
            "2048",
            "--batch-size",
            "8",
            "--micro-batch-size",
            "1",
            "--gradient-accumulation-steps",
            "8",
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
        ],
        None,
    ));
    assert_eq!(answer["fit"]["fits"], true, "{}", answer["fit"]);
    assert!(answer["fit"]["max_colocated"].as_u64().unwrap() >= 1);
}

#[test]
fn gpus_lists_the_catalogue() {
    let output = gpucast(&["gpus"], None);
    assert!(output.status.success());
    let table = String::from_utf8_lossy(&output.stdout);
    assert!(
        table.contains("rtx-4090") && table.contains("mi300x"),
        "{table}"
    );
    let listed = json(&gpucast(&["gpus", "--format", "json"], None));
    assert!(listed["gpus"].as_array().unwrap().len() >= 32);
}

/// Installed with `cargo install --path .`, the binary finds the committed models and ONNX
/// Runtime from any working directory (here an empty one, without ORT_DYLIB_PATH).
#[test]
fn the_binary_answers_from_any_directory() {
    let elsewhere = tempfile::tempdir().unwrap();
    let job = root().join("tests/fixtures/cli/llama_job.json");
    let output = Command::new(env!("CARGO_BIN_EXE_gpucast"))
        .args(["estimate", job.to_str().unwrap()])
        .current_dir(elsewhere.path())
        .env_remove("ORT_DYLIB_PATH")
        .env_remove("GPUCAST_MODELS")
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    assert!(json(&output)["memory"]["estimate_mib"].as_f64().unwrap() > 0.0);
}

#[test]
fn the_users_files_are_read_from_their_flags_as_the_setup_they_state() {
    let recipe = "tests/fixtures/recipes/trl-sft-qwen2-0.5b-lora";
    let config = format!("{recipe}/../trl-sft-qwen2-0.5b-full/config.json");
    let from_files = gpucast(
        &[
            "estimate",
            "--config",
            &config,
            "--seq-len",
            "1024",
            "--batch-size",
            "16",
            "--training-args",
            &format!("{recipe}/training_args.json"),
            "--adapter-config",
            &format!("{recipe}/adapter_config.json"),
            // The recipe ran under transformers 4, which loaded fp32 (transformers 5 loads the
            // config's bf16 when the dtype is unsaid).
            "--torch-dtype",
            "float32",
        ],
        None,
    );
    assert!(from_files.status.success(), "{from_files:?}");
    let from_files = json(&from_files);
    let hand_stated: Value = serde_json::json!({
        "transformer_config": serde_json::from_slice::<Value>(&std::fs::read(root().join(&config)).unwrap()).unwrap(),
        "seq_len": 1024, "batch_size": 16, "precision": "amp_bf16", "optimizer": "adamw",
        "optimizer_implementation": "foreach", "micro_batch_size": 2,
        "gradient_accumulation_steps": 8, "activation_checkpointing": "full",
        "lora": {"rank": 32, "alpha": 16, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}
    });
    let body = serde_json::to_vec(&hand_stated).unwrap();
    let hand = json(&gpucast(&["estimate", "-"], Some(&body)));
    assert_eq!(from_files["memory"], hand["memory"]);
    let read = from_files["setup"]["from_files"].as_array().unwrap();
    assert!(read
        .iter()
        .any(|e| e["field"] == "lora.rank" && e["from"] == "adapter_config.r"));

    // Unsaid, the dtype is the config's bf16, trained as pure bf16, and the answer says so.
    let unsaid = json(&gpucast(
        &[
            "estimate",
            "--config",
            &config,
            "--seq-len",
            "1024",
            "--batch-size",
            "16",
            "--training-args",
            &format!("{recipe}/training_args.json"),
            "--adapter-config",
            &format!("{recipe}/adapter_config.json"),
        ],
        None,
    ));
    assert_eq!(unsaid["setup"]["precision"], "bf16");
    assert!(unsaid["warnings"]
        .to_string()
        .contains("load.torch_dtype: not given"));

    // A DeepSpeed config beside a job file, its "auto" from the Trainer's arguments.
    let zero2 = "tests/fixtures/recipes/transformers-docs-zero2-offload";
    let job = serde_json::json!({
        "transformer_config": serde_json::from_slice::<Value>(&std::fs::read(root().join("tests/fixtures/transformer_configs/public/bigscience__T0_3B.json")).unwrap()).unwrap(),
        "seq_len": 512, "batch_size": 2, "parallelism": {"world_size": 2}
    });
    let output = gpucast(
        &[
            "estimate",
            "-",
            "--training-args",
            &format!("{zero2}/training_args.json"),
            "--deepspeed",
            &format!("{zero2}/deepspeed.json"),
        ],
        Some(&serde_json::to_vec(&job).unwrap()),
    );
    assert!(output.status.success(), "{output:?}");
    let answer = json(&output);
    assert_eq!(answer["setup"]["parallelism"]["strategy"], "zero2");
    assert_eq!(answer["setup"]["precision"], "fp16");
    assert_eq!(answer["setup"]["offload"]["optimizer_state"], true);

    // A file that is not there is named.
    let missing = gpucast(
        &[
            "estimate",
            "--config",
            &config,
            "--seq-len",
            "8",
            "--batch-size",
            "1",
            "--deepspeed",
            "no/such.json",
        ],
        None,
    );
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no/such.json"));
}

/// A printout saved as the tool printed it is a job as it is (its batch from --batch-size),
/// answered as the same text under `summary` would be.
#[test]
fn a_printout_file_is_answered_as_it_is() {
    let printout =
        std::fs::read_to_string(root().join("tests/fixtures/summaries/resnet18_torchsummary.txt"))
            .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("resnet18.txt");
    std::fs::write(&file, &printout).unwrap();
    let as_is = gpucast(
        &["estimate", "--batch-size", "32", file.to_str().unwrap()],
        None,
    );
    assert!(as_is.status.success(), "{as_is:?}");
    let wrapped = serde_json::json!({"summary": {"text": printout}, "batch_size": 32});
    let from_json = gpucast(&["estimate", "-"], Some(wrapped.to_string().as_bytes()));
    assert_eq!(json(&as_is)["memory"], json(&from_json)["memory"]);
}

/// Runs the CLI with `env` set (and the Hugging Face variables of this process cleared).
fn gpucast_with_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_gpucast"));
    command.args(args).current_dir(root());
    for name in [
        "HF_HUB_CACHE",
        "HF_HOME",
        "HF_ENDPOINT",
        "HF_TOKEN",
        "HF_HUB_OFFLINE",
    ] {
        command.env_remove(name);
    }
    command.envs(env.iter().copied());
    command.output().expect("the binary runs")
}

fn write_temp(dir: &std::path::Path, name: &str, value: &Value) -> String {
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_vec(value).unwrap()).unwrap();
    path.to_string_lossy().into_owned()
}

fn answer_of(request: &Value) -> Value {
    json(&gpucast(
        &["estimate", "-"],
        Some(request.to_string().as_bytes()),
    ))
}

fn tempfile_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gpucast-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `gpucast observations record` holds a file to the route's rules: a peak below the job's
/// physical floor is refused with the route's problem and records nothing; good ones are
/// recorded into the store, which `estimate --data-dir` then reads.
#[test]
fn observations_are_recorded_from_a_file_under_the_routes_rules() {
    let store = std::env::temp_dir().join(format!("gpucast-cli-record-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&store);
    let data_dir = store.to_str().unwrap();
    let job: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("tests/fixtures/cli/llama_job.json")).unwrap(),
    )
    .unwrap();
    let estimate = gpucast(&["estimate", "tests/fixtures/cli/llama_job.json"], None);
    let figure = json(&estimate)["memory"]["estimate_mib"].as_f64().unwrap();
    let observation =
        |peak: f64| serde_json::json!({"gpu": "h100-80gb", "job": job, "observed_peak_mib": peak});
    let record = |body: &Value| {
        gpucast(
            &["observations", "record", "--data-dir", data_dir, "-"],
            Some(body.to_string().as_bytes()),
        )
    };
    // One of two below the floor: the route's 422, naming the item; nothing recorded.
    let refused = record(&serde_json::json!([observation(figure), observation(1.0)]));
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    let problem = json(&refused);
    assert_eq!(problem["status"], 422, "{problem}");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .starts_with("[1].observed_peak_mib: 1 MiB is below the job's physical floor"),
        "{problem}"
    );
    let recorded = record(&serde_json::json!([
        observation(figure * 1.1),
        observation(figure * 1.12),
        observation(figure * 1.08)
    ]));
    assert!(recorded.status.success(), "{recorded:?}");
    let answer = json(&recorded);
    assert_eq!(answer["recorded"], 3, "{answer}");
    assert_eq!(answer["profiles"][0]["gpu"], "h100-80gb", "{answer}");
    assert_eq!(answer["profiles"][0]["observations"], 3, "{answer}");
    let _ = std::fs::remove_dir_all(&store);
}
