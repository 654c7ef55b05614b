//! `--config org/name`: a repo's config read from the hub's resolve route or the local cache.

use super::*;

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
