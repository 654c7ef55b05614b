//! `POST /v1/kubernetes/admission`: the mutating admission webhook ([`crate::kubernetes`]).
//! Answered only when the service is started with `--admission`; 404 otherwise.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::Json;

use crate::api::parse::parse_json;
use crate::api::types::Problem;
use crate::engine::Deadline;
use crate::error::ApiError;
use crate::http::body::{release_freed_memory, FREE_BYTES_PER_BODY};
use crate::http::extract::JsonBytes;
use crate::http::pool::Work;
use crate::http::AppState;
use crate::kubernetes::review::{AdmissionReviewRequest, AdmissionReviewResponse};

/// Place a pod (or a Job's or PyTorchJob's pod templates) annotated `gpucast.dev/job` on the
/// GPU products its job fits: a required node affinity on `nvidia.com/gpu.product` and the
/// figure as annotations (a JSON Patch); denied, with its figure, when it fits none. Objects
/// without the annotation are allowed as they are. Answered only with `--admission`.
#[utoipa::path(
    post,
    path = "/v1/kubernetes/admission",
    tag = "kubernetes",
    request_body = AdmissionReviewRequest,
    responses(
        (status = 200, description = "The review answered: allowed (with a JSON Patch when placed) or denied with the reason", body = AdmissionReviewResponse),
        (status = 400, description = "Malformed JSON", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "The webhook is off (start with --admission)", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body too large", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "Not JSON", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Not an AdmissionReview of admission.k8s.io/v1", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "Overloaded, timed out or not ready: the webhook's failurePolicy decides", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, fields(uid))]
pub async fn admission(
    State(state): State<AppState>,
    JsonBytes(body): JsonBytes,
) -> Result<Json<AdmissionReviewResponse>, ApiError> {
    let Some(cluster) = state.admission.clone() else {
        return Err(ApiError::Off(
            "the Kubernetes admission webhook is off: start the service with --admission".into(),
        ));
    };
    let started = Instant::now();
    let deadline = Deadline::at(started + state.limits.request_timeout);
    let engine = Arc::clone(&state.engine);
    let span = tracing::Span::current();
    let work = deadline.clone();
    let response = state
        .pool
        .run(Work::LongEstimate, deadline, move || {
            let large = body.len() > FREE_BYTES_PER_BODY;
            let answer = (|| {
                let review: AdmissionReviewRequest = parse_json(&body, "")?;
                span.record("uid", crate::job::echo(&review.request.uid));
                crate::kubernetes::admit(&engine, &cluster, review, started, &work)
            })();
            // A large object's tree is freed here, on this thread: handed back to the system,
            // or a flood of them would leave the process that much larger.
            if large {
                release_freed_memory();
            }
            answer
        })
        .await?;
    count_decision(&state, &response);
    Ok(Json(AdmissionReviewResponse::new(response)))
}

/// The review's decision in `/metrics` (`gpucast_admission_decisions_total`): a denial is an
/// HTTP 200 review, which the HTTP series cannot tell from a placement.
fn count_decision(state: &AppState, response: &crate::kubernetes::review::AdmissionResponse) {
    state
        .engine
        .metrics
        .record_admission(response.allowed, response.patch.is_some());
}
