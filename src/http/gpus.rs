//! `GET /v1/gpus`: the GPU catalogue as this service serves it.

use axum::extract::State;
use axum::Json;

use crate::api::gpus::catalogue_response;
use crate::api::types::GpusResponse;
use crate::http::AppState;

/// The GPU models requests can name (the built-in catalogue and the `--gpus` file), with the
/// figures estimates use.
#[utoipa::path(get, path = "/v1/gpus", tag = "devices", responses((status = 200, body = GpusResponse)))]
pub async fn gpus(State(state): State<AppState>) -> Json<GpusResponse> {
    Json(catalogue_response(&state.engine.catalogue))
}
