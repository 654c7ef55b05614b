//! How the estimators' MiB figures combine into one answer: which figure leads
//! ([`precedence`]), and how far from its training data a learned correction of the simulated
//! figure is trusted ([`correction_applies`], [`bound_widening`]). The training pipeline
//! (`training/simulated_pipeline.py`, `combine`) scores its estimators with the same rule.

use super::extrapolation::Extrapolation;
use super::manifest::Requirement;

/// Which MiB figure leads, in one place. Higher wins; between equals, the later in the
/// manifest. Physics first, learning second:
/// - 3, a regressor that requires the job's simulation: it starts from the simulated figure
///   and learns only what the simulation cannot see (workspaces, the allocator's real
///   behaviour), so it is the most accurate figure there can be, near the jobs it was trained
///   on (see [`correction_applies`]: farther away it does not run); the physics floor still
///   holds it.
/// - 2, the `simulated` estimator: a replay of the whole training step through a model of
///   the caching allocator, which no regressor trained on layer lists or traces can match
///   where no simulation regressor is loaded or applies.
/// - 1, a regressor that requires the traced saved tensors: they are the best single
///   predictor of activation memory (grouped CV median 3.0 % against 7.0 % without).
/// - 0, the family's plain regressor: any job, from its layers alone.
pub fn precedence(requires: &[Requirement]) -> u8 {
    if requires.contains(&Requirement::Simulation) {
        3
    } else if requires.contains(&Requirement::SavedTensors) {
        1
    } else {
        0
    }
}

/// The `simulated` estimator's place in [`precedence`].
pub const SIMULATED_PRECEDENCE: u8 = 2;

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
/// Wherever a job stands, see [`bound_widening`] for its bound.
pub fn correction_applies(reach: &Extrapolation) -> bool {
    reach.ratio <= reach.far
}

/// A correction of the simulated figure is learned from peaks measured on one card (the
/// entry's `capacity_mib`): jobs that ran out of memory there only say "more than the card",
/// so nothing taught the correction what a step too large for that card needs, and it pulled
/// such figures down (a 67 GB step, in-domain by its features, came out at 47 GB). It applies
/// only where the step runs on that card (`min capacity + context <= capacity`); beyond, the
/// simulated figure leads.
pub fn within_measured_range(
    min_capacity_bytes: u64,
    cuda_context_mib: f64,
    capacity_mib: u64,
) -> bool {
    min_capacity_bytes as f64 / (1024.0 * 1024.0) + cuda_context_mib <= capacity_mib as f64
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
pub fn bound_widening(reach: &Extrapolation) -> f64 {
    let widen = reach.ratio / reach.near;
    if widen.is_nan() {
        return reach.max_widen;
    }
    widen.clamp(1.0, reach.max_widen)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reach(ratio: f64) -> Extrapolation {
        Extrapolation {
            distance: ratio.is_finite().then_some(ratio * 1.7),
            typical_distance: 1.7,
            ratio,
            outside_setup: !ratio.is_finite(),
            near: 1.0,
            far: 2.0,
            max_widen: 3.0,
        }
    }

    #[test]
    fn the_correction_applies_up_to_far_and_not_beyond_nor_outside_the_setups() {
        for ratio in [0.0, 0.5, 1.0, 1.999, 2.0] {
            assert!(correction_applies(&reach(ratio)), "{ratio}");
        }
        for ratio in [2.001, 10.0, f64::INFINITY] {
            assert!(!correction_applies(&reach(ratio)), "{ratio}");
        }
    }

    #[test]
    fn a_correction_applies_only_to_steps_that_run_on_the_card_it_was_measured_on() {
        let gib = 1u64 << 30;
        assert!(within_measured_range(30 * gib, 1_700.0, 40_960));
        assert!(within_measured_range(39 * gib, 1_024.0, 40_960)); // 39,936 + 1,024 = 40,960
        assert!(!within_measured_range(39 * gib, 1_025.0, 40_960));
        assert!(!within_measured_range(64 * gib, 1_700.0, 40_960));
    }

    #[test]
    fn the_bound_widens_from_near_in_proportion_to_the_ratio_up_to_max_widen() {
        let widen = |ratio: f64| bound_widening(&reach(ratio));
        assert_eq!(widen(0.0), 1.0);
        assert_eq!(widen(1.0), 1.0);
        assert_eq!(widen(1.5), 1.5);
        assert_eq!(widen(2.5), 2.5);
        assert_eq!(widen(3.0), 3.0);
        assert_eq!(widen(40.0), 3.0);
        assert_eq!(widen(f64::INFINITY), 3.0);
        assert_eq!(widen(f64::NAN), 3.0);
        // With near 2, the bound starts widening at twice the typical distance.
        let late = Extrapolation {
            near: 2.0,
            ..reach(3.0)
        };
        assert_eq!(bound_widening(&late), 1.5);
    }

    #[test]
    fn a_simulation_regressor_leads_then_physics_then_the_traced_then_the_plain_regressor() {
        let simulation = precedence(&[Requirement::Simulation, Requirement::SavedTensors]);
        let traced = precedence(&[Requirement::SavedTensors]);
        let plain = precedence(&[]);
        assert!(
            simulation > SIMULATED_PRECEDENCE && SIMULATED_PRECEDENCE > traced && traced > plain
        );
    }
}
