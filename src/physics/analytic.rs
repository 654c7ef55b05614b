//! Analytic memory models: closed formulas over the job description, no learning
//! (docs/design/models.md). Training reads them as features from `gpucast features`.

use crate::job::validated::{Job, Precision};

const MIB: f64 = 1024.0 * 1024.0;

/// CUDA context, cuBLAS/cuDNN workspaces and the caching allocator's slack on an A100, read
/// off the smallest MLP jobs of the GPUMemNet data (whose peaks start at ~1,440 MiB).
pub const FRAMEWORK_OVERHEAD_MIB: f64 = 1300.0;

fn totals(job: &Job) -> (f64, f64, f64) {
    let params: f64 = job.layers().iter().map(|l| l.params as f64).sum();
    let activations: f64 = job.layers().iter().map(|l| l.output_size as f64).sum();
    (params, activations, job.batch_size() as f64)
}

/// Bytes the model itself keeps on the GPU through training, by category.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelState {
    /// Weights: fp32, plus a 2-byte working copy in mixed16.
    pub parameters: f64,
    pub gradients: f64,
    pub optimizer_state: f64,
}

impl ModelState {
    pub fn total(self) -> f64 {
        self.parameters + self.gradients + self.optimizer_state
    }
}

/// Bytes per parameter of weights and of activation elements for a precision.
fn weight_and_activation_bytes(precision: Precision) -> (f64, f64) {
    match precision {
        Precision::Fp32 | Precision::Tf32 => (4.0, 4.0),
        // fp32 master weights plus a 2-byte working copy; activations in 16 bits.
        Precision::AmpFp16 | Precision::AmpBf16 => (6.0, 2.0),
        Precision::Bf16 | Precision::Fp16 => (2.0, 2.0),
    }
}

/// Optimizer state per parameter: fp32 state (0, 4 or 8 bytes), in 16 bits under pure bf16/fp16.
fn state_bytes_per_param(job: &Job) -> f64 {
    job.optimizer().state_bytes_per_param() * job.precision().storage_bytes() / 4.0
}

/// Weights, gradients and optimizer state of the job's parameters, in bytes.
pub fn model_state(job: &Job) -> ModelState {
    let (params, _, _) = totals(job);
    let (weight_bytes, _) = weight_and_activation_bytes(job.precision());
    ModelState {
        parameters: params * weight_bytes,
        gradients: params * job.precision().storage_bytes(),
        optimizer_state: params * state_bytes_per_param(job),
    }
}

/// Bytes of the activations kept for backward: the traced saved tensors when the job has them
/// (fp32 bytes, halved for mixed16), else every layer output of every sample.
pub fn activation_bytes(job: &Job) -> f64 {
    let (_, activations, batch) = totals(job);
    let (_, element_bytes) = weight_and_activation_bytes(job.precision());
    match job.saved_tensors() {
        Some(saved) => saved.bytes_at(job.batch_size()) * element_bytes / 4.0,
        None => activations * batch * element_bytes,
    }
}

/// Bytes of weights, gradients and optimizer state, and bytes per activation element (one
/// product, so that the figure keeps its bits: tests/fixtures/features.json pins them).
fn model_state_and_activation_bytes(job: &Job, params: f64) -> (f64, f64) {
    let (weight_bytes, activation_bytes) = weight_and_activation_bytes(job.precision());
    let gradient_bytes = job.precision().storage_bytes();
    let state_bytes = state_bytes_per_param(job);
    (
        params * (weight_bytes + gradient_bytes + state_bytes),
        activation_bytes,
    )
}

/// Weights + gradients + optimizer state + activations kept for backward + framework overhead.
pub fn first_principles_mib(job: &Job) -> f64 {
    let (params, activations, batch) = totals(job);
    let (model, activation_bytes) = model_state_and_activation_bytes(job, params);
    FRAMEWORK_OVERHEAD_MIB + (model + activations * batch * activation_bytes) / MIB
}

/// `first_principles_mib` with the traced saved tensors (fp32 bytes, halved for mixed16) as the
/// activations kept for backward; `None` when the job carries no trace.
pub fn traced_first_principles_mib(job: &Job) -> Option<f64> {
    let saved = job.saved_tensors()?;
    let (params, _, _) = totals(job);
    let (model, activation_bytes) = model_state_and_activation_bytes(job, params);
    let traced = saved.bytes_at(job.batch_size()) * activation_bytes / 4.0;
    Some(FRAMEWORK_OVERHEAD_MIB + (model + traced) / MIB)
}

/// The Horus formula: weights plus feature maps, in fp32; no gradients, optimizer state or
/// framework overhead. A published baseline to compare against, not to trust.
pub fn horus_mib(job: &Job) -> f64 {
    let (params, activations, batch) = totals(job);
    (4.0 * params + 4.0 * activations * batch) / MIB
}

/// The analytic figures of one job. Computed once per job: the learned estimators' features
/// and the analytic estimators' answers read the same numbers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AnalyticFigures {
    pub first_principles_mib: f64,
    pub traced_first_principles_mib: Option<f64>,
    pub horus_mib: f64,
}

impl AnalyticFigures {
    pub fn of(job: &Job) -> AnalyticFigures {
        AnalyticFigures {
            first_principles_mib: first_principles_mib(job),
            traced_first_principles_mib: traced_first_principles_mib(job),
            horus_mib: horus_mib(job),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::validated::UncheckedLayer;

    fn job(optimizer: &str, precision: &str) -> Job {
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
        Job::parse(None, 256, layers.into_iter())
            .unwrap()
            .with_training(Some(optimizer), Some(precision))
            .unwrap()
    }

    #[test]
    fn adam_fp32_costs_sixteen_bytes_per_parameter_plus_activations() {
        // 2^20 params x 16 B = 16 MiB; 2,048 outputs x 256 samples x 4 B = 2 MiB.
        let mib = first_principles_mib(&job("adam", "fp32"));
        assert!(
            (mib - (FRAMEWORK_OVERHEAD_MIB + 16.0 + 2.0)).abs() < 1e-9,
            "{mib}"
        );
    }

    #[test]
    fn optimizer_and_precision_change_the_figure_as_expected() {
        let sgd = first_principles_mib(&job("sgd", "fp32"));
        let momentum = first_principles_mib(&job("momentum", "fp32"));
        let mixed = first_principles_mib(&job("adam", "mixed16"));
        assert!((sgd - (FRAMEWORK_OVERHEAD_MIB + 8.0 + 2.0)).abs() < 1e-9);
        assert!((momentum - sgd - 4.0).abs() < 1e-9);
        assert!((mixed - (FRAMEWORK_OVERHEAD_MIB + 18.0 + 1.0)).abs() < 1e-9);
    }

    #[test]
    fn the_traced_formula_swaps_the_layer_outputs_for_the_saved_tensors() {
        use crate::job::SavedTensors;
        assert_eq!(traced_first_principles_mib(&job("adam", "fp32")), None);
        // 2^20 params x 16 B = 16 MiB; 256 x 8 KiB + 2 MiB saved = 4 MiB (2 MiB in mixed16).
        let saved = Some(SavedTensors {
            per_sample_bytes: 8192,
            fixed_bytes: 2 << 20,
        });
        let fp32 =
            traced_first_principles_mib(&job("adam", "fp32").with_saved_tensors(saved).unwrap())
                .unwrap();
        assert!(
            (fp32 - (FRAMEWORK_OVERHEAD_MIB + 16.0 + 4.0)).abs() < 1e-9,
            "{fp32}"
        );
        let mixed =
            traced_first_principles_mib(&job("adam", "mixed16").with_saved_tensors(saved).unwrap())
                .unwrap();
        assert!(
            (mixed - (FRAMEWORK_OVERHEAD_MIB + 18.0 + 2.0)).abs() < 1e-9,
            "{mixed}"
        );
    }

    #[test]
    fn model_state_and_activations_split_the_first_principles_figure() {
        for (optimizer, precision) in [("adam", "fp32"), ("sgd", "fp32"), ("momentum", "mixed16")] {
            let job = job(optimizer, precision);
            let state = model_state(&job);
            let total = FRAMEWORK_OVERHEAD_MIB + (state.total() + activation_bytes(&job)) / MIB;
            assert!(
                (total - first_principles_mib(&job)).abs() < 1e-9,
                "{optimizer} {precision}"
            );
        }
        let mixed = model_state(&job("adam", "mixed16"));
        assert_eq!(
            (mixed.parameters, mixed.gradients, mixed.optimizer_state),
            (6.0 * MIB, 4.0 * MIB, 8.0 * MIB)
        );
        let saved = Some(crate::job::SavedTensors {
            per_sample_bytes: 8192,
            fixed_bytes: 2 << 20,
        });
        let traced = job("adam", "mixed16").with_saved_tensors(saved).unwrap();
        assert_eq!(activation_bytes(&traced), 2.0 * MIB);
    }

    #[test]
    fn horus_counts_weights_and_feature_maps_only() {
        let mib = horus_mib(&job("adam", "fp32"));
        assert!((mib - (4.0 + 2.0)).abs() < 1e-9, "{mib}");
    }
}
