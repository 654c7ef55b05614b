//! Operational routes: health, readiness, metrics and what is loaded.

use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::Json;

use crate::api::types::{
    CombinedInfo, DomainInfo, EstimatorInfo, EstimatorsResponse, HealthResponse, Problem,
    ReadyResponse, ResidualQuantileInfo, SimulatedInfo,
};
use crate::error::ApiError;
use crate::estimators::manifest::{CombinedEntry, InputSpec};
use crate::http::AppState;

/// Liveness: the process serves HTTP.
#[utoipa::path(get, path = "/healthz", tag = "operations", responses((status = 200, body = HealthResponse)))]
pub async fn healthz() -> Json<HealthResponse> {
    Json(HealthResponse {
        status: "ok".into(),
    })
}

/// Readiness: models loaded, not shutting down, and a request slot free for an estimate. The
/// calibration store is reported beside, not in, the decision: estimates do not need it.
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "operations",
    responses(
        (status = 200, description = "Ready (the store's state beside)", body = ReadyResponse),
        (status = 503, description = "Not ready (starting, shutting down, every request slot taken, or every connection of the main port taken, so that it closes new ones)", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn readyz(State(state): State<AppState>) -> Result<Json<ReadyResponse>, ApiError> {
    let estimates = state.permits.available_permits() > 0;
    let accepting = state.connection_slots.available_permits() > 0;
    if !(state.ready.load(Ordering::Acquire) && estimates && accepting) {
        return Err(ApiError::NotReady);
    }
    let store_error = state.engine.profiles.fault().map(|e| crate::job::echo(&e));
    Ok(Json(ReadyResponse {
        ready: true,
        estimates,
        store: store_error.is_none(),
        store_error,
    }))
}

/// Prometheus metrics, text exposition format.
#[utoipa::path(get, path = "/metrics", tag = "operations", responses((status = 200, description = "Prometheus text format", body = String, content_type = "text/plain")))]
pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.engine.metrics.render(),
    )
}

/// The loaded estimators, their provenance and validation figures.
#[utoipa::path(get, path = "/v1/estimators", tag = "estimate", responses((status = 200, body = EstimatorsResponse)))]
pub async fn estimators(State(state): State<AppState>) -> Json<EstimatorsResponse> {
    let manifest = state.engine.estimators.manifest();
    let estimators = state
        .engine
        .estimators
        .all()
        .iter()
        .map(|e| EstimatorInfo {
            name: e.entry.name.clone(),
            version: e.entry.version.clone(),
            family: e.entry.family.clone(),
            kind: e.entry.kind.as_str().to_string(),
            input: match e.entry.input {
                InputSpec::Aggregate { .. } => "aggregate".into(),
                InputSpec::Sequence { .. } => "sequence".into(),
            },
            runtime: e.runtime().to_string(),
            file: e.entry.file.clone(),
            sha256: e.entry.sha256.clone(),
            target: e.entry.target.clone(),
            class_bins_mib: e.entry.class_bins_mib.clone(),
            residual_quantiles: e.entry.residual_quantiles.as_ref().map(|levels| {
                levels
                    .iter()
                    .map(|l| ResidualQuantileInfo {
                        confidence: l.confidence,
                        log_ratio: l.log_ratio,
                    })
                    .collect()
            }),
            requires: e
                .entry
                .requires
                .iter()
                .map(|r| r.as_str().to_string())
                .collect(),
            validation: e.entry.validation.clone(),
        })
        .collect();
    Json(EstimatorsResponse {
        generated_at: manifest.generated_at.clone(),
        training_data: manifest.training_data.clone(),
        split: manifest.split.clone(),
        estimators,
        combined: manifest.combined.as_ref().map(combined_info),
        combined_by_family: manifest
            .combined_by_family
            .iter()
            .map(|(f, c)| (f.clone(), combined_info(c)))
            .collect(),
        simulated: manifest.simulated.as_ref().map(|s| SimulatedInfo {
            version: s.version.clone(),
            cuda_context_mib: s.cuda_context_mib,
            residual_quantiles: s
                .residual_quantiles
                .iter()
                .map(|l| ResidualQuantileInfo {
                    confidence: l.confidence,
                    log_ratio: l.log_ratio,
                })
                .collect(),
            domain: s
                .domain
                .as_ref()
                .zip(state.engine.estimators.simulated_domain())
                .map(|(file, loaded)| DomainInfo {
                    file: file.file.clone(),
                    sha256: file.sha256.clone(),
                    points: loaded.points,
                    features: loaded.features,
                    optimizers: loaded.optimizers,
                    precisions: loaded.precisions,
                    typical_distance: loaded.typical_distance,
                    near: loaded.near,
                    far: loaded.far,
                    max_widen: loaded.max_widen,
                }),
        }),
    })
}

fn combined_info(c: &CombinedEntry) -> CombinedInfo {
    CombinedInfo {
        members: c.members.clone(),
        rule: c.rule.clone(),
        validation: c.validation.clone(),
    }
}
