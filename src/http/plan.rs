//! `POST /v1/plan`: the largest micro-batch and sequence that fit, the setups that make a job
//! fit, the smallest card; a search over the estimates `/v1/estimate` answers
//! ([`crate::engine::plan`]).

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::Json;

use crate::api::parse::parse_json;
use crate::api::types::{PlanRequest, PlanResponse, Problem};
use crate::engine::Deadline;
use crate::error::ApiError;
use crate::http::extract::JsonBytes;
use crate::http::pool::Work;
use crate::http::AppState;

/// Plan a job: the largest micro-batch (and with `max_seq_len` the longest sequence) that
/// fits each card at the job's confidence, the setups that make it fit ranked by time per
/// sample, and the smallest card it fits. Each point is the answer of `POST /v1/estimate`
/// for that job; the plan is priced as the most estimates it can make.
#[utoipa::path(
    post,
    path = "/v1/plan",
    tag = "estimate",
    request_body(content((PlanRequest = "application/json"), (PlanRequest = "application/yaml"))),
    responses(
        (status = 200, description = "The plan", body = PlanResponse),
        (status = 400, description = "Malformed JSON", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body too large", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`gpu: attached` on a host without an NVML device", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "Neither JSON nor YAML: a `Content-Type` other than `application/json` (none is read as JSON) or a YAML type (`application/yaml`, `application/x-yaml`, `text/yaml`), or a compressed body", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid job or search, or a plan whose most estimates are priced above the cost budget (`--max-request-cost`)", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "Overloaded or not ready, or the request timeout passed; see Retry-After", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
#[tracing::instrument(skip_all, fields(estimates))]
pub async fn plan(
    State(state): State<AppState>,
    JsonBytes(body): JsonBytes,
) -> Result<Json<PlanResponse>, ApiError> {
    let started = Instant::now();
    let deadline = Deadline::at(started + state.limits.request_timeout);
    // A plan is many estimates: it waits for a batch's turn, as a batch does.
    let _slot = state
        .batch_slots
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::NotReady)?;
    let engine = Arc::clone(&state.engine);
    let span = tracing::Span::current();
    let work = deadline.clone();
    let answer = state
        .pool
        .run(Work::Batch, deadline, move || {
            let request: PlanRequest = parse_json(&body, "")?;
            let plan = crate::engine::plan::plan(&engine, &request, &work)?;
            span.record("estimates", plan.estimates);
            Ok(plan)
        })
        .await?;
    Ok(Json(answer))
}
