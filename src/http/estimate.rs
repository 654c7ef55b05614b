//! `POST /v1/estimate` and `POST /v1/estimate/batch`.

use std::collections::BTreeMap;
use std::time::Instant;

use axum::extract::State;
use axum::Json;

use crate::domain::summary::{parse_summary, SummaryFormat};
use crate::domain::{Confidence, Job, MemoryClass, SavedTensors, UncheckedLayer};
use crate::error::ApiError;
use crate::estimators::{ClassAnswer, Estimate, EstimateError};
use crate::http::extract::{parse_json, JsonBody};
use crate::http::types::{
    BatchItemResponse, BatchRequest, BatchResponse, CalibrationResponse, EstimateRequest, FitResponse, EstimateResponse, EstimatorAnswer,
    LatencyResponse, MemoryClassResponse, MemoryResponse, Problem, SummaryFormatRequest, UtilizationResponse,
};
use crate::http::calibration::resolve;
use crate::http::AppState;
use crate::placement::{place, Placement, Target};

/// Longest sequence accepted (tokens per sample).
const MAX_SEQ_LEN: u64 = 1_000_000;

const DRAMA_REASON: &str = "no measured DRAM-activity data exists yet for any family, so no DRAMA model is trained";

/// Estimate one job.
#[utoipa::path(
    post,
    path = "/v1/estimate",
    tag = "estimate",
    request_body = EstimateRequest,
    responses(
        (status = 200, description = "The estimate", body = EstimateResponse),
        (status = 400, description = "Malformed JSON", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body too large", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`gpu: attached` on a host without an NVML device", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "Not JSON", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid job description", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "Overloaded or not ready; see Retry-After", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, fields(family, layers))]
pub async fn estimate(
    State(state): State<AppState>,
    JsonBody(request): JsonBody<EstimateRequest>,
) -> Result<Json<EstimateResponse>, ApiError> {
    let started = Instant::now();
    let job = to_job(&request)?;
    let confidence = Confidence::parse(request.confidence).map_err(|e| ApiError::InvalidInput(e.to_string()))?;
    let target = resolve(&state, request.gpu.as_deref())?;
    tracing::Span::current().record("family", job.family().as_str()).record("layers", job.layers().len());
    let answer = tokio::task::spawn_blocking(move || estimate_job(&state, &job, confidence, target, started))
        .await
        .map_err(|e| ApiError::Internal(format!("estimate task failed: {e}")))??;
    Ok(Json(answer))
}

/// Estimate many jobs; each item succeeds or fails on its own.
#[utoipa::path(
    post,
    path = "/v1/estimate/batch",
    tag = "estimate",
    request_body = BatchRequest,
    responses(
        (status = 200, description = "One outcome per item, in order", body = BatchResponse),
        (status = 400, description = "Malformed JSON", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body too large", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Not a batch, or too many items", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "Overloaded or not ready", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, fields(items))]
pub async fn estimate_batch(
    State(state): State<AppState>,
    JsonBody(request): JsonBody<BatchRequest>,
) -> Result<Json<BatchResponse>, ApiError> {
    let max = state.limits.max_batch_items;
    if request.items.is_empty() || request.items.len() > max {
        return Err(ApiError::InvalidInput(format!(
            "items: between 1 and {max} items are accepted, got {}",
            request.items.len()
        )));
    }
    tracing::Span::current().record("items", request.items.len());
    let items = tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        // Validate every item first, then run the estimators once over all the valid ones.
        let parsed: Vec<Result<(Job, Confidence, Target), ApiError>> = request
            .items
            .into_iter()
            .enumerate()
            .map(|(index, item)| {
                let location = format!("items[{index}].");
                let located = |e: ApiError| e.within(&location);
                let request = parse_json::<EstimateRequest>(item.get().as_bytes(), &format!("items[{index}]"))?;
                let job = to_job(&request).map_err(located)?;
                let confidence = Confidence::parse(request.confidence).map_err(|e| located(ApiError::InvalidInput(e.to_string())))?;
                let target = resolve(&state, request.gpu.as_deref()).map_err(located)?;
                Ok((job, confidence, target))
            })
            .collect();
        let valid: Vec<(&Job, f64)> = parsed.iter().filter_map(|p| p.as_ref().ok()).map(|(job, c, _)| (job, c.get())).collect();
        let mut estimates = state.estimators.estimate_many(&valid).into_iter();
        parsed
            .into_iter()
            .enumerate()
            .map(|(index, item)| {
                let outcome = item.and_then(|(_, confidence, target)| {
                    let estimate = estimates.next().expect("one estimate per valid item");
                    respond(&state, estimate, confidence, target, started)
                });
                match outcome {
                    Ok(estimate) => BatchItemResponse { index, status: 200, estimate: Some(estimate), error: None },
                    Err(error) => {
                        BatchItemResponse { index, status: error.status().as_u16(), estimate: None, error: Some(error.problem()) }
                    }
                }
            })
            .collect()
    })
    .await
    .map_err(|e| ApiError::Internal(format!("batch task failed: {e}")))?;
    Ok(Json(BatchResponse { items }))
}

/// Turns a request into a validated job: from its layer list, or by parsing its summary text.
pub fn to_job(request: &EstimateRequest) -> Result<Job, ApiError> {
    if let Some(seq_len) = request.seq_len.filter(|&l| l == 0 || l > MAX_SEQ_LEN) {
        return Err(ApiError::InvalidInput(format!("seq_len: must be between 1 and {MAX_SEQ_LEN}, got {seq_len}")));
    }
    let job = match (&request.layers, &request.summary) {
        (Some(layers), None) => {
            let layers = layers.iter().map(|l| UncheckedLayer { kind: &l.kind, output_size: l.output_size, params: l.params });
            Job::parse(request.family.as_deref(), request.batch_size, layers)?
        }
        (None, Some(summary)) => {
            let format = match summary.format {
                SummaryFormatRequest::Torchsummary => SummaryFormat::Torchsummary,
                SummaryFormatRequest::ModulePrint => SummaryFormat::ModulePrint,
            };
            let parsed = parse_summary(format, &summary.text, request.batch_size, request.seq_len)
                .map_err(|e| ApiError::InvalidInput(e.to_string()))?;
            let layers = parsed.iter().map(|l| UncheckedLayer { kind: l.kind.as_str(), output_size: l.output_size, params: l.params });
            Job::parse(request.family.as_deref(), request.batch_size, layers)?
        }
        (Some(_), Some(_)) => return Err(ApiError::InvalidInput("layers: give either layers or summary, not both".into())),
        (None, None) => return Err(ApiError::InvalidInput("layers: missing; give layers or summary".into())),
    };
    Ok(job
        .with_training(request.optimizer.as_deref(), request.precision.as_deref())?
        .with_input_shape(request.input_shape.as_deref())?
        .with_saved_tensors(request.saved_tensors.as_ref().map(|saved| SavedTensors {
            per_sample_bytes: saved.per_sample_bytes,
            fixed_bytes: saved.fixed_bytes,
        }))?)
}

/// Runs the estimators (CPU work: call it off the async workers) and records metrics.
fn estimate_job(
    state: &AppState,
    job: &Job,
    confidence: Confidence,
    target: Target,
    started: Instant,
) -> Result<EstimateResponse, ApiError> {
    respond(state, state.estimators.estimate(job, confidence.get()), confidence, target, started)
}

/// Records an estimate's metrics and turns it into the wire answer for its target GPU.
fn respond(
    state: &AppState,
    estimate: Result<Estimate, EstimateError>,
    confidence: Confidence,
    target: Target,
    started: Instant,
) -> Result<EstimateResponse, ApiError> {
    let estimate = estimate?;
    let placement = estimate.mib.as_ref().map(|answer| place(answer, target, &state.profiles));
    for run in &estimate.runs {
        state.metrics.inference_duration_seconds.with_label_values(&[run.name.as_str()]).observe(run.latency.as_secs_f64());
    }
    state
        .metrics
        .predicted_class_total
        .with_label_values(&[estimate.family.as_str(), &estimate.class.class.index.to_string()])
        .inc();
    Ok(to_response(estimate, placement, confidence, started))
}

fn class_response(class: MemoryClass, probabilities: Vec<f32>) -> MemoryClassResponse {
    MemoryClassResponse { index: class.index, lower_mib: class.lower_mib, upper_mib: class.upper_mib, probabilities }
}

fn to_response(estimate: Estimate, placement: Option<Placement>, confidence: Confidence, started: Instant) -> EstimateResponse {
    let Estimate { family, class, classifiers, mib, mib_estimators, mut utilization, runs } = estimate;
    let versions: BTreeMap<String, String> = runs.iter().map(|r| (r.name.clone(), r.version.clone())).collect();
    let version_of = |name: &str| versions.get(name).cloned().unwrap_or_default();
    let mut estimators: BTreeMap<String, EstimatorAnswer> = classifiers
        .into_iter()
        .map(|(name, ClassAnswer { class, probabilities })| {
            let answer = EstimatorAnswer {
                version: version_of(&name),
                class: Some(class_response(class, probabilities)),
                estimate_mib: None,
            };
            (name, answer)
        })
        .collect();
    for (name, figure) in mib_estimators {
        let answer = EstimatorAnswer { version: version_of(&name), class: None, estimate_mib: Some(round_mib(figure)) };
        estimators.insert(name, answer);
    }
    let drama = utilization.remove("drama");
    EstimateResponse {
        family: family.as_str().to_string(),
        memory: MemoryResponse {
            // The figures for the target GPU (calibrated when it has a profile).
            estimate_mib: placement.as_ref().map(|p| round_mib(p.estimate_mib)).or(mib.map(|m| round_mib(m.estimate_mib))),
            // Rounded up: a bound must not shrink in rounding.
            upper_bound_mib: placement.as_ref().map(|p| p.upper_bound_mib.ceil()).or(mib.map(|m| m.upper_bound_mib.ceil())),
            confidence: confidence.get(),
            class: class_response(class.class, class.probabilities),
            estimators,
        },
        utilization: UtilizationResponse {
            smact: utilization.remove("smact"),
            smocc: utilization.remove("smocc"),
            drama,
            drama_reason: drama.is_none().then(|| DRAMA_REASON.to_string()),
        },
        latency_us: LatencyResponse {
            total: started.elapsed().as_secs_f64() * 1e6,
            estimators: runs.iter().map(|r| (r.name.clone(), r.latency.as_secs_f64() * 1e6)).collect(),
        },
        estimator_versions: versions,
        fit: placement.as_ref().map(|p| FitResponse {
            gpu: p.target.gpu.clone(),
            capacity_mib: p.target.capacity_mib,
            fits: p.fit.fits,
            max_colocated: p.fit.max_colocated,
        }),
        calibration: placement.as_ref().map(|p| CalibrationResponse {
            gpu: p.target.gpu.clone(),
            profile_used: p.profile_observations.is_some(),
            observations: p.profile_observations.unwrap_or(0),
        }),
    }
}

fn round_mib(mib: f64) -> f64 {
    (mib * 10.0).round() / 10.0
}
