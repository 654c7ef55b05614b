//! `POST /v1/estimate` and `POST /v1/estimate/batch`.

use std::time::Instant;

use axum::extract::State;
use axum::Json;

use crate::api::types::{BatchRequest, BatchResponse, EstimateRequest, EstimateResponse, Problem};
use crate::engine::answer::answer;
use crate::error::ApiError;
use crate::http::extract::{EstimateBody, JsonBody};
use crate::http::AppState;

/// The most layers a job without a simulation may have to be answered on the async worker:
/// a few hundred microseconds of work at most (docs/performance.md's stage timings: the
/// README MLP job ~50 us, Llama-3-8B built from its config.json, ~350 modules, ~120 us).
const INLINE_MAX_LAYERS: usize = 512;

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
        (status = 422, description = "Invalid job description, or one priced above the cost budget (`--max-request-cost`) from its sizes", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "Overloaded or not ready; see Retry-After", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, fields(family, layers))]
pub async fn estimate(
    State(state): State<AppState>,
    EstimateBody(request): EstimateBody,
) -> Result<Json<EstimateResponse>, ApiError> {
    let started = Instant::now();
    let engine = std::sync::Arc::clone(&state.engine);
    // Priced from its sizes first: above the budget it is refused before any work.
    let valid = engine.validate(&request)?;
    tracing::Span::current()
        .record("family", valid.job.family().as_str())
        .record("layers", valid.job.layers().len());
    // A small job's answer costs about a hundred microseconds: answered on this worker, where
    // handing it to the blocking pool and back costs as much as the work. Larger ones (a
    // simulation's placement, more layers) go to the blocking pool, off the workers.
    if valid.job.simulation().is_none() && valid.job.layers().len() <= INLINE_MAX_LAYERS {
        return answer(&engine, valid, started).map(Json);
    }
    let answer = tokio::task::spawn_blocking(move || answer(&engine, valid, started))
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
        (status = 422, description = "Not a batch, too many items, or items priced together above the cost budget (`--max-request-cost`)", body = Problem, content_type = "application/problem+json"),
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
    // Waits for its turn; the guard's request timeout bounds the wait.
    let slot = state
        .batch_slots
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::NotReady)?;
    let items = tokio::task::spawn_blocking(move || {
        let _slot = slot;
        let items = state.engine.estimate_items(request.items, Instant::now());
        release_freed_memory();
        items
    })
    .await
    .map_err(|e| ApiError::Internal(format!("batch task failed: {e}")))??;
    Ok(Json(BatchResponse { items }))
}

/// Hands the heaps' freed pages back to the system after a batch: mimalloc (the service's
/// allocator) and glibc's (ONNX Runtime's buffers) keep a batch's megabytes of features and
/// answers, and a flood of batches would leave the process that much larger for good.
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory at the top of glibc's heaps and arenas; it
    // touches no memory the program holds.
    unsafe {
        libc::malloc_trim(0);
    }
    // SAFETY: mi_collect frees what mimalloc holds unused; it touches no live allocation.
    unsafe {
        libmimalloc_sys::mi_collect(true);
    }
}
