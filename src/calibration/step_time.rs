//! What observed step times teach: the host's cost per dispatched op in one environment.
//!
//! The roofline (`physics::perf`) times every kernel on the card's data sheet, but the host that
//! issues them is the environment's: Python, PyTorch's dispatcher and autograd, autocast, the
//! CPU. Its cost per op was fitted once on the MLP campaign (15 us); a 2022 stack on an older
//! host runs at about three times that (docs/design/roofline.md: BERT with AMP on a V100), and
//! only a step it dispatches faster than the GPU computes shows it. It is the one constant of
//! the model that belongs to the environment rather than to the card or the job, so it is the
//! one observed step times fit.
//!
//! An observation stores its job's predicted step time at each of [`HOST_GRID_US`] (its
//! *curve*, computed when it is posted, while the job is built); a profile's fit then needs no
//! job: it is the host cost whose interpolated step times come nearest the observed ones in
//! log terms, shrunk toward the calibrated constant. Compute-bound jobs' curves are flat and
//! move it little; dispatch-bound ones move it most of the way.

use serde::{Deserialize, Serialize};

use crate::devices::performance::GpuPerformance;
use crate::job::Job;
use crate::physics::perf::{roofline_with, Constants, CALIBRATED};

/// Host costs per op (us) at which an observation's predicted step time is stored: from a
/// fast host with CUDA graphs' share of the work to a slow, heavily wrapped eager loop.
pub const HOST_GRID_US: [f64; 13] = [
    2.0, 3.0, 5.0, 8.0, 12.0, 15.0, 20.0, 30.0, 45.0, 70.0, 100.0, 150.0, 200.0,
];
/// Weight of the calibrated constant in a fit, as squared log error: one observation whose
/// step time moves one-for-one with the host cost takes the fit 1/1.1 of the way to itself.
const PRIOR_WEIGHT: f64 = 0.1;
/// Points searched between the grid's ends (log-spaced).
const SEARCH_POINTS: usize = 400;
/// The longest step time an observation may report, ms (an hour).
pub const MAX_STEP_TIME_MS: f64 = 3_600_000.0;
/// The most one update may move a host cost (and so any step time, which grows at most in
/// proportion to it), up or down: memory's [`crate::calibration::fit::MAX_STEP`], for the
/// same reason (one batch of wrong observations must not swing every ranking at once).
pub const MAX_HOST_STEP: f64 = crate::calibration::fit::MAX_STEP;
/// The farthest a fitted host cost may sit from the calibrated one, either way, however many
/// observations ask for more: a 2022 stack on an older host runs at about three times the
/// calibrated 15 us (docs/design/roofline.md), so four times leaves room for real hosts and none for
/// readings of other jobs than the ones described.
pub const MAX_HOST_FACTOR: f64 = 4.0;

/// A job's predicted step time (ms) at each host cost of [`HOST_GRID_US`], as
/// `[host_us, step_ms]` pairs (stored with the observation: self-describing if the grid
/// changes).
pub type Curve = Vec<[f64; 2]>;

/// The step times of `job` on `gpu` across [`HOST_GRID_US`].
pub fn curve(job: &Job, gpu: &GpuPerformance) -> Curve {
    HOST_GRID_US
        .iter()
        .map(|&host| {
            let constants = Constants {
                host_us_per_op: host,
                ..CALIBRATED
            };
            [host, roofline_with(job, gpu, &constants).step_time_ms]
        })
        .collect()
}

/// One observed step: its job's curve and the step time measured.
#[derive(Debug, Clone, PartialEq)]
pub struct StepTimeSample {
    pub curve: Curve,
    pub observed_ms: f64,
}

/// The host cost fitted to an environment's (or a GPU's) observed step times.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HostFit {
    pub host_us_per_op: f64,
    /// Observations with a step time the fit rests on.
    pub observations: usize,
    /// Median of |fitted / observed - 1| over them.
    pub median_error: f64,
}

impl HostFit {
    /// This fit held within [`MAX_HOST_FACTOR`] of the calibrated host cost.
    pub fn within_reach(mut self) -> HostFit {
        let calibrated = CALIBRATED.host_us_per_op;
        self.host_us_per_op = self
            .host_us_per_op
            .clamp(calibrated / MAX_HOST_FACTOR, calibrated * MAX_HOST_FACTOR);
        self
    }

    /// This fit (within reach) held within [`MAX_HOST_STEP`] of `previous`'s host cost, or of
    /// the calibrated one where there was none: what one update may move.
    pub fn held_to_step(self, previous: Option<&HostFit>) -> HostFit {
        let before = previous.map_or(CALIBRATED.host_us_per_op, |p| p.host_us_per_op);
        let mut held = self.within_reach();
        held.host_us_per_op = held
            .host_us_per_op
            .clamp(before / MAX_HOST_STEP, before * MAX_HOST_STEP);
        held
    }

    /// The roofline constants with this host cost.
    pub fn constants(&self) -> Constants {
        Constants {
            host_us_per_op: self.host_us_per_op,
            ..CALIBRATED
        }
    }
}

/// The step time `curve` gives at `host_us`: linear in log-log between its points, held at
/// its ends. `None` for a curve with no usable point.
pub fn interpolate(curve: &[[f64; 2]], host_us: f64) -> Option<f64> {
    // Walked without collecting: a refit interpolates every sample's curve at hundreds of
    // host costs, for each batch it replays.
    let usable = |p: &&[f64; 2]| p[0] > 0.0 && p[1] > 0.0 && p[0].is_finite() && p[1].is_finite();
    let mut points = curve.iter().filter(usable);
    let first = points.next()?;
    if host_us <= first[0] {
        return Some(first[1]);
    }
    let mut a = first;
    for b in points {
        if b[0] >= host_us {
            if b[0] == host_us {
                return Some(b[1]);
            }
            let t = (host_us.ln() - a[0].ln()) / (b[0].ln() - a[0].ln());
            return Some((a[1].ln() + t * (b[1].ln() - a[1].ln())).exp());
        }
        a = b;
    }
    Some(a[1])
}

/// The host cost nearest the samples' observed step times (least squared log error plus the
/// pull toward [`CALIBRATED`]'s), searched across [`HOST_GRID_US`]; `None` without a usable
/// sample.
pub fn fit_host_cost(samples: &[StepTimeSample]) -> Option<HostFit> {
    let usable: Vec<&StepTimeSample> = samples
        .iter()
        .filter(|s| s.observed_ms.is_finite() && s.observed_ms > 0.0)
        .filter(|s| interpolate(&s.curve, CALIBRATED.host_us_per_op).is_some())
        .collect();
    if usable.is_empty() {
        return None;
    }
    let (low, high) = (
        HOST_GRID_US[0].ln(),
        HOST_GRID_US[HOST_GRID_US.len() - 1].ln(),
    );
    let prior = CALIBRATED.host_us_per_op.ln();
    let loss = |log_host: f64| -> f64 {
        let host = log_host.exp();
        let misfit: f64 = usable
            .iter()
            .map(|s| {
                let predicted = interpolate(&s.curve, host).expect("usable");
                (predicted / s.observed_ms).ln().powi(2)
            })
            .sum();
        misfit + PRIOR_WEIGHT * (log_host - prior).powi(2)
    };
    let best = (0..=SEARCH_POINTS)
        .map(|i| low + (high - low) * i as f64 / SEARCH_POINTS as f64)
        .map(|x| (x, loss(x)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(x, _)| x.exp())?;
    let mut errors: Vec<f64> = usable
        .iter()
        .map(|s| (interpolate(&s.curve, best).expect("usable") / s.observed_ms - 1.0).abs())
        .collect();
    Some(HostFit {
        host_us_per_op: best,
        observations: usable.len(),
        median_error: super::fit::quantile(&mut errors, 0.5),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step of `compute_ms` on the GPU and `ops` dispatched: the host's or the GPU's time,
    /// whichever is longer.
    fn curve_of(compute_ms: f64, ops: f64) -> Curve {
        HOST_GRID_US
            .iter()
            .map(|&h| [h, compute_ms.max(ops * h * 1e-3)])
            .collect()
    }

    #[test]
    fn interpolation_is_exact_on_the_grid_and_held_at_its_ends() {
        let c = curve_of(10.0, 1000.0);
        assert_eq!(interpolate(&c, 45.0), Some(45.0));
        assert_eq!(interpolate(&c, 1.0), Some(10.0));
        assert_eq!(interpolate(&c, 1000.0), Some(200.0));
        let between = interpolate(&c, 50.0).unwrap();
        assert!(between > 45.0 && between < 70.0);
        assert_eq!(interpolate(&[], 15.0), None);
    }

    #[test]
    fn dispatch_bound_steps_teach_the_host_cost_and_compute_bound_ones_do_not() {
        // Three dispatch-bound jobs observed at 45 us per op.
        let slow: Vec<StepTimeSample> = [1000.0, 2000.0, 4000.0]
            .iter()
            .map(|&ops| StepTimeSample {
                curve: curve_of(1.0, ops),
                observed_ms: ops * 45.0 * 1e-3,
            })
            .collect();
        let fit = fit_host_cost(&slow).unwrap();
        assert!((fit.host_us_per_op / 45.0 - 1.0).abs() < 0.1, "{fit:?}");
        assert_eq!(fit.observations, 3);
        // A compute-bound job measured 20 % slower than predicted says nothing of the host.
        let compute = [StepTimeSample {
            curve: curve_of(500.0, 1000.0),
            observed_ms: 600.0,
        }];
        let fit = fit_host_cost(&compute).unwrap();
        assert!((fit.host_us_per_op / CALIBRATED.host_us_per_op - 1.0).abs() < 0.05);
        assert!(fit.median_error > 0.15);
    }

    #[test]
    fn one_observation_moves_the_fit_most_of_the_way_and_none_gives_no_fit() {
        let one = [StepTimeSample {
            curve: curve_of(1.0, 1000.0),
            observed_ms: 45.0,
        }];
        let host = fit_host_cost(&one).unwrap().host_us_per_op;
        assert!(host > 30.0 && host < 45.0, "{host}");
        assert_eq!(fit_host_cost(&[]), None);
        let bad = [StepTimeSample {
            curve: curve_of(1.0, 1000.0),
            observed_ms: f64::NAN,
        }];
        assert_eq!(fit_host_cost(&bad), None);
    }
}
