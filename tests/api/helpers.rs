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
    assert!(
        dylib.exists(),
        "{} is missing: run scripts/fetch-onnxruntime.sh",
        dylib.display()
    );
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
    let app = Application::build(&config)
        .await
        .expect("the application starts");
    let address = format!("http://127.0.0.1:{}", app.port());
    let (shutdown, stop) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(app.run_until(async move {
        let _ = stop.await;
    }));
    TestApp {
        address,
        client: reqwest::Client::new(),
        shutdown: Some(shutdown),
        server,
    }
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

/// The example job of the OpenAPI document (a real row of the GPUMemNet MLP data).
pub fn example_job() -> Value {
    let spec = gpucast::http::openapi();
    let schema = serde_json::to_value(&spec).unwrap();
    schema["components"]["schemas"]["EstimateRequest"]["example"].clone()
}

/// Starts the service with the given GPUs (a fake device in tests).
pub async fn spawn_app_with_devices(
    config: ServeConfig,
    devices: std::sync::Arc<dyn gpucast::devices::GpuDevices>,
) -> TestApp {
    let app = Application::build_with_devices(&config, devices)
        .await
        .expect("the application starts");
    let address = format!("http://127.0.0.1:{}", app.port());
    let (shutdown, stop) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(app.run_until(async move {
        let _ = stop.await;
    }));
    TestApp {
        address,
        client: reqwest::Client::new(),
        shutdown: Some(shutdown),
        server,
    }
}

/// Jobs of the committed MLP held-out split with their measured peaks.
pub fn held_out_mlp_jobs() -> Vec<(Value, f64)> {
    use std::io::BufRead;
    let file = std::fs::File::open(repo_root().join("data/mlp/test.jsonl.gz")).unwrap();
    std::io::BufReader::new(flate2::read::GzDecoder::new(file))
        .lines()
        .map(|line| {
            let row: Value = serde_json::from_str(&line.unwrap()).unwrap();
            (
                row["job"].clone(),
                row["measured_peak_mib"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// The descriptions `describe` wrote for the timm training models, read once per test binary
/// (unoptimised, parsing them takes a good part of a second).
fn descriptions() -> &'static [Value] {
    static DESCRIPTIONS: std::sync::OnceLock<Vec<Value>> = std::sync::OnceLock::new();
    DESCRIPTIONS.get_or_init(|| {
        use std::io::BufRead;
        let file =
            std::fs::File::open(repo_root().join("data/timm/descriptions.jsonl.gz")).unwrap();
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
    descriptions()
        .iter()
        .find(|d| d["model"] == model)
        .expect("the model is described")
        .clone()
}

/// The committed models' manifest, as the service loads it.
pub fn committed_manifest() -> Value {
    serde_json::from_str(&std::fs::read_to_string(models_dir().join("manifest.json")).unwrap())
        .unwrap()
}

/// The log ratio at `confidence` of a list of residual quantiles (a manifest's
/// `residual_quantiles`).
pub fn log_ratio_at(residual_quantiles: &Value, confidence: f64) -> f64 {
    residual_quantiles
        .as_array()
        .unwrap()
        .iter()
        .find(|level| level["confidence"] == confidence)
        .unwrap_or_else(|| panic!("no quantile at {confidence}: {residual_quantiles}"))["log_ratio"]
        .as_f64()
        .unwrap()
}

/// The committed `simulated` block's `cuda_context_mib`: what every simulated figure adds to the
/// reserved peak.
pub fn simulated_context_mib() -> f64 {
    committed_manifest()["simulated"]["cuda_context_mib"]
        .as_f64()
        .expect("simulated.cuda_context_mib")
}

/// The committed `simulated` block's log ratio at `confidence`.
pub fn simulated_log_ratio(confidence: f64) -> f64 {
    log_ratio_at(
        &committed_manifest()["simulated"]["residual_quantiles"],
        confidence,
    )
}

/// Whether a manifest entry is a regressor that corrects the simulated figure.
pub fn requires_simulation(entry: &Value) -> bool {
    entry["requires"]
        .as_array()
        .is_some_and(|r| r.iter().any(|x| x == "simulation"))
}

/// A copy of the committed models without what corrects the simulated figure: the entries that
/// require a simulation, their graphs (unless another entry uses them), and the training domain
/// (`simulated.domain` and its file). Simulated jobs are answered by physics alone there,
/// whatever the committed models learned.
pub fn models_without_simulation_regressors() -> tempfile::TempDir {
    let models = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(models_dir()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), models.path().join(entry.file_name())).unwrap();
    }
    let manifest_path = models.path().join("manifest.json");
    let mut manifest = committed_manifest();
    let estimators = manifest["estimators"].as_array_mut().unwrap();
    let mut removed: Vec<String> = estimators
        .iter()
        .filter(|e| requires_simulation(e))
        .map(|e| e["file"].as_str().unwrap().to_string())
        .collect();
    removed.sort_unstable();
    removed.dedup();
    estimators.retain(|e| !requires_simulation(e));
    for file in removed
        .iter()
        .filter(|f| !estimators.iter().any(|e| e["file"] == f.as_str()))
    {
        std::fs::remove_file(models.path().join(file)).unwrap();
    }
    if let Some(domain) = manifest["simulated"]
        .as_object_mut()
        .and_then(|s| s.remove("domain"))
    {
        std::fs::remove_file(models.path().join(domain["file"].as_str().unwrap())).unwrap();
    }
    std::fs::write(&manifest_path, manifest.to_string()).unwrap();
    models
}

/// The simulation `gpucast_describe` wrote for `model` at `batch` (data/timm/simulations.jsonl.gz).
pub fn committed_simulation(model: &str, batch: u64) -> Value {
    use std::io::BufRead;
    let file = std::fs::File::open(repo_root().join("data/timm/simulations.jsonl.gz")).unwrap();
    std::io::BufReader::new(flate2::read::GzDecoder::new(file))
        .lines()
        .map(|line| serde_json::from_str::<Value>(&line.unwrap()).unwrap())
        .find(|entry| entry["model"] == model)
        .unwrap_or_else(|| panic!("{model} is not simulated"))["simulations"][batch.to_string()]
    .clone()
}
