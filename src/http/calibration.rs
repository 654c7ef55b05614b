//! What the service learns per GPU: `GET /v1/calibration/profiles`, `POST /v1/calibration/observations`,
//! `POST /v1/calibration/watch`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{FromRequest, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::value::RawValue;

use crate::api::types::{
    ObservationsResponse, Problem, ProfilesResponse, WatchRequest, WatchResponse,
};
use crate::calibration::db::{NewObservation, Source};
use crate::calibration::store::Update;
use crate::devices::watch::{AddError, WatchConfig, WatchDone};
use crate::engine::observation;
use crate::engine::validate::resolve;
use crate::engine::Deadline;
use crate::error::ApiError;
use crate::http::auth::require_write_access;
use crate::http::extract::{JsonBody, JsonObjectOrArray};
use crate::http::idempotency::{self, Claim};
use crate::http::pool::Work;
use crate::http::AppState;

/// Calibration profiles learned so far.
#[utoipa::path(get, path = "/v1/calibration/profiles", tag = "devices", responses((status = 200, body = ProfilesResponse)))]
pub async fn profiles(State(state): State<AppState>) -> Json<ProfilesResponse> {
    Json(ProfilesResponse {
        profiles: state
            .engine
            .profiles
            .list()
            .iter()
            .map(observation::profile_response)
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
    let observations = observation::parse(body.get())?;
    observation::price(&state.engine, &observations)?;
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
            let response = observation::record(&state.engine, observations, &work)?;
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
    let reference = observation::reference_figure(&state.engine, &request.job)?;
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
