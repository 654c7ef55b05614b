//! `POST /v1/estimate` and `POST /v1/estimate/batch`.

use std::collections::BTreeMap;
use std::time::Instant;

use axum::extract::State;
use axum::Json;

use crate::domain::physics::BreakdownSource;
use crate::domain::summary::{parse_summary, SummaryFormat};
use crate::domain::{
    Confidence, Job, MemoryClass, MemoryFraction, SavedTensors, SimulatedCategories,
    UncheckedLayer, UncheckedSimulation,
};
use crate::error::ApiError;
use crate::estimators::{ClassAnswer, Estimate, EstimateError, Query};
use crate::http::calibration::resolve;
use crate::http::extract::{parse_json, JsonBody};
use crate::http::types::{
    BatchItemResponse, BatchRequest, BatchResponse, BreakdownResponse, BreakdownSourceName,
    CalibrationResponse, EstimateRequest, EstimateResponse, EstimatorAnswer, ExtrapolationResponse,
    FitBasisName, FitResponse, LatencyResponse, MemoryClassResponse, MemoryResponse, Problem,
    SummaryFormatRequest, UtilizationResponse,
};
use crate::http::AppState;
use crate::placement::{place, FitBasis, Placement, Target};

/// Longest sequence accepted (tokens per sample).
const MAX_SEQ_LEN: u64 = 1_000_000;

const DRAMA_REASON: &str =
    "no measured DRAM-activity data exists yet for any family, so no DRAMA model is trained";

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
    let Item {
        job,
        confidence,
        fraction,
        target,
    } = Item::of(&state, &request)?;
    tracing::Span::current()
        .record("family", job.family().as_str())
        .record("layers", job.layers().len());
    let answer = tokio::task::spawn_blocking(move || {
        estimate_job(&state, &job, confidence, fraction, target, started)
    })
    .await
    .map_err(|e| ApiError::Internal(format!("estimate task failed: {e}")))??;
    Ok(Json(answer))
}

/// A valid request: its job, and what the answer is asked for.
pub struct Item {
    pub job: Job,
    pub confidence: Confidence,
    pub fraction: Option<MemoryFraction>,
    pub target: Target,
}

impl Item {
    /// Validates a request as both estimate routes do.
    pub fn of(state: &AppState, request: &EstimateRequest) -> Result<Item, ApiError> {
        let job = to_job(request)?;
        let confidence = Confidence::parse(request.confidence)
            .map_err(|e| ApiError::InvalidInput(e.to_string()))?;
        let fraction = memory_fraction(request)?;
        let target = resolve(state, request.gpu.as_deref())?;
        Ok(Item {
            job,
            confidence,
            fraction,
            target,
        })
    }
}

/// Answers valid requests as `POST /v1/estimate/batch` does, running each model once over all
/// of them: CPU work, to be called off the async workers. In process it answers thousands of
/// jobs without the JSON of a round trip (the physical-floor sweep of the tests does so).
pub fn answer_items(
    state: &AppState,
    items: &[Item],
    started: Instant,
) -> Vec<Result<EstimateResponse, ApiError>> {
    let queries: Vec<Query> = items
        .iter()
        .map(|item| Query {
            job: &item.job,
            confidence: item.confidence.get(),
            capacity_mib: item.target.capacity_mib,
        })
        .collect();
    state
        .estimators
        .estimate_queries(&queries)
        .into_iter()
        .zip(items)
        .map(|(estimate, item)| {
            respond(
                state,
                estimate,
                item.confidence,
                item.fraction,
                item.target.clone(),
                started,
            )
        })
        .collect()
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
        let (mut valid, mut errors) = (
            Vec::with_capacity(request.items.len()),
            Vec::with_capacity(request.items.len()),
        );
        for (index, item) in request.items.into_iter().enumerate() {
            let checked =
                parse_json::<EstimateRequest>(item.get().as_bytes(), &format!("items[{index}]"))
                    .and_then(|request| {
                        Item::of(&state, &request)
                            .map_err(|e| e.within(&format!("items[{index}].")))
                    });
            match checked {
                Ok(item) => {
                    valid.push(item);
                    errors.push(None);
                }
                Err(error) => errors.push(Some(error)),
            }
        }
        let mut answers = answer_items(&state, &valid, started).into_iter();
        errors
            .into_iter()
            .enumerate()
            .map(|(index, error)| {
                let outcome = match error {
                    Some(error) => Err(error),
                    None => answers.next().expect("one answer per valid item"),
                };
                match outcome {
                    Ok(estimate) => BatchItemResponse {
                        index,
                        status: 200,
                        estimate: Some(estimate),
                        error: None,
                    },
                    Err(error) => BatchItemResponse {
                        index,
                        status: error.status().as_u16(),
                        estimate: None,
                        error: Some(error.problem()),
                    },
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
        return Err(ApiError::InvalidInput(format!(
            "seq_len: must be between 1 and {MAX_SEQ_LEN}, got {seq_len}"
        )));
    }
    let job = match (&request.layers, &request.summary) {
        (Some(layers), None) => {
            let layers = layers.iter().map(|l| UncheckedLayer {
                kind: &l.kind,
                output_size: l.output_size,
                params: l.params,
            });
            Job::parse(request.family.as_deref(), request.batch_size, layers)?
        }
        (None, Some(summary)) => {
            let format = match summary.format {
                SummaryFormatRequest::Torchsummary => SummaryFormat::Torchsummary,
                SummaryFormatRequest::ModulePrint => SummaryFormat::ModulePrint,
            };
            let parsed = parse_summary(format, &summary.text, request.batch_size, request.seq_len)
                .map_err(|e| ApiError::InvalidInput(e.to_string()))?;
            let layers = parsed.iter().map(|l| UncheckedLayer {
                kind: l.kind.as_str(),
                output_size: l.output_size,
                params: l.params,
            });
            Job::parse(request.family.as_deref(), request.batch_size, layers)?
        }
        (Some(_), Some(_)) => {
            return Err(ApiError::InvalidInput(
                "layers: give either layers or summary, not both".into(),
            ))
        }
        (None, None) => {
            return Err(ApiError::InvalidInput(
                "layers: missing; give layers or summary".into(),
            ))
        }
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
    MemoryFraction::parse(request.memory_fraction)
        .map_err(|e| ApiError::InvalidInput(e.to_string()))
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
    let estimate = state
        .estimators
        .estimate_on(job, confidence.get(), target.capacity_mib);
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
    let placement = estimate
        .mib
        .as_ref()
        .map(|answer| place(answer, target, &state.profiles, &estimate.physics, fraction));
    // The class contains the figure answered, which a calibration profile may have moved.
    if let Some(placement) = &placement {
        estimate.class = estimate.class_for(Some(placement.estimate_mib));
    }
    for run in &estimate.runs {
        state
            .metrics
            .inference_duration_seconds
            .with_label_values(&[run.name.as_str()])
            .observe(run.latency.as_secs_f64());
    }
    state
        .metrics
        .predicted_class_total
        .with_label_values(&[
            estimate.family.as_str(),
            &estimate.class.class.index.to_string(),
        ])
        .inc();
    Ok(to_response(estimate, placement, confidence, started))
}

fn class_response(class: MemoryClass, probabilities: Vec<f32>) -> MemoryClassResponse {
    MemoryClassResponse {
        index: class.index,
        lower_mib: class.lower_mib,
        upper_mib: class.upper_mib,
        probabilities,
    }
}

fn to_response(
    estimate: Estimate,
    placement: Option<Placement>,
    confidence: Confidence,
    started: Instant,
) -> EstimateResponse {
    let breakdown = placement.as_ref().map(|p| {
        let parts = estimate
            .physics
            .breakdown(p.estimate_mib)
            .rounded(p.estimate_mib);
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
    let extrapolation = estimate.extrapolation.map(|e| ExtrapolationResponse {
        distance: e.reach.distance.map(round_3),
        typical_distance: round_3(e.reach.typical_distance),
        ratio: Some(e.reach.ratio).filter(|r| r.is_finite()).map(round_3),
        outside_setup: e.reach.outside_setup,
        correction_applied: e.correction_applied,
        bound_widened_by: round_3(e.bound_widened_by),
    });
    let Estimate {
        family,
        class,
        classifiers,
        mib,
        mib_estimators,
        mut utilization,
        runs,
        ..
    } = estimate;
    let versions: BTreeMap<String, String> = runs
        .iter()
        .map(|r| (r.name.clone(), r.version.clone()))
        .collect();
    let version_of = |name: &str| versions.get(name).cloned().unwrap_or_default();
    let mut estimators: BTreeMap<String, EstimatorAnswer> = classifiers
        .into_iter()
        .map(
            |(
                name,
                ClassAnswer {
                    class,
                    probabilities,
                },
            )| {
                let answer = EstimatorAnswer {
                    version: version_of(&name),
                    class: Some(class_response(class, probabilities)),
                    estimate_mib: None,
                };
                (name, answer)
            },
        )
        .collect();
    for (name, figure) in mib_estimators {
        let answer = EstimatorAnswer {
            version: version_of(&name),
            class: None,
            estimate_mib: Some(round_mib(figure)),
        };
        estimators.insert(name, answer);
    }
    let drama = utilization.remove("drama");
    EstimateResponse {
        family: family.as_str().to_string(),
        memory: MemoryResponse {
            // The figures for the target GPU (calibrated when it has a profile).
            estimate_mib: placement
                .as_ref()
                .map(|p| round_mib(p.estimate_mib))
                .or(mib.map(|m| round_mib(m.estimate_mib))),
            // Rounded up: a bound must not shrink in rounding.
            upper_bound_mib: placement
                .as_ref()
                .map(|p| p.upper_bound_mib.ceil())
                .or(mib.map(|m| m.upper_bound_mib.ceil())),
            confidence: confidence.get(),
            floored: placement.as_ref().is_some_and(|p| p.floored),
            class: class_response(class.class, class.probabilities),
            breakdown,
            breakdown_source,
            allocated_peak_mib: peaks.map(|p| round_mib(p.allocated_mib)),
            reserved_peak_mib: peaks.map(|p| round_mib(p.reserved_mib)),
            min_capacity_mib: peaks.map(|p| round_mib(p.min_capacity_mib)),
            estimators,
            extrapolation,
        },
        utilization: UtilizationResponse {
            smact: utilization.remove("smact"),
            smocc: utilization.remove("smocc"),
            drama,
            drama_reason: drama.is_none().then(|| DRAMA_REASON.to_string()),
        },
        latency_us: LatencyResponse {
            total: started.elapsed().as_secs_f64() * 1e6,
            estimators: runs
                .iter()
                .map(|r| (r.name.clone(), r.latency.as_secs_f64() * 1e6))
                .collect(),
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

fn round_3(value: f64) -> f64 {
    (value * 1000.0).round() / 1000.0
}
