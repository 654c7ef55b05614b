//! The estimation engine both faces stand on: a validated request in, an answer out. It holds
//! what an answer reads (the estimators, the GPU catalogue, the calibration profiles, the
//! metrics, this host's GPUs) and nothing of HTTP: no axum, no permits, no write access. The
//! server (`http/`) admits, extracts and authorises, then calls it; `gpucast estimate` calls it
//! directly.
//!
//! - [`validate`]: a wire request -> a validated job, its target GPU and what was asked.
//! - [`answer`]: a validated request -> the answer (placement, class, utilization, metrics).

pub mod answer;
pub mod files;
pub mod validate;

use std::sync::Arc;
use std::time::Instant;

use crate::api::parse::parse_estimate;
use crate::api::types::{BatchItemResponse, EstimateResponse};
use crate::calibration::store::ProfileStore;
use crate::devices::sku::Catalogue;
use crate::devices::GpuDevices;
use crate::error::ApiError;
use crate::estimators::Estimators;
use crate::metrics::Metrics;

/// What every answer reads.
pub struct Engine {
    pub estimators: Arc<Estimators>,
    /// The GPU models requests can name: the built-in catalogue and `--gpus`.
    pub catalogue: Arc<Catalogue>,
    pub profiles: Arc<ProfileStore>,
    pub metrics: Arc<Metrics>,
    pub devices: Arc<dyn GpuDevices>,
}

impl Engine {
    /// One request's answer.
    pub fn estimate(
        &self,
        request: &crate::api::types::EstimateRequest,
        started: Instant,
    ) -> Result<EstimateResponse, ApiError> {
        let valid = validate::validate(request, &self.catalogue, self.devices.as_ref())?;
        answer::answer(self, valid, started)
    }

    /// A batch's answers, one per item in order: each item parsed and validated on its own
    /// (an error names its index), the valid ones estimated together.
    pub fn estimate_items(
        &self,
        items: Vec<Box<serde_json::value::RawValue>>,
        started: Instant,
    ) -> Vec<BatchItemResponse> {
        let (mut valid, mut errors) = (
            Vec::with_capacity(items.len()),
            Vec::with_capacity(items.len()),
        );
        for (index, item) in items.into_iter().enumerate() {
            let checked = parse_estimate(item.get().as_bytes(), &format!("items[{index}]"))
                .and_then(|request| {
                    validate::validate(&request, &self.catalogue, self.devices.as_ref())
                        .map_err(|e| e.within(&format!("items[{index}].")))
                });
            match checked {
                Ok(item) => {
                    valid.push(item);
                    errors.push(None);
                }
                Err(error) => errors.push(Some(error)),
            }
        }
        let mut answers = answer::answer_items(self, &valid, started).into_iter();
        errors
            .into_iter()
            .enumerate()
            .map(|(index, error)| {
                let outcome = match error {
                    Some(error) => Err(error),
                    None => answers.next().expect("one answer per valid item"),
                };
                match outcome {
                    Ok(estimate) => BatchItemResponse {
                        index,
                        status: 200,
                        estimate: Some(estimate),
                        error: None,
                    },
                    Err(error) => BatchItemResponse {
                        index,
                        status: error.status().as_u16(),
                        estimate: None,
                        error: Some(error.problem()),
                    },
                }
            })
            .collect()
    }
}
