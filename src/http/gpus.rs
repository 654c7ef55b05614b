//! `GET /v1/gpus`: the GPU catalogue as this service serves it.

use axum::extract::State;
use axum::Json;

use crate::devices::sku::{Catalogue, Origin, Sku};
use crate::http::types::{GpuResponse, GpusResponse, SourceResponse};
use crate::http::AppState;

/// The GPU models requests can name (the built-in catalogue and the `--gpus` file), with the
/// figures estimates use.
#[utoipa::path(get, path = "/v1/gpus", tag = "devices", responses((status = 200, body = GpusResponse)))]
pub async fn gpus(State(state): State<AppState>) -> Json<GpusResponse> {
    Json(catalogue_response(&state.engine.catalogue))
}

/// The catalogue as `GET /v1/gpus` (and `gpucast gpus --format json`) serve it.
pub fn catalogue_response(catalogue: &Catalogue) -> GpusResponse {
    GpusResponse {
        gpus: catalogue.all().iter().map(gpu_response).collect(),
    }
}

fn gpu_response(sku: &Sku) -> GpuResponse {
    GpuResponse {
        id: sku.id.clone(),
        name: sku.name.clone(),
        aliases: sku.aliases.clone(),
        memory_mib: sku.capacity_mib,
        memory_gb: sku.memory_gb,
        vendor: sku.vendor.as_str().to_string(),
        compute_capability: sku.compute_capability.clone(),
        peaks: (&sku.performance).into(),
        source: SourceResponse {
            title: sku.source.title.clone(),
            url: sku.source.url.clone(),
        },
        note: sku.note.clone(),
        from_file: sku.origin == Origin::File,
    }
}
