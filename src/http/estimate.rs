//! `POST /v1/estimate` and `POST /v1/estimate/batch`.

use std::collections::BTreeMap;
use std::time::Instant;

use axum::extract::State;
use axum::Json;

use crate::domain::summary::{parse_summary, SummaryFormat};
use crate::domain::physics::BreakdownSource;
use crate::domain::{
    Confidence, Job, MemoryClass, MemoryFraction, SavedTensors, SimulatedCategories, UncheckedLayer, UncheckedSimulation,
};
use crate::error::ApiError;
use crate::estimators::{ClassAnswer, Estimate, EstimateError, Query};
use crate::http::calibration::resolve;
use crate::http::extract::{parse_json, JsonBody};
use crate::http::types::{
    BatchItemResponse, BatchRequest, BatchResponse, BreakdownResponse, BreakdownSourceName, CalibrationResponse, EstimateRequest,
    EstimateResponse, EstimatorAnswer, FitBasisName, FitResponse, LatencyResponse, MemoryClassResponse, MemoryResponse, Problem,
    SummaryFormatRequest, UtilizationResponse,
};
use crate::http::AppState;
use crate::placement::{place, FitBasis, Placement, Target};

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
    let fraction = memory_fraction(&request)?;
    let target = resolve(&state, request.gpu.as_deref())?;
    tracing::Span::current().record("family", job.family().as_str()).record("layers", job.layers().len());
    let answer = tokio::task::spawn_blocking(move || estimate_job(&state, &job, confidence, fraction, target, started))
        .await
        .map_err(|e| ApiError::Internal(format!("estimate task failed: {e}")))??;
    Ok(Json(answer))
}

/// A valid batch item: its job, and what the answer is asked for.
type Item = (Job, Confidence, Option<MemoryFraction>, Target);

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
        let parsed: Vec<Result<Item, ApiError>> = request
            .items
            .into_iter()
            .enumerate()
            .map(|(index, item)| {
                let location = format!("items[{index}].");
                let located = |e: ApiError| e.within(&location);
                let request = parse_json::<EstimateRequest>(item.get().as_bytes(), &format!("items[{index}]"))?;
                let job = to_job(&request).map_err(located)?;
                let confidence = Confidence::parse(request.confidence).map_err(|e| located(ApiError::InvalidInput(e.to_string())))?;
                let fraction = memory_fraction(&request).map_err(located)?;
                let target = resolve(&state, request.gpu.as_deref()).map_err(located)?;
                Ok((job, confidence, fraction, target))
            })
            .collect();
        let valid: Vec<Query> = parsed
            .iter()
            .filter_map(|p| p.as_ref().ok())
            .map(|(job, c, _, target)| Query { job, confidence: c.get(), capacity_mib: target.capacity_mib })
            .collect();
        let mut estimates = state.estimators.estimate_queries(&valid).into_iter();
        parsed
            .into_iter()
            .enumerate()
            .map(|(index, item)| {
                let outcome = item.and_then(|(_, confidence, fraction, target)| {
                    let estimate = estimates.next().expect("one estimate per valid item");
                    respond(&state, estimate, confidence, fraction, target, started)
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
    let simulation = request.simulation.as_ref().map(|s| UncheckedSimulation {
        batch_size: s.batch_size,
        optimizer: s.optimizer.as_deref(),
        precision: s.precision.as_deref(),
        allocated_peak_bytes: s.allocated_peak_bytes,
        reserved_peak_bytes: s.reserved_peak_bytes,
        min_capacity_bytes: s.min_capacity_bytes,
        breakdown_at_peak: SimulatedCategories {
            parameters: s.breakdown_at_peak.parameters,
            gradients: s.breakdown_at_peak.gradients,
            optimizer_state: s.breakdown_at_peak.optimizer_state,
            activations: s.breakdown_at_peak.activations,
            temporaries: s.breakdown_at_peak.temporaries,
        },
        attention: s.attention.as_deref(),
        interpolated: s.interpolated.unwrap_or(false),
    });
    Ok(job
        .with_training(request.optimizer.as_deref(), request.precision.as_deref())?
        .with_input_shape(request.input_shape.as_deref())?
        .with_saved_tensors(request.saved_tensors.as_ref().map(|saved| SavedTensors {
            per_sample_bytes: saved.per_sample_bytes,
            fixed_bytes: saved.fixed_bytes,
        }))?
        // After the training settings: the simulation must be of the same optimizer and precision.
        .with_simulation(simulation)?)
}

fn memory_fraction(request: &EstimateRequest) -> Result<Option<MemoryFraction>, ApiError> {
    MemoryFraction::parse(request.memory_fraction).map_err(|e| ApiError::InvalidInput(e.to_string()))
}

/// Runs the estimators (CPU work: call it off the async workers) and records metrics.
fn estimate_job(
    state: &AppState,
    job: &Job,
    confidence: Confidence,
    fraction: Option<MemoryFraction>,
    target: Target,
    started: Instant,
) -> Result<EstimateResponse, ApiError> {
    let estimate = state.estimators.estimate_on(job, confidence.get(), target.capacity_mib);
    respond(state, estimate, confidence, fraction, target, started)
}

/// Records an estimate's metrics and turns it into the wire answer for its target GPU.
fn respond(
    state: &AppState,
    estimate: Result<Estimate, EstimateError>,
    confidence: Confidence,
    fraction: Option<MemoryFraction>,
    target: Target,
    started: Instant,
) -> Result<EstimateResponse, ApiError> {
    let mut estimate = estimate?;
    let placement = estimate.mib.as_ref().map(|answer| place(answer, target, &state.profiles, &estimate.physics, fraction));
    // The class contains the figure answered, which a calibration profile may have moved.
    if let Some(placement) = &placement {
        estimate.class = estimate.class_for(Some(placement.estimate_mib));
    }
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
    let breakdown = placement.as_ref().map(|p| {
        let parts = estimate.physics.breakdown(p.estimate_mib).rounded(p.estimate_mib);
        BreakdownResponse {
            parameters: parts.parameters,
            gradients: parts.gradients,
            optimizer_state: parts.optimizer_state,
            activations: parts.activations,
            temporaries: parts.temporaries,
            allocator_cache: parts.allocator_cache,
            cuda_context: parts.cuda_context,
        }
    });
    let breakdown_source = placement.as_ref().map(|_| match estimate.physics.source {
        BreakdownSource::Simulation => BreakdownSourceName::Simulation,
        BreakdownSource::Analytic => BreakdownSourceName::Analytic,
    });
    let peaks = estimate.physics.simulated;
    let Estimate { family, class, classifiers, mib, mib_estimators, mut utilization, runs, .. } = estimate;
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
            floored: placement.as_ref().is_some_and(|p| p.floored),
            class: class_response(class.class, class.probabilities),
            breakdown,
            breakdown_source,
            allocated_peak_mib: peaks.map(|p| round_mib(p.allocated_mib)),
            reserved_peak_mib: peaks.map(|p| round_mib(p.reserved_mib)),
            min_capacity_mib: peaks.map(|p| round_mib(p.min_capacity_mib)),
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
            basis: match p.fit_basis {
                FitBasis::UpperBound => FitBasisName::UpperBound,
                FitBasis::Simulation => FitBasisName::Simulation,
            },
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
