//! What the service learns per GPU: `GET /v1/calibration/profiles`, `POST /v1/calibration/observations`,
//! `POST /v1/calibration/watch`.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;

use crate::calibration::profile::{CalibrationProfile, ProfileError};
use crate::devices::watch::{watch_process, WatchConfig};
use crate::error::ApiError;
use crate::estimators::FIRST_PRINCIPLES;
use crate::http::auth::require_token;
use crate::http::extract::{from_value, JsonBody, JsonObjectOrArray};
use crate::http::types::{
    EstimateRequest, ObservationRequest, ObservationsResponse, Problem, ProfileResponse,
    ProfilesResponse, WatchRequest, WatchResponse,
};
use crate::http::validate::{resolve, to_job};
use crate::http::AppState;

/// Observations accepted in one call.
const MAX_OBSERVATIONS: usize = 1000;
/// Largest peak an observation may report, MiB.
const MAX_OBSERVED_PEAK_MIB: f64 = 10_000_000.0;

/// Calibration profiles learned so far.
#[utoipa::path(get, path = "/v1/calibration/profiles", tag = "devices", responses((status = 200, body = ProfilesResponse)))]
pub async fn profiles(State(state): State<AppState>) -> Json<ProfilesResponse> {
    Json(ProfilesResponse {
        profiles: state.profiles.list().iter().map(profile_response).collect(),
    })
}

/// Record measured peaks of jobs on a GPU; the GPU's profile is refitted and saved.
#[utoipa::path(
    post,
    path = "/v1/calibration/observations",
    tag = "devices",
    request_body = crate::http::types::ObservationsRequest,
    // The token is optional: required only when the service is started with one.
    security((), ("bearer" = [])),
    responses(
        (status = 200, description = "Recorded; the refitted profiles", body = ObservationsResponse),
        (status = 400, description = "Malformed JSON", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or wrong bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`attached` without an NVML device", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid observation", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn observe(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonObjectOrArray(body): JsonObjectOrArray<serde_json::Value>,
) -> Result<Json<ObservationsResponse>, ApiError> {
    require_token(&state, &headers)?;
    // Parsed item by item (not as an untagged enum) so that errors name the field.
    let observations: Vec<ObservationRequest> = match body {
        serde_json::Value::Array(items) => items
            .into_iter()
            .enumerate()
            .map(|(index, item)| from_value(item, &format!("[{index}]")))
            .collect::<Result<_, _>>()?,
        one => vec![from_value(one, "")?],
    };
    // An empty list records nothing, and says so.
    if observations.len() > MAX_OBSERVATIONS {
        return Err(ApiError::InvalidInput(format!(
            "body: at most {MAX_OBSERVATIONS} observations are accepted, got {}",
            observations.len()
        )));
    }
    let response = tokio::task::spawn_blocking(move || record(&state, observations))
        .await
        .map_err(|e| ApiError::Internal(format!("calibration task failed: {e}")))??;
    Ok(Json(response))
}

/// Validates every observation first, so that a bad one records nothing.
fn record(
    state: &AppState,
    observations: Vec<ObservationRequest>,
) -> Result<ObservationsResponse, ApiError> {
    let mut prepared = Vec::with_capacity(observations.len());
    for (index, observation) in observations.iter().enumerate() {
        // A lone observation's fields are named as they are; a list's with their index.
        let location = if observations.len() > 1 {
            format!("[{index}].")
        } else {
            String::new()
        };
        let at = |e: ApiError| e.within(&location);
        // No GPU job peaks below 1 MiB (the CUDA context alone is hundreds) or above 10 TiB.
        if !(1.0..=MAX_OBSERVED_PEAK_MIB).contains(&observation.observed_peak_mib) {
            return Err(at(ApiError::InvalidInput(
                "observed_peak_mib: must be a number from 1 to 10,000,000".into(),
            )));
        }
        let target = resolve(Some(&observation.gpu), state.devices.as_ref()).map_err(at)?;
        // The GPU is named once, at the top: a different one inside the job is a contradiction.
        if let Some(inner) = observation.job.gpu.as_deref() {
            let inner =
                resolve(Some(inner), state.devices.as_ref()).map_err(|e| at(e.within("job.")))?;
            if inner != target {
                return Err(at(ApiError::InvalidInput(format!(
                    "job.gpu: names {}, the observation {}",
                    inner.gpu, target.gpu
                ))));
            }
        }
        let predicted = reference_figure(state, &observation.job).map_err(at)?;
        prepared.push((target.gpu, predicted, observation.observed_peak_mib));
    }
    let mut touched: Vec<CalibrationProfile> = Vec::new();
    for (gpu, predicted, observed) in &prepared {
        let profile = state
            .profiles
            .observe(gpu, *predicted, *observed)
            .map_err(profile_error)?;
        state.metrics.record_calibration(
            &profile.sku,
            profile.observations,
            profile.scale,
            profile.offset_mib,
        );
        touched.retain(|p| p.sku != profile.sku);
        touched.push(profile);
    }
    Ok(ObservationsResponse {
        recorded: prepared.len(),
        profiles: touched.iter().map(profile_response).collect(),
    })
}

/// Watch a process on this host's GPU; its peak becomes an observation when it exits.
#[utoipa::path(
    post,
    path = "/v1/calibration/watch",
    tag = "devices",
    request_body = WatchRequest,
    // The token is optional: required only when the service is started with one.
    security((), ("bearer" = [])),
    responses(
        (status = 202, description = "Watching", body = WatchResponse),
        (status = 400, description = "Malformed JSON", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or wrong bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "No NVML device on this host", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid request", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn watch(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonBody(request): JsonBody<WatchRequest>,
) -> Result<(StatusCode, Json<WatchResponse>), ApiError> {
    require_token(&state, &headers)?;
    let pid = u32::try_from(request.pid)
        .map_err(|_| ApiError::InvalidInput(format!("pid: {} is not a process id", request.pid)))?;
    let target = resolve(Some("attached"), state.devices.as_ref())?;
    let predicted = reference_figure(&state, &request.job)?;
    let interval = Duration::from_millis(request.interval_ms.unwrap_or(200).clamp(10, 60_000));
    let max_duration =
        Duration::from_secs(request.max_seconds.unwrap_or(86_400).clamp(1, 2_592_000));
    let mut config = WatchConfig::new(interval, max_duration);
    config.stop = state.stop_watches.clone();
    let gpu = target.gpu.clone();
    let (devices, profiles, metrics) = (
        state.devices.clone(),
        Arc::clone(&state.profiles),
        Arc::clone(&state.metrics),
    );
    tracing::info!(pid, gpu = %gpu, "watching a training process");
    // A thread of its own: a watch lasts as long as the training job, and must not hold one of
    // the blocking pool's threads, which serve estimates.
    let watcher = std::thread::Builder::new().name(format!("watch-{pid}"));
    let spawned = watcher.spawn(move || match watch_process(devices, pid, &config) {
        Ok(report) if report.complete() => match profiles.observe(&gpu, predicted, report.peak_mib as f64) {
            Ok(profile) => {
                metrics.record_calibration(&profile.sku, profile.observations, profile.scale, profile.offset_mib);
                tracing::info!(pid, gpu = %gpu, peak_mib = report.peak_mib, observations = profile.observations, "watch recorded");
            }
            Err(e) => tracing::warn!(pid, error = %e, "watch peak not recorded"),
        },
        Ok(report) => tracing::warn!(pid, ended = ?report.ended, peak_mib = report.peak_mib, "watch cut short; nothing recorded"),
        Err(e) => tracing::warn!(pid, error = %e, "watch failed"),
    });
    spawned.map_err(|e| ApiError::Internal(format!("cannot start a watch thread: {e}")))?;
    Ok((
        StatusCode::ACCEPTED,
        Json(WatchResponse {
            pid,
            gpu: target.gpu,
            status: "watching".into(),
        }),
    ))
}

/// What the reference (uncalibrated) model says of a job: the learned MiB figure, or the
/// first-principles one for a family without a memory regressor.
fn reference_figure(state: &AppState, request: &EstimateRequest) -> Result<f64, ApiError> {
    let job = to_job(request).map_err(|e| e.within("job."))?;
    let estimate = state
        .estimators
        .estimate(&job, crate::domain::Confidence::DEFAULT.get())?;
    Ok(estimate
        .mib
        .map(|m| m.estimate_mib)
        .unwrap_or_else(|| estimate.mib_estimators[FIRST_PRINCIPLES]))
}

fn profile_error(e: ProfileError) -> ApiError {
    match e {
        // A profile that fails validation after a refit was made so by the observations sent.
        ProfileError::InvalidSku(_)
        | ProfileError::InvalidObservation(_)
        | ProfileError::Invalid(_) => ApiError::InvalidInput(e.to_string()),
        other => ApiError::Internal(other.to_string()),
    }
}

fn profile_response(p: &CalibrationProfile) -> ProfileResponse {
    ProfileResponse {
        gpu: p.sku.clone(),
        offset_mib: p.offset_mib,
        scale: p.scale,
        residual_quantiles: p.residual_quantiles.clone(),
        observations: p.observations,
        updated_at: p.updated_at.clone(),
    }
}
