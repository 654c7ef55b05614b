//! What the service learns per GPU: `GET /v1/calibration/profiles`, `POST /v1/calibration/observations`,
//! `POST /v1/calibration/watch`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{FromRequest, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::value::RawValue;

use crate::api::parse::parse_json;
use crate::api::types::{
    EnvironmentFitResponse, EstimateRequest, ObservationRequest, ObservationsResponse, Problem,
    ProfileResponse, ProfilesResponse, StepTimeFitResponse, WatchRequest, WatchResponse,
};
use crate::calibration::db::{NewObservation, Source};
use crate::calibration::environment::{CONTEXT_RANGE_MIB, FACTOR_RANGE};
use crate::calibration::profile::{CalibrationProfile, ProfileError};
use crate::calibration::step_time;
use crate::calibration::store::Update;
use crate::devices::watch::{AddError, WatchConfig, WatchDone};
use crate::devices::CUSTOM_PREFIX;
use crate::engine::cost::Cost;
use crate::engine::validate::{self, resolve, to_job};
use crate::engine::Deadline;
use crate::error::ApiError;
use crate::estimators::FIRST_PRINCIPLES;
use crate::http::auth::require_write_access;
use crate::http::extract::{JsonBody, JsonObjectOrArray};
use crate::http::idempotency::{self, Claim};
use crate::http::pool::Work;
use crate::http::AppState;
use crate::placement::Target;
use crate::placement::MAX_CUSTOM_PROFILES;

/// Observations accepted in one call.
const MAX_OBSERVATIONS: usize = 1000;
/// Environments with a profile of their own, per GPU.
pub const MAX_ENVIRONMENTS_PER_GPU: usize = 32;
/// Profiles in all (GPU and environment keys): each is a set of metric series and a fit held
/// in memory, and the catalogue's cards times their environments would otherwise reach
/// thousands.
pub const MAX_PROFILES: usize = 512;

/// Calibration profiles learned so far.
#[utoipa::path(get, path = "/v1/calibration/profiles", tag = "devices", responses((status = 200, body = ProfilesResponse)))]
pub async fn profiles(State(state): State<AppState>) -> Json<ProfilesResponse> {
    Json(ProfilesResponse {
        profiles: state
            .engine
            .profiles
            .list()
            .iter()
            .map(profile_response)
            .collect(),
    })
}

/// Record measured peaks of jobs on a GPU (optionally in a software `environment`), in one
/// transaction: all or none; the profiles of the GPU and of the GPU in that environment are
/// derived again from the stored observations.
///
/// The observations are priced like a batch of estimates (each job on its card) and refused
/// above the budget before any work; they are validated on the estimate threads, and the work
/// stops when the caller is gone. The recording is committed only with time to spare before
/// the request timeout, so a call answered 503 recorded nothing; one whose answer was lost
/// may have been recorded. To retry safely, send an
/// `Idempotency-Key` header (1 to 255 visible ASCII characters, e.g. a UUID per batch): the
/// first call with a key records and its answer is remembered (24 hours, the last 10,000 keys,
/// in this process); a call with the same key and the same body returns that answer again with
/// `Idempotency-Replayed: true` and records nothing (while the first call still runs, it waits
/// for it); the same key with another body is refused (422). A call that fails records nothing
/// and frees its key.
#[utoipa::path(
    post,
    path = "/v1/calibration/observations",
    tag = "devices",
    request_body = crate::api::types::ObservationsRequest,
    params(
        ("Idempotency-Key" = Option<String>, Header, description = "Makes retries safe: a call with a key already recorded returns the original answer and records nothing again"),
    ),
    // The token is required when the service is started with one; without one, writes are
    // open on a loopback-only listener and refused (403) on any other.
    security((), ("bearer" = [])),
    responses(
        (status = 200, description = "Recorded (or, for a key already recorded, the original answer replayed); the refitted profiles", body = ObservationsResponse,
            headers(("Idempotency-Replayed" = String, description = "`true` when the answer is the one recorded earlier under the same Idempotency-Key"))),
        (status = 400, description = "Malformed JSON", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or wrong bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "Writes disabled: no token configured and the listener is not loopback-only", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`attached` without an NVML device", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "Not `Content-Type: application/json` (a write must say it is JSON), or a compressed body", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid observation (its rules across fields are in `ObservationRequest`), more than 1,000 of them, their jobs priced above the request budget (--max-request-cost), or an Idempotency-Key used with another body", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The calibration store is unavailable (nothing was recorded), the service is overloaded, or the request timeout passed (nothing was recorded); see Retry-After", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
pub async fn observe(
    State(state): State<AppState>,
    headers: HeaderMap,
    request: Request,
) -> Result<Response, ApiError> {
    // The caller's right to write first: an unauthorised body is not even parsed.
    require_write_access(&state, &headers)?;
    let JsonObjectOrArray(body) =
        JsonObjectOrArray::<Box<RawValue>>::from_request(request, &state).await?;
    let key = idempotency::key(&headers)?;
    let fingerprint = key.as_ref().map(|_| idempotency::fingerprint(body.get()));
    // Parsed item by item into the typed request (not through a JSON value, which would keep
    // the last of two duplicate keys), so that errors name the field.
    // Each with its job's JSON text as posted, which is what is stored.
    let observations: Vec<Posted> = if body.get().trim_start().starts_with('[') {
        // The body already parsed as JSON: an array of values splits without error.
        let items: Vec<&RawValue> =
            serde_json::from_str(body.get()).map_err(|e| ApiError::MalformedJson(e.to_string()))?;
        items
            .iter()
            .enumerate()
            .map(|(index, item)| posted(item.get(), &format!("[{index}]")))
            .collect::<Result<_, _>>()?
    } else {
        vec![posted(body.get(), "")?]
    };
    // An empty list records nothing, and says so.
    if observations.len() > MAX_OBSERVATIONS {
        return Err(ApiError::InvalidInput(format!(
            "body: at most {MAX_OBSERVATIONS} observations are accepted, got {}",
            observations.len()
        )));
    }
    // Priced like a batch's items before any work: each job answered on its card.
    let mut spent = Cost::default();
    for observation in &observations {
        spent.add(&Cost::of(&observation.request.job));
    }
    spent.check(state.engine.cost_budget, Some(observations.len()))?;
    let started = Instant::now();
    let ticket = match (key, fingerprint) {
        (Some(key), Some(fingerprint)) => loop {
            match state.idempotency.claim(&key, fingerprint)? {
                Claim::Fresh(ticket) => break Some(ticket),
                Claim::Replay(body) => {
                    // Debug-formatted (quoted, escaped): a key cannot forge fields in the text log.
                    tracing::info!(key = ?key, "observations already recorded under this key; answer replayed");
                    let mut response = (
                        [(axum::http::header::CONTENT_TYPE, "application/json")],
                        body,
                    )
                        .into_response();
                    response.headers_mut().insert(
                        idempotency::REPLAYED_HEADER,
                        HeaderValue::from_static("true"),
                    );
                    return Ok(response);
                }
                // Bounded by the request timeout, like any call.
                Claim::Wait(progress) => idempotency::settled(progress).await,
            }
        },
        _ => None,
    };
    // On the estimate threads, within the request: the work stops when the caller is gone
    // (the deadline abandoned), and the recording commits only before `deadline`, which ends
    // [`COMMIT_MARGIN`] before the request timeout answers 503.
    let timeout = state.limits.request_timeout;
    let deadline = Deadline::at(started + timeout - COMMIT_MARGIN.min(timeout / 4));
    let work = deadline.clone();
    let pool = Arc::clone(&state.pool);
    let response = pool
        .run(Work::Batch, deadline, move || {
            let response = record(&state, observations, &work)?;
            if let Some(ticket) = ticket {
                ticket.succeed(
                    serde_json::to_vec(&response)
                        .map_err(|e| ApiError::Internal(e.to_string()))?
                        .into(),
                );
            }
            Ok::<_, ApiError>(response)
        })
        .await?;
    Ok(Json(response).into_response())
}

/// How long before the request timeout an observation call stops and commits nothing: room
/// for the store's transaction to end before the caller can be answered 503.
const COMMIT_MARGIN: Duration = Duration::from_secs(2);

/// An observation as parsed, with its job's JSON text as posted.
struct Posted {
    request: ObservationRequest,
    job: String,
}

fn posted(text: &str, location: &str) -> Result<Posted, ApiError> {
    #[derive(serde::Deserialize)]
    struct JobText<'a> {
        #[serde(borrow)]
        job: &'a RawValue,
    }
    let request: ObservationRequest = parse_json(text.as_bytes(), location)?;
    // It parsed as an observation, so it has a job.
    let job = serde_json::from_str::<JobText>(text)
        .map_err(|e| ApiError::MalformedJson(e.to_string()))?
        .job
        .get()
        .to_string();
    Ok(Posted { request, job })
}

/// Validates every observation first, so that a bad one records nothing; then stores them all
/// in one transaction and re-derives the profiles they touch.
fn record(
    state: &AppState,
    observations: Vec<Posted>,
    deadline: &Deadline,
) -> Result<ObservationsResponse, ApiError> {
    let mut batch: Vec<NewObservation> = Vec::with_capacity(observations.len());
    for (
        index,
        Posted {
            request: observation,
            job,
        },
    ) in observations.iter().enumerate()
    {
        deadline.check()?;
        // A lone observation's fields are named as they are; a list's with their index.
        let location = if observations.len() > 1 {
            format!("[{index}].")
        } else {
            String::new()
        };
        let at = |e: ApiError| e.within(&location);
        let observed = observation.observed_peak_mib;
        if !(observed.is_finite() && observed >= 1.0) {
            return Err(at(ApiError::InvalidInput(
                "observed_peak_mib: must be a number of MiB, at least 1".into(),
            )));
        }
        let (catalogue, devices) = (&state.engine.catalogue, state.engine.devices.as_ref());
        let target = resolve(Some(&observation.gpu), catalogue, devices).map_err(at)?;
        // The GPU is named once, at the top: a different one inside the job is a contradiction.
        if let Some(inner) = observation.job.gpu.as_ref() {
            // An observation is of one card: a list inside its job cannot be it.
            let crate::api::types::GpuChoice::One(inner) = inner else {
                return Err(at(ApiError::InvalidInput(
                    "job.gpu: an observation is of one GPU, not a list".into(),
                )));
            };
            let inner =
                resolve(Some(inner), catalogue, devices).map_err(|e| at(e.within("job.")))?;
            if inner != target {
                return Err(at(ApiError::InvalidInput(format!(
                    "job.gpu: names {}, the observation {}",
                    inner.gpu, target.gpu
                ))));
            }
        }
        let environment = validate::environment(observation.environment.as_deref()).map_err(at)?;
        let inner_environment = validate::environment(observation.job.environment.as_deref())
            .map_err(|e| at(e.within("job.")))?;
        if inner_environment.is_some() && inner_environment != environment {
            return Err(at(ApiError::InvalidInput(format!(
                "job.environment: names {}, the observation {}",
                inner_environment.as_deref().unwrap_or_default(),
                environment.as_deref().unwrap_or("none")
            ))));
        }
        // No job peaks above the whole memory of the card it ran on.
        if observed > target.capacity_mib as f64 {
            return Err(at(ApiError::InvalidInput(format!(
                "observed_peak_mib: {observed} MiB is more than the whole memory of {} ({} MiB)",
                target.gpu, target.capacity_mib
            ))));
        }
        let reference = reference_figure(state, &observation.job).map_err(at)?;
        // Nor below what physics says it must hold (model state and CUDA context): such a
        // reading is not of this job. In a named environment, below what the leanest stack
        // holds of it (the stack's factor's range): a stack may hold less than physics says.
        let floor = match environment {
            Some(_) => reference.floor_in_leanest_stack_mib,
            None => reference.floor_mib,
        };
        if observed < floor {
            return Err(at(ApiError::InvalidInput(format!(
                "observed_peak_mib: {observed} MiB is below the job's physical floor of {floor:.0} MiB (model state and the smallest CUDA context{})",
                if environment.is_some() { ", in the leanest stack" } else { "" }
            ))));
        }
        let step_time = observation
            .step_time_ms
            .map(|ms| observed_step_time(ms, &target, &observation.job))
            .transpose()
            .map_err(at)?;
        batch.push(NewObservation {
            gpu: target.gpu,
            environment,
            job: job.clone(),
            observed_peak_mib: observed,
            predicted_mib: reference.predicted_mib,
            breakdown: reference.breakdown,
            source: Source::Posted,
            step_time,
        });
    }
    let recorded = batch.len();
    let ratios: Vec<(String, String, f64)> = batch
        .iter()
        .map(|o| {
            let environment = o.environment.clone().unwrap_or_default();
            (
                o.gpu.clone(),
                environment,
                o.observed_peak_mib / o.predicted_mib,
            )
        })
        .collect();
    // The last moment to give up: past it, the caller may be answered 503 (or is gone), and
    // a 503 must mean nothing was recorded.
    deadline.check()?;
    // The caps are checked and the batch recorded as one: concurrent writers cannot both pass.
    let updates = state
        .engine
        .profiles
        .record_checked(batch, refuse_too_many_profiles)?
        .map_err(profile_error)?;
    // Recorded, so their labels are within the profiles' bounds.
    for (gpu, environment, ratio) in ratios {
        state
            .engine
            .metrics
            .calibration_observed_over_estimated
            .with_label_values(&[gpu.as_str(), environment.as_str()])
            .observe(ratio);
    }
    let mut profiles = Vec::with_capacity(updates.len());
    let mut limited = Vec::new();
    for update in updates {
        let profile = update.profile;
        state.engine.metrics.record_calibration(&profile);
        if profile.environment.is_none() && update.limited {
            tracing::warn!(gpu = %profile.sku, "calibration update held to the per-update step");
            limited.push(profile.sku.clone());
        }
        profiles.push(profile_response(&profile));
    }
    Ok(ObservationsResponse {
        recorded,
        profiles,
        limited,
    })
}

/// Custom cards and environments are named by callers, so their profiles (metric series,
/// memory) are bounded: observations that would start a profile beyond
/// [`MAX_CUSTOM_PROFILES`] custom cards, or beyond [`MAX_ENVIRONMENTS_PER_GPU`] environments
/// of one GPU, or beyond [`MAX_PROFILES`] in all, are refused.
fn refuse_too_many_profiles(
    existing: &[CalibrationProfile],
    batch: &[NewObservation],
) -> Result<(), ApiError> {
    let is_custom = |key: &str| key.starts_with(CUSTOM_PREFIX);
    let mut new_keys: Vec<(&str, Option<&str>)> = batch
        .iter()
        .map(|o| (o.gpu.as_str(), o.environment.as_deref()))
        .filter(|(gpu, environment)| {
            !existing
                .iter()
                .any(|p| p.sku == *gpu && p.environment.as_deref() == *environment)
        })
        .collect();
    new_keys.sort_unstable();
    new_keys.dedup();
    if existing.len() + new_keys.len() > MAX_PROFILES {
        return Err(ApiError::InvalidInput(format!(
            "gpu, environment: at most {MAX_PROFILES} profiles are kept; {} exist and this call starts {}",
            existing.len(),
            new_keys.len()
        )));
    }
    let mut new_custom: Vec<&str> = batch
        .iter()
        .map(|o| o.gpu.as_str())
        .filter(|gpu| is_custom(gpu) && !existing.iter().any(|p| p.sku == *gpu))
        .collect();
    new_custom.sort_unstable();
    new_custom.dedup();
    if !new_custom.is_empty() {
        let mut custom: Vec<&str> = existing
            .iter()
            .filter(|p| is_custom(&p.sku))
            .map(|p| p.sku.as_str())
            .collect();
        custom.dedup();
        if custom.len() + new_custom.len() > MAX_CUSTOM_PROFILES {
            return Err(ApiError::InvalidInput(format!(
                "gpu: at most {MAX_CUSTOM_PROFILES} custom cards are calibrated; {} are already",
                custom.len()
            )));
        }
    }
    for o in batch {
        let Some(environment) = &o.environment else {
            continue;
        };
        let known = |p: &CalibrationProfile| p.sku == o.gpu && p.environment.is_some();
        if existing
            .iter()
            .any(|p| known(p) && p.environment.as_ref() == Some(environment))
        {
            continue;
        }
        let mut environments: Vec<&str> = existing
            .iter()
            .filter(|p| known(p))
            .filter_map(|p| p.environment.as_deref())
            .chain(
                batch
                    .iter()
                    .filter(|b| b.gpu == o.gpu)
                    .filter_map(|b| b.environment.as_deref()),
            )
            .collect();
        environments.sort_unstable();
        environments.dedup();
        if environments.len() > MAX_ENVIRONMENTS_PER_GPU {
            return Err(ApiError::InvalidInput(format!(
                "environment: at most {MAX_ENVIRONMENTS_PER_GPU} environments are calibrated per GPU; {} has more with this call",
                o.gpu
            )));
        }
    }
    Ok(())
}

/// Watch a process on this host's GPU; its peak becomes an observation when it exits.
///
/// One sampler thread reads every watched process; at most `--max-watches` (default 64) are
/// watched at once (429 beyond), each process once (409 for a second watch of it: the first
/// one's job description stands), none for longer than `max_seconds` (at most 30 days).
#[utoipa::path(
    post,
    path = "/v1/calibration/watch",
    tag = "devices",
    request_body = WatchRequest,
    // The token is required when the service is started with one; without one, writes are
    // open on a loopback-only listener and refused (403) on any other.
    security((), ("bearer" = [])),
    responses(
        (status = 202, description = "Watching", body = WatchResponse),
        (status = 400, description = "Malformed JSON", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or wrong bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "Writes disabled: no token configured and the listener is not loopback-only", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "No NVML device on this host, or the process is watched already", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "Not `Content-Type: application/json` (a write must say it is JSON), or a compressed body", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid request", body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "As many processes are watched as `--max-watches` allows; Retry-After says when to try again", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
pub async fn watch(
    State(state): State<AppState>,
    headers: HeaderMap,
    request: Request,
) -> Result<(StatusCode, Json<WatchResponse>), ApiError> {
    require_write_access(&state, &headers)?;
    let JsonBody(request) = JsonBody::<WatchRequest>::from_request(request, &state).await?;
    let pid = u32::try_from(request.pid)
        .map_err(|_| ApiError::InvalidInput(format!("pid: {} is not a process id", request.pid)))?;
    let attached = crate::api::types::GpuRequest::Name("attached".into());
    let target = resolve(
        Some(&attached),
        &state.engine.catalogue,
        state.engine.devices.as_ref(),
    )?;
    let reference = reference_figure(&state, &request.job)?;
    // The job as the request gave it (its absent fields left out, not written as nulls).
    let job = serde_json::to_value(&request.job)
        .map(without_nulls)
        .map_err(|e| ApiError::Internal(e.to_string()))?
        .to_string();
    let interval = Duration::from_millis(request.interval_ms.unwrap_or(200).clamp(10, 60_000));
    let max_duration =
        Duration::from_secs(request.max_seconds.unwrap_or(86_400).clamp(1, 2_592_000));
    let config = WatchConfig::new(interval, max_duration);
    let (gpu, capacity_mib) = (target.gpu.clone(), target.capacity_mib);
    let (profiles, metrics) = (
        Arc::clone(&state.engine.profiles),
        Arc::clone(&state.engine.metrics),
    );
    // Runs on the sampler's thread when the watch ends.
    let done: WatchDone = Box::new(move |outcome| match outcome {
        Ok(report) if report.complete() => {
            let peak = report.peak_mib as f64;
            // The same physics as an observation's: a peak outside it is not this job's.
            if peak < reference.floor_mib || peak > capacity_mib as f64 {
                tracing::warn!(
                    pid,
                    peak_mib = report.peak_mib,
                    floor_mib = reference.floor_mib,
                    capacity_mib,
                    "watched peak outside physics; nothing recorded"
                );
                return;
            }
            let observation = NewObservation {
                gpu: gpu.clone(),
                environment: None,
                job: job.clone(),
                observed_peak_mib: peak,
                predicted_mib: reference.predicted_mib,
                breakdown: reference.breakdown.clone(),
                source: Source::Watched,
                step_time: None,
            };
            match profiles
                .record(vec![observation])
                .map(|u| u.into_iter().next())
            {
                Ok(None) => tracing::warn!(pid, "watch recorded but no profile derived"),
                Ok(Some(Update { profile, limited })) => {
                    metrics.record_calibration(&profile);
                    metrics
                        .calibration_observed_over_estimated
                        .with_label_values(&[gpu.as_str(), ""])
                        .observe(peak / reference.predicted_mib);
                    tracing::info!(pid, gpu = %gpu, peak_mib = report.peak_mib, observations = profile.observations, limited, "watch recorded");
                }
                Err(e) => tracing::warn!(pid, error = %e, "watch peak not recorded"),
            }
        }
        Ok(report) => {
            tracing::warn!(pid, ended = ?report.ended, peak_mib = report.peak_mib, "watch cut short; nothing recorded")
        }
        Err(e) => tracing::warn!(pid, error = %e, "watch failed"),
    });
    state.watches.add(pid, &config, done).map_err(|e| match e {
        AddError::Full { .. } => ApiError::TooManyWatches(e.to_string()),
        AddError::AlreadyWatched(_) => ApiError::Conflict(e.to_string()),
        AddError::Stopped => ApiError::NotReady,
        AddError::Thread(_) => ApiError::Internal(e.to_string()),
    })?;
    tracing::info!(pid, gpu = %target.gpu, "watching a training process");
    Ok((
        StatusCode::ACCEPTED,
        Json(WatchResponse {
            pid,
            gpu: target.gpu,
            status: "watching".into(),
        }),
    ))
}

/// `value` without the object fields that are null.
fn without_nulls(value: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::Object(map) => Value::Object(
            map.into_iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k, without_nulls(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.into_iter().map(without_nulls).collect()),
        other => other,
    }
}

/// A measured step time and the job's predicted step times across host costs on the card
/// ([`step_time::curve`]), stored together; refused unless a positive number of ms up to an
/// hour on a card with peak figures (a custom card known by its memory has no roofline).
fn observed_step_time(
    ms: f64,
    target: &Target,
    request: &EstimateRequest,
) -> Result<(f64, String), ApiError> {
    if !(ms.is_finite() && ms > 0.0 && ms <= step_time::MAX_STEP_TIME_MS) {
        return Err(ApiError::InvalidInput(format!(
            "step_time_ms: must be a positive number of ms, at most {}",
            step_time::MAX_STEP_TIME_MS
        )));
    }
    let Some(gpu) = target.performance.as_ref() else {
        return Err(ApiError::InvalidInput(format!(
            "step_time_ms: the GPU '{}' is known only by its memory: no performance model to \
             learn from a step time",
            target.gpu
        )));
    };
    let job = to_job(request).map_err(|e| e.within("job."))?;
    let curve = serde_json::to_string(&step_time::curve(&job, gpu)).expect("a curve serialises");
    Ok((ms, curve))
}

/// What the reference (uncalibrated) model says of a job, and the least it can need.
struct Reference {
    /// The learned MiB figure, or the first-principles one for a family without a memory
    /// regressor.
    predicted_mib: f64,
    /// Physics' floor: model state and the smallest CUDA context an environment has
    /// ([`CONTEXT_RANGE_MIB`]): the context is the environment's, so an observation from
    /// one with a smaller context than physics assumes is not refused for it.
    floor_mib: f64,
    /// The floor in a stack that holds the least of it ([`FACTOR_RANGE`]'s low end).
    floor_in_leanest_stack_mib: f64,
    /// The predicted figure by category, MiB, as a JSON object.
    breakdown: String,
}

fn reference_figure(state: &AppState, request: &EstimateRequest) -> Result<Reference, ApiError> {
    let job = to_job(request).map_err(|e| e.within("job."))?;
    let estimate = state
        .engine
        .estimators
        .estimate(&job, crate::job::Confidence::DEFAULT.get())?;
    let predicted_mib = estimate
        .mib
        .map(|m| m.estimate_mib)
        .unwrap_or_else(|| estimate.mib_estimators[FIRST_PRINCIPLES]);
    let b = estimate.physics.breakdown(predicted_mib);
    let breakdown = serde_json::to_string(&b).expect("a breakdown serialises");
    let least_context = CONTEXT_RANGE_MIB.0.min(estimate.physics.parts.cuda_context);
    Ok(Reference {
        predicted_mib,
        floor_mib: estimate.physics.floor_with_context_mib(least_context),
        floor_in_leanest_stack_mib: estimate
            .physics
            .floor_in_stack_mib(least_context, FACTOR_RANGE.0),
        breakdown,
    })
}

fn profile_error(e: ProfileError) -> ApiError {
    match e {
        // A profile that fails validation after a refit was made so by the observations sent.
        ProfileError::InvalidSku(_)
        | ProfileError::InvalidObservation(_)
        | ProfileError::Invalid(_) => ApiError::InvalidInput(e.to_string()),
        ProfileError::Store(detail) => {
            tracing::error!(error = %detail, "observation store failed");
            ApiError::StoreUnavailable(crate::job::echo(&detail))
        }
        other => ApiError::Internal(other.to_string()),
    }
}

fn profile_response(p: &CalibrationProfile) -> ProfileResponse {
    ProfileResponse {
        gpu: p.sku.clone(),
        environment: p.environment.clone(),
        offset_mib: p.offset_mib,
        scale: p.scale,
        residual_quantiles: p.residual_quantiles.clone(),
        observations: p.observations,
        updated_at: p.updated_at.clone(),
        environment_fit: p.environment_fit.as_ref().map(|f| EnvironmentFitResponse {
            context_mib: f.context_mib,
            allocator_fixed_mib: f.allocator_fixed_mib,
            activation_scale: f.activation_scale,
            cache_scale: f.cache_scale,
            observations: f.samples,
            log_residual_quantiles: f.log_residual_quantiles.clone(),
            stack_factor: f.stack_factor,
            log_margin_95: crate::calibration::environment::log_margin(f, 0.95),
        }),
        step_time_fit: p.host_fit.map(|f| StepTimeFitResponse {
            host_us_per_op: f.host_us_per_op,
            observations: f.observations,
            median_error: f.median_error,
        }),
    }
}
