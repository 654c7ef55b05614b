//! The learned and simulated figures' bounds: their residual quantiles (the analytic step's
//! and the simulated figure's outside the learned setups), how far a bound widens with the
//! distance from the training data, the simulated bound capped at the card, and the whole rule
//! on a training fold's figures (`gpucast combine`).

use std::sync::OnceLock;

use crate::job::ResidualQuantiles;

/// Residual quantiles of the `training_step` figure (log of measured / figure), which leads
/// for jobs outside the learned setups that carry no simulation.
pub fn training_step_quantiles() -> &'static ResidualQuantiles {
    static QUANTILES: OnceLock<ResidualQuantiles> = OnceLock::new();
    QUANTILES.get_or_init(|| measured(&TRAINING_STEP_QUANTILES))
}

/// Measured on the 142 rows of public_training_memory.csv that the analytic step answers
/// (`cargo test --test api public_setups -- --nocapture` prints them): in-sample quantiles of
/// log(measured / figure), like with like. The 0.95 level taken from the other architectures'
/// rows only is exceeded by 5.6 % of each held-out architecture's rows. The tail is wide:
/// published peaks that include what a training step does not (model loading, evaluation,
/// compilers) sit up to 2.7 x above the step.
const TRAINING_STEP_QUANTILES: [(f64, f64); 5] = [
    (0.5, 0.042),
    (0.8, 0.285),
    (0.9, 0.623),
    (0.95, 0.791),
    (0.99, 1.004),
];

/// Residual quantiles of the `simulated` figure for jobs outside the learned setups: measured
/// like `TRAINING_STEP_QUANTILES`, on the same 142 rows answered from describe's simulation
/// of their setup. The 0.95 level from the other architectures' rows only is exceeded by
/// 5.6 % of each held-out architecture's rows.
pub fn simulated_setup_quantiles() -> &'static ResidualQuantiles {
    static QUANTILES: OnceLock<ResidualQuantiles> = OnceLock::new();
    QUANTILES.get_or_init(|| measured(&SIMULATED_SETUP_QUANTILES))
}

/// Quantiles written in this file (a unit test builds both).
fn measured(levels: &[(f64, f64)]) -> ResidualQuantiles {
    ResidualQuantiles::new(levels.to_vec()).expect("increasing levels")
}

const SIMULATED_SETUP_QUANTILES: [(f64, f64); 5] = [
    (0.5, 0.041),
    (0.8, 0.302),
    (0.9, 0.469),
    (0.95, 0.739),
    (0.99, 0.965),
];

/// Extrapolation, the rule for a simulated job when the manifest names the training domain of
/// the regressors that correct the simulated figure (`ratio` = distance to the nearest
/// training job / the typical distance of a family those regressors had not seen; infinite
/// for an optimizer or precision they were not trained on):
///
/// - `ratio <= far`: the correction applies, and its figure leads as [`precedence`] says. Up
///   to `far` x the typical distance the job is no farther from the training data than the
///   held-out families the correction was validated on (grouped CV), so its validated
///   accuracy is the best evidence there is.
/// - `ratio > far`, or another setup: the correction is not applied (the regressor does not
///   run) and the `simulated` figure leads with its own residual quantiles. A learned
///   correction far from its data is an extrapolation of a small network, which can move the
///   figure anywhere within its cap, while the simulation's error does not grow with the
///   distance in features: it replays this job's own step. And no feature vector says what
///   another optimizer's state or another precision's copies do to a correction learned on
///   Adam fp32 jobs, so those are outside whatever their distance.
///
/// Wherever a job stands, see [`bound_widening`] for its bound. (`estimators::combine` reads
/// the ratio and thresholds from a job's `Extrapolation`.)
pub fn correction_applies(ratio: f64, far: f64) -> bool {
    ratio <= far
}

/// A figure's upper bound at `log_ratio` (its residual quantile at the confidence), widened by
/// `widen` ([`bound_widening`]).
pub fn widened_bound(figure_mib: f64, log_ratio: f64, widen: f64) -> f64 {
    figure_mib * (log_ratio * widen).exp()
}

/// The simulated figure's bound: [`widened_bound`], capped at the card where the step runs
/// (the allocator cannot hold more than the card has: a peak above the capacity cannot be
/// read, whatever the residuals say), never below the figure there.
pub fn simulated_bound(
    figure_mib: f64,
    log_ratio: f64,
    widen: f64,
    runs_on_card: bool,
    capacity_mib: u64,
) -> f64 {
    let bound = widened_bound(figure_mib, log_ratio, widen);
    if runs_on_card {
        bound.min(capacity_mib as f64).max(figure_mib)
    } else {
        bound
    }
}

/// The factor on the log ratio of the upper bound (`bound = figure x exp(q(c) x widen)`),
/// whichever figure leads: `clamp(ratio / near, 1, max_widen)`, `max_widen` outside the
/// setups. Both figures' residual quantiles were calibrated on jobs within about the typical
/// distance of the training data (held-out families); beyond `near` x that distance nothing
/// measured says how the residuals spread, so the bound grows with the distance rather than
/// claim a coverage it was never shown to have, up to `max_widen` (a bound that widened
/// without end would tell a scheduler nothing). The floor and the card's capacity then
/// apply as for any figure; a log ratio below 0 (a bound under the figure, at low
/// confidences) ends at the figure all the same.
pub fn bound_widening(ratio: f64, near: f64, max_widen: f64) -> f64 {
    let widen = ratio / near;
    if widen.is_nan() {
        return max_widen;
    }
    widen.clamp(1.0, max_widen)
}

/// One job of a training fold as the simulated stage scores a model it has not served yet:
/// its learned and simulated figures, floor, distance from the fold's data and residual log
/// ratios (`gpucast combine`; training/gpucast_training/simulated.py).
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FoldJob {
    pub log_learned: f64,
    pub simulated_mib: f64,
    pub floor_mib: f64,
    /// `None`: outside the domain's setups.
    pub distance: Option<f64>,
    pub typical_distance: f64,
    pub learned_log_ratio: f64,
    pub simulated_log_ratio: f64,
    pub runs_on_card: bool,
    pub capacity_mib: u64,
    /// The step runs on the card the correction's labels were measured on.
    pub measured_range: bool,
}

/// What the service would answer for a [`FoldJob`]: the figure, its bound, and whether the
/// correction was too far (or off its measured range) to apply.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct FoldAnswer {
    pub figure_mib: f64,
    pub upper_bound_mib: f64,
    pub far: bool,
}

/// The rule `estimators::combine`'s `Partial::finish` applies to a simulated job, on a fold's figures: the
/// correction where it applies, widened with the distance; the simulated figure beyond it,
/// its bound capped at the card where the step runs there; the floor under the figure, the
/// bound never below it. `near`, `far`, `max_widen`: the domain's thresholds.
pub fn fold_answer(job: &FoldJob, near: f64, far: f64, max_widen: f64) -> FoldAnswer {
    let ratio = job
        .distance
        .map_or(f64::INFINITY, |d| d / job.typical_distance);
    let widen = bound_widening(ratio, near, max_widen);
    let applied = correction_applies(ratio, far) && job.measured_range;
    let (figure, bound) = if applied {
        let learned = job.log_learned.exp();
        (
            learned,
            widened_bound(learned, job.learned_log_ratio, widen),
        )
    } else {
        let bound = simulated_bound(
            job.simulated_mib,
            job.simulated_log_ratio,
            widen,
            job.runs_on_card,
            job.capacity_mib,
        );
        (job.simulated_mib, bound)
    };
    let figure = figure.max(job.floor_mib);
    FoldAnswer {
        figure_mib: figure,
        upper_bound_mib: bound.max(figure),
        far: !applied,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rule on a fold's figures, case by case (typical distance 1.529, the residual log
    /// ratios at 0.95 of the cnn correction, 0.1098, and of the simulated figure, 0.1448).
    #[test]
    fn a_folds_job_is_answered_as_a_served_simulated_job_would_be() {
        let job = |learned: f64, simulated: f64, floor: f64, ratio: Option<f64>| FoldJob {
            log_learned: learned.ln(),
            simulated_mib: simulated,
            floor_mib: floor,
            distance: ratio.map(|r| r * 1.528993221769941),
            typical_distance: 1.528993221769941,
            learned_log_ratio: 0.10978161040269008,
            simulated_log_ratio: 0.14484173204555617,
            runs_on_card: true,
            capacity_mib: 40960,
            measured_range: true,
        };
        let answer = |j: &FoldJob| fold_answer(j, 1.0, 2.0, 2.0);
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0);
        // (job, figure, bound, far)
        let cases = [
            // Within near: the correction, its own bound.
            (
                job(12000.0, 11500.0, 6000.0, Some(0.5)),
                12000.0,
                13392.41176270238,
                false,
            ),
            // Between near and far: the correction's bound widened by the ratio.
            (
                job(12000.0, 11500.0, 6000.0, Some(1.5)),
                12000.0,
                14148.081974439914,
                false,
            ),
            // Beyond far: the simulated figure, widened at most.
            (
                job(12000.0, 11500.0, 6000.0, Some(3.0)),
                11500.0,
                15364.052068325609,
                true,
            ),
            // Outside the setups (no distance): the simulated figure.
            (
                job(12000.0, 11500.0, 6000.0, None),
                11500.0,
                15364.052068325609,
                true,
            ),
            // Far, the simulated bound capped at the card where the step runs.
            (
                job(40000.0, 39000.0, 20000.0, Some(2.5)),
                39000.0,
                40960.0,
                true,
            ),
            // Near, the correction below the floor: the floor, the bound at least it.
            (
                job(5000.0, 6500.0, 7000.0, Some(0.4)),
                7000.0,
                7000.0,
                false,
            ),
        ];
        for (i, (job, figure, bound, far)) in cases.iter().enumerate() {
            let got = answer(job);
            assert!(close(got.figure_mib, *figure), "{i}: {got:?}");
            assert!(close(got.upper_bound_mib, *bound), "{i}: {got:?}");
            assert_eq!(got.far, *far, "{i}");
        }
        // Off the card its labels were measured on, a near job takes the simulated figure;
        // a step that does not run on the card keeps its bound uncapped.
        let off = FoldJob {
            measured_range: false,
            ..job(50000.0, 48000.0, 20000.0, Some(0.3))
        };
        assert!(answer(&off).far);
        assert_eq!(answer(&off).figure_mib, 48000.0);
        let not_on_card = FoldJob {
            runs_on_card: false,
            ..job(70000.0, 60000.0, 30000.0, Some(2.5))
        };
        assert!(answer(&not_on_card).upper_bound_mib > 40960.0);
    }
}
