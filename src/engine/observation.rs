//! The rules an observation of a job's peak is held to before it is recorded (the card's
//! whole memory above, physics' floor below, one GPU and environment named once, a step time
//! the card's roofline can learn from), the caps on the profiles callers can start, and the
//! recording itself: one home for the service's routes (`/v1/calibration/*`) and the CLI
//! (`gpucast observe`).

use serde_json::value::RawValue;

use crate::api::parse::parse_json;
use crate::api::types::{
    EnvironmentFitResponse, EstimateRequest, ObservationRequest, ObservationsResponse,
    ProfileResponse, StepTimeFitResponse,
};
use crate::calibration::db::{NewObservation, Source};
use crate::calibration::environment::{CONTEXT_RANGE_MIB, FACTOR_RANGE};
use crate::calibration::profile::{CalibrationProfile, ProfileError};
use crate::calibration::step_time;
use crate::devices::CUSTOM_PREFIX;
use crate::engine::cost::Cost;
use crate::engine::validate::{self, resolve, to_job};
use crate::engine::{Deadline, Engine};
use crate::error::ApiError;
use crate::estimators::FIRST_PRINCIPLES;
use crate::placement::Target;
use crate::placement::MAX_CUSTOM_PROFILES;

/// Observations accepted in one call.
pub const MAX_OBSERVATIONS: usize = 1000;
/// Environments with a profile of their own, per GPU.
pub const MAX_ENVIRONMENTS_PER_GPU: usize = 32;
/// Profiles in all (GPU and environment keys): each is a set of metric series and a fit held
/// in memory, and the catalogue's cards times their environments would otherwise reach
/// thousands.
pub const MAX_PROFILES: usize = 512;

/// The observations of a body (one object, or an array of them), each parsed into the typed
/// request item by item (not through a JSON value, which would keep the last of two duplicate
/// keys), so that errors name the field, and each with its job's JSON text as posted, which
/// is what is stored. More than [`MAX_OBSERVATIONS`] are refused; an empty list records
/// nothing, and says so.
pub fn parse(body: &str) -> Result<Vec<Posted>, ApiError> {
    let observations: Vec<Posted> = if body.trim_start().starts_with('[') {
        let items: Vec<&RawValue> =
            serde_json::from_str(body).map_err(|e| ApiError::MalformedJson(e.to_string()))?;
        items
            .iter()
            .enumerate()
            .map(|(index, item)| posted(item.get(), &format!("[{index}]")))
            .collect::<Result<_, _>>()?
    } else {
        vec![posted(body, "")?]
    };
    if observations.len() > MAX_OBSERVATIONS {
        return Err(ApiError::InvalidInput(format!(
            "body: at most {MAX_OBSERVATIONS} observations are accepted, got {}",
            observations.len()
        )));
    }
    Ok(observations)
}

/// Observations are priced like a batch's items before any work: each job answered on its
/// card; refused above the engine's budget.
pub fn price(engine: &Engine, observations: &[Posted]) -> Result<(), ApiError> {
    let mut spent = Cost::default();
    for observation in observations {
        spent.add(&Cost::of(&observation.request.job));
    }
    spent.check(engine.cost_budget, Some(observations.len()))
}

/// An observation as parsed, with its job's JSON text as posted.
pub struct Posted {
    request: ObservationRequest,
    job: String,
}

fn posted(text: &str, location: &str) -> Result<Posted, ApiError> {
    #[derive(serde::Deserialize)]
    struct JobText<'a> {
        #[serde(borrow)]
        job: &'a RawValue,
    }
    let request: ObservationRequest = parse_json(text.as_bytes(), location)?;
    // It parsed as an observation, so it has a job.
    let job = serde_json::from_str::<JobText>(text)
        .map_err(|e| ApiError::MalformedJson(e.to_string()))?
        .job
        .get()
        .to_string();
    Ok(Posted { request, job })
}

/// Validates every observation first, so that a bad one records nothing; then stores them all
/// in one transaction and re-derives the profiles they touch.
pub fn record(
    engine: &Engine,
    observations: Vec<Posted>,
    deadline: &Deadline,
) -> Result<ObservationsResponse, ApiError> {
    // The caps first, from each observation's names alone (cheap), so that a batch that
    // would start too many profiles is refused before its jobs are estimated; an
    // observation whose names do not resolve is left to the checks below to name. The
    // store checks them again as it records (concurrent writers).
    let (catalogue, devices) = (&engine.catalogue, engine.devices.as_ref());
    let named: Vec<(String, Option<String>)> = observations
        .iter()
        .filter_map(|Posted { request, .. }| {
            let target = resolve(Some(&request.gpu), catalogue, devices).ok()?;
            let environment = validate::environment(request.environment.as_deref()).ok()?;
            Some((target.gpu, environment))
        })
        .collect();
    let keys: Vec<Key> = named
        .iter()
        .map(|(gpu, environment)| (gpu.as_str(), environment.as_deref()))
        .collect();
    refuse_too_many_keys(&engine.profiles.list(), &keys)?;
    let mut batch: Vec<NewObservation> = Vec::with_capacity(observations.len());
    for (
        index,
        Posted {
            request: observation,
            job,
        },
    ) in observations.iter().enumerate()
    {
        deadline.check()?;
        // A lone observation's fields are named as they are; a list's with their index.
        let location = if observations.len() > 1 {
            format!("[{index}].")
        } else {
            String::new()
        };
        let at = |e: ApiError| e.within(&location);
        let observed = observation.observed_peak_mib;
        if !(observed.is_finite() && observed >= 1.0) {
            return Err(at(ApiError::InvalidInput(
                "observed_peak_mib: must be a number of MiB, at least 1".into(),
            )));
        }
        let (catalogue, devices) = (&engine.catalogue, engine.devices.as_ref());
        let target = resolve(Some(&observation.gpu), catalogue, devices).map_err(at)?;
        // The GPU is named once, at the top: a different one inside the job is a contradiction.
        if let Some(inner) = observation.job.gpu.as_ref() {
            // An observation is of one card: a list inside its job cannot be it.
            let crate::api::types::GpuChoice::One(inner) = inner else {
                return Err(at(ApiError::InvalidInput(
                    "job.gpu: an observation is of one GPU, not a list".into(),
                )));
            };
            let inner =
                resolve(Some(inner), catalogue, devices).map_err(|e| at(e.within("job.")))?;
            if inner != target {
                return Err(at(ApiError::InvalidInput(format!(
                    "job.gpu: names {}, the observation {}",
                    inner.gpu, target.gpu
                ))));
            }
        }
        let environment = validate::environment(observation.environment.as_deref()).map_err(at)?;
        let inner_environment = validate::environment(observation.job.environment.as_deref())
            .map_err(|e| at(e.within("job.")))?;
        if inner_environment.is_some() && inner_environment != environment {
            return Err(at(ApiError::InvalidInput(format!(
                "job.environment: names {}, the observation {}",
                inner_environment.as_deref().unwrap_or_default(),
                environment.as_deref().unwrap_or("none")
            ))));
        }
        // No job peaks above the whole memory of the card it ran on.
        if observed > target.capacity_mib as f64 {
            return Err(at(ApiError::InvalidInput(format!(
                "observed_peak_mib: {observed} MiB is more than the whole memory of {} ({} MiB)",
                target.gpu, target.capacity_mib
            ))));
        }
        let reference = reference_figure(engine, &observation.job).map_err(at)?;
        // Nor below what physics says it must hold (model state and CUDA context): such a
        // reading is not of this job. In a named environment, below what the leanest stack
        // holds of it (the stack's factor's range): a stack may hold less than physics says.
        let floor = match environment {
            Some(_) => reference.floor_in_leanest_stack_mib,
            None => reference.floor_mib,
        };
        if observed < floor {
            return Err(at(ApiError::InvalidInput(format!(
                "observed_peak_mib: {observed} MiB is below the job's physical floor of {floor:.0} MiB (model state and the smallest CUDA context{})",
                if environment.is_some() { ", in the leanest stack" } else { "" }
            ))));
        }
        let step_time = observation
            .step_time_ms
            .map(|ms| observed_step_time(ms, &target, &observation.job))
            .transpose()
            .map_err(at)?;
        batch.push(NewObservation {
            gpu: target.gpu,
            environment,
            job: job.clone(),
            observed_peak_mib: observed,
            predicted_mib: reference.predicted_mib,
            breakdown: reference.breakdown,
            source: Source::Posted,
            step_time,
        });
    }
    let recorded = batch.len();
    let ratios: Vec<(String, String, f64)> = batch
        .iter()
        .map(|o| {
            let environment = o.environment.clone().unwrap_or_default();
            (
                o.gpu.clone(),
                environment,
                o.observed_peak_mib / o.predicted_mib,
            )
        })
        .collect();
    // The last moment to give up: past it, the caller may be answered 503 (or is gone), and
    // a 503 must mean nothing was recorded.
    deadline.check()?;
    // The caps are checked and the batch recorded as one: concurrent writers cannot both pass.
    let updates = engine
        .profiles
        .record_checked(batch, refuse_too_many_profiles)?
        .map_err(profile_error)?;
    // Recorded, so their labels are within the profiles' bounds.
    for (gpu, environment, ratio) in ratios {
        engine
            .metrics
            .calibration_observed_over_estimated
            .with_label_values(&[gpu.as_str(), environment.as_str()])
            .observe(ratio);
    }
    let mut profiles = Vec::with_capacity(updates.len());
    let mut limited = Vec::new();
    for update in updates {
        let profile = update.profile;
        engine.metrics.record_calibration(&profile);
        if profile.environment.is_none() && update.limited {
            tracing::warn!(gpu = %profile.sku, "calibration update held to the per-update step");
            limited.push(profile.sku.clone());
        }
        profiles.push(profile_response(&profile));
    }
    Ok(ObservationsResponse {
        recorded,
        profiles,
        limited,
    })
}

/// Custom cards and environments are named by callers, so their profiles (metric series,
/// memory) are bounded: observations that would start a profile beyond
/// [`MAX_CUSTOM_PROFILES`] custom cards, or beyond [`MAX_ENVIRONMENTS_PER_GPU`] environments
/// of one GPU, or beyond [`MAX_PROFILES`] in all, are refused.
fn refuse_too_many_profiles(
    existing: &[CalibrationProfile],
    batch: &[NewObservation],
) -> Result<(), ApiError> {
    let keys: Vec<Key> = batch
        .iter()
        .map(|o| (o.gpu.as_str(), o.environment.as_deref()))
        .collect();
    refuse_too_many_keys(existing, &keys)
}

/// A profile's key: the GPU, and the environment (`None`: the GPU's own).
type Key<'a> = (&'a str, Option<&'a str>);

/// [`refuse_too_many_profiles`] over the keys a batch would write.
fn refuse_too_many_keys(existing: &[CalibrationProfile], batch: &[Key]) -> Result<(), ApiError> {
    let is_custom = |key: &str| key.starts_with(CUSTOM_PREFIX);
    let mut new_keys: Vec<(&str, Option<&str>)> = batch
        .iter()
        .copied()
        .filter(|(gpu, environment)| {
            !existing
                .iter()
                .any(|p| p.sku == *gpu && p.environment.as_deref() == *environment)
        })
        .collect();
    new_keys.sort_unstable();
    new_keys.dedup();
    if existing.len() + new_keys.len() > MAX_PROFILES {
        return Err(ApiError::InvalidInput(format!(
            "gpu, environment: at most {MAX_PROFILES} profiles are kept; {} exist and this call starts {}",
            existing.len(),
            new_keys.len()
        )));
    }
    let mut new_custom: Vec<&str> = batch
        .iter()
        .map(|&(gpu, _)| gpu)
        .filter(|gpu| is_custom(gpu) && !existing.iter().any(|p| p.sku == *gpu))
        .collect();
    new_custom.sort_unstable();
    new_custom.dedup();
    if !new_custom.is_empty() {
        let mut custom: Vec<&str> = existing
            .iter()
            .filter(|p| is_custom(&p.sku))
            .map(|p| p.sku.as_str())
            .collect();
        custom.dedup();
        if custom.len() + new_custom.len() > MAX_CUSTOM_PROFILES {
            return Err(ApiError::InvalidInput(format!(
                "gpu: at most {MAX_CUSTOM_PROFILES} custom cards are calibrated; {} are already",
                custom.len()
            )));
        }
    }
    for &(gpu, environment) in batch {
        let Some(environment) = environment else {
            continue;
        };
        let known = |p: &CalibrationProfile| p.sku == gpu && p.environment.is_some();
        if existing
            .iter()
            .any(|p| known(p) && p.environment.as_deref() == Some(environment))
        {
            continue;
        }
        let mut environments: Vec<&str> = existing
            .iter()
            .filter(|p| known(p))
            .filter_map(|p| p.environment.as_deref())
            .chain(
                batch
                    .iter()
                    .filter(|&&(other, _)| other == gpu)
                    .filter_map(|&(_, environment)| environment),
            )
            .collect();
        environments.sort_unstable();
        environments.dedup();
        if environments.len() > MAX_ENVIRONMENTS_PER_GPU {
            return Err(ApiError::InvalidInput(format!(
                "environment: at most {MAX_ENVIRONMENTS_PER_GPU} environments are calibrated per GPU; {} has more with this call",
                gpu
            )));
        }
    }
    Ok(())
}

/// A measured step time and the job's predicted step times across host costs on the card
/// ([`step_time::curve`]), stored together; refused unless a positive number of ms up to an
/// hour on a card with peak figures (a custom card known by its memory has no roofline).
fn observed_step_time(
    ms: f64,
    target: &Target,
    request: &EstimateRequest,
) -> Result<(f64, String), ApiError> {
    if !(ms.is_finite() && ms > 0.0 && ms <= step_time::MAX_STEP_TIME_MS) {
        return Err(ApiError::InvalidInput(format!(
            "step_time_ms: must be a positive number of ms, at most {}",
            step_time::MAX_STEP_TIME_MS
        )));
    }
    let Some(gpu) = target.performance.as_ref() else {
        return Err(ApiError::InvalidInput(format!(
            "step_time_ms: the GPU '{}' is known only by its memory: no performance model to \
             learn from a step time",
            target.gpu
        )));
    };
    let job = to_job(request).map_err(|e| e.within("job."))?;
    let curve = serde_json::to_string(&step_time::curve(&job, gpu)).expect("a curve serialises");
    Ok((ms, curve))
}

/// What the reference (uncalibrated) model says of a job, and the least it can need.
pub struct Reference {
    /// The learned MiB figure, or the first-principles one for a family without a memory
    /// regressor.
    pub predicted_mib: f64,
    /// Physics' floor: model state and the smallest CUDA context an environment has
    /// ([`CONTEXT_RANGE_MIB`]): the context is the environment's, so an observation from
    /// one with a smaller context than physics assumes is not refused for it.
    pub floor_mib: f64,
    /// The floor in a stack that holds the least of it ([`FACTOR_RANGE`]'s low end).
    pub floor_in_leanest_stack_mib: f64,
    /// The predicted figure by category, MiB, as a JSON object.
    pub breakdown: String,
}

pub fn reference_figure(engine: &Engine, request: &EstimateRequest) -> Result<Reference, ApiError> {
    let job = to_job(request).map_err(|e| e.within("job."))?;
    let estimate = engine
        .estimators
        .estimate(&job, crate::job::Confidence::DEFAULT.get())?;
    let predicted_mib = estimate
        .mib
        .map(|m| m.estimate_mib)
        .unwrap_or_else(|| estimate.mib_estimators[FIRST_PRINCIPLES]);
    let b = estimate.physics.breakdown(predicted_mib);
    let breakdown = serde_json::to_string(&b).expect("a breakdown serialises");
    let least_context = CONTEXT_RANGE_MIB.0.min(estimate.physics.parts.cuda_context);
    Ok(Reference {
        predicted_mib,
        floor_mib: estimate.physics.floor_with_context_mib(least_context),
        floor_in_leanest_stack_mib: estimate
            .physics
            .floor_in_stack_mib(least_context, FACTOR_RANGE.0),
        breakdown,
    })
}

fn profile_error(e: ProfileError) -> ApiError {
    match e {
        // A profile that fails validation after a refit was made so by the observations sent.
        ProfileError::InvalidSku(_)
        | ProfileError::InvalidObservation(_)
        | ProfileError::Invalid(_) => ApiError::InvalidInput(e.to_string()),
        ProfileError::Store(detail) => {
            tracing::error!(error = %detail, "observation store failed");
            ApiError::StoreUnavailable(crate::job::echo(&detail))
        }
        other => ApiError::Internal(other.to_string()),
    }
}

pub fn profile_response(p: &CalibrationProfile) -> ProfileResponse {
    ProfileResponse {
        gpu: p.sku.clone(),
        environment: p.environment.clone(),
        offset_mib: p.offset_mib,
        scale: p.scale,
        residual_quantiles: p.residual_quantiles.clone(),
        observations: p.observations,
        updated_at: p.updated_at.clone(),
        environment_fit: p.environment_fit.as_ref().map(|f| EnvironmentFitResponse {
            context_mib: f.context_mib,
            allocator_fixed_mib: f.allocator_fixed_mib,
            activation_scale: f.activation_scale,
            cache_scale: f.cache_scale,
            observations: f.samples,
            log_residual_quantiles: f.log_residual_quantiles.clone(),
            stack_factor: f.stack_factor,
            log_margin_95: crate::calibration::environment::log_margin(f, 0.95),
        }),
        step_time_fit: p.host_fit.map(|f| StepTimeFitResponse {
            host_us_per_op: f.host_us_per_op,
            observations: f.observations,
            median_error: f.median_error,
        }),
    }
}
