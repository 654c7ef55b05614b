//! Uncertainty per term: what a figure leaves open, as distributions, and from them the upper
//! bound and the probability that a job runs out of memory on a card.
//!
//! A figure's terms are of three kinds:
//! - **known**: weights, gradients, optimizer state (paged or not) and the layout's collective
//!   buffers are counted from the parameters and the setup, so they carry no width;
//! - **context**: the CUDA context and library handles, a property of the environment (driver,
//!   CUDA, lazy loading), normal with a fixed spread in MiB;
//! - **uncertain**: activations, temporaries and the allocator's cache, log-normal with a bias
//!   and spread that depend on how much of the job the figure rests on ([`Detail`]).
//!
//! The peak at standard score z is `known + (context + z sd_c) + uncertain x exp(bias + z sd)`:
//! the two deviations are taken together (as if fully correlated), which never gives a
//! narrower bound than independent errors would. The spreads are fitted on measured peaks
//! (MLP and timm campaigns, published runs) by `python -m gpucast_training decisions`, which
//! writes `data/uncertainty.json` and docs/accuracy.md.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use super::breakdown::Breakdown;
pub use crate::job::Detail;

/// The log-normal error of the uncertain terms at one [`Detail`]: log(measured / figure) of
/// those terms has this mean and standard deviation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub bias: f64,
    pub log_sd: f64,
    /// Measured rows the spread was fitted on.
    #[serde(default)]
    pub rows: u64,
}

/// The spreads of every term, as fitted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Spreads {
    /// The CUDA context's standard deviation within one environment, MiB.
    pub cuda_context_sd_mib: f64,
    pub levels: BTreeMap<Detail, Spread>,
}

/// Largest spread accepted from a file: beyond it a bound says nothing.
const MAX_LOG_SD: f64 = 3.0;

impl Spreads {
    /// Parses and checks a spreads file: every detail present, finite figures, spreads >= 0.
    pub fn parse(text: &str) -> Result<Spreads, String> {
        let spreads: Spreads = serde_json::from_str(text).map_err(|e| e.to_string())?;
        for detail in Detail::ALL {
            let Some(s) = spreads.levels.get(&detail) else {
                return Err(format!("levels.{}: missing", detail.as_str()));
            };
            let valid = s.bias.is_finite()
                && s.bias.abs() <= MAX_LOG_SD
                && (0.0..=MAX_LOG_SD).contains(&s.log_sd);
            if !valid {
                return Err(format!(
                    "levels.{}: bias and log_sd must be finite and within {MAX_LOG_SD}",
                    detail.as_str()
                ));
            }
        }
        if !(0.0..=4096.0).contains(&spreads.cuda_context_sd_mib) {
            return Err("cuda_context_sd_mib: must be 0 to 4096".into());
        }
        Ok(spreads)
    }

    pub fn level(&self, detail: Detail) -> Spread {
        self.levels[&detail]
    }
}

/// The committed spreads (data/uncertainty.json), unless [`install`] put others first.
pub fn spreads() -> &'static Spreads {
    SPREADS.get_or_init(|| {
        Spreads::parse(include_str!("../../data/uncertainty.json"))
            .expect("data/uncertainty.json is valid (unit test)")
    })
}

static SPREADS: OnceLock<Spreads> = OnceLock::new();

/// Serves `spreads` instead of the committed ones (the evaluation's held-out folds); only
/// before the first estimate. Returns false when spreads were already in use.
pub fn install(spreads: Spreads) -> bool {
    SPREADS.set(spreads).is_ok()
}

/// A figure split into its kinds of term, MiB.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Terms {
    pub known: f64,
    pub cuda_context: f64,
    pub uncertain: f64,
    /// Of the uncertain terms, the allocator's cache: freed and retried before an OOM, so a
    /// card fits the job when the peak without it does.
    pub reclaimable: f64,
}

impl Terms {
    /// The terms of an answered figure's breakdown. The uncertain part is at least
    /// `physical_uncertain` (physics' own activations, temporaries and cache): a figure raised
    /// to the floor keeps the doubt about what the floor leaves out.
    pub fn of(parts: &Breakdown, physical_uncertain: f64) -> Terms {
        let known = parts.parameters
            + parts.gradients
            + parts.optimizer_state
            + parts.collective_buffers
            + parts.paged_optimizer_state;
        let uncertain = parts.activations + parts.temporaries + parts.allocator_cache;
        Terms {
            known,
            cuda_context: parts.cuda_context,
            uncertain: uncertain.max(physical_uncertain).max(0.0),
            reclaimable: parts.allocator_cache.max(0.0),
        }
    }

    /// The peak at standard score `z`.
    pub fn at(&self, spread: Spread, context_sd: f64, z: f64) -> f64 {
        self.known
            + (self.cuda_context + z * context_sd).max(0.0)
            + self.uncertain * (spread.bias + z * spread.log_sd).exp()
    }
}

/// The standard normal's cumulative distribution.
pub fn normal_cdf(z: f64) -> f64 {
    0.5 * libm::erfc(-z / std::f64::consts::SQRT_2)
}

/// The standard score with `normal_cdf(z) = p`, by bisection (p in (0, 1)).
pub fn normal_quantile(p: f64) -> f64 {
    let (mut low, mut high) = (-Z_RANGE, Z_RANGE);
    for _ in 0..60 {
        let mid = 0.5 * (low + high);
        if normal_cdf(mid) < p {
            low = mid;
        } else {
            high = mid;
        }
    }
    0.5 * (low + high)
}

/// Standard scores searched: beyond, probabilities are below 1e-15.
const Z_RANGE: f64 = 8.0;

/// One job's distribution of peaks on one card.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PeakDistribution {
    pub detail: Detail,
    /// The terms at the moment the figure is read at.
    pub terms: Terms,
    /// The terms at the step's other moment (the optimizer's step when the figure is at the
    /// start of backward, and the reverse), when physics knows both. The peak is the larger
    /// of the two: a setup that moves the peak from one moment to the other (8-bit state
    /// leaves activations the larger) keeps the doubt of the moment it leaves.
    pub other: Option<Terms>,
    pub spread: Spread,
    pub context_sd: f64,
}

impl PeakDistribution {
    pub fn new(detail: Detail, terms: Terms) -> PeakDistribution {
        let spreads = spreads();
        PeakDistribution {
            detail,
            terms,
            other: None,
            spread: spreads.level(detail),
            context_sd: spreads.cuda_context_sd_mib,
        }
    }

    /// The moments' terms: the figure's, then the other's.
    fn moments(&self) -> impl Iterator<Item = &Terms> {
        std::iter::once(&self.terms).chain(self.other.as_ref())
    }

    /// The peak at standard score `z`, less what the allocator frees before it fails when
    /// `less_reclaimable`: the larger of the moments (one doubt moves both, since both are
    /// the same step's tensors read by the same physics).
    fn at(&self, z: f64, less_reclaimable: bool) -> f64 {
        self.moments()
            .map(|t| {
                t.at(self.spread, self.context_sd, z)
                    - if less_reclaimable { t.reclaimable } else { 0.0 }
            })
            .fold(f64::NEG_INFINITY, f64::max)
    }

    /// The peak the job stays at or below with probability `confidence`.
    pub fn quantile(&self, confidence: f64) -> f64 {
        self.at(normal_quantile(confidence), false)
    }

    /// Sets the spread so that the quantile at `confidence` is `bound` (a calibration
    /// profile's bound), when the uncertain terms and that confidence allow it.
    pub fn fit_bound(&mut self, confidence: f64, bound: f64) {
        let z = normal_quantile(confidence);
        if z <= 0.0 || self.moments().all(|t| t.uncertain <= 0.0) {
            return;
        }
        // The quantile grows with the spread at z > 0: bisect it.
        let quantile_at = |log_sd: f64| {
            let mut d = *self;
            d.spread.log_sd = log_sd;
            d.at(z, false)
        };
        if quantile_at(0.0) >= bound {
            self.spread.log_sd = 0.0;
            return;
        }
        let (mut low, mut high) = (0.0, MAX_LOG_SD);
        for _ in 0..60 {
            let mid = 0.5 * (low + high);
            if quantile_at(mid) <= bound {
                low = mid;
            } else {
                high = mid;
            }
        }
        self.spread.log_sd = low;
    }

    /// The probability that the job needs more than `capacity_mib` (at either moment, the peak
    /// less the cache the allocator frees before it fails).
    pub fn oom_probability(&self, capacity_mib: f64) -> f64 {
        let need = |z: f64| self.at(z, true);
        if need(-Z_RANGE) > capacity_mib {
            return 1.0;
        }
        if need(Z_RANGE) <= capacity_mib {
            return 0.0;
        }
        let (mut low, mut high) = (-Z_RANGE, Z_RANGE);
        for _ in 0..60 {
            let mid = 0.5 * (low + high);
            if need(mid) <= capacity_mib {
                low = mid;
            } else {
                high = mid;
            }
        }
        1.0 - normal_cdf(0.5 * (low + high))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn terms(known: f64, uncertain: f64) -> Terms {
        Terms {
            known,
            cuda_context: 1000.0,
            uncertain,
            reclaimable: 0.0,
        }
    }

    fn distribution(known: f64, uncertain: f64) -> PeakDistribution {
        PeakDistribution {
            detail: Detail::Layers,
            terms: terms(known, uncertain),
            other: None,
            spread: Spread {
                bias: 0.0,
                log_sd: 0.2,
                rows: 0,
            },
            context_sd: 50.0,
        }
    }

    #[test]
    fn the_committed_spreads_parse_and_cover_every_detail() {
        let spreads = spreads();
        for detail in Detail::ALL {
            assert!(spreads.level(detail).log_sd >= 0.0, "{detail:?}");
        }
        assert!(Spreads::parse(r#"{"cuda_context_sd_mib": 1, "levels": {}}"#).is_err());
    }

    #[test]
    fn the_normal_quantile_inverts_the_cdf() {
        for p in [0.5, 0.8, 0.95, 0.99] {
            assert!((normal_cdf(normal_quantile(p)) - p).abs() < 1e-9, "{p}");
        }
        assert!((normal_quantile(0.95) - 1.644_853_6).abs() < 1e-6);
    }

    #[test]
    fn known_terms_carry_no_width_so_the_bound_follows_the_uncertain_share() {
        // 90 % frozen weights: a narrow bound; mostly activations: a wide one.
        let weights = distribution(60_000.0, 6_000.0);
        let activations = distribution(600.0, 60_000.0);
        let ratio = |d: &PeakDistribution| d.quantile(0.95) / d.quantile(0.5);
        assert!(ratio(&weights) < 1.05, "{}", ratio(&weights));
        assert!(ratio(&activations) > 1.3, "{}", ratio(&activations));
    }

    #[test]
    fn the_oom_probability_is_the_distribution_read_at_the_capacity() {
        let d = distribution(10_000.0, 10_000.0);
        for confidence in [0.5, 0.9, 0.95, 0.99] {
            let bound = d.quantile(confidence);
            let p = d.oom_probability(bound);
            assert!((p - (1.0 - confidence)).abs() < 1e-6, "{confidence}: {p}");
        }
        assert_eq!(d.oom_probability(1.0), 1.0);
        assert_eq!(d.oom_probability(1e12), 0.0);
        // The cache is freed before an OOM: it lowers the probability, not the peak.
        let cached = PeakDistribution {
            terms: Terms {
                reclaimable: 2_000.0,
                ..d.terms
            },
            ..d
        };
        assert!(cached.oom_probability(21_000.0) < d.oom_probability(21_000.0));
    }

    /// A setup that moves the peak to the other moment (smaller state leaves the activations
    /// the larger) keeps that moment's doubt: the bound and the OOM probability are the
    /// larger moment's.
    #[test]
    fn the_peak_is_the_larger_of_the_two_moments() {
        // At the optimizer's step: 20,000 counted, 1,000 uncertain; at the start of backward:
        // 12,000 counted, 8,000 uncertain (the same point figure, far more doubt).
        let mut d = distribution(20_000.0, 1_000.0);
        let alone = d.quantile(0.95);
        d.other = Some(terms(12_000.0, 8_000.0));
        let backward = distribution(12_000.0, 8_000.0).quantile(0.95);
        assert!(alone < backward);
        assert_eq!(d.quantile(0.95), backward);
        assert!(d.oom_probability(alone) > 0.05);
        // The bound a profile implies is met by the larger moment.
        d.fit_bound(0.95, backward + 500.0);
        assert!((d.quantile(0.95) - (backward + 500.0)).abs() < 0.01);
    }
}
