//! `POST /v1/estimate` and `POST /v1/estimate/batch`.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::Json;

use crate::api::parse::{parse_estimate, parse_json};
use crate::api::types::{BatchRequest, BatchResponse, EstimateRequest, EstimateResponse, Problem};
use crate::engine::answer::{answer_items_until, answer_until};
use crate::engine::validate::ValidEstimateRequest;
use crate::engine::{shared_outcomes, Deadline, Engine};
use crate::error::ApiError;
use crate::http::extract::JsonBytes;
use crate::http::pool::{Work, PROMPT_UNITS};
use crate::http::AppState;

/// The most card estimates (an item ranked on n cards is n) a part of a batch holds when the
/// batch has more than one part per thread: a part runs to its end once started, so this
/// bounds how long a single estimate waits for a thread (about 5 ms on this machine's cores).
const MAX_PART_CARD_ESTIMATES: usize = 64;

/// Estimate one job.
#[utoipa::path(
    post,
    path = "/v1/estimate",
    tag = "estimate",
    request_body(content((EstimateRequest = "application/json"), (EstimateRequest = "application/yaml"))),
    responses(
        (status = 200, description = "The estimate", body = EstimateResponse),
        (status = 400, description = "Malformed JSON", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body too large", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`gpu: attached` on a host without an NVML device", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "Neither JSON nor YAML: a `Content-Type` other than `application/json` (none is read as JSON) or a YAML type (`application/yaml`, `application/x-yaml`, `text/yaml`), a model printout pasted as the body, or a compressed body", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid job description, or one priced above the cost budget (`--max-request-cost`) from its sizes", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "Overloaded or not ready, or the request timeout passed; see Retry-After", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
#[tracing::instrument(skip_all, fields(family, layers))]
pub async fn estimate(
    State(state): State<AppState>,
    JsonBytes(body): JsonBytes,
) -> Result<Json<EstimateResponse>, ApiError> {
    let started = Instant::now();
    // A body answered before, while the profiles it read are current: its kept answer, here
    // on the async worker (a lookup and a copy, no estimate).
    if let Some(answer) = state.engine.reuse(&body, started) {
        return Ok(Json(answer));
    }
    // The guard's timeout answers 503 at the same moment; the work stops there too.
    let deadline = Deadline::at(started + state.limits.request_timeout);
    let engine = Arc::clone(&state.engine);
    let span = tracing::Span::current();
    // Every step of an estimate on the estimate pool, none on this async worker: parsing,
    // pricing (above the budget it is refused before any work), validation, the answer. A
    // prompt thread parses and prices; a request priced above PROMPT_UNITS goes on to a bulk
    // thread (`http::pool`).
    let prompt = {
        let (engine, span, work, body) = (
            Arc::clone(&engine),
            span.clone(),
            deadline.clone(),
            body.clone(),
        );
        state.pool.run(Work::Estimate, deadline.clone(), move || {
            let request: EstimateRequest = parse_estimate(&body, "")?;
            if engine.price(&request)? > PROMPT_UNITS {
                return Ok(Priced::Long(Box::new(request)));
            }
            let answer = validate_and_answer(&engine, &body, &request, &span, started, &work)?;
            Ok(Priced::Answered(Box::new(answer)))
        })
    };
    let answer = match prompt.await? {
        Priced::Answered(answer) => *answer,
        Priced::Long(request) => {
            let work = deadline.clone();
            state
                .pool
                .run(Work::LongEstimate, deadline, move || {
                    validate_and_answer(&engine, &body, &request, &span, started, &work)
                })
                .await?
        }
    };
    Ok(Json(answer))
}

/// A single estimate once priced: answered on the prompt thread, or too long for it.
enum Priced {
    Answered(Box<EstimateResponse>),
    Long(Box<EstimateRequest>),
}

/// A priced request validated and answered, its family and layers recorded in `span`; its
/// answer kept for reuse by its `body` ([`crate::engine::memo`]) when it reads no attached
/// card and was given before the deadline (a caller answered 503 leaves nothing behind).
fn validate_and_answer(
    engine: &Engine,
    body: &[u8],
    request: &EstimateRequest,
    span: &tracing::Span,
    started: Instant,
    deadline: &Deadline,
) -> Result<EstimateResponse, ApiError> {
    // Taken before the answer reads the profiles: a later version makes the kept answer stale.
    let version = engine.profiles.snapshot().version();
    let valid = engine.validate_priced(request)?;
    span.record("family", valid.job.family().as_str())
        .record("layers", valid.job.layers().len());
    let reusable = !valid.reads_device;
    let answer = answer_until(engine, valid, started, deadline)?;
    if reusable && deadline.check().is_ok() {
        engine.memo.keep(body, version, &answer);
    }
    Ok(answer)
}

/// Estimate many jobs; each item succeeds or fails on its own.
#[utoipa::path(
    post,
    path = "/v1/estimate/batch",
    tag = "estimate",
    request_body(content((BatchRequest = "application/json"), (BatchRequest = "application/yaml"))),
    responses(
        (status = 200, description = "One outcome per item, in order", body = BatchResponse),
        (status = 400, description = "Malformed JSON", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body too large", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "Neither JSON nor YAML: a `Content-Type` other than `application/json` (none is read as JSON) or a YAML type (`application/yaml`, `application/x-yaml`, `text/yaml`), or a compressed body", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Not a batch, too many items, or items priced together above the cost budget (`--max-request-cost`)", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "Overloaded or not ready, or the request timeout passed; see Retry-After", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    )
)]
#[tracing::instrument(skip_all, fields(items))]
pub async fn estimate_batch(
    State(state): State<AppState>,
    JsonBytes(body): JsonBytes,
) -> Result<Json<BatchResponse>, ApiError> {
    let started = Instant::now();
    let deadline = Deadline::at(started + state.limits.request_timeout);
    let max = state.limits.max_batch_items;
    let span = tracing::Span::current();
    let request = state
        .pool
        .run(Work::Batch, deadline.clone(), move || {
            let request: BatchRequest = parse_json(&body, "")?;
            if request.items.is_empty() || request.items.len() > max {
                return Err(ApiError::InvalidInput(format!(
                    "items: between 1 and {max} items are accepted, got {}",
                    request.items.len()
                )));
            }
            span.record("items", request.items.len());
            Ok(request)
        })
        .await?;
    // Waits for its turn; the guard's request timeout bounds the wait.
    let _slot = state
        .batch_slots
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::NotReady)?;
    let engine = Arc::clone(&state.engine);
    // An item repeating an earlier one's JSON is read and answered once, one with a kept
    // answer is read and priced but not answered again (`Engine::validate_items_shared`).
    let (valid, sources) = state
        .pool
        .run(Work::Batch, deadline.clone(), move || {
            engine.validate_items_shared(request.items)
        })
        .await?;
    // The valid items in parts (`into_parts`), all queued at once: they run side by side,
    // and a single estimate queued meanwhile goes before the parts not yet started. One
    // version of the profiles for the whole batch; each item's answer is the one it gets alone.
    let profiles = state.engine.profiles.snapshot();
    let distinct = valid.len();
    let parts = into_parts(valid, state.pool.threads());
    let pending: Vec<_> = parts
        .into_iter()
        .map(|part| {
            let (engine, profiles) = (Arc::clone(&state.engine), profiles.clone());
            let work = deadline.clone();
            state.pool.run(Work::Batch, deadline.clone(), move || {
                let answers = answer_items_until(&engine, &part, &profiles, started, &work);
                super::body::release_freed_memory_when_idle();
                answers
            })
        })
        .collect();
    let mut answers = Vec::with_capacity(distinct);
    for part in pending {
        answers.extend(part.await?);
    }
    // Repeated items' answers are copied on the pool too, and the answers computed kept.
    let engine = Arc::clone(&state.engine);
    let items = state
        .pool
        .run(Work::Batch, deadline.clone(), move || {
            Ok(shared_outcomes(
                &engine, sources, answers, started, &deadline,
            ))
        })
        .await?;
    Ok(Json(BatchResponse { items }))
}

/// A batch's valid items in order, cut into parts of about equal work (an item ranked on n
/// cards weighs n): one per pool thread, or more, of at most [`MAX_PART_CARD_ESTIMATES`]
/// each, so that no part holds a thread long.
fn into_parts(items: Vec<ValidEstimateRequest>, threads: usize) -> Vec<Vec<ValidEstimateRequest>> {
    let weight = |item: &ValidEstimateRequest| 1 + item.others.len();
    let total: usize = items.iter().map(weight).sum();
    let per_part = total
        .div_ceil(threads.max(1))
        .clamp(1, MAX_PART_CARD_ESTIMATES);
    let mut parts = Vec::new();
    let (mut part, mut held) = (Vec::new(), 0);
    for item in items {
        held += weight(&item);
        part.push(item);
        if held >= per_part {
            parts.push(std::mem::take(&mut part));
            held = 0;
        }
    }
    if !part.is_empty() {
        parts.push(part);
    }
    parts
}
