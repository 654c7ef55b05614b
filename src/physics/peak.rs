//! Physics of a job's GPU memory, before any learning: the figure `gpucast_describe`'s
//! whole-step simulation gives on a card, the floor no answered figure may go below, and the
//! breakdown of an answered figure by category. "Physics first, learning second": a learned
//! figure may correct these, never contradict them.

use super::analytic::{self, FRAMEWORK_OVERHEAD_MIB};
use super::breakdown::{Breakdown, BreakdownSource};
use super::step::{self, ALLOCATOR_CACHE_SHARE};
use crate::job::{Detail, Job, KnownActivations, Setup, Simulation};

const MIB: f64 = 1024.0 * 1024.0;

/// Capacity of the card the training data was measured on (the A100 40 GB): figures are for it
/// unless a request names another GPU.
pub const REFERENCE_CAPACITY_MIB: u64 = 40_960;

/// A simulation's peaks placed on one card, MiB.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimulatedPeaks {
    pub allocated_mib: f64,
    /// The reserved peak with unlimited memory.
    pub reserved_mib: f64,
    pub min_capacity_mib: f64,
    /// The reserved peak as the card holds it: capped at the card's usable memory when the
    /// step runs there (the allocator frees its cache and retries before it fails), else the
    /// uncapped peak (the job does not run there; the figure says how far it is from fitting).
    pub reserved_on_card_mib: f64,
    pub cuda_context_mib: f64,
    /// A paged optimizer's state: on the device beside the allocator's segments.
    pub paged_mib: f64,
    pub capacity_mib: u64,
}

impl SimulatedPeaks {
    pub fn on_card(
        simulation: &Simulation,
        cuda_context_mib: f64,
        capacity_mib: u64,
    ) -> SimulatedPeaks {
        let allocated_mib = simulation.allocated_peak_bytes as f64 / MIB;
        let reserved_mib = simulation.reserved_peak_bytes as f64 / MIB;
        let min_capacity_mib = simulation.min_capacity_bytes as f64 / MIB;
        let usable_mib = capacity_mib as f64 - cuda_context_mib;
        let runs = min_capacity_mib <= usable_mib;
        let reserved_on_card_mib = if runs {
            reserved_mib.min(usable_mib)
        } else {
            reserved_mib
        };
        SimulatedPeaks {
            allocated_mib,
            reserved_mib,
            min_capacity_mib,
            reserved_on_card_mib,
            cuda_context_mib,
            paged_mib: simulation.paged_optimizer_state_bytes as f64 / MIB,
            capacity_mib,
        }
    }

    /// Whether the training step runs on the card: `min_capacity + context <= capacity`.
    pub fn runs_on_card(&self) -> bool {
        self.min_capacity_mib + self.cuda_context_mib <= self.capacity_mib as f64
    }

    /// The `simulated` estimator's figure: what nvidia-smi shows at the peak.
    pub fn figure_mib(&self) -> f64 {
        self.reserved_on_card_mib + self.cuda_context_mib + self.paged_mib
    }
}

/// An estimate held to physics: at least the floor, with a bound at least the estimate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settled {
    pub estimate_mib: f64,
    pub upper_bound_mib: f64,
    /// True when the figure was raised to the floor.
    pub floored: bool,
}

/// What physics says of one job on one card.
#[derive(Debug, Clone, PartialEq)]
pub struct Physics {
    pub source: BreakdownSource,
    /// The categories as physics sees them; their sum is the physical figure (the simulated
    /// figure, or the first-principles formula, traced when the job has saved tensors).
    pub parts: Breakdown,
    /// The simulation's peaks on the card; `None` for an analytic breakdown.
    pub simulated: Option<SimulatedPeaks>,
    /// For an analytic breakdown: what the optimizer's step reserves (weights, every gradient,
    /// the state and a foreach step's temporaries, with the allocator's usual cache share, as
    /// the training step counts them) with the context, MiB: no figure goes below it. 0 where
    /// the breakdown already holds that moment.
    pub optimizer_step_mib: f64,
    /// The step's other moment (the optimizer's step when `parts` are at the start of
    /// backward, and the reverse); `None` for a simulation, which records its one peak.
    pub other_moment: Option<Breakdown>,
    /// The parameters that train, and of them the LoRA adapters', as the analytic step this
    /// was read from counts them; `None` for a simulation. The setup's echo reads them here
    /// rather than walking the step again.
    pub trained_params: Option<(f64, f64)>,
    /// Whether `parts.activations` were counted tensor by tensor (a simulation, or a trace of
    /// the saved tensors): autograd holds every one of them when backward starts, so no figure
    /// goes below them.
    pub activations_counted: bool,
}

impl Physics {
    /// From the job's simulation when it has one and the context cost is known (the manifest's
    /// `simulated` block), else from the analytic formulas.
    pub fn of(job: &Job, cuda_context_mib: Option<f64>, capacity_mib: u64) -> Physics {
        Physics::of_staged(job, cuda_context_mib, capacity_mib).0
    }

    /// [`Physics::of`], with the analytic step's stages when the step answers (what the
    /// assumed fields' alternatives reuse, `physics::assumed`).
    pub fn of_staged(
        job: &Job,
        cuda_context_mib: Option<f64>,
        capacity_mib: u64,
    ) -> (Physics, Option<step::StepStages<'_>>) {
        match (job.simulation(), cuda_context_mib) {
            (Some(simulation), Some(context)) => (
                Physics::simulated(&on_most_loaded_gpu(job, simulation), context, capacity_mib),
                None,
            ),
            _ if !job.learned_estimators_apply() => {
                let stages = step::StepStages::of(job, job.setup(), job.known_activations());
                (Physics::from_step(&stages.memory), Some(stages))
            }
            _ => (Physics::analytic(job), None),
        }
    }

    /// The analytic training step of the job's setup ([`step::analytic_step`]): what PyTorch's
    /// allocator holds, the cache it reserves beyond (the simulations' median share), a paged
    /// optimizer's state beside them, and the context.
    pub fn step(job: &Job) -> Physics {
        Physics::step_as(job, job.setup(), job.known_activations())
    }

    /// [`Physics::step`] of `job`'s layers with `setup` and `known` activations in place of
    /// its own ([`step::analytic_step_as`]).
    pub fn step_as(job: &Job, setup: &Setup, known: Option<KnownActivations>) -> Physics {
        Physics::from_step(&step::analytic_step_as(job, setup, known))
    }

    /// The physics of an analytic step's bytes ([`Physics::step_as`]).
    pub fn from_step(memory: &step::StepMemory) -> Physics {
        let parts = Breakdown {
            parameters: memory.parameters / MIB,
            gradients: memory.gradients / MIB,
            optimizer_state: memory.optimizer_state / MIB,
            activations: memory.activations / MIB,
            temporaries: memory.temporaries / MIB,
            collective_buffers: memory.collective_buffers / MIB,
            paged_optimizer_state: memory.paged_optimizer_state / MIB,
            allocator_cache: memory.allocated() * ALLOCATOR_CACHE_SHARE / MIB,
            cuda_context: FRAMEWORK_OVERHEAD_MIB,
        };
        let other = memory.other_moment;
        let other_allocated = memory.allocated()
            - memory.gradients
            - memory.activations
            - memory.temporaries
            - memory.collective_buffers
            + other.gradients
            + other.activations
            + other.temporaries
            + other.collective_buffers;
        let other_moment = Breakdown {
            gradients: other.gradients / MIB,
            activations: other.activations / MIB,
            temporaries: other.temporaries / MIB,
            collective_buffers: other.collective_buffers / MIB,
            allocator_cache: other_allocated * ALLOCATOR_CACHE_SHARE / MIB,
            ..parts
        };
        Physics {
            source: BreakdownSource::Step,
            parts,
            simulated: None,
            optimizer_step_mib: 0.0,
            other_moment: Some(other_moment),
            trained_params: Some((memory.trainable_params, memory.lora_params)),
            activations_counted: false,
        }
    }

    pub fn simulated(simulation: &Simulation, cuda_context_mib: f64, capacity_mib: u64) -> Physics {
        let peaks = SimulatedPeaks::on_card(simulation, cuda_context_mib, capacity_mib);
        let at_peak = simulation.breakdown_at_peak;
        let named: u64 = at_peak.named().iter().map(|&(_, bytes)| bytes).sum();
        let parts = Breakdown {
            parameters: at_peak.parameters as f64 / MIB,
            gradients: at_peak.gradients as f64 / MIB,
            optimizer_state: at_peak.optimizer_state as f64 / MIB,
            activations: at_peak.activations as f64 / MIB,
            temporaries: at_peak.temporaries as f64 / MIB,
            // What the layout adds beyond the one-GPU step's categories (see
            // `on_most_loaded_gpu`).
            collective_buffers: simulation.allocated_peak_bytes.saturating_sub(named) as f64 / MIB,
            paged_optimizer_state: peaks.paged_mib,
            // Capping only ever removes cache: reserved on the card >= min capacity >= allocated.
            allocator_cache: (peaks.reserved_on_card_mib - peaks.allocated_mib).max(0.0),
            cuda_context: cuda_context_mib,
        };
        Physics {
            source: BreakdownSource::Simulation,
            parts,
            simulated: Some(peaks),
            optimizer_step_mib: 0.0,
            other_moment: None,
            trained_params: None,
            activations_counted: true,
        }
    }

    pub fn analytic(job: &Job) -> Physics {
        let state = analytic::model_state(job);
        let parts = Breakdown {
            parameters: state.parameters / MIB,
            gradients: state.gradients / MIB,
            optimizer_state: state.optimizer_state / MIB,
            activations: analytic::activation_bytes(job) / MIB,
            temporaries: 0.0,
            collective_buffers: 0.0,
            paged_optimizer_state: 0.0,
            allocator_cache: 0.0,
            cuda_context: FRAMEWORK_OVERHEAD_MIB,
        };
        // The per-parameter bytes above miss the optimizer step's temporaries (a foreach
        // step's copy of every gradient): the step model counts them.
        let step = step::analytic_step(job);
        // The optimizer's step as the formula's model state holds it, with the step model's
        // temporaries: the moment the formula's parts (at the start of backward) leave out.
        let state = parts.parameters + parts.gradients + parts.optimizer_state;
        let at_step = Breakdown {
            activations: 0.0,
            temporaries: (step.optimizer_step_bytes / MIB - state).max(0.0),
            paged_optimizer_state: step.paged_optimizer_state / MIB,
            allocator_cache: step.optimizer_step_bytes * ALLOCATOR_CACHE_SHARE / MIB,
            ..parts
        };
        Physics {
            source: BreakdownSource::Analytic,
            parts,
            simulated: None,
            optimizer_step_mib: (step.optimizer_step_bytes * (1.0 + ALLOCATOR_CACHE_SHARE)
                + step.paged_optimizer_state)
                / MIB
                + FRAMEWORK_OVERHEAD_MIB,
            other_moment: Some(at_step),
            trained_params: Some((step.trainable_params, step.lora_params)),
            activations_counted: job.detail() == Detail::Traced,
        }
    }

    /// The same physics with its uncertain terms (activations, temporaries, allocator cache)
    /// multiplied by `factor`: a learned correction of what physics cannot count exactly.
    pub fn with_uncertain_scaled(mut self, factor: f64) -> Physics {
        for p in std::iter::once(&mut self.parts).chain(self.other_moment.as_mut()) {
            p.activations *= factor;
            p.temporaries *= factor;
            p.allocator_cache *= factor;
        }
        self
    }

    /// No job needs less than its model state and the CUDA context, nor than its optimizer's
    /// step; a simulated or traced one also keeps its activations at the peak (counted byte by
    /// byte). (A traced GPT-2 was answered 48 % under its simulation by a regressor that learned
    /// from vision models, below the tensors its own trace saves.)
    pub fn floor_mib(&self) -> f64 {
        let p = &self.parts;
        let activations = if self.activations_counted {
            p.activations
        } else {
            0.0
        };
        let model_state = p.parameters
            + p.gradients
            + p.optimizer_state
            + activations
            + p.collective_buffers
            + p.paged_optimizer_state
            + p.cuda_context;
        model_state.max(self.optimizer_step_mib)
    }

    /// Holds a figure and its bound to physics: the figure at least the floor, the bound at
    /// least the figure.
    pub fn settle(&self, estimate_mib: f64, upper_bound_mib: f64) -> Settled {
        self.settle_above(self.floor_mib(), estimate_mib, upper_bound_mib)
    }

    /// The floor with another CUDA context than physics assumes: an environment's (its
    /// driver, CUDA and lazy loading set the context, not the job).
    pub fn floor_with_context_mib(&self, cuda_context_mib: f64) -> f64 {
        self.floor_in_stack_mib(cuda_context_mib, 1.0)
    }

    /// The floor in an environment whose stack holds `stack_factor` times physics' bytes
    /// (`calibration::environment`): a stack observed to hold less (its own sharding, a leaner
    /// master copy) lowers the model state too; one that holds more leaves the floor as it is.
    pub fn floor_in_stack_mib(&self, cuda_context_mib: f64, stack_factor: f64) -> f64 {
        (self.floor_mib() - self.parts.cuda_context) * stack_factor.min(1.0)
            + cuda_context_mib.max(0.0)
    }

    /// [`Physics::settle`] against `floor`.
    pub fn settle_above(&self, floor: f64, estimate_mib: f64, upper_bound_mib: f64) -> Settled {
        let floored = estimate_mib < floor;
        let estimate_mib = estimate_mib.max(floor);
        Settled {
            estimate_mib,
            upper_bound_mib: upper_bound_mib.max(estimate_mib),
            floored,
        }
    }

    /// The categories of an answered figure (at least the floor). Simulated: the simulation's
    /// categories, what a learned correction adds going to temporaries (workspaces the
    /// simulation cannot see), what it takes coming out of the allocator cache, then the
    /// temporaries. Analytic: what the formula does not explain goes to temporaries; a figure
    /// below the formula shrinks the activations, never the model state.
    pub fn breakdown(&self, figure_mib: f64) -> Breakdown {
        let mut parts = self.parts;
        let difference = figure_mib - parts.total();
        if difference >= 0.0 {
            parts.temporaries += difference;
            return parts;
        }
        let mut deficit = -difference;
        let shrinkable: [&mut f64; 3] = match self.source {
            BreakdownSource::Simulation => [
                &mut parts.allocator_cache,
                &mut parts.temporaries,
                &mut parts.activations,
            ],
            BreakdownSource::Analytic | BreakdownSource::Step => [
                &mut parts.temporaries,
                &mut parts.activations,
                &mut parts.allocator_cache,
            ],
        };
        for category in shrinkable {
            let taken = deficit.min(*category);
            *category -= taken;
            deficit -= taken;
        }
        parts
    }
}

/// A one-GPU simulation placed on the most loaded GPU of the job's layout: its categories
/// sharded and split as [`step::shard_simulated`] says, the collective buffers added to the
/// allocated peak (the breakdown no longer sums to it: the difference is those buffers), the
/// allocator's cache and the minimum capacity's margin kept as simulated.
pub fn on_most_loaded_gpu(job: &Job, simulation: &Simulation) -> Simulation {
    if job.setup().parallelism.is_single_gpu() {
        return simulation.clone();
    }
    let (categories, collective) = step::shard_simulated(job, simulation.breakdown_at_peak);
    let named: u64 = categories.named().iter().map(|&(_, bytes)| bytes).sum();
    let allocated = named + collective;
    let cache = simulation.reserved_peak_bytes - simulation.allocated_peak_bytes;
    let margin = simulation.min_capacity_bytes - simulation.allocated_peak_bytes;
    Simulation {
        allocated_peak_bytes: allocated,
        reserved_peak_bytes: allocated + cache,
        min_capacity_bytes: allocated + margin,
        breakdown_at_peak: categories,
        paged_optimizer_state_bytes: step::shard_paged(job, simulation.paged_optimizer_state_bytes),
        ..simulation.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::validated::{SimulatedCategories, UncheckedLayer, UncheckedSimulation};

    const GIB: u64 = 1 << 30;

    fn job() -> Job {
        let layers = vec![
            UncheckedLayer {
                kind: "linear",
                output_size: 1024,
                params: 1 << 20,
            },
            UncheckedLayer {
                kind: "relu",
                output_size: 1024,
                params: 0,
            },
        ];
        Job::parse(None, 256, layers.into_iter()).unwrap()
    }

    /// 1 + 1 + 2 + 3 + 1 GiB allocated at the peak; reserved 10 GiB; runs on 9 GiB.
    fn simulated_job() -> Job {
        let raw = UncheckedSimulation {
            batch_size: 256,
            optimizer: None,
            precision: None,
            allocated_peak_bytes: 8 * GIB,
            reserved_peak_bytes: 10 * GIB,
            min_capacity_bytes: 9 * GIB,
            breakdown_at_peak: SimulatedCategories {
                parameters: GIB,
                gradients: GIB,
                optimizer_state: 2 * GIB,
                activations: 3 * GIB,
                temporaries: GIB,
            },
            attention: None,
            interpolated: false,
            ..Default::default()
        };
        job().with_simulation(Some(raw)).unwrap()
    }

    fn simulation() -> Simulation {
        simulated_job().simulation().unwrap().clone()
    }

    #[test]
    fn the_simulated_figure_is_the_reserved_peak_plus_the_context_capped_at_the_card_where_the_step_runs(
    ) {
        // Roomy card: the whole reserved peak, 10,240 MiB, plus the context.
        let roomy = SimulatedPeaks::on_card(&simulation(), 1300.0, 40_960);
        assert!(roomy.runs_on_card());
        assert_eq!(roomy.figure_mib(), 10_240.0 + 1300.0);
        // 9 GiB + context fits exactly; the allocator frees its cache there: capped at usable.
        let tight = SimulatedPeaks::on_card(&simulation(), 1300.0, 9216 + 1300);
        assert!(tight.runs_on_card());
        assert_eq!(tight.reserved_on_card_mib, 9216.0);
        assert_eq!(tight.figure_mib(), (9216 + 1300) as f64);
        // Too small a card: the step fails, the figure is the uncapped need.
        let small = SimulatedPeaks::on_card(&simulation(), 1300.0, 9216 + 1299);
        assert!(!small.runs_on_card());
        assert_eq!(small.figure_mib(), 10_240.0 + 1300.0);
    }

    #[test]
    fn the_floor_is_the_model_state_and_context_plus_simulated_activations() {
        let simulated = Physics::simulated(&simulation(), 1300.0, 40_960);
        assert_eq!(
            simulated.floor_mib(),
            (1024 + 1024 + 2048 + 3072) as f64 + 1300.0
        );
        assert_eq!(simulated.parts.total(), 10_240.0 + 1300.0);
        let analytic = Physics::analytic(&job());
        // 2^20 params, Adam fp32: not the 4 + 4 + 8 MiB of model state alone but the optimizer's
        // step, which also holds foreach's 4 MiB copy of the gradients, with the cache share;
        // the activations are no part of it.
        let optimizer_step = 20.0 * (1.0 + ALLOCATOR_CACHE_SHARE) + FRAMEWORK_OVERHEAD_MIB;
        assert!((analytic.floor_mib() - optimizer_step).abs() < 1e-9);
        assert!((analytic.parts.total() - analytic::first_principles_mib(&job())).abs() < 1e-9);
        // Without the manifest's context cost a simulation cannot be placed: analytic.
        assert_eq!(
            Physics::of(&simulated_job(), None, 40_960).source,
            BreakdownSource::Analytic
        );
        assert_eq!(
            Physics::of(&simulated_job(), Some(1300.0), 40_960),
            simulated
        );
    }

    #[test]
    fn settling_raises_a_figure_to_the_floor_and_the_bound_to_the_figure() {
        let physics = Physics::analytic(&job());
        let floor = physics.floor_mib();
        assert_eq!(
            physics.settle(900.0, 950.0),
            Settled {
                estimate_mib: floor,
                upper_bound_mib: floor,
                floored: true
            }
        );
        assert_eq!(
            physics.settle(2000.0, 1900.0),
            Settled {
                estimate_mib: 2000.0,
                upper_bound_mib: 2000.0,
                floored: false
            }
        );
        assert_eq!(physics.settle(2000.0, 2500.0).upper_bound_mib, 2500.0);
    }

    #[test]
    fn a_simulated_breakdown_puts_a_learned_addition_in_temporaries_and_takes_a_cut_from_the_cache()
    {
        let physics = Physics::simulated(&simulation(), 1300.0, 40_960);
        let figure = physics.parts.total();
        let raised = physics.breakdown(figure + 500.0);
        assert_eq!(raised.temporaries, 1024.0 + 500.0);
        assert_eq!(raised.allocator_cache, 2048.0);
        let cut = physics.breakdown(figure - 2500.0);
        assert_eq!(
            (cut.allocator_cache, cut.temporaries),
            (0.0, 1024.0 - 452.0)
        );
        assert_eq!(cut.activations, 3072.0);
        for figure in [figure + 500.0, figure, figure - 2500.0, physics.floor_mib()] {
            assert!(
                (physics.breakdown(figure).total() - figure).abs() < 1e-9,
                "{figure}"
            );
        }
        assert_eq!(physics.breakdown(physics.floor_mib()).temporaries, 0.0);
    }

    #[test]
    fn an_analytic_breakdown_shrinks_activations_never_the_model_state() {
        let physics = Physics::analytic(&job());
        // Model state (4 + 4 + 8 MiB) and context: what the breakdown never shrinks.
        let floor = 16.0 + FRAMEWORK_OVERHEAD_MIB;
        let above = physics.breakdown(floor + 100.0);
        assert_eq!((above.activations, above.temporaries), (2.0, 98.0));
        let below = physics.breakdown(floor + 1.0);
        assert_eq!((below.activations, below.temporaries), (1.0, 0.0));
        assert_eq!(
            (below.parameters, below.gradients, below.optimizer_state),
            (4.0, 4.0, 8.0)
        );
        assert_eq!(below.cuda_context, FRAMEWORK_OVERHEAD_MIB);
    }

    #[test]
    fn rounded_categories_sum_exactly_to_the_rounded_figure() {
        let parts = Breakdown {
            parameters: 97.46,
            gradients: 97.46,
            optimizer_state: 194.93,
            activations: 1234.56,
            temporaries: 0.04,
            collective_buffers: 3.33,
            paged_optimizer_state: 0.07,
            allocator_cache: 12.34,
            cuda_context: 1300.0,
        };
        let total = parts.total();
        let rounded = parts.rounded(total);
        let tenths = |v: f64| (v * 10.0).round() as i64;
        assert_eq!(
            rounded.values().iter().map(|&v| tenths(v)).sum::<i64>(),
            tenths(total)
        );
        for (r, e) in rounded.values().iter().zip(parts.values()) {
            assert!((r - e).abs() <= 0.1 + 1e-9, "{r} from {e}");
            assert_eq!(*r, tenths(*r) as f64 / 10.0);
        }
    }
}
