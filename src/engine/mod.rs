//! The estimation engine both faces stand on: a validated request in, an answer out. It holds
//! what an answer reads (the estimators, the GPU catalogue, the calibration profiles, the
//! metrics, this host's GPUs) and nothing of HTTP: no axum, no permits, no write access. The
//! server (`http/`) admits, extracts and authorises, then calls it; `gpucast estimate` calls it
//! directly.
//!
//! - [`cost`]: a wire request's price from its sizes, refused above the budget before any work.
//! - [`files`]: the setup the user's files (training arguments, PEFT, DeepSpeed, load) state,
//!   written into the request's own fields.
//! - [`plan`]: the reverse question, a search over estimates: the largest micro-batch and
//!   sequence that fit, the setups that make a job fit, the smallest card.
//! - [`validate`]: a wire request -> a validated job, its target GPU and what was asked.
//! - [`answer`]: a validated request -> the answer (placement, class, utilization, metrics).
//! - [`memo`]: answers kept by their request's bytes, reused while the profiles they read
//!   are current.

pub mod answer;
pub mod cost;
pub mod files;
pub mod memo;
pub mod observation;
pub mod plan;
pub mod validate;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
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

/// When a request's work must stop: at its deadline (the request timeout), or as soon as
/// nobody waits for it (the request answered 503 at its timeout, or its connection closed).
/// Checked between the steps of the long loops (the cards a job is ranked on, the items of a
/// batch), so that abandoned work ends within one step rather than running on unanswered.
/// Past it, the work's outcome is [`ApiError::Timeout`], the 503 the timeout answers. Clones
/// share one abandonment: the parts of a batch stop together.
#[derive(Debug, Clone, Default)]
pub struct Deadline {
    at: Option<Instant>,
    abandoned: Option<Arc<AtomicBool>>,
}

impl Deadline {
    /// No deadline: the CLI and in-process callers.
    pub const NONE: Deadline = Deadline {
        at: None,
        abandoned: None,
    };

    pub fn at(at: Instant) -> Deadline {
        Deadline {
            at: Some(at),
            abandoned: Some(Arc::new(AtomicBool::new(false))),
        }
    }

    /// Nobody waits for the work any more: it stops at its next check.
    pub fn abandon(&self) {
        if let Some(abandoned) = &self.abandoned {
            abandoned.store(true, Ordering::Relaxed);
        }
    }

    /// `Err(ApiError::Timeout)` once the deadline has passed or the work was abandoned.
    pub fn check(&self) -> Result<(), ApiError> {
        let abandoned = self
            .abandoned
            .as_ref()
            .is_some_and(|a| a.load(Ordering::Relaxed));
        let passed = self.at.is_some_and(|at| Instant::now() >= at);
        if abandoned || passed {
            Err(ApiError::Timeout)
        } else {
            Ok(())
        }
    }
}

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
    /// Answers kept for reuse ([`memo`]; `--answer-memo-mib`).
    pub memo: memo::AnswerMemo,
}

impl Engine {
    /// One request's answer.
    pub fn estimate(
        &self,
        request: &EstimateRequest,
        started: Instant,
    ) -> Result<EstimateResponse, ApiError> {
        self.estimate_until(request, started, &Deadline::NONE)
    }

    /// One request's answer, stopped at `deadline`.
    pub fn estimate_until(
        &self,
        request: &EstimateRequest,
        started: Instant,
        deadline: &Deadline,
    ) -> Result<EstimateResponse, ApiError> {
        let valid = self.validate(request)?;
        answer::answer_until(self, valid, started, deadline)
    }

    /// [`Engine::estimate_until`] for a point of a search (a plan's): answered alike, not
    /// counted in the metrics.
    pub fn estimate_uncounted(
        &self,
        request: &EstimateRequest,
        started: Instant,
        deadline: &Deadline,
    ) -> Result<EstimateResponse, ApiError> {
        let mut valid = self.validate(request)?;
        valid.counted = false;
        answer::answer_until(self, valid, started, deadline)
    }

    /// The answer kept for the request `body` ([`memo`]), counted as an answer, its
    /// `latency_us.total` its own; `None` when none is kept or the profiles have moved since.
    pub fn reuse(&self, body: &[u8], started: Instant) -> Option<EstimateResponse> {
        let mut answer = self.memo.get(body, &self.profiles.snapshot())?;
        count_reused(self, &mut answer, started);
        Some(answer)
    }

    /// A request priced ([`cost::Cost`]) and, within the budget, validated
    /// ([`validate::validate`]).
    pub fn validate(&self, request: &EstimateRequest) -> Result<ValidEstimateRequest, ApiError> {
        self.price(request)?;
        self.validate_priced(request)
    }

    /// The price of `request` in work units ([`cost::Cost`]), refused above the budget.
    pub fn price(&self, request: &EstimateRequest) -> Result<u64, ApiError> {
        let cost = cost::Cost::of(request);
        cost.check(self.cost_budget, None)?;
        Ok(cost.units())
    }

    /// A request already priced within the budget ([`Engine::price`]), validated.
    pub fn validate_priced(
        &self,
        request: &EstimateRequest,
    ) -> Result<ValidEstimateRequest, ApiError> {
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
        let (valid, sources) = self.validate_items_shared(items)?;
        let answers = answer::answer_items(self, &valid, started);
        Ok(shared_outcomes(
            self,
            sources,
            answers,
            started,
            &Deadline::NONE,
        ))
    }

    /// [`Engine::validate_items`], with an item whose JSON repeats an earlier valid item's
    /// byte for byte read, priced and validated once: it is answered as that item is
    /// ([`shared_outcomes`]), and only the distinct valid items are returned to answer. The
    /// price is the whole batch's, repeats included. An item whose JSON has a kept answer
    /// ([`memo`]) is parsed and priced like the others, and answered with it.
    pub fn validate_items_shared(
        &self,
        items: Vec<Box<serde_json::value::RawValue>>,
    ) -> Result<(Vec<ValidEstimateRequest>, ItemSources), ApiError> {
        // Taken before any item is answered: a later version makes the answers kept stale.
        let profiles = self.profiles.snapshot();
        let count = items.len();
        // Per item: its request parsed, or the earlier item its JSON repeats.
        let mut first: HashMap<&str, usize> = HashMap::with_capacity(count);
        let mut parsed: Vec<Result<Result<EstimateRequest, ApiError>, usize>> =
            Vec::with_capacity(count);
        let mut costs: Vec<Option<cost::Cost>> = Vec::with_capacity(count);
        let mut price = cost::Cost::default();
        for (index, item) in items.iter().enumerate() {
            if let Some(&earlier) = first.get(item.get()) {
                if let Some(cost) = costs[earlier] {
                    price.add(&cost);
                }
                costs.push(costs[earlier]);
                parsed.push(Err(earlier));
                continue;
            }
            let request = parse_estimate(item.get().as_bytes(), &format!("items[{index}]"));
            let cost = request.as_ref().ok().map(cost::Cost::of);
            if let Some(cost) = &cost {
                price.add(cost);
                // Only a request that parsed is shared (an error names its own index).
                first.insert(item.get(), index);
            }
            costs.push(cost);
            parsed.push(Ok(request));
        }
        price.check(self.cost_budget, Some(count))?;
        let (mut valid, mut sources) = (Vec::with_capacity(count), Vec::with_capacity(count));
        let mut keys = Vec::with_capacity(count);
        for (index, request) in parsed.into_iter().enumerate() {
            let request = match request {
                Ok(request) => request,
                Err(earlier) => {
                    if matches!(sources[earlier], ItemSource::Valid | ItemSource::Kept(_)) {
                        sources.push(ItemSource::Repeats(earlier));
                        continue;
                    }
                    // The earlier item was refused: this one is read again, its error naming
                    // its own index.
                    parse_estimate(items[index].get().as_bytes(), &format!("items[{index}]"))
                }
            };
            let bytes = items[index].get().as_bytes();
            if request.is_ok() {
                if let Some(answer) = self.memo.get(bytes, &profiles) {
                    sources.push(ItemSource::Kept(Box::new(answer)));
                    continue;
                }
            }
            let checked = request.and_then(|request| {
                validate::validate(&request, &self.catalogue, self.devices.as_ref())
                    .map_err(|e| e.within(&format!("items[{index}].")))
            });
            match checked {
                Ok(item) => {
                    keys.push((!item.reads_device).then(|| Box::<[u8]>::from(bytes)));
                    valid.push(item);
                    sources.push(ItemSource::Valid);
                }
                Err(error) => sources.push(ItemSource::Invalid(error)),
            }
        }
        let sources = ItemSources {
            sources,
            keys,
            version: profiles.version(),
        };
        Ok((valid, sources))
    }

    /// A batch's items parsed, priced together (above the cost budget the batch is refused
    /// whole, before any is validated) and validated one by one: the valid items in order, and
    /// per item its error or `None` for a valid one.
    #[allow(clippy::type_complexity)]
    pub fn validate_items(
        &self,
        items: Vec<Box<serde_json::value::RawValue>>,
    ) -> Result<(Vec<ValidEstimateRequest>, Vec<Option<ApiError>>), ApiError> {
        let count = items.len();
        let parsed = parse_items(items, self.cost_budget)?;
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
        Ok((valid, errors))
    }
}

/// A batch's items parsed and priced together: above `budget` the batch is refused whole,
/// before any item is validated; else per item its request or its error (naming its index).
/// `gpucast features --batch` reads its items as the estimate routes do through this.
pub fn parse_items(
    items: Vec<Box<serde_json::value::RawValue>>,
    budget: u64,
) -> Result<Vec<Result<EstimateRequest, ApiError>>, ApiError> {
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
    price.check(budget, Some(count))?;
    Ok(parsed)
}

/// Where a batch's item outcomes come from ([`Engine::validate_items_shared`]), and what
/// the answers computed for it are kept under.
#[derive(Debug)]
pub struct ItemSources {
    sources: Vec<ItemSource>,
    /// Per distinct valid item, in order, the bytes its answer is kept under (`None`: not
    /// kept, it reads the attached card).
    keys: Vec<Option<Box<[u8]>>>,
    /// The profiles' version before any item was answered.
    version: crate::calibration::store::ProfileVersion,
}

/// Where a batch item's outcome comes from.
#[derive(Debug)]
pub enum ItemSource {
    /// The next of the answers to the distinct valid items.
    Valid,
    /// Refused on its own.
    Invalid(ApiError),
    /// The JSON of the earlier item at this index, repeated: answered as that item is.
    Repeats(usize),
    /// An answer kept for its JSON ([`memo`]).
    Kept(Box<EstimateResponse>),
}

/// A batch's outcomes in order from [`Engine::validate_items_shared`]'s sources and the
/// answers to its distinct valid items (in order): a repeated item gets the answer of the
/// item it repeats, a kept one its kept answer (each with its `latency_us.total` its own: the
/// time until it was answered), and is counted in the predicted classes as an answer of its
/// own. The answers computed are kept for reuse ([`memo`]) while `deadline` holds.
pub fn shared_outcomes(
    engine: &Engine,
    sources: ItemSources,
    answers: impl IntoIterator<Item = Result<EstimateResponse, ApiError>>,
    started: Instant,
    deadline: &Deadline,
) -> Vec<BatchItemResponse> {
    let ItemSources {
        sources,
        keys,
        version,
    } = sources;
    let keep = deadline.check().is_ok();
    let mut answers = answers.into_iter().zip(keys);
    let mut outcomes: Vec<BatchItemResponse> = Vec::with_capacity(sources.len());
    for (index, source) in sources.into_iter().enumerate() {
        let outcome = match source {
            ItemSource::Valid => {
                let (answer, key) = answers.next().expect("one answer per distinct valid item");
                if let (Ok(answer), Some(key), true) = (&answer, key, keep) {
                    engine.memo.keep(&key, version.clone(), answer);
                }
                outcome(index, answer)
            }
            ItemSource::Kept(mut answer) => {
                count_reused(engine, &mut answer, started);
                outcome(index, Ok(*answer))
            }
            ItemSource::Invalid(error) => outcome(index, Err(error)),
            ItemSource::Repeats(earlier) => {
                let answered = &outcomes[earlier];
                let mut estimate = answered.estimate.clone();
                if let Some(estimate) = estimate.as_mut() {
                    count_reused(engine, estimate, started);
                }
                BatchItemResponse {
                    index,
                    status: answered.status,
                    estimate,
                    error: answered.error.clone(),
                }
            }
        };
        outcomes.push(outcome);
    }
    outcomes
}

/// An answer given again (kept, or an earlier item's of the same batch): its
/// `latency_us.total` is this request's own, and it counts as an answer in the predicted
/// classes (the estimators' times are those of the run that computed it, and are not counted
/// again).
fn count_reused(engine: &Engine, answer: &mut EstimateResponse, started: Instant) {
    answer.latency_us.total = crate::api::answer::round_1(started.elapsed().as_secs_f64() * 1e6);
    engine
        .metrics
        .count_class(&answer.family, answer.memory.class.index);
    engine.metrics.answers_reused_total.inc();
}

/// One item's outcome as the batch answers it.
fn outcome(index: usize, outcome: Result<EstimateResponse, ApiError>) -> BatchItemResponse {
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
}

/// A batch's outcomes in order: each item's error (from [`Engine::validate_items`]) or the
/// next of `answers` (one per valid item, in order).
pub fn batch_outcomes(
    errors: Vec<Option<ApiError>>,
    answers: impl IntoIterator<Item = Result<EstimateResponse, ApiError>>,
) -> Vec<BatchItemResponse> {
    let mut answers = answers.into_iter();
    errors
        .into_iter()
        .enumerate()
        .map(|(index, error)| {
            let answer = match error {
                Some(error) => Err(error),
                None => answers.next().expect("one answer per valid item"),
            };
            outcome(index, answer)
        })
        .collect()
}
