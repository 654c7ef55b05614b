//! The GPU catalogue as the wire shows it (`GET /v1/gpus`, `gpucast gpus --format json`).

use crate::api::types::{GpuResponse, GpusResponse, SourceResponse};
use crate::devices::sku::{Catalogue, Origin, Sku};

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
        gfd_products: sku.gfd_products.clone(),
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
