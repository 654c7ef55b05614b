//! The engine's answer as the wire shows it: an estimate, its placement on the target GPU and
//! the job's setup mapped to the response types, with the rounding every figure gets. Both
//! faces (the server and `gpucast estimate`) answer through these mappings.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::api::types::{
    AssumedResponse, BreakdownResponse, BreakdownSourceName, CalibrationResponse, EstimateResponse,
    EstimatorAnswer, ExtrapolationResponse, FitBasisName, FitResponse, HostMemoryResponse,
    LatencyResponse, MemoryClassResponse, MemoryResponse, OffloadResponse, ParallelismResponse,
    PeakMomentName, PerformanceBoundName, PerformanceResponse, PerformanceSourceName,
    SetupResponse, UncertaintyResponse, UtilizationResponse,
};
use crate::bound::PeakDistribution;
use crate::calibration::step_time::HostFit;
use crate::estimators::{ClassAnswer, Estimate};
use crate::job::setup::Trainable;
use crate::job::{Confidence, Job, MemoryClass};
use crate::physics::assumed::AssumedRange;
use crate::physics::perf::{self, Bound, Roofline};
use crate::physics::step;
use crate::physics::{Breakdown, BreakdownSource, Physics};
use crate::placement::{BoundBasis, FitBasis, Placement};

pub fn performance_response(r: &Roofline, host: Option<&HostFit>) -> PerformanceResponse {
    PerformanceResponse {
        step_time_ms: round_3(r.step_time_ms),
        samples_per_s: round_3(r.samples_per_s),
        forward_ms: round_3(r.forward_ms),
        backward_ms: round_3(r.backward_ms),
        optimizer_ms: round_3(r.optimizer_ms),
        collectives_ms: round_3(r.collectives_ms),
        bound: match r.bound {
            Bound::Compute => PerformanceBoundName::Compute,
            Bound::Memory => PerformanceBoundName::Memory,
            Bound::Overhead => PerformanceBoundName::Overhead,
            Bound::Communication => PerformanceBoundName::Communication,
        },
        source: PerformanceSourceName::Roofline,
        host_us_per_op: round_3(host.map_or(perf::CALIBRATED.host_us_per_op, |h| h.host_us_per_op)),
        host_cost_observations: host.map_or(0, |h| h.observations),
    }
}

/// The setup of `job` as an answer states it; `trained_params` are the trainable and LoRA
/// parameters when the job's analytic step was already walked ([`Physics::trained_params`]).
pub fn setup_response(job: &Job, trained_params: Option<(f64, f64)>) -> SetupResponse {
    let setup = job.setup();
    // Every parameter trains unless the setup says otherwise: no need to walk the step then
    // (the hot path of plain jobs).
    let (trainable, lora) = if setup.trainable == Trainable::All && setup.lora.is_none() {
        (job.layers().iter().map(|l| l.params).sum::<u64>(), 0)
    } else {
        let (trainable, lora) = trained_params.unwrap_or_else(|| {
            let step = step::analytic_step(job);
            (step.trainable_params, step.lora_params)
        });
        (trainable.round() as u64, lora.round() as u64)
    };
    let p = setup.parallelism;
    SetupResponse {
        precision: setup.precision.as_str().into(),
        optimizer: setup.optimizer.as_str().into(),
        optimizer_implementation: setup.implementation.as_str().into(),
        activation_checkpointing: setup.checkpointing.as_str().into(),
        micro_batch_size: setup.micro_batch_size,
        gradient_accumulation_steps: setup.accumulation,
        trainable_params: job
            .simulation()
            .and_then(|s| s.trainable_params)
            .unwrap_or(trainable),
        lora_params: lora,
        parallelism: ParallelismResponse {
            strategy: p.strategy.as_str().into(),
            world_size: p.world_size,
            data_parallel: p.data(),
            tensor_parallel: p.tensor,
            pipeline_parallel: p.pipeline,
            context_parallel: p.context,
            sequence_parallel: p.sequence_parallel,
        },
        offload: {
            let host = step::host_memory(job);
            let mib = |bytes: f64| round_1(bytes / (1024.0 * 1024.0));
            OffloadResponse {
                optimizer_state: setup.offload.optimizer_state,
                gradients: setup.offload.gradients,
                parameters: setup.offload.parameters,
                host_memory_mib: host.map(|h| mib(h.total())),
                host_breakdown: host.map(|h| HostMemoryResponse {
                    optimizer_state: mib(h.optimizer_state),
                    gradients: mib(h.gradients),
                    parameters: mib(h.parameters),
                }),
            }
        },
        master_weights: if setup.fp32_master { "fp32" } else { "none" }.into(),
        reference_model: setup.reference.as_str().into(),
        loss_implementation: job
            .known_activations()
            .map(|k| k.loss_implementation.as_str().to_string()),
        from_files: Vec::new(),
        learned_estimators_apply: job.learned_estimators_apply(),
    }
}

pub fn class_response(class: MemoryClass, probabilities: Vec<f32>) -> MemoryClassResponse {
    MemoryClassResponse {
        index: class.index,
        lower_mib: class.lower_mib,
        upper_mib: class.upper_mib,
        // Four decimals: a probability of 4.458427e-6 says no more than 0.0000.
        probabilities: probabilities
            .into_iter()
            .map(|p| round_to(p, 1e4))
            .collect(),
    }
}

pub fn to_response(
    estimate: Estimate,
    placement: Option<Placement>,
    confidence: Confidence,
    mut warnings: Vec<String>,
    utilization: UtilizationResponse,
    setup: SetupResponse,
    started: Instant,
) -> EstimateResponse {
    let breakdown = placement.as_ref().map(|p| {
        BreakdownResponse::from(
            estimate
                .physics
                .breakdown(p.estimate_mib)
                .rounded(p.estimate_mib),
        )
    });
    let breakdown_source = placement.as_ref().map(|_| match estimate.physics.source {
        BreakdownSource::Simulation => BreakdownSourceName::Simulation,
        BreakdownSource::Analytic => BreakdownSourceName::Analytic,
        BreakdownSource::Step => BreakdownSourceName::TrainingStep,
    });
    let peaks = estimate.physics.simulated;
    let extrapolation = estimate.extrapolation.map(|e| ExtrapolationResponse {
        distance: e.reach.distance.map(round_3),
        typical_distance: round_3(e.reach.typical_distance),
        ratio: Some(e.reach.ratio).filter(|r| r.is_finite()).map(round_3),
        outside_setup: e.reach.outside_setup,
        correction_applied: e.correction_applied,
        bound_widened_by: round_3(e.bound_widened_by),
    });
    let moment = placement
        .as_ref()
        .map(|p| peak_moment(&estimate.physics, p.estimate_mib));
    let base_correction = estimate.base_correction;
    let Estimate {
        family,
        class,
        classifiers,
        mib,
        mib_estimators,
        runs,
        left_out,
        assumed,
        ..
    } = estimate;
    let versions: BTreeMap<String, String> = runs
        .iter()
        .map(|r| (r.name.clone(), r.version.clone()))
        .collect();
    let version_of = |name: &str| versions.get(name).cloned().unwrap_or_default();
    let mut estimators: BTreeMap<String, EstimatorAnswer> = classifiers
        .into_iter()
        .map(
            |(
                name,
                ClassAnswer {
                    class,
                    probabilities,
                },
            )| {
                let answer = EstimatorAnswer {
                    version: version_of(&name),
                    class: Some(class_response(class, probabilities)),
                    estimate_mib: None,
                };
                (name, answer)
            },
        )
        .collect();
    for (name, figure) in mib_estimators {
        let answer = EstimatorAnswer {
            version: version_of(&name),
            class: None,
            estimate_mib: Some(round_mib(figure)),
        };
        estimators.insert(name, answer);
    }
    EstimateResponse {
        family: family.as_str().to_string(),
        memory: MemoryResponse {
            // The figures for the target GPU (calibrated when it has a profile).
            estimate_mib: placement
                .as_ref()
                .map(|p| round_mib(p.estimate_mib))
                .or(mib.map(|m| round_mib(m.estimate_mib))),
            // Rounded up: a bound must not shrink in rounding.
            upper_bound_mib: placement
                .as_ref()
                .map(|p| p.upper_bound_mib.ceil())
                .or(mib.map(|m| m.upper_bound_mib.ceil())),
            confidence: confidence.get(),
            floored: placement.as_ref().is_some_and(|p| p.floored),
            class: class_response(class.class, class.probabilities),
            breakdown,
            breakdown_source,
            allocated_peak_mib: peaks.map(|p| round_mib(p.allocated_mib)),
            reserved_peak_mib: peaks.map(|p| round_mib(p.reserved_mib)),
            min_capacity_mib: peaks.map(|p| round_mib(p.min_capacity_mib)),
            estimators,
            extrapolation,
            uncertainty: placement
                .as_ref()
                .map(|p| uncertainty_response(&p.peak, &assumed, p.estimate_mib, p.basis)),
            peak_moment: moment,
            base_correction: base_correction.map(|f| round_to_f64(f, 1e4)),
        },
        utilization,
        latency_us: LatencyResponse {
            total: round_1(started.elapsed().as_secs_f64() * 1e6),
            estimators: runs
                .iter()
                .map(|r| (r.name.clone(), round_1(r.latency.as_secs_f64() * 1e6)))
                .collect(),
        },
        estimator_versions: versions,
        fit: placement.as_ref().map(|p| FitResponse {
            gpu: p.target.gpu.clone(),
            capacity_mib: p.target.capacity_mib,
            oom_probability: round_probability(p.fit.oom_probability),
            confidence: confidence.get(),
            fits: p.fit.fits,
            max_colocated: p.fit.max_colocated,
            basis: match p.fit_basis {
                FitBasis::UpperBound => FitBasisName::UpperBound,
                FitBasis::Simulation => FitBasisName::Simulation,
            },
            host: None,
        }),
        warnings: {
            warnings.extend(left_out);
            warnings
        },
        setup,
        calibration: placement.as_ref().map(|p| CalibrationResponse {
            gpu: p.target.gpu.clone(),
            profile_used: p.profile_observations.is_some(),
            observations: p.profile_observations.unwrap_or(0),
            environment: p.profile_environment.clone(),
            profiles_stale: false,
        }),
        // Set by `respond` from the roofline.
        performance: None,
        performance_null_reason: None,
        gpu_ranking: Vec::new(),
    }
}

impl From<Breakdown> for BreakdownResponse {
    fn from(parts: Breakdown) -> BreakdownResponse {
        BreakdownResponse {
            parameters: parts.parameters,
            gradients: parts.gradients,
            optimizer_state: parts.optimizer_state,
            activations: parts.activations,
            temporaries: parts.temporaries,
            collective_buffers: parts.collective_buffers,
            paged_optimizer_state: parts.paged_optimizer_state,
            allocator_cache: parts.allocator_cache,
            cuda_context: parts.cuda_context,
        }
    }
}

/// When in the step the peak falls, as physics sees it: at the optimizer's step when no
/// activation is alive at the peak (weights, gradients, optimizer state and its
/// temporaries), or when the figure is held at what the optimizer's step reserves; else at
/// the start of backward (every activation kept, the first gradients).
pub fn peak_moment(physics: &Physics, figure_mib: f64) -> PeakMomentName {
    let p = &physics.parts;
    let held_at_optimizer_step =
        physics.optimizer_step_mib > 0.0 && figure_mib <= physics.optimizer_step_mib + 0.05;
    if (p.activations <= 0.0 && p.gradients > 0.0) || held_at_optimizer_step {
        PeakMomentName::OptimizerStep
    } else {
        PeakMomentName::BackwardStart
    }
}

/// The distribution behind a bound and a decision, as answered, with the fields the request
/// left unsaid as ranges around the answered figure `estimate_mib`.
pub fn uncertainty_response(
    peak: &PeakDistribution,
    assumed: &[AssumedRange],
    estimate_mib: f64,
    basis: BoundBasis,
) -> UncertaintyResponse {
    let t = &peak.terms;
    UncertaintyResponse {
        basis: basis.as_str().into(),
        assumed: assumed
            .iter()
            .map(|r| AssumedResponse {
                field: r.field.into(),
                assumed: r.assumed.into(),
                low_mib: round_mib((estimate_mib - r.down_mib).max(0.0)),
                high_mib: round_mib(estimate_mib + r.up_mib),
            })
            .collect(),
        assumed_log_range: round_to_f64(peak.assumed_log_range, 1e4),
        assumed_factor: round_to_f64(peak.assumed_factor(), 1e4),
        detail: peak.group.detail.as_str().into(),
        setup_family: peak.group.family.as_str().into(),
        scores_group: peak.scores_group.into(),
        rows: peak.scores.rows,
        known_mib: round_mib(t.known),
        cuda_context_mib: round_mib(t.cuda_context),
        uncertain_mib: round_mib(t.uncertain),
        reclaimable_mib: round_mib(t.reclaimable),
        share: round_to_f64(t.share(peak.min_share()), 1e4),
        scale: round_to_f64(peak.scale, 1e4),
        score_quantiles: REPORTED_LEVELS
            .iter()
            .map(|(key, level)| (key.to_string(), round_to_f64(peak.score_at(*level), 1e4)))
            .collect(),
    }
}

/// The confidences whose scores an answer shows.
const REPORTED_LEVELS: [(&str, f64); 5] = [
    ("0.5", 0.5),
    ("0.8", 0.8),
    ("0.9", 0.9),
    ("0.95", 0.95),
    ("0.99", 0.99),
];

/// A probability to 1e-6 (a decision compares it with 1 - confidence).
pub fn round_probability(p: f64) -> f64 {
    round_to_f64(p, 1e6)
}

pub fn round_to_f64(value: f64, scale: f64) -> f64 {
    (value * scale).round() / scale
}

/// MiB figures to 0.1 MiB.
pub fn round_mib(mib: f64) -> f64 {
    round_1(mib)
}

/// A fraction to `1 / scale`.
pub fn round_to(fraction: f32, scale: f32) -> f32 {
    (fraction * scale).round() / scale
}

/// To one decimal: what a reader can use, without float noise like `383.25399999999996`.
pub fn round_1(value: f64) -> f64 {
    (value * 10.0).round() / 10.0
}

pub fn round_3(value: f64) -> f64 {
    (value * 1000.0).round() / 1000.0
}
