//! ONNX Runtime behind the [`Model`] trait: one process-wide environment, loaded from the
//! shared library of the PyPI `onnxruntime` wheel, and a small pool of sessions per model
//! (`Session::run` needs `&mut`, so concurrent requests each take a session).

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use ort::environment::Environment;
use ort::session::builder::GraphOptimizationLevel;
use ort::session::Session;
use ort::value::TensorRef;

/// What a model is fed: `n_rows` jobs at once, row-major.
#[derive(Debug, Clone, Copy)]
pub enum ModelInput<'a> {
    /// Aggregate features, `[n_rows, rows.len() / n_rows]`.
    Aggregate { rows: &'a [f32], n_rows: usize },
    /// Layer tokens of jobs that all have `n_tokens` layers (no padding needed).
    Sequence {
        kind_ids: &'a [i64],
        features: &'a [f32],
        n_rows: usize,
        n_tokens: usize,
        n_features: usize,
    },
}

#[derive(Debug, Clone, thiserror::Error)]
#[error("inference failed: {0}")]
pub struct InferenceError(pub String);

/// A loaded model: `n_rows` jobs in, their outputs out, row-major (`[n_rows, outputs]`).
pub trait Model: Send + Sync {
    fn infer(&self, input: ModelInput<'_>) -> Result<Vec<f32>, InferenceError>;
}

static ENVIRONMENT: OnceLock<Result<Environment, String>> = OnceLock::new();

/// The process-wide ONNX Runtime environment (ONNX Runtime allows one per process), loading
/// the library from `dylib` on first use.
pub fn environment(dylib: &Path) -> Result<&'static Environment, String> {
    ENVIRONMENT
        .get_or_init(|| {
            let builder = ort::init_from(dylib)
                .map_err(|e| format!("cannot load ONNX Runtime from {}: {e}", dylib.display()))?;
            builder
                .with_name("gpucast")
                .with_telemetry(false)
                .build()
                .map_err(|e| format!("cannot start ONNX Runtime: {e}"))
        })
        .as_ref()
        .map_err(Clone::clone)
}

pub struct OnnxModel {
    sessions: Vec<Mutex<Session>>,
    next: AtomicUsize,
    output: String,
}

impl OnnxModel {
    /// Builds `pool_size` sessions from the model bytes and checks the graph's input and
    /// output names against what the service will feed and read.
    pub fn load(
        environment: &Environment,
        bytes: &[u8],
        expected_inputs: &[&str],
        output: &str,
        pool_size: usize,
    ) -> Result<OnnxModel, String> {
        let mut sessions = Vec::with_capacity(pool_size.max(1));
        for _ in 0..pool_size.max(1) {
            let session = Session::builder(environment)
                .and_then(|b| {
                    b.with_optimization_level(GraphOptimizationLevel::Level3)
                        .map_err(Into::into)
                })
                // No arena: it keeps the largest batch's buffers for good, per session; the
                // models are small, so plain allocations cost little and memory stays flat.
                .and_then(|b| {
                    b.with_execution_providers([ort::ep::CPU::default()
                        .with_arena_allocator(false)
                        .build()])
                        .map_err(Into::into)
                })
                .and_then(|b| b.with_memory_pattern(false).map_err(Into::into))
                // Tiny models: a single thread per run is fastest; parallelism comes from
                // concurrent requests using different sessions of the pool.
                .and_then(|b| b.with_intra_threads(1).map_err(Into::into))
                .and_then(|mut b| b.commit_from_memory(bytes))
                .map_err(|e| format!("not a loadable ONNX model: {e}"))?;
            sessions.push(Mutex::new(session));
        }
        let session = sessions[0]
            .lock()
            .map_err(|_| "session lock poisoned".to_string())?;
        let mut inputs: Vec<&str> = session.inputs().iter().map(|i| i.name()).collect();
        inputs.sort_unstable();
        let mut expected: Vec<&str> = expected_inputs.to_vec();
        expected.sort_unstable();
        if inputs != expected {
            return Err(format!(
                "graph inputs are {inputs:?}, expected {expected:?}"
            ));
        }
        if !session.outputs().iter().any(|o| o.name() == output) {
            return Err(format!("graph has no output named '{output}'"));
        }
        drop(session);
        Ok(OnnxModel {
            sessions,
            next: AtomicUsize::new(0),
            output: output.to_string(),
        })
    }

    fn run_on<R>(
        &self,
        f: impl FnOnce(&mut Session) -> Result<R, ort::Error>,
    ) -> Result<R, InferenceError> {
        // Take any idle session; if all are busy, wait on one chosen round-robin.
        let mut guard = self.sessions.iter().find_map(|s| s.try_lock().ok());
        if guard.is_none() {
            let index = self.next.fetch_add(1, Ordering::Relaxed) % self.sessions.len();
            guard = Some(
                self.sessions[index]
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()),
            );
        }
        let mut session = guard.expect("a session was taken above");
        f(&mut session).map_err(|e| InferenceError(e.to_string()))
    }
}

impl Model for OnnxModel {
    fn infer(&self, input: ModelInput<'_>) -> Result<Vec<f32>, InferenceError> {
        let output = self.output.as_str();
        self.run_on(|session| {
            let outputs = match input {
                ModelInput::Aggregate { rows, n_rows } => {
                    // One row a run: ONNX Runtime's kernels split a batch's sums differently
                    // from one row's, and a job's answer must not depend on its neighbours.
                    let width = rows.len() / n_rows.max(1);
                    let mut values = Vec::with_capacity(rows.len());
                    for row in rows.chunks_exact(width.max(1)) {
                        let features = TensorRef::from_array_view(([1, width], row))?;
                        let outputs = session.run(ort::inputs!["features" => features])?;
                        let (_, row_values) = outputs[output].try_extract_tensor::<f32>()?;
                        values.extend_from_slice(row_values);
                    }
                    return Ok(values);
                }
                ModelInput::Sequence {
                    kind_ids,
                    features,
                    n_rows,
                    n_tokens,
                    n_features,
                } => {
                    let mask = vec![1.0f32; n_rows * n_tokens];
                    let kind_ids = TensorRef::from_array_view(([n_rows, n_tokens], kind_ids))?;
                    let token_features =
                        TensorRef::from_array_view(([n_rows, n_tokens, n_features], features))?;
                    let mask = TensorRef::from_array_view(([n_rows, n_tokens], mask.as_slice()))?;
                    session.run(ort::inputs![
                        "kind_ids" => kind_ids,
                        "token_features" => token_features,
                        "mask" => mask,
                    ])?
                }
            };
            let (_, values) = outputs[output].try_extract_tensor::<f32>()?;
            Ok(values.to_vec())
        })
    }
}
