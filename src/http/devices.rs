//! `GET /v1/devices`: the GPUs of this host.

use axum::extract::State;
use axum::Json;

use crate::api::types::{DeviceResponse, DevicesResponse, PeaksResponse};
use crate::devices::{derived, DeviceError};
use crate::error::ApiError;
use crate::http::AppState;

/// The GPUs of this host, as NVML reports them.
#[utoipa::path(get, path = "/v1/devices", tag = "devices", responses((status = 200, body = DevicesResponse)))]
pub async fn devices(State(state): State<AppState>) -> Result<Json<DevicesResponse>, ApiError> {
    let devices = state.engine.devices.clone();
    let listed = tokio::task::spawn_blocking(move || devices.list())
        .await
        .map_err(|e| ApiError::Internal(format!("device task failed: {e}")))?;
    let response = match listed {
        Ok(devices) => DevicesResponse {
            nvml: true,
            reason: None,
            devices: devices
                .into_iter()
                .map(|d| {
                    // Read against the service's catalogue, which `--gpus` may extend.
                    let sku = d.sku_in(&state.engine.catalogue).map(|s| s.id.clone());
                    let derived_peaks = match sku {
                        Some(_) => None,
                        None => derived::performance_of(&d)
                            .as_ref()
                            .map(PeaksResponse::from),
                    };
                    DeviceResponse {
                        index: d.index,
                        uuid: d.uuid,
                        name: d.name,
                        sku,
                        memory_total_mib: d.memory_total_mib,
                        memory_used_mib: d.memory_used_mib,
                        memory_free_mib: d.memory_free_mib,
                        compute_capability: d.compute_capability,
                        driver_version: d.driver_version,
                        multiprocessor_count: d.multiprocessor_count,
                        max_sm_clock_mhz: d.max_sm_clock_mhz,
                        max_memory_clock_mhz: d.max_memory_clock_mhz,
                        memory_bus_width_bits: d.memory_bus_width_bits,
                        derived_peaks,
                    }
                })
                .collect(),
        },
        // No driver is a fact about the host, not a failure: say so plainly.
        Err(DeviceError::Unavailable(reason)) => DevicesResponse {
            nvml: false,
            reason: Some(format!("no NVML device is present: {reason}")),
            devices: vec![],
        },
        Err(other) => return Err(ApiError::Internal(other.to_string())),
    };
    Ok(Json(response))
}
