//! Answers a validated request for its target GPU (or ranks a list of them): the estimators
//! and physics, placement and calibration, the roofline and which utilization source answers,
//! the class of the figure answered, metrics; the wire mapping is [`crate::api::answer`].

use std::collections::BTreeMap;
use std::time::Instant;

use crate::api::answer::{performance_response, round_1, round_to, setup_response, to_response};
use crate::api::types::{
    EstimateResponse, GpuRankResponse, HostFitResponse, SetupResponse, UtilizationResponse,
    UtilizationSourceName,
};
use crate::calibration::label::Stack;
use crate::calibration::step_time::HostFit;
use crate::calibration::store::ProfileSnapshot;
use crate::engine::validate::{Node, ValidEstimateRequest};
use crate::engine::{Deadline, Engine};
use crate::error::ApiError;
use crate::estimators::manifest::EstimatorKind;
use crate::estimators::{Estimate, EstimateError, Query};
use crate::job::{Confidence, Job, MemoryFraction};
use crate::physics::perf::{self, Roofline};
use crate::physics::BreakdownSource;
use crate::placement::{self, place, BoundBasis, Candidate, Target, REFERENCE_SKU};

/// The utilization metrics answered, each a fraction or null with a reason.
const UTILIZATION_TARGETS: [&str; 3] = ["smact", "smocc", "drama"];

/// The metrics whose learned regressor (trained on A100 40 GB MLP measurements) answers
/// before the roofline on the reference card: those where it beat the roofline on the
/// held-out MLP rows (`cargo test --test api roofline -- --nocapture`, docs/design/roofline.md):
/// SMACT (MAE 0.010 against the roofline's 0.038); on SMOCC the roofline wins (0.014 against
/// 0.027). Elsewhere, and on every other card, the roofline answers.
const LEARNED_FIRST: [&str; 1] = ["smact"];

/// Runs the estimators (CPU work: call it off the async workers) and records metrics.
pub fn answer(
    engine: &Engine,
    request: ValidEstimateRequest,
    started: Instant,
) -> Result<EstimateResponse, ApiError> {
    answer_until(engine, request, started, &Deadline::NONE)
}

/// [`answer`], stopped with [`ApiError::Timeout`] at `deadline`: checked before each card a
/// job is ranked on.
pub fn answer_until(
    engine: &Engine,
    request: ValidEstimateRequest,
    started: Instant,
    deadline: &Deadline,
) -> Result<EstimateResponse, ApiError> {
    deadline.check()?;
    if request.listed {
        let profiles = engine.profiles.snapshot();
        return answer_ranked(engine, &request, &profiles, started, deadline);
    }
    let ValidEstimateRequest {
        job,
        confidence,
        fraction,
        target,
        environment,
        stack,
        warnings,
        classifiers,
        from_files,
        node,
        counted,
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
        stack,
        warnings,
        setup: SetupResponse {
            from_files,
            ..setup_response(&job, trained_params(&estimate))
        },
        node,
    };
    respond(engine, estimate, asked, started, counted)
}

/// Answers a request whose `gpu` is a list: the job on every card, ranked by
/// [`placement::rank`]; the answer is the best-ranked card's, with the ranking.
fn answer_ranked(
    engine: &Engine,
    request: &ValidEstimateRequest,
    profiles: &ProfileSnapshot,
    started: Instant,
    deadline: &Deadline,
) -> Result<EstimateResponse, ApiError> {
    let job = &request.job;
    let setup = SetupResponse {
        from_files: request.from_files.clone(),
        ..setup_response(job, None)
    };
    let mut answers = Vec::with_capacity(1 + request.others.len());
    for (index, target) in std::iter::once(&request.target)
        .chain(&request.others)
        .enumerate()
    {
        // Each card is a job's estimators, physics and placement over again.
        deadline.check()?;
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
                profiles,
                job,
                target,
                request.environment.as_deref(),
            ),
            profiles: profiles.clone(),
            target: target.clone(),
            environment: request.environment.clone(),
            stack: request.stack,
            warnings: request.warnings.clone(),
            setup: setup.clone(),
            node: request.node,
        };
        // One request counts once in the metrics: the estimates of the first card.
        answers.push(respond(
            engine,
            estimate,
            asked,
            started,
            request.counted && index == 0,
        )?);
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
    // One version of the profiles for the whole batch.
    let profiles = engine.profiles.snapshot();
    answer_items_until(engine, items, &profiles, started, &Deadline::NONE)
        .expect("without a deadline the work is not stopped")
}

/// [`answer_items`] with the profiles the whole batch reads (a batch answered in parts, on
/// several threads, reads one version), stopped with [`ApiError::Timeout`] at `deadline`:
/// checked before each item's answer and each card of a ranked item.
pub fn answer_items_until(
    engine: &Engine,
    items: &[ValidEstimateRequest],
    profiles: &ProfileSnapshot,
    started: Instant,
    deadline: &Deadline,
) -> Result<Vec<Result<EstimateResponse, ApiError>>, ApiError> {
    deadline.check()?;
    let single: Vec<&ValidEstimateRequest> = items.iter().filter(|i| !i.listed).collect();
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
            deadline.check()?;
            let asked = Asked {
                confidence: item.confidence,
                fraction: item.fraction,
                roofline: roofline(
                    engine,
                    profiles,
                    &item.job,
                    &item.target,
                    item.environment.as_deref(),
                ),
                profiles: profiles.clone(),
                target: item.target.clone(),
                environment: item.environment.clone(),
                stack: item.stack,
                warnings: item.warnings.clone(),
                setup: SetupResponse {
                    from_files: item.from_files.clone(),
                    ..setup_response(&item.job, trained_params(&estimate))
                },
                node: item.node,
            };
            Ok(respond(engine, estimate, asked, started, true))
        });
    items
        .iter()
        .map(|item| {
            if item.listed {
                match answer_ranked(engine, item, profiles, started, deadline) {
                    Err(ApiError::Timeout) => Err(ApiError::Timeout),
                    answered => Ok(answered),
                }
            } else {
                singles.next().expect("one answer per single-card item")
            }
        })
        .collect()
}

/// The trainable and LoRA parameters the estimate's physics counted, for the setup's echo.
fn trained_params(estimate: &Result<Estimate, EstimateError>) -> Option<(f64, f64)> {
    estimate
        .as_ref()
        .ok()
        .and_then(|e| e.physics.trained_params)
}

/// What a request asked beside its job, and its setup as understood.
struct Asked {
    confidence: Confidence,
    fraction: Option<MemoryFraction>,
    target: Target,
    environment: Option<String>,
    /// The training stack the request names (`None`: unsaid).
    stack: Option<Stack>,
    warnings: Vec<String>,
    setup: SetupResponse,
    /// The performance model on the target, or why there is none.
    roofline: Result<Timed, String>,
    /// The calibration profiles as the request read them.
    profiles: ProfileSnapshot,
    /// The node whose host memory an offloading job must fit.
    node: Option<Node>,
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
        stack,
        mut warnings,
        setup,
        roofline,
        profiles,
        node,
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
                stack,
                &profiles,
                &estimate.physics,
                distribution,
                fraction,
                confidence.get(),
            )
        });
    if let (Some(p), Some(stack)) = (&placement, stack) {
        if p.basis == BoundBasis::BetweenStacks {
            warnings.push(format!(
                "stack: {} is not a stack the physics follows and the bound was measured on; \
                 the bound holds the spread between stacks: report three of its runs as \
                 observations of an environment (POST /v1/calibration/observations) and name \
                 it to narrow it",
                stack.as_str()
            ));
        }
    }
    // Unsaid, the stack is assumed like the other fields the analytic step answers for;
    // listed last, since stating it does not narrow the bound.
    let physics_answers = estimate.physics.source == BreakdownSource::Step;
    if let Some(p) = placement.as_ref().filter(|p| {
        stack.is_none()
            && physics_answers
            && matches!(p.basis, BoundBasis::HeldOutGroups | BoundBasis::GpuProfile)
    }) {
        let range = placement::unsaid_stack(&estimate.physics, p.estimate_mib, confidence.get());
        estimate.assumed.push(range);
    }
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
            .count_class(estimate.family.as_str(), estimate.class.class.index);
    }
    // With a roofline every metric has a figure: no reason to write.
    let null_reasons = if roofline.is_ok() {
        BTreeMap::new()
    } else {
        utilization_null_reasons(engine, &estimate)
    };
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
        Ok(r) => response.performance = Some(performance_response(&r.roofline, r.host.as_ref())),
        Err(why) => response.performance_null_reason = Some(why.clone()),
    }
    // Estimates do not need the store: while it fails they go on with the profiles last
    // derived, and say so.
    if let Some(calibration) = response.calibration.as_mut() {
        calibration.profiles_stale = profiles.stale();
    }
    if let Some(node) = node {
        check_host(&mut response, node);
    }
    Ok(response)
}

/// An offloading job placed on `node`: what its ranks there keep on the CPU against the node's
/// host memory; the job does not fit where it does not. A job without offload is not checked
/// (its host memory is not modelled).
fn check_host(response: &mut EstimateResponse, node: Node) {
    let (Some(per_gpu), Some(fit)) = (
        response.setup.offload.host_memory_mib,
        response.fit.as_mut(),
    ) else {
        return;
    };
    let needed = round_1(per_gpu * node.gpus as f64);
    let fits = needed <= node.memory_mib as f64;
    fit.host = Some(HostFitResponse {
        needed_mib: needed,
        capacity_mib: node.memory_mib,
        gpus: node.gpus,
        fits,
    });
    if !fits {
        fit.fits = false;
        fit.max_colocated = 0;
        response.warnings.push(format!(
            "node: the {} GPUs' offload holds {needed} MiB of host memory ({per_gpu} MiB each), \
             more than the node's {} MiB: the job does not fit there",
            node.gpus, node.memory_mib
        ));
    }
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
