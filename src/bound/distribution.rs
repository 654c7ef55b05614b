//! Uncertainty: what a figure leaves open, as the distribution of held-out errors of figures
//! like it, and from it the upper bound and the probability that a job runs out of memory.
//!
//! A measured peak's **score** against a figure `F` is `log(measured / F) / share`, with
//! `share = max(uncertain / F, min_share)`. The uncertain terms (activations, temporaries, the
//! allocator's cache) are what physics cannot count exactly; weights, gradients, optimizer
//! state and collective buffers are counted from the parameters and the setup. So a figure that
//! is mostly counted state moves less than one that is mostly activations, while `min_share`
//! keeps the doubt about the counting itself (a mis-stated setup, the context).
//!
//! Scores are grouped by level of detail and setup family ([`Group`]). `python -m
//! gpucast_training decisions` computes them on measured peaks and writes
//! `data/uncertainty.json`: each group's split-conformal quantiles (the score at rank
//! `(n + 1) c` of its `n` rows, so that a new job like them lies above the bound with
//! probability at most `1 - c`) on a grid of levels. A group with fewer than `min_rows` rows
//! answers with its level of detail's scores, and that with all rows'. The docs report the
//! bounds' held-out calibration (docs/reports/accuracy.md).
//!
//! The peak at score `s` is `F_m exp(scale s share_m)` at the larger of the step's moments `m`;
//! `scale` is 1, or more for a job far from the data the scores were measured on, or what a
//! calibration profile's bound implies ([`PeakDistribution::fit_bound`]).

use std::collections::BTreeMap;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

pub use crate::job::{Detail, Family, Group, SetupFamily};
use crate::physics::assumed::AssumedRange;
use crate::physics::{Breakdown, Physics};

/// One group's score quantiles, at the calibration's levels.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScoreQuantiles {
    /// Measured rows the quantiles were computed on.
    pub rows: u64,
    pub scores: Vec<f64>,
}

/// The held-out score quantiles of every group, as computed by the decisions evaluation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// The least uncertain share a score is normalised by.
    pub min_share: f64,
    /// A group with fewer rows answers with its parent's scores.
    pub min_rows: u64,
    /// How much the assumed fields' log range widens a score's normaliser: a job's scores are
    /// divided by `share (1 + assumed_weight R)`, `R` the log of the widest over the narrowest
    /// figure the fields the request left unsaid allow (`physics::assumed`); 0 leaves them out.
    #[serde(default)]
    pub assumed_weight: f64,
    /// Increasing levels from 0 (the scores' lower end) to 1 (their upper end).
    pub levels: Vec<f64>,
    /// `all`, a level of detail (`config`), or a level and a setup family (`config/qlora`).
    pub groups: BTreeMap<String, ScoreQuantiles>,
}

/// Largest score accepted from a file: beyond it a bound says nothing.
const MAX_SCORE: f64 = 50.0;
/// Most levels a file may carry.
const MAX_LEVELS: usize = 1024;
/// The group every job falls back to.
pub const ALL: &str = "all";

impl Calibration {
    /// Parses and checks a calibration file: levels from 0 to 1, increasing; every group's
    /// scores finite, non-decreasing, one per level; the `all` group present.
    pub fn parse(text: &str) -> Result<Calibration, String> {
        let c: Calibration = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let levels = &c.levels;
        if levels.len() < 2 || levels.len() > MAX_LEVELS {
            return Err(format!("levels: 2 to {MAX_LEVELS} levels"));
        }
        let increasing = levels.windows(2).all(|w| w[0] < w[1]);
        if levels[0] != 0.0 || levels[levels.len() - 1] != 1.0 || !increasing {
            return Err("levels: must increase from 0 to 1".into());
        }
        if !(c.min_share > 0.0 && c.min_share <= 1.0) {
            return Err("min_share: must be in (0, 1]".into());
        }
        if !(0.0..=10.0).contains(&c.assumed_weight) {
            return Err("assumed_weight: must be 0 to 10".into());
        }
        if c.min_rows == 0 {
            return Err("min_rows: must be at least 1".into());
        }
        if !c.groups.contains_key(ALL) {
            return Err(format!("groups.{ALL}: missing"));
        }
        for (name, group) in &c.groups {
            let s = &group.scores;
            let valid = s.len() == levels.len()
                && s.iter().all(|v| v.is_finite() && v.abs() <= MAX_SCORE)
                && s.windows(2).all(|w| w[0] <= w[1]);
            if !valid {
                return Err(format!(
                    "groups.{name}: one finite score per level, non-decreasing, within \
                     {MAX_SCORE}"
                ));
            }
        }
        Ok(c)
    }

    /// The scores a job of `group` is answered with at `confidence`, the first group with
    /// `min_rows` and with the rows the confidence needs (`(n + 1) c <= n`, so that the bound
    /// is a score seen, not an extension past the largest: 19 rows at 0.95, 99 at 0.99): its
    /// level of detail, setup family and model family (`traced/full/cnn`), its level and setup
    /// family (`traced/full`), its level (`traced`), else all rows'; with the group's name.
    pub fn scores(&self, group: Group, confidence: f64) -> (&str, &ScoreQuantiles) {
        let needed = (confidence / (1.0 - confidence))
            .ceil()
            .max(self.min_rows as f64);
        let detail = group.detail.as_str();
        let setup = format!("{detail}/{}", group.family.as_str());
        let own = format!("{setup}/{}", group.model.as_str());
        let enough = |key: &str| {
            self.groups
                .get_key_value(key)
                .filter(|(_, g)| g.rows as f64 >= needed)
        };
        let (key, scores) = enough(&own)
            .or_else(|| enough(&setup))
            .or_else(|| enough(detail))
            .or_else(|| self.groups.get_key_value(ALL))
            .expect("the all group is checked at parse");
        (key.as_str(), scores)
    }

    /// The score at `level`, interpolated between the grid's levels.
    pub fn score_at(&self, scores: &ScoreQuantiles, level: f64) -> f64 {
        let (levels, s) = (&self.levels, &scores.scores);
        let level = level.clamp(0.0, 1.0);
        let i = levels
            .partition_point(|l| *l < level)
            .clamp(1, levels.len() - 1);
        let (l0, l1) = (levels[i - 1], levels[i]);
        let t = ((level - l0) / (l1 - l0)).clamp(0.0, 1.0);
        s[i - 1] + t * (s[i] - s[i - 1])
    }

    /// The level at or below which a score of `score` lies: the highest level whose score is
    /// at most it (a run of equal scores counts at its top), interpolated.
    pub fn level_of(&self, scores: &ScoreQuantiles, score: f64) -> f64 {
        let (levels, s) = (&self.levels, &scores.scores);
        if score < s[0] {
            return 0.0;
        }
        if score >= s[s.len() - 1] {
            return 1.0;
        }
        // The last index with s[i] <= score; s[i + 1] > score.
        let i = s.partition_point(|v| *v <= score) - 1;
        let t = (score - s[i]) / (s[i + 1] - s[i]);
        levels[i] + t * (levels[i + 1] - levels[i])
    }
}

/// The committed calibration (data/uncertainty.json), unless [`install`] put another first.
pub fn calibration() -> &'static Calibration {
    CALIBRATION.get_or_init(|| {
        Calibration::parse(include_str!("../../data/uncertainty.json"))
            .expect("data/uncertainty.json is valid (unit test)")
    })
}

static CALIBRATION: OnceLock<Calibration> = OnceLock::new();

/// Serves `calibration` instead of the committed one (the evaluation's held-out folds); only
/// before the first estimate. Returns false when one was already in use.
pub fn install(calibration: Calibration) -> bool {
    CALIBRATION.set(calibration).is_ok()
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

    pub fn figure(&self) -> f64 {
        self.known + self.cuda_context + self.uncertain
    }

    /// What a score is normalised by: the uncertain share of the figure, at least `min_share`.
    pub fn share(&self, min_share: f64) -> f64 {
        let figure = self.figure();
        if figure <= 0.0 {
            return 1.0;
        }
        (self.uncertain / figure).clamp(min_share, 1.0)
    }

    /// The peak at `score` (already scaled).
    pub fn at(&self, score: f64, min_share: f64) -> f64 {
        self.figure() * (score * self.share(min_share)).exp()
    }
}

/// One job's distribution of peaks on one card.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PeakDistribution {
    pub group: Group,
    /// The group whose scores are read (a parent of `group` when it has too few rows).
    pub scores_group: &'static str,
    pub scores: &'static ScoreQuantiles,
    calibration: &'static Calibration,
    /// The terms at the moment the figure is read at.
    pub terms: Terms,
    /// The terms at the step's other moment (the optimizer's step when the figure is at the
    /// start of backward, and the reverse), when physics knows both. The peak is the larger
    /// of the two: a setup that moves the peak from one moment to the other (8-bit state
    /// leaves activations the larger) keeps the doubt of the moment it leaves.
    pub other: Option<Terms>,
    /// The factor on every score: 1, more far from the measured data, or what a calibration
    /// profile's bound implies.
    pub scale: f64,
    /// `ln(highest / lowest)` of the figures the fields the request left unsaid allow
    /// (`physics::assumed::log_range`): 0 when it states them all.
    pub assumed_log_range: f64,
}

/// Largest scale a profile's bound may set.
const MAX_SCALE: f64 = 50.0;

impl PeakDistribution {
    /// The distribution of `group`'s scores that answer at `confidence`.
    pub fn new(group: Group, confidence: f64, terms: Terms) -> PeakDistribution {
        Self::with(calibration(), group, confidence, terms)
    }

    pub fn with(
        calibration: &'static Calibration,
        group: Group,
        confidence: f64,
        terms: Terms,
    ) -> PeakDistribution {
        let (scores_group, scores) = calibration.scores(group, confidence);
        PeakDistribution {
            group,
            scores_group,
            scores,
            calibration,
            terms,
            other: None,
            scale: 1.0,
            assumed_log_range: 0.0,
        }
    }

    /// What the group's scores are multiplied by beside the uncertain share: 1, more for a
    /// job whose unstated fields leave a range open.
    pub fn assumed_factor(&self) -> f64 {
        1.0 + self.calibration.assumed_weight * self.assumed_log_range
    }

    pub fn min_share(&self) -> f64 {
        self.calibration.min_share
    }

    /// The group's score at `level`, before scaling.
    pub fn score_at(&self, level: f64) -> f64 {
        self.calibration.score_at(self.scores, level)
    }

    /// The moments' terms: the figure's, then the other's.
    fn moments(&self) -> impl Iterator<Item = &Terms> {
        std::iter::once(&self.terms).chain(self.other.as_ref())
    }

    /// The peak at (unscaled) score `score`, less what the allocator frees before it fails
    /// when `less_reclaimable`: the larger of the moments (one error moves both, since both
    /// are the same step's tensors read by the same physics).
    fn at(&self, score: f64, less_reclaimable: bool) -> f64 {
        let min_share = self.min_share();
        self.moments()
            .map(|t| {
                t.at(self.scale * self.assumed_factor() * score, min_share)
                    - if less_reclaimable { t.reclaimable } else { 0.0 }
            })
            .fold(f64::NEG_INFINITY, f64::max)
    }

    /// The peak the job stays at or below with probability `confidence`.
    pub fn quantile(&self, confidence: f64) -> f64 {
        self.at(self.score_at(confidence), false)
    }

    /// Sets the scale so that the quantile at `confidence` is `bound` (a calibration
    /// profile's bound), when the group's score there is above 0 and the bound allows it.
    pub fn fit_bound(&mut self, confidence: f64, bound: f64) {
        let score = self.score_at(confidence);
        if score <= 0.0 {
            return;
        }
        // The quantile grows with the scale at a positive score: bisect it.
        let quantile_at = |scale: f64| {
            let mut d = *self;
            d.scale = scale;
            d.at(score, false)
        };
        if quantile_at(0.0) >= bound {
            self.scale = 0.0;
            return;
        }
        let (mut low, mut high) = (0.0, MAX_SCALE);
        for _ in 0..60 {
            let mid = 0.5 * (low + high);
            if quantile_at(mid) <= bound {
                low = mid;
            } else {
                high = mid;
            }
        }
        self.scale = low;
    }

    /// The probability that the job needs more than `capacity_mib` (at either moment, the peak
    /// less the cache the allocator frees before it fails): the share of the group's scores
    /// above the score at which it needs the capacity.
    pub fn oom_probability(&self, capacity_mib: f64) -> f64 {
        let need = |score: f64| self.at(score, true);
        let (mut low, mut high) = (self.score_at(0.0), self.score_at(1.0));
        if need(low) > capacity_mib {
            return 1.0;
        }
        if need(high) <= capacity_mib {
            return 0.0;
        }
        for _ in 0..60 {
            let mid = 0.5 * (low + high);
            if need(mid) <= capacity_mib {
                low = mid;
            } else {
                high = mid;
            }
        }
        1.0 - self.calibration.level_of(self.scores, low)
    }
}

/// `ln(highest / lowest)` of the figures the assumed fields allow together around
/// `figure_mib` (each field's move added): 0 when nothing is assumed.
pub fn log_range(ranges: &[AssumedRange], figure_mib: f64) -> f64 {
    if ranges.is_empty() || figure_mib <= 0.0 {
        return 0.0;
    }
    let up: f64 = ranges.iter().map(|r| r.up_mib).sum();
    let down: f64 = ranges.iter().map(|r| r.down_mib).sum();
    ((figure_mib + up) / (figure_mib - down).max(1.0)).ln()
}

impl Physics {
    /// The distribution of the peak around an answered figure: its breakdown's terms, the
    /// uncertain ones at least physics' own (a figure held at the floor keeps their doubt),
    /// with the held-out scores of `group` that answer at `confidence`, scaled by `widen` (a job far from the data the
    /// scores were measured on). For a simulated job the cache the allocator frees before it
    /// fails is what lies between the reserved peak and the minimum capacity.
    pub fn distribution(
        &self,
        group: Group,
        confidence: f64,
        figure_mib: f64,
        widen: f64,
    ) -> PeakDistribution {
        let p = &self.parts;
        let mut terms = Terms::of(
            &self.breakdown(figure_mib),
            p.activations + p.temporaries + p.allocator_cache,
        );
        if let Some(peaks) = &self.simulated {
            terms.reclaimable = (peaks.reserved_on_card_mib - peaks.min_capacity_mib).max(0.0);
        }
        let mut distribution = PeakDistribution::new(group, confidence, terms);
        distribution.other = self
            .other_moment
            .map(|b| Terms::of(&b, b.activations + b.temporaries + b.allocator_cache));
        distribution.scale = widen.max(1.0);
        distribution
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

    /// Scores spread evenly from -0.5 at level 0 to 1.5 at level 1 (0.5 at the median).
    fn even() -> &'static Calibration {
        static EVEN: OnceLock<Calibration> = OnceLock::new();
        EVEN.get_or_init(|| {
            let levels: Vec<f64> = (0..=100).map(|i| f64::from(i) / 100.0).collect();
            let scores = levels.iter().map(|l| -0.5 + 2.0 * l).collect();
            Calibration {
                min_share: 0.1,
                min_rows: 30,
                assumed_weight: 1.0,
                levels,
                groups: BTreeMap::from([(ALL.to_string(), ScoreQuantiles { rows: 500, scores })]),
            }
        })
    }

    const LAYERS: Group = Group {
        detail: Detail::Layers,
        family: SetupFamily::Full,
        model: Family::Cnn,
    };

    fn distribution(known: f64, uncertain: f64) -> PeakDistribution {
        PeakDistribution::with(even(), LAYERS, 0.95, terms(known, uncertain))
    }

    #[test]
    fn the_committed_calibration_parses_and_answers_every_group() {
        let c = calibration();
        for detail in Detail::ALL {
            for family in SetupFamily::ALL {
                for model in [Family::Mlp, Family::Cnn, Family::Transformer] {
                    let group = Group {
                        detail,
                        family,
                        model,
                    };
                    let (_, scores) = c.scores(group, 0.99);
                    assert_eq!(scores.scores.len(), c.levels.len());
                }
            }
        }
        let bad = r#"{"min_share": 0.1, "min_rows": 1, "levels": [0, 1], "groups": {}}"#;
        assert!(Calibration::parse(bad).is_err());
        let decreasing = r#"{"min_share": 0.1, "min_rows": 1, "levels": [0, 1],
            "groups": {"all": {"rows": 3, "scores": [1, 0]}}}"#;
        assert!(Calibration::parse(decreasing).is_err());
    }

    #[test]
    fn a_group_with_too_few_rows_answers_with_its_parents_scores() {
        let mut c = even().clone();
        let few = ScoreQuantiles {
            rows: 5,
            scores: vec![0.0; c.levels.len()],
        };
        c.groups.insert("config/qlora".into(), few.clone());
        c.groups.insert(
            "config".into(),
            ScoreQuantiles {
                rows: 40,
                ..few.clone()
            },
        );
        let qlora = Group {
            detail: Detail::Config,
            family: SetupFamily::Qlora,
            model: Family::Transformer,
        };
        assert_eq!(c.scores(qlora, 0.95).0, "config");
        c.groups.get_mut("config/qlora").unwrap().rows = 30;
        assert_eq!(c.scores(qlora, 0.95).0, "config/qlora");
        // 0.99 needs 99 rows: the level's 40 are too few, all rows answer.
        assert_eq!(c.scores(qlora, 0.99).0, ALL);
        c.groups.insert(
            "config/qlora/transformer".into(),
            ScoreQuantiles { rows: 30, ..few },
        );
        assert_eq!(c.scores(qlora, 0.95).0, "config/qlora/transformer");
        assert_eq!(c.scores(LAYERS, 0.95).0, ALL);
    }

    #[test]
    fn the_level_of_a_score_inverts_the_score_at_a_level() {
        let c = even();
        let all = &c.groups[ALL];
        for level in [0.0, 0.05, 0.5, 0.8, 0.95, 0.99, 1.0] {
            let back = c.level_of(all, c.score_at(all, level));
            assert!((back - level).abs() < 1e-9, "{level}: {back}");
        }
        // A run of equal scores counts at its top: the bound at any of its levels is a fit.
        let flat = ScoreQuantiles {
            rows: 3,
            scores: vec![0.0, 0.0, 1.0],
        };
        let c3 = Calibration {
            levels: vec![0.0, 0.5, 1.0],
            ..c.clone()
        };
        assert_eq!(c3.level_of(&flat, 0.0), 0.5);
    }

    #[test]
    fn known_terms_carry_less_width_so_the_bound_follows_the_uncertain_share() {
        // 90 % frozen weights: a narrow bound; mostly activations: a wide one.
        let weights = distribution(60_000.0, 6_000.0);
        let activations = distribution(600.0, 60_000.0);
        let ratio = |d: &PeakDistribution| d.quantile(0.95) / d.quantile(0.5);
        assert!(ratio(&weights) < 1.15, "{}", ratio(&weights));
        assert!(ratio(&activations) > 2.0, "{}", ratio(&activations));
    }

    #[test]
    fn the_oom_probability_is_the_distribution_read_at_the_capacity() {
        let d = distribution(10_000.0, 10_000.0);
        for confidence in [0.5, 0.8, 0.9, 0.95, 0.99] {
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
        assert!(cached.oom_probability(25_000.0) < d.oom_probability(25_000.0));
    }

    /// A setup that moves the peak to the other moment (smaller state leaves the activations
    /// the larger) keeps that moment's doubt: the bound and the OOM probability are the
    /// larger moment's.
    #[test]
    fn the_peak_is_the_larger_of_the_two_moments() {
        // At the optimizer's step: 20,000 counted, 1,000 uncertain; at the start of backward:
        // 12,000 counted, 8,000 uncertain (about the same figure, far more doubt).
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
