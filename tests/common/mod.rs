//! What every test crate and the benches share: where the repository, the committed models and
//! ONNX Runtime are, a test configuration, the OpenAPI example job, and the real server started
//! on an ephemeral port. Each crate uses part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpucast::config::ServeConfig;
use gpucast::devices::GpuDevices;
use gpucast::http::AppState;
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

/// The test configuration with the models of `models`.
pub fn test_config(models: &Path) -> ServeConfig {
    let dylib = ort_dylib();
    assert!(
        dylib.exists(),
        "{} is missing: run scripts/fetch-onnxruntime.sh",
        dylib.display()
    );
    ServeConfig::for_tests(models.to_path_buf(), dylib)
}

/// The example job of the OpenAPI document (a real row of the GPUMemNet MLP data).
pub fn example_job() -> Value {
    let spec = serde_json::to_value(gpucast::http::openapi()).unwrap();
    spec["components"]["schemas"]["EstimateRequest"]["example"].clone()
}

/// The real server, running on 127.0.0.1 at an ephemeral port.
pub struct TestApp {
    pub address: String,
    pub port: u16,
    /// The health listener's port, when the config asked for one (`health_listen`).
    pub health_port: Option<u16>,
    /// The running server's state: its permits and readiness flag.
    pub state: AppState,
    pub client: reqwest::Client,
    pub shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    pub server: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// Starts the service on port 0 with the committed models.
pub async fn spawn_app() -> TestApp {
    spawn_app_with(test_config(&models_dir())).await
}

pub async fn spawn_app_with(config: ServeConfig) -> TestApp {
    let app = Application::build(&config)
        .await
        .expect("the application starts");
    run(app)
}

/// Starts the service with the given GPUs (a fake device in tests).
pub async fn spawn_app_with_devices(config: ServeConfig, devices: Arc<dyn GpuDevices>) -> TestApp {
    let app = Application::build_with_devices(&config, devices)
        .await
        .expect("the application starts");
    run(app)
}

fn run(app: Application) -> TestApp {
    let port = app.port();
    let health_port = app.health_port();
    let state = app.state().clone();
    let (shutdown, stop) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(app.run_until(async move {
        let _ = stop.await;
    }));
    TestApp {
        address: format!("http://127.0.0.1:{port}"),
        port,
        health_port,
        state,
        client: reqwest::Client::new(),
        shutdown: Some(shutdown),
        server,
    }
}

/// A POST of a JSON body already serialized, by `client`, to `url`.
pub async fn post_bytes(client: &reqwest::Client, url: &str, body: &[u8]) -> reqwest::Response {
    client
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_vec())
        .send()
        .await
        .expect("an answer")
}

impl TestApp {
    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.client
            .get(format!("{}{path}", self.address))
            .send()
            .await
            .expect("request sent")
    }

    pub async fn post_json(&self, path: &str, body: &Value) -> reqwest::Response {
        self.client
            .post(format!("{}{path}", self.address))
            .json(body)
            .send()
            .await
            .expect("request sent")
    }

    /// The JSON body of a GET, whatever its status (the tests assert on the body).
    pub async fn get_json(&self, path: &str) -> Value {
        self.get(path).await.json().await.expect("a JSON body")
    }

    /// The JSON body of a POST of `body`, whatever its status.
    pub async fn post_json_value(&self, path: &str, body: &Value) -> Value {
        self.post_json(path, body)
            .await
            .json()
            .await
            .expect("a JSON body")
    }

    pub async fn post_raw(
        &self,
        path: &str,
        content_type: &str,
        body: impl Into<reqwest::Body>,
    ) -> reqwest::Response {
        self.client
            .post(format!("{}{path}", self.address))
            .header("content-type", content_type)
            .body(body)
            .send()
            .await
            .expect("request sent")
    }
}
