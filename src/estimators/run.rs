//! Running: the estimators of a job's family, each model called once per batch of jobs (per
//! distinct layer count for sequence models), their outputs handed to [`super::combine`].

use std::cell::OnceCell;
use std::time::{Duration, Instant};

use super::combine::{self, FamilyModels, Partial};
use super::estimator::{AnalyticRun, Estimator};
use super::extrapolation::Extrapolation;
use super::manifest::{EstimatorEntry, EstimatorKind, Requirement};
use super::{Estimate, EstimateError, EstimatorRun, Estimators, Query};
use crate::estimators::features::AggregateFeatures;
use crate::job::{Family, Job};
use crate::physics::analytic::AnalyticFigures;
use crate::physics::REFERENCE_CAPACITY_MIB;

impl Estimators {
    /// Runs every estimator of the job's family for the reference card (the A100 40 GB of the
    /// training data); the upper bound is at `confidence`.
    pub fn estimate(&self, job: &Job, confidence: f64) -> Result<Estimate, EstimateError> {
        self.estimate_on(job, confidence, REFERENCE_CAPACITY_MIB)
    }

    /// [`Estimators::estimate`] for a card of `capacity_mib`.
    pub fn estimate_on(
        &self,
        job: &Job,
        confidence: f64,
        capacity_mib: u64,
    ) -> Result<Estimate, EstimateError> {
        self.estimate_query(Query {
            job,
            confidence,
            capacity_mib,
            classifiers: true,
            utilization: None,
        })
    }

    /// One job, as [`Estimators::estimate_queries`] answers it.
    pub fn estimate_query(&self, query: Query) -> Result<Estimate, EstimateError> {
        self.estimate_queries(&[query])
            .pop()
            .expect("one job in, one answer out")
    }

    /// Estimates many jobs (each with its confidence) for the reference card.
    pub fn estimate_many(&self, jobs: &[(&Job, f64)]) -> Vec<Result<Estimate, EstimateError>> {
        let queries: Vec<Query> = jobs
            .iter()
            .map(|&(job, confidence)| Query {
                job,
                confidence,
                capacity_mib: REFERENCE_CAPACITY_MIB,
                classifiers: true,
                utilization: None,
            })
            .collect();
        self.estimate_queries(&queries)
    }

    /// Estimates many jobs, calling each model once per family rather than once per job.
    /// Per-estimator latencies are the call's time per job.
    pub fn estimate_queries(&self, queries: &[Query]) -> Vec<Result<Estimate, EstimateError>> {
        let mut answers: Vec<Option<Result<Estimate, EstimateError>>> =
            (0..queries.len()).map(|_| None).collect();
        for family in [Family::Mlp, Family::Cnn, Family::Transformer] {
            let indices: Vec<usize> = (0..queries.len())
                .filter(|&i| queries[i].job.family() == family)
                .collect();
            if indices.is_empty() {
                continue;
            }
            let group: Vec<Query> = indices.iter().map(|&i| queries[i]).collect();
            for (i, answer) in indices
                .into_iter()
                .zip(self.estimate_family(family, &group))
            {
                answers[i] = Some(answer);
            }
        }
        answers
            .into_iter()
            .map(|a| a.expect("every job has a family"))
            .collect()
    }

    /// Whether a simulated job's step runs on the card a simulation regressor's labels were
    /// measured on ([`combine::within_measured_range`]).
    fn within_measured_range(&self, job: &Job, entry: &EstimatorEntry) -> bool {
        match (
            job.simulation(),
            self.simulated.as_ref(),
            entry.capacity_mib,
        ) {
            (Some(simulation), Some(model), Some(capacity_mib)) => combine::within_measured_range(
                simulation.min_capacity_bytes,
                model.cuda_context_mib,
                capacity_mib,
            ),
            _ => true,
        }
    }

    fn estimate_family(
        &self,
        family: Family,
        jobs: &[Query],
    ) -> Vec<Result<Estimate, EstimateError>> {
        let members: Vec<&Estimator> = self
            .estimators
            .iter()
            .filter(|e| e.family == family)
            .collect();
        let Some(classes) = members.iter().find_map(|e| e.classes.as_ref()) else {
            return jobs
                .iter()
                .map(|_| Err(EstimateError::UnsupportedFamily(family)))
                .collect();
        };
        let job_refs: Vec<&Job> = jobs.iter().map(|query| query.job).collect();
        // The analytic figures once per job: the features read them, and they are answers too.
        let analytic: Vec<AnalyticRun> = job_refs.iter().map(|job| AnalyticRun::of(job)).collect();
        // The aggregate features, once a learned model or the training domain reads them: a
        // job none applies to (a config job's analytic step answers alone) never needs them.
        let aggregates_once: OnceCell<Vec<AggregateFeatures>> = OnceCell::new();
        let aggregates = || {
            aggregates_once.get_or_init(|| {
                job_refs
                    .iter()
                    .zip(&analytic)
                    .map(|(job, run)| AggregateFeatures::with_analytic(job, &run.figures))
                    .collect()
            })
        };
        // A job of a setup the learned models were not trained on: its memory regressors
        // answer the same layers in the nearest setup they know, and the training step carries
        // that answer to the job's setup (`combine`, `Partial::finish`).
        let bases: Vec<Option<Job>> = job_refs.iter().map(|job| job.learned_base()).collect();
        let base_aggregates: Vec<Option<AggregateFeatures>> = bases
            .iter()
            .map(|base| {
                base.as_ref()
                    .map(|base| AggregateFeatures::with_analytic(base, &AnalyticFigures::of(base)))
            })
            .collect();
        // What an estimator reads of a job: the job, or for a memory regressor its base; and
        // the features of that job (computed only when asked for).
        let reads_base = |i: usize, estimator: &Estimator| -> bool {
            bases[i].is_some() && base_aggregates[i].is_some() && estimator.answers_bases()
        };
        let view_job = |i: usize, estimator: &Estimator| -> &Job {
            match &bases[i] {
                Some(base) if reads_base(i, estimator) => base,
                _ => job_refs[i],
            }
        };
        let view_features = |i: usize, estimator: &Estimator| -> &AggregateFeatures {
            match &base_aggregates[i] {
                Some(features) if reads_base(i, estimator) => features,
                _ => &aggregates()[i],
            }
        };
        // Only simulated jobs are placed against the training domain: nothing for the others.
        let domain = self.simulated.as_ref().and_then(|s| s.domain.as_ref());
        let reaches: Vec<Option<(Extrapolation, Duration)>> = job_refs
            .iter()
            .enumerate()
            .map(|(i, job)| {
                let domain = domain.filter(|_| job.simulation().is_some())?;
                let aggregate = &aggregates()[i];
                let started = Instant::now();
                Some((domain.locate(job, aggregate), started.elapsed()))
            })
            .collect();
        let mut partials: Vec<Result<Partial, EstimateError>> = jobs
            .iter()
            .map(|_| Ok(Partial::new(members.len())))
            .collect();
        for estimator in &members {
            let applicable: Vec<usize> = (0..jobs.len())
                .filter(|&i| estimator.applies_to(view_job(i, estimator)))
                // The classifiers give opinions only: they run when they are asked for; a
                // utilization regressor, where its figure is answered.
                .filter(|&i| match estimator.entry.kind {
                    EstimatorKind::MemoryClassifier => jobs[i].classifiers,
                    EstimatorKind::UtilizationRegressor => {
                        jobs[i].utilization.is_none_or(|targets| {
                            estimator
                                .entry
                                .target
                                .as_deref()
                                .is_some_and(|t| targets.contains(&t))
                        })
                    }
                    _ => true,
                })
                // A sequence model that cannot read a job is left out of it, and the answer
                // says so; the family's other estimators answer.
                // Trained on plain one-GPU jobs: another setup is physics', corrected by the
                // memory regressors' answer of its base.
                .filter(|&i| {
                    let reason = if job_refs[i].learned_estimators_apply() {
                        estimator.cannot_read(job_refs[i])
                    } else if bases[i].is_some() && estimator.answers_bases() {
                        None
                    } else if job_refs[i].known_activations().is_some() {
                        Some(combine::BUILT_FROM_CONFIG.to_string())
                    } else {
                        Some(combine::OUTSIDE_LEARNED_SETUPS.to_string())
                    };
                    let Some(reason) = reason else { return true };
                    if let Ok(partial) = &mut partials[i] {
                        if !partial.left_out.contains(&reason) {
                            partial.left_out.push(reason);
                        }
                    }
                    false
                })
                // Far from the training data a simulation regressor is not applied at all, nor
                // beyond the card its labels were measured on.
                .filter(|&i| {
                    !estimator.entry.requires.contains(&Requirement::Simulation)
                        || (reaches[i]
                            .as_ref()
                            .is_none_or(|(reach, _)| combine::correction_applies(reach))
                            && self.within_measured_range(job_refs[i], &estimator.entry))
                })
                .collect();
            if applicable.is_empty() {
                continue;
            }
            let started = Instant::now();
            let own_jobs = applicable.len() == jobs.len()
                && (!estimator.answers_bases() || bases.iter().all(Option::is_none));
            let outputs = if own_jobs {
                estimator.run_many(&job_refs, aggregates())
            } else {
                let some_jobs: Vec<&Job> =
                    applicable.iter().map(|&i| view_job(i, estimator)).collect();
                let some_aggregates: Vec<AggregateFeatures> = applicable
                    .iter()
                    .map(|&i| view_features(i, estimator).clone())
                    .collect();
                estimator.run_many(&some_jobs, &some_aggregates)
            };
            let latency = started.elapsed() / applicable.len() as u32;
            for (&i, output) in applicable.iter().zip(outputs) {
                let (partial, confidence) = (&mut partials[i], jobs[i].confidence);
                let Ok(state) = partial else { continue };
                let applied =
                    output.and_then(|output| state.apply(estimator, classes, output, confidence));
                match applied {
                    Ok(()) => state.runs.push(EstimatorRun {
                        name: estimator.entry.name.clone(),
                        version: estimator.entry.version.clone(),
                        latency,
                    }),
                    Err(e) => *partial = Err(e),
                }
            }
        }
        let models = FamilyModels {
            family,
            classes,
            simulated: self.simulated.as_ref(),
        };
        partials
            .into_iter()
            .zip(jobs)
            .zip(reaches)
            .zip(analytic)
            .zip(bases)
            .map(|((((partial, query), reach), analytic), base)| {
                partial
                    .and_then(|state| state.finish(&models, query, analytic, reach, base.as_ref()))
            })
            .collect()
    }
}
