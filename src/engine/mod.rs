//! The estimation engine both faces stand on: a validated request in, an answer out. It holds
//! what an answer reads (the estimators, the GPU catalogue, the calibration profiles, the
//! metrics, this host's GPUs) and nothing of HTTP: no axum, no permits, no write access. The
//! server (`http/`) admits, extracts and authorises, then calls it; `gpucast estimate` calls it
//! directly.
//!
//! - [`cost`]: a wire request's price from its sizes, refused above the budget before any work.
//! - [`files`]: the setup the user's files (training arguments, PEFT, DeepSpeed, load) state,
//!   written into the request's own fields.
//! - [`validate`]: a wire request -> a validated job, its target GPU and what was asked.
//! - [`answer`]: a validated request -> the answer (placement, class, utilization, metrics).

pub mod answer;
pub mod cost;
pub mod files;
pub mod validate;

use std::sync::Arc;
use std::time::Instant;

use crate::api::parse::parse_estimate;
use crate::api::types::{BatchItemResponse, EstimateRequest, EstimateResponse};
use crate::calibration::store::ProfileStore;
use crate::devices::sku::Catalogue;
use crate::devices::GpuDevices;
use crate::error::ApiError;
use crate::estimators::Estimators;
use crate::metrics::Metrics;
use validate::ValidEstimateRequest;

/// What every answer reads.
pub struct Engine {
    pub estimators: Arc<Estimators>,
    /// The GPU models requests can name: the built-in catalogue and `--gpus`.
    pub catalogue: Arc<Catalogue>,
    pub profiles: Arc<ProfileStore>,
    pub metrics: Arc<Metrics>,
    pub devices: Arc<dyn GpuDevices>,
    /// The most work units a request may cost ([`cost`]; `--max-request-cost`): a request
    /// priced above it is refused before any work.
    pub cost_budget: u64,
}

impl Engine {
    /// One request's answer.
    pub fn estimate(
        &self,
        request: &EstimateRequest,
        started: Instant,
    ) -> Result<EstimateResponse, ApiError> {
        let valid = self.validate(request)?;
        answer::answer(self, valid, started)
    }

    /// A request priced ([`cost::Cost`]) and, within the budget, validated
    /// ([`validate::validate`]).
    pub fn validate(&self, request: &EstimateRequest) -> Result<ValidEstimateRequest, ApiError> {
        cost::Cost::of(request).check(self.cost_budget, None)?;
        validate::validate(request, &self.catalogue, self.devices.as_ref())
    }

    /// A batch's answers, one per item in order: each item parsed and validated on its own
    /// (an error names its index), the valid ones estimated together. The items are priced
    /// together first: a batch above the cost budget is refused whole, before any is validated.
    pub fn estimate_items(
        &self,
        items: Vec<Box<serde_json::value::RawValue>>,
        started: Instant,
    ) -> Result<Vec<BatchItemResponse>, ApiError> {
        let count = items.len();
        let parsed: Vec<Result<EstimateRequest, ApiError>> = items
            .into_iter()
            .enumerate()
            .map(|(index, item)| parse_estimate(item.get().as_bytes(), &format!("items[{index}]")))
            .collect();
        let mut price = cost::Cost::default();
        for request in parsed.iter().flatten() {
            price.add(&cost::Cost::of(request));
        }
        price.check(self.cost_budget, Some(count))?;
        let (mut valid, mut errors) = (Vec::with_capacity(count), Vec::with_capacity(count));
        for (index, request) in parsed.into_iter().enumerate() {
            let checked = request.and_then(|request| {
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
        Ok(errors
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
            .collect())
    }
}
