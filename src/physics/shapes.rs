//! A linear layer's shape, read in one place: the step's memory (LoRA adapters, quantised and
//! factored weights, a tied head's trained copy) and its time (GEMMs, adapter collectives) take
//! it from here, so one layer never has two shapes.

use crate::job::validated::Layer;
use crate::job::LayerDetail;

/// What the step knows of one layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    /// Rows of the layer's GEMM per sample (tokens, output positions).
    pub positions: f64,
    pub inputs: f64,
    pub outputs: f64,
}

/// A linear layer's positions and (in, out): `out_features` when given (positions =
/// output_size / out_features), else one position (an MLP: the output is the features).
pub fn linear_shape(layer: &Layer, detail: Option<&LayerDetail>, seq: Option<f64>) -> Shape {
    let output = layer.output_size.max(1) as f64;
    let params = layer.params.max(1) as f64;
    match detail.and_then(|d| d.out_features) {
        Some(out) => {
            let out = out as f64;
            let inputs = detail
                .and_then(|d| d.in_features)
                .map_or(params / out, |i| i as f64);
            Shape {
                positions: (output / out).max(1.0),
                inputs,
                outputs: out,
            }
        }
        None => {
            // A token model's linear without shapes: the sequence's positions when the output
            // holds them; otherwise the output is the features.
            let positions = seq.filter(|&s| output >= s * 2.0).unwrap_or(1.0);
            let outputs = (output / positions).max(1.0);
            Shape {
                positions,
                inputs: (params / outputs).max(1.0),
                outputs,
            }
        }
    }
}
