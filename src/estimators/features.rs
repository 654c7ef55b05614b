//! Feature extraction: what the estimators read of a job. The training pipeline reads the same
//! features from `gpucast features --batch` (training/gpucast_training/service.py), so there is
//! one implementation. docs/design/models.md defines every feature.

use serde::Deserialize;

use crate::job::{Job, LayerKind};
use crate::physics::analytic;

/// Hidden activations that get a one-hot feature, in the order of the `act_<name>` features.
pub const ONE_HOT_ACTIVATIONS: [LayerKind; 11] = [
    LayerKind::Relu,
    LayerKind::LeakyRelu,
    LayerKind::Prelu,
    LayerKind::Elu,
    LayerKind::Selu,
    LayerKind::Gelu,
    LayerKind::Silu,
    LayerKind::Mish,
    LayerKind::Softplus,
    LayerKind::Tanh,
    LayerKind::Identity,
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Transform {
    Identity,
    Log1p,
}

/// One model input column: which raw feature, and how it is normalised.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct FeatureSpec {
    pub name: String,
    pub transform: Transform,
    pub mean: f64,
    pub std: f64,
}

impl FeatureSpec {
    pub fn normalise(&self, raw: f64) -> f64 {
        let transformed = match self.transform {
            Transform::Identity => raw,
            Transform::Log1p => raw.ln_1p(),
        };
        (transformed - self.mean) / self.std
    }
}

/// Aggregate (whole-job) raw features, computed once per job and shared by every estimator.
#[derive(Debug, Clone, PartialEq)]
pub struct AggregateFeatures {
    depth: f64,
    n_layers: f64,
    total_params: f64,
    total_activations: f64,
    batch_size: f64,
    max_output_size: f64,
    n_batch_norm: f64,
    n_dropout: f64,
    n_activation: f64,
    n_conv: f64,
    n_attention: f64,
    n_norm: f64,
    n_embedding: f64,
    input_pixels: f64,
    /// Outputs per sample by the kind of layer that produced them: what a layer keeps for
    /// backward depends on its kind.
    conv_outputs: f64,
    norm_outputs: f64,
    activation_outputs: f64,
    linear_outputs: f64,
    attention_outputs: f64,
    other_outputs: f64,
    first_principles_mib: f64,
    /// 0 without a trace: only the traced regressors read it, and only traced jobs reach them.
    traced_first_principles_mib: f64,
    horus_mib: f64,
    /// The whole-step simulation's figures, MiB; all 0 without a simulation (only the
    /// regressors that require one read them, and only simulated jobs reach those).
    simulated: [f64; SIMULATION_FEATURES.len()],
    hidden_activation: LayerKind,
}

/// The aggregate features that are neither a simulation figure nor an activation's one-hot.
const MEASURE_FEATURES: [&str; 25] = [
    "depth",
    "n_layers",
    "total_params",
    "total_activations",
    "batch_size",
    "activations_x_batch",
    "params_x_batch",
    "max_output_size",
    "n_batch_norm",
    "n_dropout",
    "n_activation",
    "n_conv",
    "n_attention",
    "n_norm",
    "n_embedding",
    "input_pixels",
    "conv_outputs_x_batch",
    "norm_outputs_x_batch",
    "activation_outputs_x_batch",
    "linear_outputs_x_batch",
    "attention_outputs_x_batch",
    "other_outputs_x_batch",
    "first_principles_mib",
    "traced_first_principles_mib",
    "horus_mib",
];

/// Every name [`AggregateFeatures::get`] knows: the measures, the simulation's figures, then
/// the `act_<name>` one-hots.
pub fn aggregate_feature_names() -> impl Iterator<Item = String> {
    MEASURE_FEATURES
        .into_iter()
        .chain(SIMULATION_FEATURES)
        .map(str::to_string)
        .chain(ONE_HOT_ACTIVATIONS.map(|k| format!("act_{}", k.as_str())))
}

/// The simulation's figures as features, in this order: allocated, reserved and minimum
/// capacity, then the allocated bytes at the peak by category (bytes / 2^20).
pub const SIMULATION_FEATURES: [&str; 8] = [
    "sim_allocated_mib",
    "sim_reserved_mib",
    "sim_min_capacity_mib",
    "sim_parameters_mib",
    "sim_gradients_mib",
    "sim_optimizer_state_mib",
    "sim_activations_mib",
    "sim_temporaries_mib",
];

fn simulation_features(job: &Job) -> [f64; SIMULATION_FEATURES.len()] {
    const MIB: f64 = 1024.0 * 1024.0;
    let Some(s) = job.simulation() else {
        return [0.0; SIMULATION_FEATURES.len()];
    };
    let c = s.breakdown_at_peak;
    [
        s.allocated_peak_bytes,
        s.reserved_peak_bytes,
        s.min_capacity_bytes,
        c.parameters,
        c.gradients,
        c.optimizer_state,
        c.activations,
        c.temporaries,
    ]
    .map(|bytes| bytes as f64 / MIB)
}

impl AggregateFeatures {
    pub fn of(job: &Job) -> AggregateFeatures {
        AggregateFeatures::with_analytic(job, &analytic::AnalyticFigures::of(job))
    }

    /// The features of a job whose analytic figures are already computed.
    pub fn with_analytic(job: &Job, figures: &analytic::AnalyticFigures) -> AggregateFeatures {
        // One pass over the layers (a model built from its configuration has ~900). Each sum
        // adds the layers in order from -0.0, as `Iterator::sum` does, so every feature keeps
        // its bits.
        const SUM: f64 = -0.0;
        let mut f = AggregateFeatures {
            depth: 0.0,
            n_layers: job.layers().len() as f64,
            total_params: SUM,
            total_activations: SUM,
            batch_size: job.batch_size() as f64,
            max_output_size: 0.0,
            n_batch_norm: 0.0,
            n_dropout: 0.0,
            n_activation: 0.0,
            n_conv: 0.0,
            n_attention: 0.0,
            n_norm: 0.0,
            n_embedding: 0.0,
            input_pixels: job
                .input_shape()
                .map_or(0.0, |shape| shape.iter().map(|&d| d as f64).product()),
            conv_outputs: SUM,
            norm_outputs: SUM,
            activation_outputs: SUM,
            linear_outputs: SUM,
            attention_outputs: SUM,
            other_outputs: SUM,
            first_principles_mib: figures.first_principles_mib,
            traced_first_principles_mib: figures.traced_first_principles_mib.unwrap_or(0.0),
            horus_mib: figures.horus_mib,
            simulated: simulation_features(job),
            hidden_activation: hidden_activation(job),
        };
        let mut max_output_size = 0;
        for layer in job.layers() {
            let (kind, output) = (layer.kind, layer.output_size as f64);
            f.total_params += layer.params as f64;
            f.total_activations += output;
            max_output_size = max_output_size.max(layer.output_size);
            match kind {
                LayerKind::Linear => {
                    f.depth += 1.0;
                    f.linear_outputs += output;
                }
                LayerKind::Attention => {
                    f.n_attention += 1.0;
                    f.attention_outputs += output;
                }
                LayerKind::Other => f.other_outputs += output,
                LayerKind::BatchNorm => f.n_batch_norm += 1.0,
                LayerKind::Dropout => f.n_dropout += 1.0,
                LayerKind::Embedding => f.n_embedding += 1.0,
                _ => {}
            }
            if kind.is_activation() {
                f.n_activation += 1.0;
                if kind != LayerKind::Identity {
                    f.activation_outputs += output;
                }
            }
            if kind.is_convolution() {
                f.n_conv += 1.0;
                f.conv_outputs += output;
            }
            if kind.is_normalisation() {
                f.n_norm += 1.0;
                f.norm_outputs += output;
            }
        }
        f.max_output_size = max_output_size as f64;
        f
    }

    /// The raw value of a named feature, or `None` for a name this build does not know.
    pub fn get(&self, name: &str) -> Option<f64> {
        let value = match name {
            "depth" => self.depth,
            "n_layers" => self.n_layers,
            "total_params" => self.total_params,
            "total_activations" => self.total_activations,
            "batch_size" => self.batch_size,
            "activations_x_batch" => self.total_activations * self.batch_size,
            "params_x_batch" => self.total_params * self.batch_size,
            "max_output_size" => self.max_output_size,
            "n_batch_norm" => self.n_batch_norm,
            "n_dropout" => self.n_dropout,
            "n_activation" => self.n_activation,
            "n_conv" => self.n_conv,
            "n_attention" => self.n_attention,
            "n_norm" => self.n_norm,
            "n_embedding" => self.n_embedding,
            "input_pixels" => self.input_pixels,
            "conv_outputs_x_batch" => self.conv_outputs * self.batch_size,
            "norm_outputs_x_batch" => self.norm_outputs * self.batch_size,
            "activation_outputs_x_batch" => self.activation_outputs * self.batch_size,
            "linear_outputs_x_batch" => self.linear_outputs * self.batch_size,
            "attention_outputs_x_batch" => self.attention_outputs * self.batch_size,
            "other_outputs_x_batch" => self.other_outputs * self.batch_size,
            "first_principles_mib" => self.first_principles_mib,
            "traced_first_principles_mib" => self.traced_first_principles_mib,
            "horus_mib" => self.horus_mib,
            _ if name.starts_with("sim_") => {
                let index = SIMULATION_FEATURES.iter().position(|&n| n == name)?;
                self.simulated[index]
            }
            _ => {
                let activation = name.strip_prefix("act_")?;
                let kind = ONE_HOT_ACTIVATIONS
                    .into_iter()
                    .find(|k| k.as_str() == activation)?;
                f64::from(u8::from(kind == self.hidden_activation))
            }
        };
        Some(value)
    }

    /// Every feature by name ([`aggregate_feature_names`]'s order): what `gpucast features`
    /// prints for training to learn from.
    pub fn named(&self) -> Vec<(String, f64)> {
        aggregate_feature_names()
            .map(|name| {
                let value = self.get(&name).expect("every listed name is known");
                (name, value)
            })
            .collect()
    }

    /// The model input vector for `specs`, in their order.
    pub fn normalised(&self, specs: &[FeatureSpec]) -> Vec<f32> {
        specs
            .iter()
            .map(|spec| {
                // Names were checked against `get` when the manifest was loaded.
                spec.normalise(self.get(&spec.name).unwrap_or(0.0)) as f32
            })
            .collect()
    }
}

/// Names of the per-layer token features.
pub const TOKEN_FEATURES: [&str; 5] = [
    "output_size",
    "params",
    "batch_size",
    "output_x_batch",
    "position",
];

/// Per-layer token inputs of a sequence model: kind ids (0 = padding) and a row-major
/// `[n_tokens, specs.len()]` matrix of normalised features.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenFeatures {
    pub kind_ids: Vec<i64>,
    pub features: Vec<f32>,
    pub n_tokens: usize,
    pub n_features: usize,
}

/// Raw value of a token feature for layer `index`, or `None` for an unknown name.
pub fn raw_token_feature(job: &Job, index: usize, name: &str) -> Option<f64> {
    let layer = job.layers()[index];
    let batch = job.batch_size() as f64;
    let value = match name {
        "output_size" => layer.output_size as f64,
        "params" => layer.params as f64,
        "batch_size" => batch,
        "output_x_batch" => layer.output_size as f64 * batch,
        "position" => index as f64 / (job.layers().len().saturating_sub(1).max(1)) as f64,
        _ => return None,
    };
    Some(value)
}

impl TokenFeatures {
    /// `vocab_index` maps a kind to its position in the model's vocabulary; a kind outside the
    /// vocabulary is reported back so the caller can refuse the job.
    pub fn of(
        job: &Job,
        vocab_index: impl Fn(LayerKind) -> Option<usize>,
        specs: &[FeatureSpec],
    ) -> Result<TokenFeatures, (usize, LayerKind)> {
        let n_tokens = job.layers().len();
        let mut kind_ids = Vec::with_capacity(n_tokens);
        let mut features = Vec::with_capacity(n_tokens * specs.len());
        for (index, layer) in job.layers().iter().enumerate() {
            let id = vocab_index(layer.kind).ok_or((index, layer.kind))?;
            kind_ids.push(id as i64 + 1);
            for spec in specs {
                let raw = raw_token_feature(job, index, &spec.name).unwrap_or(0.0);
                features.push(spec.normalise(raw) as f32);
            }
        }
        Ok(TokenFeatures {
            kind_ids,
            features,
            n_tokens,
            n_features: specs.len(),
        })
    }
}

/// The most frequent activation kind, not counting the output nonlinearities softmax and
/// sigmoid; ties go to the kind seen first; none means identity.
fn hidden_activation(job: &Job) -> LayerKind {
    let mut counts: Vec<(LayerKind, usize)> = Vec::new();
    for layer in job.layers() {
        let kind = layer.kind;
        if !kind.is_activation() || matches!(kind, LayerKind::Softmax | LayerKind::Sigmoid) {
            continue;
        }
        match counts.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => *n += 1,
            None => counts.push((kind, 1)),
        }
    }
    // `max_by_key` keeps the last maximum, so scan in reverse to keep the first one seen.
    counts
        .iter()
        .rev()
        .max_by_key(|(_, n)| *n)
        .map_or(LayerKind::Identity, |(k, _)| *k)
}

/// Checks a model's feature specs: every name known, every mean and std usable, at least one.
pub fn check_specs(specs: &[FeatureSpec], known: impl Fn(&str) -> bool) -> Result<(), String> {
    for spec in specs {
        if !known(&spec.name) {
            return Err(format!("unknown feature '{}'", spec.name));
        }
        if !(spec.std.is_finite() && spec.std > 0.0 && spec.mean.is_finite()) {
            return Err(format!("feature '{}' has an invalid mean/std", spec.name));
        }
    }
    if specs.is_empty() {
        return Err("no input features".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::validated::UncheckedLayer;

    fn job(batch: u64, layers: &[(&str, u64, u64)]) -> Job {
        let layers: Vec<_> = layers
            .iter()
            .map(|&(kind, output_size, params)| UncheckedLayer {
                kind,
                output_size,
                params,
            })
            .collect();
        Job::parse(None, batch, layers.into_iter()).unwrap()
    }

    #[test]
    fn aggregate_features_follow_the_contract() {
        let job = job(
            4,
            &[
                ("linear", 10, 110),
                ("batch_norm", 10, 20),
                ("relu", 10, 0),
                ("dropout", 10, 0),
                ("linear", 3, 33),
                ("softmax", 3, 0),
            ],
        );
        let f = AggregateFeatures::of(&job);
        assert_eq!(f.get("depth"), Some(2.0));
        assert_eq!(f.get("n_layers"), Some(6.0));
        assert_eq!(f.get("total_params"), Some(163.0));
        assert_eq!(f.get("total_activations"), Some(46.0));
        assert_eq!(f.get("activations_x_batch"), Some(184.0));
        assert_eq!(f.get("params_x_batch"), Some(652.0));
        assert_eq!(f.get("max_output_size"), Some(10.0));
        assert_eq!(f.get("n_batch_norm"), Some(1.0));
        assert_eq!(f.get("n_dropout"), Some(1.0));
        assert_eq!(f.get("n_activation"), Some(2.0));
        assert_eq!(f.get("act_relu"), Some(1.0));
        assert_eq!(f.get("act_gelu"), Some(0.0));
        assert_eq!(f.get("no_such_feature"), None);
    }

    #[test]
    fn outputs_by_layer_kind_are_summed_per_kind_and_scaled_by_the_batch() {
        let job = job(
            4,
            &[
                ("conv2d", 8, 1),
                ("batch_norm", 8, 2),
                ("relu", 8, 0),
                ("identity", 8, 0),
                ("attention", 5, 0),
                ("other", 7, 3),
                ("linear", 3, 4),
            ],
        );
        let f = AggregateFeatures::of(&job);
        assert_eq!(f.get("conv_outputs_x_batch"), Some(32.0));
        assert_eq!(f.get("norm_outputs_x_batch"), Some(32.0));
        assert_eq!(
            f.get("activation_outputs_x_batch"),
            Some(32.0),
            "identity is no activation here"
        );
        assert_eq!(f.get("attention_outputs_x_batch"), Some(20.0));
        assert_eq!(f.get("other_outputs_x_batch"), Some(28.0));
        assert_eq!(f.get("linear_outputs_x_batch"), Some(12.0));
    }

    #[test]
    fn simulation_features_are_its_byte_counts_in_mib_and_zero_without_one() {
        use crate::job::{SimulatedCategories, UncheckedSimulation};
        let plain = job(4, &[("linear", 10, 110)]);
        let f = AggregateFeatures::of(&plain);
        for name in SIMULATION_FEATURES {
            assert_eq!(f.get(name), Some(0.0), "{name}");
        }
        assert_eq!(f.get("sim_nothing"), None);
        let mib = 1 << 20;
        let simulation = UncheckedSimulation {
            batch_size: 4,
            optimizer: None,
            precision: None,
            allocated_peak_bytes: 15 * mib + 512 * 1024,
            reserved_peak_bytes: 20 * mib,
            min_capacity_bytes: 16 * mib,
            breakdown_at_peak: SimulatedCategories {
                parameters: mib,
                gradients: 2 * mib,
                optimizer_state: 3 * mib,
                activations: 4 * mib,
                temporaries: 5 * mib + 512 * 1024,
            },
            attention: None,
            interpolated: true,
            ..Default::default()
        };
        let f = AggregateFeatures::of(&plain.with_simulation(Some(simulation)).unwrap());
        let values: Vec<f64> = SIMULATION_FEATURES
            .iter()
            .map(|name| f.get(name).unwrap())
            .collect();
        assert_eq!(values, [15.5, 20.0, 16.0, 1.0, 2.0, 3.0, 4.0, 5.5]);
    }

    #[test]
    fn every_named_feature_is_known_once_and_unknown_names_are_not() {
        let f = AggregateFeatures::of(&job(2, &[("linear", 3, 12), ("gelu", 3, 0)]));
        let named = f.named();
        assert_eq!(named.len(), 44);
        let mut names: Vec<&str> = named.iter().map(|(n, _)| n.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), 44, "a name listed twice");
        let value = |name: &str| named.iter().find(|(n, _)| n == name).map(|(_, v)| *v);
        assert_eq!(value("act_gelu"), Some(1.0));
        assert_eq!(value("sim_reserved_mib"), Some(0.0));
        assert_eq!(value("params_x_batch"), Some(24.0));
        assert_eq!(
            f.get("act_softmax"),
            None,
            "an output activation has no one-hot"
        );
    }

    #[test]
    fn hidden_activation_ties_go_to_the_first_seen_and_none_is_identity() {
        let tie = job(
            1,
            &[
                ("linear", 1, 1),
                ("tanh", 1, 0),
                ("gelu", 1, 0),
                ("gelu", 1, 0),
                ("tanh", 1, 0),
            ],
        );
        assert_eq!(hidden_activation(&tie), LayerKind::Tanh);
        let none = job(1, &[("linear", 1, 1), ("softmax", 1, 0), ("sigmoid", 1, 0)]);
        assert_eq!(hidden_activation(&none), LayerKind::Identity);
    }

    #[test]
    fn normalisation_applies_the_transform_then_standardises() {
        let spec = FeatureSpec {
            name: "x".into(),
            transform: Transform::Log1p,
            mean: 1.0,
            std: 2.0,
        };
        assert!((spec.normalise(std::f64::consts::E - 1.0) - 0.0).abs() < 1e-12);
        let spec = FeatureSpec {
            name: "x".into(),
            transform: Transform::Identity,
            mean: 1.0,
            std: 2.0,
        };
        assert_eq!(spec.normalise(5.0), 2.0);
    }

    #[test]
    fn tokens_carry_vocabulary_ids_from_one_and_positions_from_zero_to_one() {
        let job = job(2, &[("linear", 4, 8), ("relu", 4, 0), ("linear", 2, 10)]);
        let specs: Vec<_> = TOKEN_FEATURES
            .iter()
            .map(|n| FeatureSpec {
                name: (*n).into(),
                transform: Transform::Identity,
                mean: 0.0,
                std: 1.0,
            })
            .collect();
        let vocab = [LayerKind::Linear, LayerKind::Relu];
        let tokens =
            TokenFeatures::of(&job, |k| vocab.iter().position(|v| *v == k), &specs).unwrap();
        assert_eq!(tokens.kind_ids, vec![1, 2, 1]);
        assert_eq!(&tokens.features[0..5], &[4.0, 8.0, 2.0, 8.0, 0.0]);
        assert_eq!(&tokens.features[10..15], &[2.0, 10.0, 2.0, 4.0, 1.0]);
        let err =
            TokenFeatures::of(&job, |k| (k == LayerKind::Linear).then_some(0), &specs).unwrap_err();
        assert_eq!(err, (1, LayerKind::Relu));
    }
}
