//! `gpucast estimate`: the built binary answers job descriptions from the command line, the
//! same JSON as the API, exit status 2 with the problem JSON on bad input.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

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

/// The (path, Authorization) of each request a test hub answered.
type RequestLog = std::sync::Arc<std::sync::Mutex<Vec<(String, String)>>>;

/// A hub that speaks the `resolve` route on loopback: `files` by URL path, 404 otherwise;
/// records each request's path and Authorization header.
fn serve_hub(files: Vec<(String, Value)>) -> (String, RequestLog) {
    use std::io::{BufRead, BufReader};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = std::sync::Arc::clone(&seen);
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            let path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
            let mut authorization = String::new();
            loop {
                let mut header = String::new();
                if reader.read_line(&mut header).unwrap_or(0) == 0 || header.trim().is_empty() {
                    break;
                }
                if let Some(value) = header.to_ascii_lowercase().strip_prefix("authorization:") {
                    authorization = value.trim().to_owned();
                }
            }
            log.lock().unwrap().push((path.clone(), authorization));
            let found = files.iter().find(|(p, _)| *p == path);
            let (status, body) = match found {
                Some((_, value)) => ("200 OK", value.to_string()),
                None => ("404 Not Found", "{}".to_owned()),
            };
            let mut stream = stream;
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    (address, seen)
}

/// `--config org/name` reads the repo's config.json from the hub's resolve route (with
/// HF_TOKEN), an adapter repo's adapter_config.json and its base's config, and the local cache
/// with HF_HUB_OFFLINE: each answered as the same files given by path.
#[test]
fn a_hub_repo_id_is_read_from_the_hub_or_the_cache() {
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(
            root().join("tests/fixtures/transformer_configs/public/meta-llama__Llama-3.2-1B.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let adapter = serde_json::json!({"peft_type": "LORA", "r": 16, "lora_alpha": 32,
        "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": "meta-llama/Llama-3.2-1B"});
    let (endpoint, seen) = serve_hub(vec![
        (
            "/meta-llama/Llama-3.2-1B/resolve/main/config.json".into(),
            config.clone(),
        ),
        (
            "/someone/llama-lora/resolve/main/adapter_config.json".into(),
            adapter.clone(),
        ),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let (config_file, adapter_file) = (
        dir.path().join("config.json"),
        dir.path().join("adapter.json"),
    );
    std::fs::write(&config_file, config.to_string()).unwrap();
    std::fs::write(&adapter_file, adapter.to_string()).unwrap();
    let setup = [
        "--seq-len",
        "512",
        "--batch-size",
        "4",
        "--precision",
        "amp_bf16",
    ];
    let env = [
        ("HF_ENDPOINT", endpoint.as_str()),
        ("HF_TOKEN", "hf_test"),
        ("HF_HUB_CACHE", dir.path().to_str().unwrap()),
    ];

    let by_path = json(&gpucast(
        &[
            &["estimate", "--config", config_file.to_str().unwrap()][..],
            &setup,
        ]
        .concat(),
        None,
    ));
    let from_hub = gpucast_with_env(
        &[
            &["estimate", "--config", "meta-llama/Llama-3.2-1B"][..],
            &setup,
        ]
        .concat(),
        &env,
    );
    assert!(from_hub.status.success(), "{from_hub:?}");
    assert_eq!(json(&from_hub)["memory"], by_path["memory"]);
    assert!(
        seen.lock()
            .unwrap()
            .iter()
            .all(|(_, auth)| auth == "bearer hf_test"),
        "{:?}",
        seen.lock().unwrap()
    );

    let adapter_by_path = json(&gpucast(
        &[
            &[
                "estimate",
                "--config",
                config_file.to_str().unwrap(),
                "--adapter-config",
                adapter_file.to_str().unwrap(),
            ][..],
            &setup,
        ]
        .concat(),
        None,
    ));
    let adapter_from_hub = gpucast_with_env(
        &[&["estimate", "--config", "someone/llama-lora"][..], &setup].concat(),
        &env,
    );
    assert!(adapter_from_hub.status.success(), "{adapter_from_hub:?}");
    assert_eq!(json(&adapter_from_hub)["memory"], adapter_by_path["memory"]);

    // The cache as huggingface_hub lays it out, read with the network off.
    let snapshot = dir
        .path()
        .join("models--meta-llama--Llama-3.2-1B/snapshots/abc123");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(dir.path().join("models--meta-llama--Llama-3.2-1B/refs")).unwrap();
    std::fs::write(
        dir.path()
            .join("models--meta-llama--Llama-3.2-1B/refs/main"),
        "abc123",
    )
    .unwrap();
    std::fs::write(snapshot.join("config.json"), config.to_string()).unwrap();
    let offline = [
        ("HF_HUB_CACHE", dir.path().to_str().unwrap()),
        ("HF_HUB_OFFLINE", "1"),
    ];
    let cached = gpucast_with_env(
        &[
            &["estimate", "--config", "meta-llama/Llama-3.2-1B"][..],
            &setup,
        ]
        .concat(),
        &offline,
    );
    assert!(cached.status.success(), "{cached:?}");
    assert_eq!(json(&cached)["memory"], by_path["memory"]);
    let missing = gpucast_with_env(
        &[&["estimate", "--config", "nobody/nothing"][..], &setup].concat(),
        &offline,
    );
    assert!(!missing.status.success(), "{missing:?}");
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("HF_HUB_OFFLINE"),
        "{missing:?}"
    );
}

/// tests/fixtures/features.json: known jobs and the features pinned for them.
fn pinned_features() -> Vec<Value> {
    let text = std::fs::read_to_string(root().join("tests/fixtures/features.json")).unwrap();
    let fixture: Value = serde_json::from_str(&text).unwrap();
    fixture["cases"].as_array().unwrap().clone()
}

fn close(a: &Value, b: &Value) -> bool {
    let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
    (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1.0)
}

#[test]
fn features_batch_prints_the_pinned_features_of_known_jobs() {
    let cases = pinned_features();
    let jobs: Vec<&Value> = cases.iter().map(|c| &c["job"]).collect();
    let body = serde_json::to_vec(&jobs).unwrap();
    let output = gpucast(&["features", "--batch", "-"], Some(&body));
    assert!(output.status.success(), "{output:?}");
    let answer = json(&output);
    let items = answer["items"].as_array().unwrap();
    assert_eq!(items.len(), cases.len());
    for (case, item) in cases.iter().zip(items) {
        let name = case["name"].as_str().unwrap();
        assert_eq!(item["status"], 200, "{name}: {item}");
        let features = &item["features"];
        assert_eq!(features["family"], case["family"], "{name}");
        assert_eq!(features["kinds"], case["kinds"], "{name}");
        let (aggregate, pinned) = (
            features["aggregate"].as_object().unwrap(),
            case["aggregate"].as_object().unwrap(),
        );
        assert_eq!(aggregate.len(), pinned.len(), "{name}: the feature names");
        for (feature, expected) in pinned {
            assert!(
                close(&aggregate[feature], expected),
                "{name}: {feature} = {}, pinned {expected}",
                aggregate[feature]
            );
        }
        let tokens: Vec<&Value> = features["tokens"].as_array().unwrap().iter().collect();
        let pinned: Vec<&Value> = case["tokens"].as_array().unwrap().iter().collect();
        assert_eq!(tokens.len(), pinned.len(), "{name}: tokens");
        for (layer, (t, p)) in tokens.iter().zip(&pinned).enumerate() {
            let (t, p) = (t.as_array().unwrap(), p.as_array().unwrap());
            assert_eq!(t.len(), p.len());
            assert!(
                t.iter().zip(p).all(|(t, p)| close(t, p)),
                "{name}: token {layer}: {t:?}, pinned {p:?}"
            );
        }
        assert_eq!(
            features["token_features"],
            serde_json::json!([
                "output_size",
                "params",
                "batch_size",
                "output_x_batch",
                "position"
            ])
        );
    }
}

#[test]
fn features_answer_a_bad_item_with_its_problem_and_the_rest_with_their_features() {
    let body = br#"{"items": [
        {"batch_size": 0, "layers": [{"kind": "linear", "output_size": 1, "params": 1}]},
        {"batch_size": 2, "layers": [{"kind": "Linear", "output_size": 3, "params": 12}, {"kind": "ReLU", "output_size": 3, "params": 0}]},
        {"batch_size": 2, "layers": [{"kind": "no_such_layer", "output_size": 3, "params": 12}]}
    ]}"#;
    let output = gpucast(&["features", "--batch", "-"], Some(body));
    assert!(output.status.success(), "{output:?}");
    let answer = json(&output);
    let items = answer["items"].as_array().unwrap();
    assert_eq!(items.len(), 3);
    for bad in [0, 2] {
        assert_eq!(items[bad]["index"], bad);
        assert_eq!(items[bad]["status"], 422, "{}", items[bad]);
        assert!(items[bad]["features"].is_null());
        let detail = items[bad]["error"]["detail"].as_str().unwrap();
        assert!(detail.starts_with(&format!("items[{bad}]")), "{detail}");
    }
    let features = &items[1]["features"];
    assert_eq!(features["kinds"], serde_json::json!(["linear", "relu"]));
    assert_eq!(features["aggregate"]["params_x_batch"], 24.0);
    assert_eq!(features["aggregate"]["act_relu"], 1.0);
    // Weights, gradients and Adam's two moments in fp32 plus the activations, over the
    // framework's 1300 MiB.
    let expected = 1300.0 + (12.0 * 16.0 + 6.0 * 2.0 * 4.0) / 1_048_576.0;
    assert_eq!(features["aggregate"]["first_principles_mib"], expected);
    assert_eq!(
        features["tokens"][1],
        serde_json::json!([3.0, 0.0, 2.0, 6.0, 1.0])
    );
}

#[test]
fn features_read_a_job_as_the_estimate_routes_do_within_their_limits() {
    // One job, as `estimate` takes it: a config job's layers come from its builder.
    let output = gpucast(&["features", "tests/fixtures/cli/llama_job.json"], None);
    assert!(output.status.success(), "{output:?}");
    let features = json(&output);
    assert_eq!(features["family"], "transformer");
    assert!(features["kinds"].as_array().unwrap().len() > 10);
    assert!(features["aggregate"]["n_attention"].as_f64().unwrap() > 0.0);
    let bad = gpucast(&["features", "tests/fixtures/cli/bad_job.json"], None);
    assert_eq!(bad.status.code(), Some(2));
    assert_eq!(json(&bad)["status"], 422);
    // More items than a batch takes: refused whole, as the batch route refuses it.
    let job = serde_json::json!({"batch_size": 1, "layers": [{"kind": "linear", "output_size": 1, "params": 1}]});
    let many = serde_json::to_vec(&vec![job.clone(); 257]).unwrap();
    let output = gpucast(&["features", "--batch", "-"], Some(&many));
    assert_eq!(output.status.code(), Some(2));
    assert_eq!(json(&output)["status"], 422);
    // A batch priced above the budget: refused whole, before any item is read.
    let two = serde_json::to_vec(&vec![job; 2]).unwrap();
    let output = gpucast(
        &["features", "--batch", "--max-request-cost", "100", "-"],
        Some(&two),
    );
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    assert_eq!(json(&output)["status"], 422);
    // Input beyond the body limit is not read at all.
    let output = gpucast(
        &["features", "--batch", "--max-body-bytes", "10", "-"],
        Some(&two),
    );
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("--max-body-bytes"));
}

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

fn tempfile_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gpucast-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
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

/// With no cache and no hub in reach, the error names the file that was needed (config.json,
/// not the adapter probe), the cache folder looked in, and the offline switch.
#[test]
fn a_hub_out_of_reach_names_the_file_the_cache_and_the_offline_switch() {
    let cache = tempfile_dir("empty-hub-cache");
    let cache_arg = cache.to_string_lossy().into_owned();
    // A loopback port nothing listens on: the connection is refused at once.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let output = gpucast_with_env(
        &[
            "estimate",
            "--config",
            "meta-llama/Meta-Llama-3-8B",
            "--seq-len",
            "2048",
            "--batch-size",
            "1",
        ],
        &[
            ("HF_HUB_CACHE", cache_arg.as_str()),
            ("HF_ENDPOINT", endpoint.as_str()),
        ],
    );
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let error = String::from_utf8_lossy(&output.stderr);
    assert!(error.contains("config.json"), "{error}");
    assert!(!error.contains("adapter_config.json"), "{error}");
    assert!(error.contains(&cache_arg), "{error}");
    assert!(error.contains("HF_HUB_OFFLINE"), "{error}");
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
