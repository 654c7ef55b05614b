use std::path::{Path, PathBuf};

use gpucast::config::ServeConfig;
use gpucast::startup::Application;
use serde_json::Value;

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn models_dir() -> PathBuf {
    repo_root().join("models")
}

/// ONNX Runtime as scripts/fetch-onnxruntime.sh installs it, unless ORT_DYLIB_PATH says otherwise.
pub fn ort_dylib() -> PathBuf {
    std::env::var_os("ORT_DYLIB_PATH")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".cache/onnxruntime/libonnxruntime.so"))
}

pub fn test_config(models: &Path) -> ServeConfig {
    let dylib = ort_dylib();
    assert!(dylib.exists(), "{} is missing: run scripts/fetch-onnxruntime.sh", dylib.display());
    ServeConfig::for_tests(models.to_path_buf(), dylib)
}

pub struct TestApp {
    pub address: String,
    pub client: reqwest::Client,
    pub shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    pub server: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// Starts the service on port 0 with the committed models.
pub async fn spawn_app() -> TestApp {
    spawn_app_with(test_config(&models_dir())).await
}

pub async fn spawn_app_with(config: ServeConfig) -> TestApp {
    let app = Application::build(&config).await.expect("the application starts");
    let address = format!("http://127.0.0.1:{}", app.port());
    let (shutdown, stop) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(app.run_until(async move {
        let _ = stop.await;
    }));
    TestApp { address, client: reqwest::Client::new(), shutdown: Some(shutdown), server }
}

impl TestApp {
    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.client.get(format!("{}{path}", self.address)).send().await.expect("request sent")
    }

    pub async fn post_json(&self, path: &str, body: &Value) -> reqwest::Response {
        self.client.post(format!("{}{path}", self.address)).json(body).send().await.expect("request sent")
    }

    pub async fn post_raw(&self, path: &str, content_type: &str, body: impl Into<reqwest::Body>) -> reqwest::Response {
        self.client
            .post(format!("{}{path}", self.address))
            .header("content-type", content_type)
            .body(body)
            .send()
            .await
            .expect("request sent")
    }
}

/// The example job of the OpenAPI document (a real row of the GPUMemNet MLP data).
pub fn example_job() -> Value {
    let spec = gpucast::http::openapi();
    let schema = serde_json::to_value(&spec).unwrap();
    schema["components"]["schemas"]["EstimateRequest"]["example"].clone()
}

/// Starts the service with the given GPUs (a fake device in tests).
pub async fn spawn_app_with_devices(config: ServeConfig, devices: std::sync::Arc<dyn gpucast::devices::GpuDevices>) -> TestApp {
    let app = Application::build_with_devices(&config, devices).await.expect("the application starts");
    let address = format!("http://127.0.0.1:{}", app.port());
    let (shutdown, stop) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(app.run_until(async move {
        let _ = stop.await;
    }));
    TestApp { address, client: reqwest::Client::new(), shutdown: Some(shutdown), server }
}

/// Jobs of the committed MLP held-out split with their measured peaks.
pub fn held_out_mlp_jobs() -> Vec<(Value, f64)> {
    use std::io::BufRead;
    let file = std::fs::File::open(repo_root().join("data/mlp/test.jsonl.gz")).unwrap();
    std::io::BufReader::new(flate2::read::GzDecoder::new(file))
        .lines()
        .map(|line| {
            let row: Value = serde_json::from_str(&line.unwrap()).unwrap();
            (row["job"].clone(), row["measured_peak_mib"].as_f64().unwrap())
        })
        .collect()
}

/// The descriptions `describe` wrote for the timm training models, read once per test binary
/// (unoptimised, parsing them takes a good part of a second).
fn descriptions() -> &'static [Value] {
    static DESCRIPTIONS: std::sync::OnceLock<Vec<Value>> = std::sync::OnceLock::new();
    DESCRIPTIONS.get_or_init(|| {
        use std::io::BufRead;
        let file = std::fs::File::open(repo_root().join("data/timm/descriptions.jsonl.gz")).unwrap();
        std::io::BufReader::new(flate2::read::GzDecoder::new(file))
            .lines()
            .map(|line| serde_json::from_str(&line.unwrap()).unwrap())
            .collect()
    })
}

pub fn training_descriptions() -> Vec<Value> {
    descriptions().to_vec()
}

pub fn training_description(model: &str) -> Value {
    descriptions().iter().find(|d| d["model"] == model).expect("the model is described").clone()
}
