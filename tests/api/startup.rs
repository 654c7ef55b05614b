use std::path::Path;

use gpucast::startup::Application;

use crate::helpers::{models_dir, test_config};

/// A copy of the committed models that a test may break.
fn copy_models() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(models_dir()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    dir
}

async fn start_error(models: &Path) -> String {
    match Application::build(&test_config(models)).await {
        Ok(_) => panic!("the application started on broken models"),
        Err(e) => e.to_string(),
    }
}

#[tokio::test]
async fn a_missing_model_fails_start_up_naming_the_file() {
    let models = copy_models();
    std::fs::remove_file(models.path().join("sequence_transformer.onnx")).unwrap();
    let error = start_error(models.path()).await;
    assert!(
        error.contains("sequence_transformer.onnx") && error.contains("cannot read"),
        "{error}"
    );
    assert_eq!(error.lines().count(), 1);
}

#[tokio::test]
async fn a_model_whose_checksum_differs_fails_start_up_naming_the_file() {
    let models = copy_models();
    let path = models.path().join("mlp_ensemble.weights.json");
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&path, bytes).unwrap();
    let error = start_error(models.path()).await;
    assert!(
        error.contains("mlp_ensemble.weights.json") && error.contains("sha256"),
        "{error}"
    );
}

#[tokio::test]
async fn a_corrupt_model_with_a_matching_checksum_fails_start_up_naming_the_file() {
    use sha2::{Digest, Sha256};
    let models = copy_models();
    let garbage = b"this is not a weights file".to_vec();
    std::fs::write(models.path().join("smact.weights.json"), &garbage).unwrap();
    let manifest_path = models.path().join("manifest.json");
    let manifest = std::fs::read_to_string(&manifest_path).unwrap();
    let mut manifest: serde_json::Value = serde_json::from_str(&manifest).unwrap();
    for estimator in manifest["estimators"].as_array_mut().unwrap() {
        if estimator["file"] == "smact.weights.json" {
            estimator["sha256"] = hex::encode(Sha256::digest(&garbage)).into();
        }
    }
    std::fs::write(&manifest_path, manifest.to_string()).unwrap();
    let error = start_error(models.path()).await;
    // smact runs in process: its evaluator reads the file, and names the model and its runtime.
    assert!(
        error.contains("smact.weights.json")
            && error.contains("estimator 'smact' cannot run on in_process")
            && error.contains("not a weights file"),
        "{error}"
    );
}

#[tokio::test]
async fn a_corrupt_manifest_fails_start_up_naming_the_file() {
    let models = copy_models();
    std::fs::write(models.path().join("manifest.json"), "{ not json").unwrap();
    let error = start_error(models.path()).await;
    assert!(
        error.contains("manifest.json") && error.contains("invalid manifest"),
        "{error}"
    );
}

/// A log read from a pipe (a file, a collector) is plain text: no ANSI colour codes.
#[test]
fn the_log_to_a_pipe_has_no_colour_codes() {
    use std::io::Read;
    let profiles = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_gpucast"))
        .args(["serve", "--listen", "127.0.0.1:0", "--no-nvml"])
        .arg("--models")
        .arg(models_dir())
        .arg("--profiles")
        .arg(profiles.path())
        .env("ORT_DYLIB_PATH", crate::helpers::ort_dylib())
        .env_remove("RUST_LOG")
        .env_remove("GPUCAST_LOG_FORMAT")
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut log = String::new();
        let _ = stderr.read_to_string(&mut log);
        log
    });
    // ready within a few seconds; then stop it and read what it logged
    std::thread::sleep(std::time::Duration::from_secs(5));
    child.kill().unwrap();
    child.wait().unwrap();
    let log = reader.join().unwrap();
    assert!(log.contains("INFO"), "the server logged at info: {log}");
    assert!(
        !log.contains('\u{1b}'),
        "colour codes in a piped log: {log:?}"
    );
}
