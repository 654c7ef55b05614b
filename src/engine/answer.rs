//! Turns estimates into wire answers for their target GPU: placement and calibration, the
//! class of the figure answered, metrics, rounding.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::api::types::{
    BreakdownResponse, BreakdownSourceName, CalibrationResponse, EstimateResponse, EstimatorAnswer,
    ExtrapolationResponse, FitBasisName, FitResponse, GpuRankResponse, LatencyResponse,
    MemoryClassResponse, MemoryResponse, OffloadResponse, ParallelismResponse, PeakMomentName,
    PerformanceBoundName, PerformanceResponse, PerformanceSourceName, SetupResponse,
    UncertaintyResponse, UtilizationResponse, UtilizationSourceName,
};
use crate::calibration::placement::{
    self, place, Candidate, FitBasis, Placement, Target, REFERENCE_SKU,
};
use crate::calibration::step_time::HostFit;
use crate::calibration::store::ProfileSnapshot;
use crate::engine::validate::ValidEstimateRequest;
use crate::engine::Engine;
use crate::error::ApiError;
use crate::estimators::manifest::EstimatorKind;
use crate::estimators::{ClassAnswer, Estimate, EstimateError, Query};
use crate::job::setup::Trainable;
use crate::job::{Confidence, Job, MemoryClass, MemoryFraction};
use crate::physics::perf::{self, Bound, Roofline};
use crate::physics::step;
use crate::physics::uncertainty::PeakDistribution;
use crate::physics::{BreakdownSource, Physics};

/// The utilization metrics answered, each a fraction or null with a reason.
const UTILIZATION_TARGETS: [&str; 3] = ["smact", "smocc", "drama"];

/// The metrics whose learned regressor (trained on A100 40 GB MLP measurements) answers
/// before the roofline on the reference card: those where it beat the roofline on the
/// held-out MLP rows (`cargo test --test api roofline -- --nocapture`, docs/roofline.md):
/// SMACT (MAE 0.010 against the roofline's 0.038); on SMOCC the roofline wins (0.014 against
/// 0.027). Elsewhere, and on every other card, the roofline answers.
const LEARNED_FIRST: [&str; 1] = ["smact"];

/// Runs the estimators (CPU work: call it off the async workers) and records metrics.
pub fn answer(
    engine: &Engine,
    request: ValidEstimateRequest,
    started: Instant,
) -> Result<EstimateResponse, ApiError> {
    if request.listed {
        return answer_ranked(engine, &request, started);
    }
    let ValidEstimateRequest {
        job,
        confidence,
        fraction,
        target,
        environment,
        warnings,
        classifiers,
        ..
    } = request;
    // The profiles as this request reads them: one version throughout.
    let profiles = engine.profiles.snapshot();
    let estimate = engine.estimators.estimate_query(Query {
        job: &job,
        confidence: confidence.get(),
        capacity_mib: target.capacity_mib,
        classifiers,
        utilization: learned_utilization(engine, &target).filter(|_| !classifiers),
    });
    let asked = Asked {
        confidence,
        fraction,
        roofline: roofline(engine, &profiles, &job, &target, environment.as_deref()),
        profiles,
        target,
        environment,
        warnings,
        setup: setup_response(&job),
    };
    respond(engine, estimate, asked, started, true)
}

/// Answers a request whose `gpu` is a list: the job on every card, ranked by
/// [`placement::rank`]; the answer is the best-ranked card's, with the ranking.
fn answer_ranked(
    engine: &Engine,
    request: &ValidEstimateRequest,
    started: Instant,
) -> Result<EstimateResponse, ApiError> {
    let job = &request.job;
    let setup = setup_response(job);
    let profiles = engine.profiles.snapshot();
    let mut answers = Vec::with_capacity(1 + request.others.len());
    for (index, target) in std::iter::once(&request.target)
        .chain(&request.others)
        .enumerate()
    {
        let estimate = engine.estimators.estimate_query(Query {
            job,
            confidence: request.confidence.get(),
            capacity_mib: target.capacity_mib,
            classifiers: request.classifiers,
            utilization: learned_utilization(engine, target).filter(|_| !request.classifiers),
        });
        let asked = Asked {
            confidence: request.confidence,
            fraction: request.fraction,
            roofline: roofline(
                engine,
                &profiles,
                job,
                target,
                request.environment.as_deref(),
            ),
            profiles: profiles.clone(),
            target: target.clone(),
            environment: request.environment.clone(),
            warnings: request.warnings.clone(),
            setup: setup.clone(),
        };
        // One request counts once in the metrics: the estimates of the first card.
        answers.push(respond(engine, estimate, asked, started, index == 0)?);
    }
    let candidates: Vec<Candidate> = answers
        .iter()
        .map(|a| Candidate {
            fits: a.fit.as_ref().is_some_and(|f| f.fits),
            step_time_ms: a.performance.as_ref().map(|p| p.step_time_ms),
            capacity_mib: a.fit.as_ref().map_or(0, |f| f.capacity_mib),
            upper_bound_mib: a.memory.upper_bound_mib.unwrap_or(f64::INFINITY),
        })
        .collect();
    let order = placement::rank(&candidates);
    let ranking: Vec<GpuRankResponse> = order
        .iter()
        .zip(1..)
        .map(|(&i, rank)| {
            let a = &answers[i];
            GpuRankResponse {
                rank,
                gpu: a.fit.as_ref().map_or_else(String::new, |f| f.gpu.clone()),
                capacity_mib: candidates[i].capacity_mib,
                fits: candidates[i].fits,
                max_colocated: a.fit.as_ref().map_or(0, |f| f.max_colocated),
                estimate_mib: a.memory.estimate_mib,
                upper_bound_mib: a.memory.upper_bound_mib,
                step_time_ms: a.performance.as_ref().map(|p| p.step_time_ms),
                samples_per_s: a.performance.as_ref().map(|p| p.samples_per_s),
            }
        })
        .collect();
    let mut best = answers.swap_remove(order[0]);
    best.gpu_ranking = ranking;
    best.latency_us.total = round_1(started.elapsed().as_secs_f64() * 1e6);
    Ok(best)
}

/// Answers valid requests as `POST /v1/estimate/batch` does, running each model once over all
/// of them: CPU work, to be called off the async workers. In process it answers thousands of
/// jobs without the JSON of a round trip (the physical-floor sweep of the tests does so).
/// Items with a `gpu` list are answered one by one, each ranked.
pub fn answer_items(
    engine: &Engine,
    items: &[ValidEstimateRequest],
    started: Instant,
) -> Vec<Result<EstimateResponse, ApiError>> {
    let single: Vec<&ValidEstimateRequest> = items.iter().filter(|i| !i.listed).collect();
    // One version of the profiles for the whole batch.
    let profiles = engine.profiles.snapshot();
    let queries: Vec<Query> = single
        .iter()
        .map(|item| Query {
            job: &item.job,
            confidence: item.confidence.get(),
            capacity_mib: item.target.capacity_mib,
            classifiers: item.classifiers,
            utilization: learned_utilization(engine, &item.target).filter(|_| !item.classifiers),
        })
        .collect();
    let mut singles = engine
        .estimators
        .estimate_queries(&queries)
        .into_iter()
        .zip(single)
        .map(|(estimate, item)| {
            let asked = Asked {
                confidence: item.confidence,
                fraction: item.fraction,
                roofline: roofline(
                    engine,
                    &profiles,
                    &item.job,
                    &item.target,
                    item.environment.as_deref(),
                ),
                profiles: profiles.clone(),
                target: item.target.clone(),
                environment: item.environment.clone(),
                warnings: item.warnings.clone(),
                setup: setup_response(&item.job),
            };
            respond(engine, estimate, asked, started, true)
        });
    items
        .iter()
        .map(|item| {
            if item.listed {
                answer_ranked(engine, item, started)
            } else {
                singles.next().expect("one answer per single-card item")
            }
        })
        .collect()
}

/// What a request asked beside its job, and its setup as understood.
struct Asked {
    confidence: Confidence,
    fraction: Option<MemoryFraction>,
    target: Target,
    environment: Option<String>,
    warnings: Vec<String>,
    setup: SetupResponse,
    /// The performance model on the target, or why there is none.
    roofline: Result<Timed, String>,
    /// The calibration profiles as the request read them.
    profiles: ProfileSnapshot,
}

/// The roofline and the host cost it was timed with.
struct Timed {
    roofline: Roofline,
    /// Fitted to observed step times; `None`: the model's default.
    host: Option<HostFit>,
}

/// The roofline of `job` on the target, timed with the host cost fitted to the step times
/// observed on that GPU in `environment` (else in any) when there is one; or why there is none.
fn roofline(
    engine: &Engine,
    profiles: &ProfileSnapshot,
    job: &Job,
    target: &Target,
    environment: Option<&str>,
) -> Result<Timed, String> {
    if engine
        .catalogue
        .by_id(&target.gpu)
        .is_some_and(|sku| sku.vendor == crate::devices::sku::Vendor::Amd)
    {
        return Err(format!(
            "utilization on '{}' (AMD) is not modelled: the roofline follows NVIDIA's kernels \
             (warps of 32, cuBLAS's tiles); the memory figures hold",
            target.gpu
        ));
    }
    let Some(gpu) = &target.performance else {
        return Err(format!(
            "the target GPU '{}' is known only by its memory: no peak throughput to run the \
             roofline performance model on",
            target.gpu
        ));
    };
    let host = profiles.host_fit(&target.gpu, environment);
    let roofline = match &host {
        Some(fit) => perf::roofline_with(job, gpu, &fit.constants()),
        None => perf::roofline(job, gpu),
    };
    Ok(Timed { roofline, host })
}

/// The utilization targets whose learned regressor can be answered on `target`: with a
/// roofline, [`LEARNED_FIRST`] on the reference card and none elsewhere (the roofline answers);
/// without one, all (`None`). `estimators: all` runs every regressor whatever is answered.
pub fn learned_utilization(engine: &Engine, target: &Target) -> Option<&'static [&'static str]> {
    if !has_roofline(engine, target) {
        None
    } else if target.gpu == REFERENCE_SKU {
        Some(&LEARNED_FIRST)
    } else {
        Some(&[])
    }
}

/// Whether the roofline can time a job on `target`: an NVIDIA card with known peaks.
fn has_roofline(engine: &Engine, target: &Target) -> bool {
    target.performance.is_some()
        && !engine
            .catalogue
            .by_id(&target.gpu)
            .is_some_and(|sku| sku.vendor == crate::devices::sku::Vendor::Amd)
}

/// Utilization figures, where each comes from and why the others are null: the learned
/// regressors' first on the reference card for [`LEARNED_FIRST`], the roofline's otherwise;
/// a learned figure stays when there is no roofline.
fn utilization(
    learned: &mut BTreeMap<String, f32>,
    roofline: &Result<Timed, String>,
    on_reference: bool,
    mut null_reasons: BTreeMap<String, String>,
) -> UtilizationResponse {
    let mut sources = BTreeMap::new();
    let mut figures: BTreeMap<&str, f32> = BTreeMap::new();
    for target in UTILIZATION_TARGETS {
        let learned_figure = learned.remove(target);
        let roofline_figure = roofline
            .as_ref()
            .ok()
            .map(|t| &t.roofline)
            .map(|r| match target {
                "smact" => r.smact,
                "smocc" => r.smocc,
                _ => r.drama,
            } as f32);
        let learned_first = on_reference && LEARNED_FIRST.contains(&target);
        let chosen = match (learned_figure, roofline_figure) {
            (Some(l), _) if learned_first => Some((l, UtilizationSourceName::Learned)),
            (_, Some(r)) => Some((r, UtilizationSourceName::Roofline)),
            (Some(l), None) => Some((l, UtilizationSourceName::Learned)),
            (None, None) => None,
        };
        match chosen {
            Some((figure, source)) => {
                null_reasons.remove(target);
                figures.insert(target, round_to(figure, 1e3));
                sources.insert(target.to_string(), source);
            }
            None => {
                if let Err(why) = roofline {
                    let learned_why = null_reasons.remove(target).unwrap_or_default();
                    null_reasons.insert(target.to_string(), format!("{learned_why}; {why}"));
                }
            }
        }
    }
    UtilizationResponse {
        smact: figures.get("smact").copied(),
        smocc: figures.get("smocc").copied(),
        drama: figures.get("drama").copied(),
        sources,
        null_reasons,
    }
}

fn performance_response(timed: &Timed) -> PerformanceResponse {
    let r = &timed.roofline;
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
        host_us_per_op: round_3(
            timed
                .host
                .map_or(perf::CALIBRATED.host_us_per_op, |h| h.host_us_per_op),
        ),
        host_cost_observations: timed.host.map_or(0, |h| h.observations),
    }
}

/// The setup of `job` as an answer states it.
fn setup_response(job: &Job) -> SetupResponse {
    let setup = job.setup();
    // Every parameter trains unless the setup says otherwise: no need to walk the step then
    // (the hot path of plain jobs).
    let (trainable, lora) = if setup.trainable == Trainable::All && setup.lora.is_none() {
        (job.layers().iter().map(|l| l.params).sum::<u64>(), 0)
    } else {
        let step = step::analytic_step(job);
        (
            step.trainable_params.round() as u64,
            step.lora_params.round() as u64,
        )
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
        },
        offload: OffloadResponse {
            optimizer_state: setup.offload.optimizer_state,
            gradients: setup.offload.gradients,
            parameters: setup.offload.parameters,
        },
        master_weights: if setup.fp32_master { "fp32" } else { "none" }.into(),
        reference_model: setup.reference.as_str().into(),
        loss_implementation: job
            .known_activations()
            .map(|k| k.loss_implementation.as_str().to_string()),
        learned_estimators_apply: job.learned_estimators_apply(),
    }
}

/// Records an estimate's metrics and turns it into the wire answer for its target GPU.
fn respond(
    engine: &Engine,
    estimate: Result<Estimate, EstimateError>,
    asked: Asked,
    started: Instant,
    record: bool,
) -> Result<EstimateResponse, ApiError> {
    let Asked {
        confidence,
        fraction,
        target,
        environment,
        warnings,
        setup,
        roofline,
        profiles,
    } = asked;
    let on_reference = target.gpu == REFERENCE_SKU;
    let mut estimate = estimate?;
    let placement = estimate
        .mib
        .as_ref()
        .zip(estimate.distribution.as_ref())
        .map(|(answer, distribution)| {
            place(
                answer,
                target,
                environment.as_deref(),
                &profiles,
                &estimate.physics,
                distribution,
                fraction,
                confidence.get(),
            )
        });
    // The class contains the figure answered, which a calibration profile may have moved.
    if let Some(placement) = &placement {
        estimate.class = estimate.class_for(Some(placement.estimate_mib));
    }
    if record {
        for run in &estimate.runs {
            engine
                .metrics
                .inference_duration_seconds
                .with_label_values(&[run.name.as_str()])
                .observe(run.latency.as_secs_f64());
        }
        engine
            .metrics
            .predicted_class_total
            .with_label_values(&[
                estimate.family.as_str(),
                &estimate.class.class.index.to_string(),
            ])
            .inc();
    }
    let null_reasons = utilization_null_reasons(engine, &estimate);
    let utilization = utilization(
        &mut estimate.utilization,
        &roofline,
        on_reference,
        null_reasons,
    );
    let mut response = to_response(
        estimate,
        placement,
        confidence,
        warnings,
        utilization,
        setup,
        started,
    );
    match &roofline {
        Ok(r) => response.performance = Some(performance_response(r)),
        Err(why) => response.performance_null_reason = Some(why.clone()),
    }
    // Estimates do not need the store: while it fails they go on with the profiles last
    // derived, and say so.
    if let Some(calibration) = response.calibration.as_mut() {
        calibration.profiles_stale = profiles.stale();
    }
    Ok(response)
}

/// Why each utilization metric without a figure has none: no model for the job's family (and
/// which families have one), or the family's model did not answer this job.
fn utilization_null_reasons(engine: &Engine, estimate: &Estimate) -> BTreeMap<String, String> {
    let family = estimate.family.as_str();
    UTILIZATION_TARGETS
        .iter()
        .filter(|target| !estimate.utilization.contains_key(**target))
        .map(|&target| {
            let mut trained: Vec<&str> = engine
                .estimators
                .all()
                .iter()
                .filter(|e| {
                    e.entry.kind == EstimatorKind::UtilizationRegressor
                        && e.entry.target.as_deref() == Some(target)
                })
                .map(|e| e.family.as_str())
                .collect();
            trained.sort_unstable();
            trained.dedup();
            let reason = if trained.contains(&family) {
                format!("the {family} {target} model did not answer this job (see warnings)")
            } else if trained.is_empty() {
                format!("no {target} model is loaded: no measured {target} data exists yet for any family")
            } else {
                format!(
                    "no {target} model for {family} jobs: measured {target} data exists only for {} jobs",
                    trained.join(", ")
                )
            };
            (target.to_string(), reason)
        })
        .collect()
}

fn class_response(class: MemoryClass, probabilities: Vec<f32>) -> MemoryClassResponse {
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

fn to_response(
    estimate: Estimate,
    placement: Option<Placement>,
    confidence: Confidence,
    mut warnings: Vec<String>,
    utilization: UtilizationResponse,
    setup: SetupResponse,
    started: Instant,
) -> EstimateResponse {
    let breakdown = placement.as_ref().map(|p| {
        let parts = estimate
            .physics
            .breakdown(p.estimate_mib)
            .rounded(p.estimate_mib);
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
            uncertainty: placement.as_ref().map(|p| uncertainty_response(&p.peak)),
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

/// When in the step the peak falls, as physics sees it: at the optimizer's step when no
/// activation is alive at the peak (weights, gradients, optimizer state and its
/// temporaries), or when the figure is held at what the optimizer's step reserves; else at
/// the start of backward (every activation kept, the first gradients).
fn peak_moment(physics: &Physics, figure_mib: f64) -> PeakMomentName {
    let p = &physics.parts;
    let held_at_optimizer_step =
        physics.optimizer_step_mib > 0.0 && figure_mib <= physics.optimizer_step_mib + 0.05;
    if (p.activations <= 0.0 && p.gradients > 0.0) || held_at_optimizer_step {
        PeakMomentName::OptimizerStep
    } else {
        PeakMomentName::BackwardStart
    }
}

/// The distribution behind a bound and a decision, as answered.
fn uncertainty_response(peak: &PeakDistribution) -> UncertaintyResponse {
    let t = &peak.terms;
    UncertaintyResponse {
        detail: peak.detail.as_str().into(),
        known_mib: round_mib(t.known),
        cuda_context_mib: round_mib(t.cuda_context),
        uncertain_mib: round_mib(t.uncertain),
        reclaimable_mib: round_mib(t.reclaimable),
        log_sd: round_to_f64(peak.spread.log_sd, 1e4),
        bias: round_to_f64(peak.spread.bias, 1e4),
        cuda_context_sd_mib: round_mib(peak.context_sd),
    }
}

/// A probability to 1e-6 (a decision compares it with 1 - confidence).
fn round_probability(p: f64) -> f64 {
    round_to_f64(p, 1e6)
}

fn round_to_f64(value: f64, scale: f64) -> f64 {
    (value * scale).round() / scale
}

/// MiB figures to 0.1 MiB.
fn round_mib(mib: f64) -> f64 {
    round_1(mib)
}

/// A fraction to `1 / scale`.
fn round_to(fraction: f32, scale: f32) -> f32 {
    (fraction * scale).round() / scale
}

/// To one decimal: what a reader can use, without float noise like `383.25399999999996`.
fn round_1(value: f64) -> f64 {
    (value * 10.0).round() / 10.0
}

fn round_3(value: f64) -> f64 {
    (value * 1000.0).round() / 1000.0
}
