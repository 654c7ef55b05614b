//! The aggregate estimators evaluated in process: ensembles of small MLPs read as plain weight
//! arrays (`models/*.weights.json`, written by training from the graph it exported:
//! `training/gpucast_training/weights.py` documents the format), no ONNX read here.
//!
//! Why not ONNX Runtime for these: it costs about 0.4 us a node whatever the node does, so a
//! 19-node regressor took 13 us and a 36-node utilization head 12 us of an estimate whose
//! physics takes 2. Here each row is evaluated alone, so a job's answer never depends on the
//! jobs batched with it, and every sum runs in the order the exported graph's ops ran it in
//! gpucast's earlier evaluator of those graphs, so answers kept their bits. The tests of `load`
//! check every committed weights file against ONNX Runtime's run of the graph it came from.

use serde::Deserialize;

use super::onnx::{InferenceError, Model, ModelInput};

/// The `format` and `version` this build reads.
pub const FORMAT: &str = "gpucast-mlp-ensemble";
pub const VERSION: u32 = 1;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Document {
    format: String,
    version: u32,
    inputs: usize,
    #[serde(default)]
    linear_scale: Option<LinearScale>,
    members: Vec<MemberDocument>,
    head: HeadDocument,
}

/// The linear-scale view of some log-scaled count features: `(exp(x[c] * std + mean) - 1) /
/// scale`, appended to the row the members read.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LinearScale {
    columns: Vec<usize>,
    means: Vec<f32>,
    stds: Vec<f32>,
    scales: Vec<f32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MemberDocument {
    #[serde(default)]
    input_mask: Option<Vec<f32>>,
    layers: Vec<Dense>,
    #[serde(default)]
    linear: Option<Linear>,
    #[serde(default)]
    spread: Option<f32>,
}

/// One dense layer, `weights` row-major `[inputs][outputs]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Dense {
    inputs: usize,
    outputs: usize,
    weights: Vec<f32>,
    bias: Vec<f32>,
}

/// A linear map of the linear-scale view to one value.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Linear {
    weights: Vec<f32>,
    bias: f32,
}

/// The raw base feature a residual head adds to: `x[feature] * std + mean`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
struct Base {
    feature: usize,
    mean: f32,
    std: f32,
}

/// The base of the capped residual: `ln(max(exp(x[feature] * std + mean) - 1, floor) + context)`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
struct LogBase {
    feature: usize,
    mean: f32,
    std: f32,
    floor: f32,
    context: f32,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
enum HeadDocument {
    Sigmoid,
    Residual {
        base: Base,
    },
    CappedResidual {
        base: LogBase,
        cap: f32,
    },
    OrdinalLearnedSpread {
        bins: Vec<f32>,
        base: Base,
        threshold: f32,
        add: f32,
        floor: f32,
    },
    OrdinalFixedSpread {
        bins: Vec<f32>,
    },
}

/// How a member's outputs become its share of the answer (the answer is their mean).
#[derive(Debug)]
enum Head {
    /// `sigmoid(y[0])`.
    Sigmoid,
    /// `base + tanh(y[0])`.
    Residual { base: Base },
    /// `log base + tanh(y[0] / cap) * cap`.
    CappedResidual { base: LogBase, cap: f32 },
    /// Class probabilities between `bins` around `base + y[0]`, spread by `y[1]`.
    OrdinalLearnedSpread {
        bins: Vec<f32>,
        base: Base,
        threshold: f32,
        add: f32,
        floor: f32,
    },
    /// Class probabilities between `bins` around the member's linear map plus `y[0]`, spread by
    /// the member's own constant.
    OrdinalFixedSpread { bins: Vec<f32> },
}

#[derive(Debug)]
struct Member {
    input_mask: Option<Vec<f32>>,
    layers: Vec<Dense>,
    /// The ordinal head's linear map and spread (`OrdinalFixedSpread` only).
    linear: Option<Linear>,
    spread: f32,
}

/// One aggregate model's weights, ready to evaluate row by row.
#[derive(Debug)]
pub struct FeedForward {
    inputs: usize,
    linear_scale: Option<LinearScale>,
    members: Vec<Member>,
    head: Head,
}

type Fallible<T> = Result<T, String>;

fn check(condition: bool, why: impl FnOnce() -> String) -> Fallible<()> {
    if condition {
        Ok(())
    } else {
        Err(why())
    }
}

fn all_finite(values: &[f32]) -> bool {
    values.iter().all(|v| v.is_finite())
}

impl FeedForward {
    /// Reads a weights file. `Err` says why the evaluator cannot run it.
    pub fn from_weights(bytes: &[u8]) -> Fallible<FeedForward> {
        let document: Document = serde_json::from_slice(bytes)
            .map_err(|e| format!("not a weights file of this build: {e}"))?;
        check(document.format == FORMAT, || {
            format!("format '{}', not '{FORMAT}'", document.format)
        })?;
        check(document.version == VERSION, || {
            format!(
                "format version {}, this build reads {VERSION}",
                document.version
            )
        })?;
        let inputs = document.inputs;
        check(inputs > 0, || "no inputs".into())?;
        let view = match &document.linear_scale {
            None => 0,
            Some(scale) => {
                let n = scale.columns.len();
                check(
                    scale.means.len() == n && scale.stds.len() == n && scale.scales.len() == n,
                    || "linear_scale: columns, means, stds and scales differ in length".into(),
                )?;
                check(scale.columns.iter().all(|&c| c < inputs), || {
                    format!("linear_scale: a column past the {inputs} inputs")
                })?;
                check(
                    all_finite(&scale.means)
                        && all_finite(&scale.stds)
                        && all_finite(&scale.scales),
                    || "linear_scale: a value that is not finite".into(),
                )?;
                n
            }
        };
        let head = match document.head {
            HeadDocument::Sigmoid => Head::Sigmoid,
            HeadDocument::Residual { base } => Head::Residual { base },
            HeadDocument::CappedResidual { base, cap } => Head::CappedResidual { base, cap },
            HeadDocument::OrdinalLearnedSpread {
                bins,
                base,
                threshold,
                add,
                floor,
            } => Head::OrdinalLearnedSpread {
                bins,
                base,
                threshold,
                add,
                floor,
            },
            HeadDocument::OrdinalFixedSpread { bins } => Head::OrdinalFixedSpread { bins },
        };
        let base_feature = match &head {
            Head::Residual { base } | Head::OrdinalLearnedSpread { base, .. } => Some(base.feature),
            Head::CappedResidual { base, .. } => Some(base.feature),
            Head::Sigmoid | Head::OrdinalFixedSpread { .. } => None,
        };
        check(base_feature.is_none_or(|f| f < inputs), || {
            format!("the head's base feature is past the {inputs} inputs")
        })?;
        let (member_outputs, fixed_spread) = match &head {
            Head::Sigmoid | Head::Residual { .. } | Head::CappedResidual { .. } => (1, false),
            Head::OrdinalLearnedSpread { bins, .. } => {
                check(!bins.is_empty(), || "an ordinal head without bins".into())?;
                (2, false)
            }
            Head::OrdinalFixedSpread { bins } => {
                check(!bins.is_empty(), || "an ordinal head without bins".into())?;
                check(view > 0, || {
                    "a fixed-spread ordinal head reads the linear-scale view, and there is none"
                        .into()
                })?;
                (1, true)
            }
        };
        check(!document.members.is_empty(), || "no members".into())?;
        let mut members = Vec::with_capacity(document.members.len());
        for (k, member) in document.members.into_iter().enumerate() {
            let at = |why: String| format!("member {k}: {why}");
            if let Some(mask) = &member.input_mask {
                check(mask.len() == inputs, || {
                    at(format!(
                        "an input mask of {} for {inputs} inputs",
                        mask.len()
                    ))
                })?;
            }
            check(!member.layers.is_empty(), || at("no layers".into()))?;
            let mut width = inputs + view;
            for (i, layer) in member.layers.iter().enumerate() {
                check(layer.inputs == width, || {
                    at(format!(
                        "layer {i} reads {} values, it is fed {width}",
                        layer.inputs
                    ))
                })?;
                check(
                    layer.weights.len() == layer.inputs * layer.outputs
                        && layer.bias.len() == layer.outputs
                        && layer.outputs > 0,
                    || at(format!("layer {i}: weights or bias of the wrong length")),
                )?;
                check(
                    all_finite(&layer.weights) && all_finite(&layer.bias),
                    || at(format!("layer {i}: a value that is not finite")),
                )?;
                width = layer.outputs;
            }
            check(width == member_outputs, || {
                at(format!("{width} outputs, the head reads {member_outputs}"))
            })?;
            let spread = match (fixed_spread, &member.linear, member.spread) {
                (true, Some(linear), Some(spread)) => {
                    check(linear.weights.len() == view, || {
                        at(format!(
                            "a linear map of {} weights for a view of {view}",
                            linear.weights.len()
                        ))
                    })?;
                    spread
                }
                (false, None, None) => 1.0,
                _ => return Err(at(
                    "a linear map and a spread are the fixed-spread ordinal head's, and only its"
                        .into(),
                )),
            };
            members.push(Member {
                input_mask: member.input_mask,
                layers: member.layers,
                linear: member.linear,
                spread,
            });
        }
        Ok(FeedForward {
            inputs,
            linear_scale: document.linear_scale,
            members,
            head,
        })
    }

    /// How many features a row holds.
    pub fn inputs(&self) -> usize {
        self.inputs
    }

    /// How many values the answer of a row holds.
    fn outputs(&self) -> usize {
        match &self.head {
            Head::Sigmoid | Head::Residual { .. } | Head::CappedResidual { .. } => 1,
            Head::OrdinalLearnedSpread { bins, .. } | Head::OrdinalFixedSpread { bins } => {
                bins.len() + 1
            }
        }
    }

    /// The answer for one row, appended to `out`.
    fn evaluate_row(&self, row: &[f32], out: &mut Vec<f32>) {
        // The linear-scale view, appended to the row the members read.
        let mut extended;
        let mut view: &[f32] = &[];
        let mut read: &[f32] = row;
        if let Some(scale) = &self.linear_scale {
            extended = Vec::with_capacity(row.len() + scale.columns.len());
            extended.extend_from_slice(row);
            for (i, &c) in scale.columns.iter().enumerate() {
                let raw = (row[c] * scale.stds[i] + scale.means[i]).exp() - 1.0;
                extended.push(raw / scale.scales[i]);
            }
            view = &extended[row.len()..];
            read = &extended;
        }
        let n = self.outputs();
        let mut sums = vec![0.0f32; n];
        let mut masked = Vec::new();
        let mut share = vec![0.0f32; n];
        for member in &self.members {
            let input = match &member.input_mask {
                Some(mask) => {
                    masked.clear();
                    masked.extend(read.iter().zip(mask).map(|(&x, &m)| x * m));
                    masked.as_slice()
                }
                None => read,
            };
            let y = member.forward(input);
            self.head_of(member, row, view, &y, &mut share);
            for (sum, &v) in sums.iter_mut().zip(&share) {
                *sum += v;
            }
        }
        let count = self.members.len() as f32;
        out.extend(sums.into_iter().map(|s| s / count));
    }

    /// One member's share of the answer from its outputs `y`, into `share`.
    fn head_of(&self, member: &Member, row: &[f32], view: &[f32], y: &[f32], share: &mut [f32]) {
        match &self.head {
            Head::Sigmoid => share[0] = sigmoid(y[0]),
            Head::Residual { base } => share[0] = base.of(row) + y[0].tanh(),
            Head::CappedResidual { base, cap } => {
                let raw = (row[base.feature] * base.std + base.mean).exp() - 1.0;
                let log_base = (raw.max(base.floor) + base.context).ln();
                share[0] = log_base + (y[0] / cap).tanh() * cap;
            }
            Head::OrdinalLearnedSpread {
                bins,
                base,
                threshold,
                add,
                floor,
            } => {
                let centre = base.of(row) + y[0];
                let raw = y[1];
                let spread = (if raw > *threshold { raw } else { softplus(raw) }) + add;
                ordinal(bins, centre, spread, share);
                share.iter_mut().for_each(|p| *p = p.max(*floor));
            }
            Head::OrdinalFixedSpread { bins } => {
                let linear = member.linear.as_ref().expect("checked at load");
                let dot = view
                    .iter()
                    .zip(&linear.weights)
                    .fold(0.0f32, |sum, (&x, &w)| sum + x * w);
                let centre = (dot + linear.bias) + y[0];
                ordinal(bins, centre, member.spread, share);
            }
        }
    }
}

impl Base {
    fn of(&self, row: &[f32]) -> f32 {
        row[self.feature] * self.std + self.mean
    }
}

impl Member {
    /// The member's MLP on `input`: SiLU after every layer but the last.
    fn forward(&self, input: &[f32]) -> Vec<f32> {
        let mut x = input.to_vec();
        let last = self.layers.len() - 1;
        for (i, layer) in self.layers.iter().enumerate() {
            let mut y = vec![0.0f32; layer.outputs];
            row_times_matrix(&x, &layer.weights, &mut y);
            for (v, &b) in y.iter_mut().zip(&layer.bias) {
                *v += b;
                if i < last {
                    *v *= sigmoid(*v);
                }
            }
            x = y;
        }
        x
    }
}

fn sigmoid(v: f32) -> f32 {
    1.0 / (1.0 + (-v).exp())
}

/// log(1 + e^v) without overflow for large v.
fn softplus(v: f32) -> f32 {
    if v > 0.0 {
        v + (-v).exp().ln_1p()
    } else {
        v.exp().ln_1p()
    }
}

/// The mass of each class between `bins` (and below the first, above the last) of a logistic
/// around `centre`: `[cdf, 1] - [0, cdf]`.
fn ordinal(bins: &[f32], centre: f32, spread: f32, share: &mut [f32]) {
    let mut below = 0.0f32;
    for (p, &bin) in share.iter_mut().zip(bins) {
        let cdf = sigmoid((bin - centre) / spread);
        *p = cdf - below;
        below = cdf;
    }
    share[bins.len()] = 1.0 - below;
}

impl Model for FeedForward {
    fn infer(&self, input: ModelInput<'_>) -> Result<Vec<f32>, InferenceError> {
        let ModelInput::Aggregate { rows, n_rows } = input else {
            return Err(InferenceError(
                "the in-process evaluator reads aggregate features".into(),
            ));
        };
        if n_rows == 0 {
            return Ok(Vec::new());
        }
        if rows.len() != n_rows * self.inputs {
            return Err(InferenceError(format!(
                "{} features for {n_rows} rows of {}",
                rows.len(),
                self.inputs
            )));
        }
        let mut out = Vec::with_capacity(n_rows * self.outputs());
        for row in rows.chunks_exact(self.inputs) {
            self.evaluate_row(row, &mut out);
        }
        Ok(out)
    }
}

/// `out += row B`, B row-major `[row.len(), out.len()]`: each output sums its products in
/// the order of `row`, whatever the width of the vector unit (and never fused into one
/// rounding), so every machine gets the same bits; the widest unit the CPU has does it.
fn row_times_matrix(row: &[f32], b: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, checked just above.
            return unsafe { row_times_matrix_avx512(row, b, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just above.
            return unsafe { row_times_matrix_avx2(row, b, out) };
        }
    }
    row_times_matrix_any(row, b, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn row_times_matrix_avx512(row: &[f32], b: &[f32], out: &mut [f32]) {
    row_times_matrix_any(row, b, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn row_times_matrix_avx2(row: &[f32], b: &[f32], out: &mut [f32]) {
    row_times_matrix_any(row, b, out)
}

#[inline(always)]
fn row_times_matrix_any(row: &[f32], b: &[f32], out: &mut [f32]) {
    let n = out.len();
    if n == 1 {
        // One output: a dot product, summed in the same order.
        out[0] = row.iter().zip(b).fold(out[0], |sum, (&x, &y)| sum + x * y);
        return;
    }
    // Sixteen outputs at a time, kept in registers across the whole row rather than stored
    // and loaded again for every product.
    const LANES: usize = 16;
    let mut start = 0;
    while start < n {
        let width = LANES.min(n - start);
        let mut sums = [0.0f32; LANES];
        sums[..width].copy_from_slice(&out[start..start + width]);
        if width == LANES {
            for (p, &x) in row.iter().enumerate() {
                let b_part: &[f32; LANES] = b[p * n + start..p * n + start + LANES]
                    .try_into()
                    .expect("sixteen values");
                for (sum, &y) in sums.iter_mut().zip(b_part) {
                    *sum += x * y;
                }
            }
        } else {
            for (p, &x) in row.iter().enumerate() {
                for (sum, &y) in sums[..width]
                    .iter_mut()
                    .zip(&b[p * n + start..p * n + start + width])
                {
                    *sum += x * y;
                }
            }
        }
        out[start..start + width].copy_from_slice(&sums[..width]);
        start += width;
    }
}

#[cfg(test)]
mod tests;
