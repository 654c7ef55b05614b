//! The reverse question (`POST /v1/plan`, `gpucast plan`): a search over estimates, never a
//! second physics. Every point is the answer `POST /v1/estimate` gives for that job (the same
//! validation, estimators, placement and calibration), so a plan agrees with the estimates a
//! caller would bisect by hand.
//!
//! - The largest micro-batch that fits: the figure grows with the micro-batch, so `fits` is
//!   true up to some size and false beyond; from the job's own micro-batch the search doubles
//!   while it fits, then bisects (about 2 log2 of the answer estimates, not a sweep).
//! - The longest sequence (`max_seq_len`): the same search over `seq_len`.
//! - The setups: each change over the job on its own, at its micro-batch, ranked by time per
//!   sample among those that fit.
//!
//! The plan is priced before any work as the batch of the most estimates it can make (each
//! at the job's price), and refused above the cost budget; each estimate checks the deadline.

use std::time::Instant;

use crate::api::parse::parse_estimate;
use crate::api::types::{
    EstimateRequest, EstimateResponse, GpuChoice, GpuRequest, LoraRequest, NamesRequest,
    OffloadRequest, ParallelismRequest, PlanCardResponse, PlanPointResponse, PlanRequest,
    PlanResponse, PlanSeqLenResponse, PlanSetupResponse, MAX_PLAN_PRECISIONS,
};
use crate::engine::cost::Cost;
use crate::engine::validate::MAX_SEQ_LEN;
use crate::engine::{Deadline, Engine};
use crate::error::ApiError;

/// The largest micro-batch tried when the plan does not say.
pub const DEFAULT_MAX_MICRO_BATCH: u64 = 4096;
/// The largest micro-batch or sequence a plan may ask for (the request schema's).
const MAX_SEARCH: u64 = 1_048_576;
/// The setups tried over the job, at most.
const SETUPS: u64 = 6;

/// The plan of `request`, stopped at `deadline`.
pub fn plan(
    engine: &Engine,
    request: &PlanRequest,
    deadline: &Deadline,
) -> Result<PlanResponse, ApiError> {
    let started = Instant::now();
    let job = parse_estimate(request.job.get().as_bytes(), "job")?;
    if job.simulation.is_some() {
        return Err(ApiError::InvalidInput(
            "job.simulation: a simulation is of one batch size and sequence; plan the job \
             without it"
                .into(),
        ));
    }
    let max_micro_batch = bounded(
        "max_micro_batch",
        request.max_micro_batch,
        DEFAULT_MAX_MICRO_BATCH,
    )?;
    let max_seq_len = match request.max_seq_len {
        Some(m) if !(1..=MAX_SEQ_LEN).contains(&m) => {
            return Err(ApiError::InvalidInput(format!(
                "max_seq_len: between 1 and {MAX_SEQ_LEN}, got {m}"
            )))
        }
        other => other,
    };
    // A job without a sequence has none to free: the plan says so and searches the batch.
    let mut notes = Vec::new();
    let max_seq_len = max_seq_len.filter(|_| {
        let free = job.seq_len.is_some();
        if !free {
            notes.push("max_seq_len: the job has no seq_len to free; left out".to_string());
        }
        free
    });
    let cards: Vec<Option<GpuRequest>> = if request.catalogue {
        engine
            .catalogue
            .all()
            .iter()
            .map(|sku| Some(GpuRequest::Name(sku.id.clone())))
            .collect()
    } else {
        match &job.gpu {
            None => vec![None],
            Some(choice) => choice.cards().iter().cloned().map(Some).collect(),
        }
    };
    let precisions: Vec<Option<String>> = match &request.precisions {
        None => vec![None],
        Some(list) if list.is_empty() || list.len() > MAX_PLAN_PRECISIONS => {
            return Err(ApiError::InvalidInput(format!(
                "precisions: 1 to {MAX_PLAN_PRECISIONS} precisions, got {}",
                list.len()
            )))
        }
        Some(list) => list.iter().cloned().map(Some).collect(),
    };
    let with_setups = request.setups.unwrap_or(true);

    // The price: every estimate the plan can make, each at the job's price on one card.
    let rows = (cards.len() * precisions.len()) as u64;
    let most = rows * search_steps(max_micro_batch)
        + max_seq_len.map_or(0, search_steps)
        + if with_setups { SETUPS } else { 0 };
    let mut one = job.clone();
    one.gpu = cards[0].clone().map(GpuChoice::One);
    Cost::of(&one)
        .times(most)
        .check(engine.cost_budget, None)
        .map_err(|e| e.within(&format!("the plan's {most} estimates at most: ")))?;

    let mut search = Search {
        engine,
        deadline,
        estimates: 0,
    };
    let mut rows = Vec::with_capacity(cards.len() * precisions.len());
    let mut first: Option<(EstimateRequest, EstimateResponse)> = None;
    for precision in &precisions {
        for card in &cards {
            let mut base = job.clone();
            base.gpu = card.clone().map(GpuChoice::One);
            if let Some(p) = precision {
                base.precision = Some(p.clone());
            }
            let answer = search.run(&base)?;
            let row = search.card(&base, &answer, max_micro_batch)?;
            if first.is_none() {
                first = Some((base, answer));
            }
            rows.push(row);
        }
    }
    let (base, answer) = first.expect("a plan has at least one row");
    let micro = answer.setup.micro_batch_size;
    let accumulation = answer.setup.gradient_accumulation_steps;
    let seq_len = match max_seq_len {
        Some(max) => Some(search.seq_len(&base, &answer, max)?),
        None => None,
    };
    let mut warnings = answer.warnings.clone();
    warnings.extend(notes);
    let setups = if with_setups {
        search.setups(&base, &answer, &mut warnings)?
    } else {
        Vec::new()
    };
    let first_precision = &rows[0].precision.clone();
    let smallest_fitting_gpu = rows
        .iter()
        .filter(|r| r.fits && &r.precision == first_precision)
        .min_by(|a, b| {
            a.capacity_mib.cmp(&b.capacity_mib).then_with(|| {
                let time = |r: &PlanCardResponse| r.job.step_time_ms.unwrap_or(f64::INFINITY);
                time(a).total_cmp(&time(b))
            })
        })
        .map(|r| r.gpu.clone());
    Ok(PlanResponse {
        confidence: answer.memory.confidence,
        micro_batch_size: micro,
        gradient_accumulation_steps: accumulation,
        cards: rows,
        smallest_fitting_gpu,
        seq_len,
        setups,
        estimates: search.estimates,
        latency_us: (started.elapsed().as_secs_f64() * 1e6).round(),
        warnings,
    })
}

/// A search bound: 1 to [`MAX_SEARCH`], `default` when absent.
fn bounded(field: &str, value: Option<u64>, default: u64) -> Result<u64, ApiError> {
    match value.unwrap_or(default) {
        v @ 1..=MAX_SEARCH => Ok(v),
        v => Err(ApiError::InvalidInput(format!(
            "{field}: between 1 and {MAX_SEARCH}, got {v}"
        ))),
    }
}

/// The most estimates one search up to `max` makes: the start, doubling to `max` and
/// bisecting back (at most the bits of `max` each), and one more for a start above `max`.
fn search_steps(max: u64) -> u64 {
    2 + 2 * u64::from(u64::BITS - max.leading_zeros())
}

/// The largest `n` in `1..=max` with `fits(n)`, for `fits` true up to some `n` and false
/// beyond; `None` when not even 1 fits. `start` is a known point (`start_fits` its outcome):
/// from a fitting start the search doubles until a size fails or `max` is reached, then
/// bisects between the last that fitted and the first that failed.
pub fn largest_fitting(
    start: u64,
    start_fits: bool,
    max: u64,
    mut fits: impl FnMut(u64) -> Result<bool, ApiError>,
) -> Result<Option<u64>, ApiError> {
    let max = max.max(1);
    let (start, start_fits) = if start > max {
        (max, fits(max)?)
    } else {
        (start.max(1), start_fits)
    };
    // `low` fits (0: none known), `high` fails (None: none known).
    let (mut low, mut high) = if start_fits {
        (start, None)
    } else {
        (0, Some(start))
    };
    while high.is_none() && low < max {
        let next = low.saturating_mul(2).min(max);
        if fits(next)? {
            low = next;
        } else {
            high = Some(next);
        }
    }
    if let Some(mut high) = high {
        while high - low > 1 {
            let middle = low + (high - low) / 2;
            if fits(middle)? {
                low = middle;
            } else {
                high = middle;
            }
        }
    }
    Ok((low > 0).then_some(low))
}

/// The estimates of one plan, counted.
struct Search<'a> {
    engine: &'a Engine,
    deadline: &'a Deadline,
    estimates: u64,
}

impl Search<'_> {
    /// One estimate, as `POST /v1/estimate` answers it.
    fn run(&mut self, request: &EstimateRequest) -> Result<EstimateResponse, ApiError> {
        self.deadline.check()?;
        self.estimates += 1;
        self.engine
            .estimate_uncounted(request, Instant::now(), self.deadline)
            .map_err(|e| e.within("job."))
    }

    /// Whether `request` fits its card at the plan's confidence, and its answer.
    fn fits(&mut self, request: &EstimateRequest) -> Result<(bool, EstimateResponse), ApiError> {
        let answer = self.run(request)?;
        Ok((fits(&answer)?, answer))
    }

    /// One card at one precision: the job as given, and the largest micro-batch that fits.
    fn card(
        &mut self,
        base: &EstimateRequest,
        answer: &EstimateResponse,
        max: u64,
    ) -> Result<PlanCardResponse, ApiError> {
        let fit = answer.fit.as_ref().ok_or_else(no_figure)?;
        let micro = answer.setup.micro_batch_size;
        let accumulation = answer.setup.gradient_accumulation_steps;
        let mut best: Option<(u64, EstimateResponse)> = None;
        let largest = largest_fitting(micro, fit.fits, max, |m| {
            let (fits, at) = self.fits(&at_micro_batch(base, m, accumulation))?;
            if fits && best.as_ref().is_none_or(|(b, _)| m > *b) {
                best = Some((m, at));
            }
            Ok(fits)
        })?;
        let at_largest = match (largest, best) {
            (Some(m), Some((b, at))) if m == b => Some(point(&at, m, base.seq_len)),
            (Some(m), _) if m == micro => Some(point(answer, m, base.seq_len)),
            _ => None,
        };
        Ok(PlanCardResponse {
            gpu: fit.gpu.clone(),
            capacity_mib: fit.capacity_mib,
            precision: answer.setup.precision.clone(),
            fits: fit.fits,
            job: point(answer, micro, base.seq_len),
            largest_micro_batch: largest,
            at_largest,
            limited_by_max: largest == Some(max),
        })
    }

    /// The longest sequence up to `max` that fits the job's card at its micro-batch.
    fn seq_len(
        &mut self,
        base: &EstimateRequest,
        answer: &EstimateResponse,
        max: u64,
    ) -> Result<PlanSeqLenResponse, ApiError> {
        let fit = answer.fit.as_ref().ok_or_else(no_figure)?;
        let start = base.seq_len.unwrap_or(1);
        let micro = answer.setup.micro_batch_size;
        let mut best: Option<(u64, EstimateResponse)> = None;
        let longest = largest_fitting(start, fit.fits, max, |s| {
            let mut at = base.clone();
            at.seq_len = Some(s);
            let (fits, answer) = self.fits(&at)?;
            if fits && best.as_ref().is_none_or(|(b, _)| s > *b) {
                best = Some((s, answer));
            }
            Ok(fits)
        })?;
        let at_longest = match (longest, best) {
            (Some(s), Some((b, at))) if s == b => Some(point(&at, micro, Some(s))),
            (Some(s), _) if s == start => Some(point(answer, micro, Some(s))),
            _ => None,
        };
        Ok(PlanSeqLenResponse {
            gpu: fit.gpu.clone(),
            micro_batch_size: micro,
            longest_seq_len: longest,
            at_longest,
            limited_by_max: longest == Some(max),
        })
    }

    /// The job as given and each setup over it, at its micro-batch, ranked. A setup the job
    /// already has, or that does not apply to it, is left out (said in `warnings` when the
    /// job refuses it).
    fn setups(
        &mut self,
        base: &EstimateRequest,
        answer: &EstimateResponse,
        warnings: &mut Vec<String>,
    ) -> Result<Vec<PlanSetupResponse>, ApiError> {
        let mut rows = vec![setup_row("as_given", Vec::new(), answer)?];
        for (name, changes, request) in setup_changes(base, answer) {
            match self.run(&request) {
                Ok(at) => rows.push(setup_row(name, changes, &at)?),
                Err(ApiError::InvalidInput(why)) => {
                    warnings.push(format!("setup {name} left out: {why}"));
                }
                Err(other) => return Err(other),
            }
        }
        rows.sort_by(|a, b| {
            b.fits.cmp(&a.fits).then_with(|| {
                if a.fits {
                    let time = |r: &PlanSetupResponse| r.ms_per_sample.unwrap_or(f64::INFINITY);
                    time(a).total_cmp(&time(b))
                } else {
                    let bound = |r: &PlanSetupResponse| r.upper_bound_mib.unwrap_or(f64::INFINITY);
                    bound(a).total_cmp(&bound(b))
                }
            })
        });
        for (i, row) in rows.iter_mut().enumerate() {
            row.rank = i as u32 + 1;
        }
        Ok(rows)
    }
}

/// Whether an answer fits its card; a job without a MiB figure cannot be planned.
fn fits(answer: &EstimateResponse) -> Result<bool, ApiError> {
    answer.fit.as_ref().map(|f| f.fits).ok_or_else(no_figure)
}

fn no_figure() -> ApiError {
    ApiError::InvalidInput(
        "job: its answer has no MiB figure (a family without a memory regressor and no \
         simulation), so no fit to plan on"
            .into(),
    )
}

/// The job at micro-batch `m` with its accumulation steps: the batch a GPU takes per step is
/// `m` x them. The files' own micro-batch keys are the job's, so they are left out here.
pub fn at_micro_batch(base: &EstimateRequest, m: u64, accumulation: u64) -> EstimateRequest {
    let mut at = base.clone();
    at.micro_batch_size = Some(m);
    at.gradient_accumulation_steps = Some(accumulation);
    at.batch_size = Some(m.saturating_mul(accumulation));
    if let Some(arguments) = at.training_arguments.as_mut() {
        arguments.remove("per_device_train_batch_size");
    }
    if let Some(deepspeed) = at.deepspeed.as_mut() {
        deepspeed.remove("train_micro_batch_size_per_gpu");
        deepspeed.remove("train_batch_size");
    }
    at
}

/// An answer's figures at one point.
fn point(answer: &EstimateResponse, micro: u64, seq_len: Option<u64>) -> PlanPointResponse {
    PlanPointResponse {
        micro_batch_size: micro,
        seq_len,
        estimate_mib: answer.memory.estimate_mib,
        upper_bound_mib: answer.memory.upper_bound_mib,
        oom_probability: answer.fit.as_ref().map(|f| f.oom_probability),
        step_time_ms: answer.performance.as_ref().map(|p| p.step_time_ms),
        samples_per_s: answer.performance.as_ref().map(|p| p.samples_per_s),
    }
}

fn setup_row(
    name: &str,
    changes: Vec<String>,
    answer: &EstimateResponse,
) -> Result<PlanSetupResponse, ApiError> {
    let samples = answer.setup.micro_batch_size * answer.setup.gradient_accumulation_steps;
    Ok(PlanSetupResponse {
        rank: 0,
        setup: name.to_string(),
        changes,
        fits: fits(answer)?,
        estimate_mib: answer.memory.estimate_mib,
        upper_bound_mib: answer.memory.upper_bound_mib,
        host_memory_mib: answer.setup.offload.host_memory_mib,
        step_time_ms: answer.performance.as_ref().map(|p| p.step_time_ms),
        ms_per_sample: answer
            .performance
            .as_ref()
            .map(|p| (p.step_time_ms / samples.max(1) as f64 * 100.0).round() / 100.0),
    })
}

/// The setups tried over the job: each one change, where the job does not have it already.
fn setup_changes(
    base: &EstimateRequest,
    answer: &EstimateResponse,
) -> Vec<(&'static str, Vec<String>, EstimateRequest)> {
    let setup = &answer.setup;
    let mut out = Vec::new();
    if setup.activation_checkpointing != "full" {
        let mut at = base.clone();
        at.activation_checkpointing = Some(NamesRequest::Keyword("full".into()));
        out.push((
            "activation_checkpointing",
            vec!["activation_checkpointing: full".into()],
            at,
        ));
    }
    if setup.lora_params == 0 && answer.family == "transformer" {
        let mut at = base.clone();
        at.lora = Some(LoraRequest {
            rank: 16,
            alpha: None,
            dropout: None,
            target_modules: NamesRequest::Keyword("all-linear".into()),
            base_weights: None,
            group_size: None,
            expert_layout: None,
            modules_to_save: None,
        });
        out.push((
            "lora",
            vec!["lora: rank 16, target_modules all-linear".into()],
            at,
        ));
    }
    if !setup.optimizer.contains("8bit") && setup.trainable_params > 0 {
        let mut at = base.clone();
        at.optimizer = Some("adamw_8bit".into());
        out.push(("optimizer_8bit", vec!["optimizer: adamw_8bit".into()], at));
    }
    let parallelism = &setup.parallelism;
    if parallelism.data_parallel > 1 && parallelism.strategy != "zero3" {
        let mut at = base.clone();
        let layout = at.parallelism.get_or_insert(ParallelismRequest {
            strategy: None,
            world_size: Some(parallelism.world_size),
            tensor_parallel: None,
            pipeline_parallel: None,
            context_parallel: None,
            sequence_parallel: None,
        });
        layout.strategy = Some("zero3".into());
        out.push(("zero3", vec!["parallelism.strategy: zero3".into()], at));
    }
    if !setup.offload.optimizer_state && setup.trainable_params > 0 {
        let mut at = base.clone();
        let offload = at.offload.get_or_insert(OffloadRequest {
            optimizer_state: None,
            gradients: None,
            parameters: None,
        });
        offload.optimizer_state = Some(true);
        out.push((
            "offload_optimizer",
            vec!["offload.optimizer_state: true".into()],
            at,
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The search over a threshold `limit` (fits up to it), counting its probes.
    fn probe(start: u64, limit: u64, max: u64) -> (Option<u64>, u32) {
        let mut calls = 0;
        let found = largest_fitting(start, start <= limit, max, |n| {
            calls += 1;
            Ok(n <= limit)
        })
        .unwrap();
        (found, calls)
    }

    #[test]
    fn the_search_finds_the_threshold_from_any_start() {
        for limit in 0..=70 {
            for start in 1..=80 {
                let (found, _) = probe(start, limit, 64);
                let expected = (limit > 0).then_some(limit.min(64));
                assert_eq!(found, expected, "start {start}, limit {limit}");
            }
        }
    }

    #[test]
    fn the_search_makes_about_twice_log2_probes_not_a_sweep() {
        // From 1, with 1000 fitting up to 4096: doubling to 1024 (10 probes), bisecting
        // 512..1024 (9 probes).
        let (found, calls) = probe(1, 1000, 4096);
        assert_eq!(found, Some(1000));
        assert!(calls <= 20, "{calls} probes");
        for max in [1, 2, 3, 64, 4096, MAX_SEARCH] {
            for limit in [0, 1, max / 3, max - 1, max] {
                let (_, calls) = probe(1, limit, max);
                assert!(
                    u64::from(calls) < search_steps(max),
                    "max {max} limit {limit}: {calls} probes"
                );
            }
        }
    }

    #[test]
    fn nothing_fitting_is_none_and_a_start_above_the_maximum_is_clamped() {
        assert_eq!(probe(8, 0, 64).0, None);
        assert_eq!(probe(100, 10, 64).0, Some(10));
        assert_eq!(probe(100, 80, 64).0, Some(64));
    }
}
