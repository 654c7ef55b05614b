//! Transformer jobs from a Hugging Face `config.json` alone (issue 16): the configuration keys
//! of the common architectures (Llama, Mistral, Qwen2, Gemma, Phi-3, Mixtral-style MoE, GPT-2,
//! GPT-NeoX, BERT, T5, ChatGLM) become the layer list `describe` would trace from the model (HF module
//! paths as names, linear shapes, forward FLOPs) and the activations a training step keeps,
//! counted tensor by tensor as autograd saves them with the attention kernel a GPU runs.
//!
//! Untrusted input: every number is bounded, missing essentials are named, unknown keys are
//! ignored, and the layer list stays within [`MAX_LAYERS`] (MoE experts are one fused module
//! each layer, as transformers 5 builds them).

mod bert;
mod chatglm;
mod config;
mod decoder;
mod gpt2;
mod neox;
mod phi;
mod t5;

pub use config::*;

use crate::job::echo;
use crate::job::names::Experts;
use crate::job::setup::LossImplementation;
use crate::job::validated::{Layer, LayerKind, Precision, MAX_LAYERS};
use crate::job::KnownActivations;
use crate::job::LayerDetail;

/// Saved elements per token by storage class; bytes follow the precision ([`Saved::bytes`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Saved {
    /// int64 ids and routing indices.
    pub int64: f64,
    /// One-byte dropout masks.
    pub mask: f64,
    /// Always fp32: log-sum-exps, norm statistics, the loss's upcast logits.
    pub fp32: f64,
    /// The norms' side: fp32 under autocast (norms run in fp32), the storage dtype otherwise.
    pub norm: f64,
    /// Matmul inputs and outputs, MLP intermediates: the compute dtype.
    pub compute: f64,
    /// Kept under autocast only: each linear casts its fp32 input to 16 bits on its own, so
    /// a norm read by n projections is copied n times (once otherwise).
    pub autocast_copies: f64,
}

impl Saved {
    fn add(&mut self, other: Saved) {
        self.int64 += other.int64;
        self.mask += other.mask;
        self.fp32 += other.fp32;
        self.norm += other.norm;
        self.compute += other.compute;
        self.autocast_copies += other.autocast_copies;
    }

    fn scaled(self, by: f64) -> Saved {
        Saved {
            int64: self.int64 * by,
            mask: self.mask * by,
            fp32: self.fp32 * by,
            norm: self.norm * by,
            compute: self.compute * by,
            autocast_copies: self.autocast_copies * by,
        }
    }

    /// Bytes per token at `precision`.
    pub fn bytes(&self, precision: Precision) -> f64 {
        let compute = precision.compute_bytes();
        let norm = if precision.is_autocast() {
            4.0
        } else {
            compute
        };
        let copies = if precision.is_autocast() {
            self.autocast_copies * 2.0
        } else {
            0.0
        };
        self.int64 * 8.0
            + self.mask
            + self.fp32 * 4.0
            + self.norm * norm
            + self.compute * compute
            + copies
    }
}

/// A model built from its configuration: the layers, and what its step keeps per token.
#[derive(Debug, Clone, PartialEq)]
pub struct TransformerModel {
    pub config: TransformerConfig,
    pub seq_len: u64,
    pub layers: Vec<Layer>,
    pub details: Vec<LayerDetail>,
    /// Saved per token outside the repeated blocks (embeddings, final norm, head, loss).
    pub outside: Saved,
    /// Saved per token by all the blocks together.
    pub blocks: Saved,
    /// The repeated blocks.
    pub block_count: u64,
    /// What backward starts with beside the kept tensors, per token: the gradients of the
    /// loss's log-softmax and of the logits (compute dtype).
    pub loss_gradients: f64,
    /// Whether the math path (N x N probabilities) runs.
    pub math_attention: bool,
    pub warnings: Vec<String>,
}

/// A product of bounded sizes that cannot overflow (FLOPs of a hostile configuration saturate,
/// and the job's own limits then refuse them).
fn product(factors: &[u64]) -> u64 {
    factors.iter().fold(1u64, |p, &f| p.saturating_mul(f))
}

/// The module path `prefix.name`. Allocated at its exact length: an 80-layer decoder names
/// ~900 modules, and `format!` would grow each name through the formatting machinery.
fn dotted(prefix: &str, name: &str) -> String {
    let mut path = String::with_capacity(prefix.len() + 1 + name.len());
    path.push_str(prefix);
    path.push('.');
    path.push_str(name);
    path
}

struct Builder {
    seq: u64,
    layers: Vec<Layer>,
    details: Vec<LayerDetail>,
    /// Whether the modules are named and described (`details`): not when the model is built
    /// only for its activations ([`build_unnamed`]), which read neither.
    named: bool,
}

impl Builder {
    /// A block's prefix (`model.layers.7`), made only when the modules are named: unnamed,
    /// nothing (no allocation, no formatting).
    fn prefix(&self, made: impl FnOnce() -> String) -> String {
        if self.named {
            made()
        } else {
            String::new()
        }
    }

    /// The module path `prefix.name` ([`dotted`]), or nothing (no allocation) unnamed.
    fn name(&self, prefix: &str, name: &str) -> String {
        if self.named {
            dotted(prefix, name)
        } else {
            String::new()
        }
    }

    fn push(&mut self, name: String, kind: LayerKind, params: u64, outputs: u64, flops: u64) {
        self.layers.push(Layer {
            kind,
            output_size: outputs.saturating_mul(self.seq),
            params,
        });
        if self.named {
            self.details.push(LayerDetail {
                name: Some(name),
                in_features: None,
                out_features: None,
                flops: Some(flops),
                experts: None,
            });
        }
    }

    /// A mixture of experts' routed experts as one layer (a fused module, as transformers 5
    /// builds them), with what quantising each expert's linears needs (`Experts`).
    fn experts(&mut self, name: String, experts: Experts, routed: u64) {
        let Experts {
            count,
            hidden,
            intermediate,
        } = experts;
        self.push(
            name,
            LayerKind::Other,
            product(&[count, 3, hidden, intermediate]),
            routed * hidden,
            product(&[6, routed, hidden, intermediate, self.seq]),
        );
        if let Some(detail) = self.details.last_mut() {
            detail.experts = Some(experts);
        }
    }

    /// A LayerNorm over `width` features: a weight and a bias.
    fn layer_norm(&mut self, name: String, width: u64) {
        self.push(name, LayerKind::LayerNorm, 2 * width, width, 0);
    }

    /// An RMSNorm over `width` features: a weight alone.
    fn rms_norm(&mut self, name: String, width: u64) {
        self.push(name, LayerKind::RmsNorm, width, width, 0);
    }

    fn linear(&mut self, name: String, inputs: u64, outputs: u64, bias: bool, params: bool) {
        let count = if params {
            inputs * outputs + if bias { outputs } else { 0 }
        } else {
            0
        };
        let flops = product(&[2, inputs, outputs, self.seq]);
        self.layers.push(Layer {
            kind: LayerKind::Linear,
            output_size: outputs * self.seq,
            params: count,
        });
        if self.named {
            self.details.push(LayerDetail {
                name: Some(name),
                in_features: Some(inputs),
                out_features: Some(outputs),
                flops: Some(flops),
                experts: None,
            });
        }
    }
}

/// What every family's body reads: the configuration and the sizes, kernel choices and
/// per-token tensors the step keeps, worked out once per build.
#[derive(Clone, Copy)]
pub(super) struct Shapes<'a> {
    pub c: &'a TransformerConfig,
    pub seq: u64,
    /// Hidden size, tokens, intermediate size, as f64.
    pub h: f64,
    pub l: f64,
    pub i_size: f64,
    /// Query and key/value widths (heads x head dimension).
    pub q: f64,
    pub kv: f64,
    pub heads: f64,
    /// A 16-bit precision (flash attention may run).
    pub sixteen: bool,
    /// Whether the math path (N x N probabilities) runs.
    pub math: bool,
    pub attention_flops: u64,
    /// Pre-norm RMSNorm: its input, the inverse RMS, the normalised output, the matmul's copy.
    pub rms: Saved,
    /// LayerNorm: its input, mean and inverse deviation, the matmul's copy of the output.
    pub layer_norm: Saved,
    /// The language-model loss's fp32 logits.
    pub lm_loss: Saved,
    /// Whether the head has parameters of its own (not tied to the embeddings).
    pub head_params: bool,
}

impl Shapes<'_> {
    /// Attention as the kernel keeps it, per token (the o-projection's input included).
    pub fn attention_saved(&self, kv_width: f64) -> Saved {
        if self.math {
            // q, k and v (repeated to every head), the probabilities (kept by softmax), the
            // output made contiguous for the o-projection; and the probabilities the second
            // matmul reads, a tensor of their own where dropout ran (its mask beside them) or
            // autocast cast them to 16 bits.
            let nn = self.heads * self.l;
            let dropped = dropout(self.c.attention_dropout);
            Saved {
                compute: 4.0 * self.q + dropped * nn,
                norm: nn,
                mask: dropped * nn,
                autocast_copies: (1.0 - dropped) * nn,
                ..Default::default()
            }
        } else {
            Saved {
                compute: 2.0 * self.q + 2.0 * kv_width,
                fp32: self.heads,
                ..Default::default()
            }
        }
    }
}

/// One byte of mask per element where dropout is on.
fn dropout(p: f64) -> f64 {
    if p > 0.0 {
        1.0
    } else {
        0.0
    }
}

/// How a family's body ends.
#[derive(Clone, Copy)]
pub(super) enum Head {
    /// The language-model head to add (its module name, whether it has a bias), or a score
    /// head in its place for a sequence classifier.
    LanguageModel(&'static str, bool),
    /// BERT's masked-LM prediction head, added with its loss by the body.
    Own,
    /// BERT's pooler and classifier, added by the body.
    Classifier,
}

/// A family's body: what its blocks keep per token, how many, and how it ends.
pub(super) struct Body {
    pub blocks: Saved,
    pub block_count: u64,
    pub head: Head,
}

/// Builds the model of `config` at `seq_len` tokens per sample with `precision`'s kernels.
pub fn build(
    config: TransformerConfig,
    seq_len: u64,
    precision: Precision,
    kernel: AttentionKernel,
) -> Result<TransformerModel, ConfigError> {
    build_named(config, seq_len, precision, kernel, true)
}

/// [`build`] without the modules' names and details (`details` is empty): for a model built
/// again only for its activations at another precision or attention kernel
/// ([`TransformerModel::activations_with`] reads no name), at a fraction of the cost.
pub fn build_unnamed(
    config: TransformerConfig,
    seq_len: u64,
    precision: Precision,
    kernel: AttentionKernel,
) -> Result<TransformerModel, ConfigError> {
    build_named(config, seq_len, precision, kernel, false)
}

fn build_named(
    config: TransformerConfig,
    seq_len: u64,
    precision: Precision,
    kernel: AttentionKernel,
    named: bool,
) -> Result<TransformerModel, ConfigError> {
    let c = &config;
    let mut warnings = c.notes.clone();
    let seq = seq_len;
    if seq > c.positions && matches!(c.architecture, Architecture::Gpt2 | Architecture::Bert) {
        return Err(ConfigError(format!(
            "seq_len: {seq} is beyond the model's {} learned positions (n_positions / \
             max_position_embeddings)",
            c.positions
        )));
    }
    let (h, l, i_size, v) = (
        c.hidden as f64,
        seq as f64,
        c.intermediate as f64,
        c.vocab as f64,
    );
    let q = (c.heads * c.head_dim) as f64;
    let kv = (c.kv_heads * c.head_dim) as f64;
    let heads = c.heads as f64;
    let gqa = c.kv_heads != c.heads;
    let sixteen = !matches!(precision, Precision::Fp32 | Precision::Tf32);
    // Flash (16 bits) and memory-efficient attention (fp32) keep q, k, v, the output and a
    // log-sum-exp; both refuse grouped-query attention in fp32, which a GPU then runs on the
    // math path (and T5's relative bias is an additive mask both accept).
    let math = kernel == AttentionKernel::Eager || (gqa && !sixteen);
    if gqa && !sixteen && kernel == AttentionKernel::Auto {
        warnings.push(
            "attention: grouped-query attention in fp32 runs on the math path on a GPU (flash \
             needs 16 bits, memory-efficient attention refuses it): the N x N probabilities \
             are kept"
                .into(),
        );
    }
    let attention_flops = product(&[4, seq, seq, c.heads, c.head_dim]);
    // Room for the modules (other layouts grow the lists as needed); never more than a job may
    // hold, however many blocks are asked.
    let expected = c.modules_hint();
    let mut b = Builder {
        seq,
        layers: Vec::with_capacity(expected),
        details: Vec::with_capacity(if named { expected } else { 0 }),
        named,
    };
    let mut outside = Saved {
        int64: 1.0,
        ..Default::default()
    };
    let s = Shapes {
        c,
        seq,
        h,
        l,
        i_size,
        q,
        kv,
        heads,
        sixteen,
        math,
        attention_flops,
        rms: Saved {
            norm: 2.0 * h,
            fp32: 1.0,
            compute: h,
            ..Default::default()
        },
        layer_norm: Saved {
            norm: h,
            fp32: 2.0,
            compute: h,
            ..Default::default()
        },
        lm_loss: Saved {
            fp32: v,
            ..Default::default()
        },
        head_params: !c.tied,
    };
    let Body {
        blocks,
        block_count,
        head,
    } = match c.architecture {
        Architecture::Decoder => decoder::body(&mut b, &s, &mut outside),
        Architecture::Gpt2 => gpt2::body(&mut b, &s, &mut outside),
        Architecture::GptNeox => neox::body(&mut b, &s, &mut outside),
        Architecture::Phi => phi::body(&mut b, &s, &mut outside),
        Architecture::Bert => bert::body(&mut b, &s, &mut outside),
        Architecture::T5 => t5::body(&mut b, &s, &mut outside),
        Architecture::ChatGlm => chatglm::body(&mut b, &s, &mut outside),
    };
    // The head: the language model's over the vocabulary, or a reward or value model's
    // (`...ForSequenceClassification`): a score over every position, pooled at the last token
    // (T5: a two-layer head on the end-of-sequence token), with its loss over a few labels (a
    // reward model's pairwise loss over one score per sequence).
    let loss_classes = match (head, c.classifier_labels) {
        // BERT's pooler and classifier: their loss over a few labels is counted with them.
        (Head::Classifier, _) => 0.0,
        (_, Some(labels)) if c.architecture == Architecture::T5 => {
            b.linear(
                "classification_head.dense".into(),
                c.hidden,
                c.hidden,
                true,
                true,
            );
            b.linear(
                "classification_head.out_proj".into(),
                c.hidden,
                labels,
                true,
                true,
            );
            let first = b.layers.len() - 2;
            for layer in &mut b.layers[first..] {
                layer.output_size /= seq.max(1);
            }
            labels as f64
        }
        (_, Some(labels)) => {
            b.linear("score".into(), c.hidden, labels, false, true);
            labels as f64
        }
        (Head::LanguageModel(name, bias), None) => {
            b.linear(name.into(), c.hidden, c.vocab, bias, s.head_params);
            outside.add(s.lm_loss);
            v
        }
        (Head::Own, None) => v,
    };
    finish(
        b,
        config,
        seq_len,
        outside,
        blocks,
        block_count,
        math,
        warnings,
        loss_classes,
    )
}

#[allow(clippy::too_many_arguments)]
fn finish(
    b: Builder,
    config: TransformerConfig,
    seq_len: u64,
    outside: Saved,
    blocks: Saved,
    block_count: u64,
    math_attention: bool,
    warnings: Vec<String>,
    loss_classes: f64,
) -> Result<TransformerModel, ConfigError> {
    if b.layers.len() > MAX_LAYERS {
        return Err(ConfigError(format!(
            "the model has {} modules, more than the {MAX_LAYERS} a job may have",
            b.layers.len()
        )));
    }
    Ok(TransformerModel {
        loss_gradients: 2.0 * loss_classes,
        config,
        seq_len,
        layers: b.layers,
        details: b.details,
        outside,
        blocks,
        block_count,
        math_attention,
        warnings,
    })
}

/// Reads `loss_implementation` (absent: the default).
pub fn parse_loss_implementation(raw: Option<&str>) -> Result<LossImplementation, ConfigError> {
    match raw.map(str::to_ascii_lowercase).as_deref() {
        None | Some("upcast_fp32") => Ok(LossImplementation::UpcastFp32),
        Some("chunked") => Ok(LossImplementation::Chunked),
        Some("fused") => Ok(LossImplementation::Fused),
        Some("native") => Ok(LossImplementation::Native),
        Some(other) => Err(ConfigError(format!(
            "loss_implementation: unknown '{}' (known: {})",
            echo(other),
            crate::job::setup::known(&LossImplementation::ALL, LossImplementation::as_str)
        ))),
    }
}

impl TransformerModel {
    pub fn params(&self) -> u64 {
        self.layers.iter().map(|l| l.params).sum()
    }

    /// What the analytic step reads, per sample, at `precision`.
    pub fn activations(&self, precision: Precision) -> KnownActivations {
        self.activations_with(precision, false, LossImplementation::default())
    }

    /// [`TransformerModel::activations`]; `sharded_weights`: FSDP/ZeRO-3 gather 16-bit
    /// weights instead of autocast's cached casts.
    pub fn activations_with(
        &self,
        precision: Precision,
        sharded_weights: bool,
        loss_implementation: LossImplementation,
    ) -> KnownActivations {
        let l = self.seq_len as f64;
        let compute = precision.compute_bytes();
        // A block's input: the residual stream (fp32 under autocast).
        let stream = if precision.is_autocast() {
            4.0
        } else {
            compute
        };
        // The loss: the fp32 log-softmax of the logits; under autocast the 16-bit logits'
        // log-softmax too (describe's simulation, CUDA's cross-entropy under autocast).
        let classes = self.loss_gradients / 2.0;
        // A native loss is the upcast one except where it stays 16-bit: pure 16-bit weights
        // (autocast runs cross-entropy in fp32; fp32 has nothing to upcast).
        let native_16bit = loss_implementation == LossImplementation::Native
            && !precision.is_autocast()
            && compute < 4.0;
        let loss = match loss_implementation {
            LossImplementation::Fused => 0.0,
            // The 16-bit log-softmax.
            _ if native_16bit => classes * compute * l,
            _ => classes * if precision.is_autocast() { 6.0 } else { 4.0 } * l,
        };
        // Autocast keeps a 16-bit copy of every matmul weight for the forward pass.
        let casts = if precision.is_autocast() && !sharded_weights {
            self.layers
                .iter()
                .filter(|layer| matches!(layer.kind, LayerKind::Linear | LayerKind::Other))
                .map(|layer| layer.params as f64 * 2.0)
                .sum::<f64>()
        } else {
            0.0
        };
        let lm = classes * 4.0 * l;
        KnownActivations {
            loss,
            fixed: casts,
            outside: self.outside.bytes(precision) * l - lm + loss,
            per_block: self.blocks.bytes(precision) * l / self.block_count.max(1) as f64,
            blocks: self.block_count,
            block_input: self.config.hidden as f64 * stream * l,
            // Backward starts with the loss's gradients in fp32 (of the log-softmax and of the
            // upcast logits, as Hugging Face's causal-LM loss upcasts them), and in 16 bits
            // the logits' own gradient beside them. (describe's simulation of transformers'
            // current loss holds 8 bytes at once, not 10; the published runs, scored held out,
            // fit 10 better: config median 13.5 % at 10, 15.0 % at 8.)
            // The chunked loss (torchtune's CEWithChunkedOutputLoss) peaks at its own end in
            // forward: the list of every chunk's logits in the compute dtype, held until it
            // returns, and one chunk's fp32 upcast (of 8) beside the kept log-softmax; its
            // backward frees as it goes.
            // A native 16-bit loss starts backward with the 16-bit gradients of the
            // log-softmax and of the logits.
            backward_temporaries: match loss_implementation {
                LossImplementation::Native if native_16bit => classes * 2.0 * compute * l,
                LossImplementation::UpcastFp32 | LossImplementation::Native => {
                    classes * if compute == 4.0 { 8.0 } else { 10.0 } * l
                }
                LossImplementation::Chunked => {
                    classes * (compute + if compute < 4.0 { 4.0 / 8.0 } else { 0.0 }) * l
                }
                // The logits never exist beyond one chunk.
                LossImplementation::Fused => 0.0,
            },
            loss_implementation,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: serde_json::Value) -> Result<TransformerConfig, ConfigError> {
        TransformerConfig::parse(json.as_object().unwrap())
    }

    fn llama() -> serde_json::Value {
        serde_json::json!({
            "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "vocab_size": 32000,
            "torch_dtype": "bfloat16", "unknown_key": [1, 2, 3]
        })
    }

    #[test]
    fn a_model_built_unnamed_has_the_same_layers_and_activations() {
        for kernel in [AttentionKernel::Auto, AttentionKernel::Eager] {
            for precision in [Precision::Bf16, Precision::AmpBf16, Precision::Fp32] {
                let named = build(config(llama()).unwrap(), 512, precision, kernel).unwrap();
                let unnamed =
                    build_unnamed(config(llama()).unwrap(), 512, precision, kernel).unwrap();
                assert_eq!(named.layers, unnamed.layers);
                for loss in [LossImplementation::UpcastFp32, LossImplementation::Fused] {
                    for sharded in [false, true] {
                        assert_eq!(
                            named.activations_with(precision, sharded, loss),
                            unnamed.activations_with(precision, sharded, loss)
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn llama_2_7b_has_its_published_parameter_count_and_hf_module_names() {
        let model = build(
            config(llama()).unwrap(),
            512,
            Precision::Bf16,
            AttentionKernel::Auto,
        )
        .unwrap();
        // 6,738,415,616 parameters (Llama-2-7b-hf).
        assert_eq!(model.params(), 6_738_415_616);
        let names: Vec<&str> = model
            .details
            .iter()
            .filter_map(|d| d.name.as_deref())
            .collect();
        assert!(names.contains(&"model.layers.0.self_attn.q_proj"));
        assert!(names.contains(&"model.layers.31.mlp.down_proj"));
        assert_eq!(names.last(), Some(&"lm_head"));
        assert!(!model.math_attention);
    }

    /// THUDM/chatglm3-6b's config.json (remote code, `model_type: chatglm`).
    fn chatglm3() -> serde_json::Value {
        serde_json::json!({
            "model_type": "chatglm", "architectures": ["ChatGLMModel"],
            "add_bias_linear": false, "add_qkv_bias": true, "ffn_hidden_size": 13696,
            "hidden_size": 4096, "kv_channels": 128, "multi_query_attention": true,
            "multi_query_group_num": 2, "num_attention_heads": 32, "num_layers": 28,
            "padded_vocab_size": 65024, "vocab_size": 65024, "rmsnorm": true,
            "seq_length": 8192, "hidden_dropout": 0.0, "attention_dropout": 0.0
        })
    }

    #[test]
    fn chatglm_has_its_fused_projections_and_the_published_size() {
        let model = build(
            config(chatglm3()).unwrap(),
            1024,
            Precision::Bf16,
            AttentionKernel::Auto,
        )
        .unwrap();
        let shape = |name: &str| {
            model
                .details
                .iter()
                .zip(&model.layers)
                .find(|(d, _)| d.name.as_deref() == Some(name))
                .map(|(d, l)| (d.in_features, d.out_features, l.params))
                .unwrap_or_else(|| panic!("{name} not built"))
        };
        // 32 query heads and 2 key/value groups of 128, with their biases.
        assert_eq!(
            shape("transformer.encoder.layers.0.self_attention.query_key_value"),
            (Some(4096), Some(4608), 4096 * 4608 + 4608)
        );
        assert_eq!(
            shape("transformer.encoder.layers.27.mlp.dense_h_to_4h"),
            (Some(4096), Some(2 * 13696), 4096 * 2 * 13696)
        );
        assert_eq!(
            shape("transformer.output_layer"),
            (Some(4096), Some(65024), 4096 * 65024)
        );
        // The model card's 6.24 B parameters.
        let billions = model.params() as f64 / 1e9;
        assert!((6.235..6.245).contains(&billions), "{billions}");
        // Without multi-query attention every head has its own keys and values.
        let mut mha = chatglm3();
        mha["multi_query_attention"] = serde_json::json!(false);
        assert_eq!(config(mha).unwrap().kv_heads, 32);
        // The first ChatGLM-6B (another layout) is named, not guessed.
        let mut first = chatglm3();
        first.as_object_mut().unwrap().remove("ffn_hidden_size");
        assert!(config(first).unwrap_err().0.contains("ffn_hidden_size"));
    }

    #[test]
    fn missing_essentials_are_named_and_numbers_bounded() {
        let err =
            config(serde_json::json!({"model_type": "llama", "hidden_size": 64})).unwrap_err();
        for key in [
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
            "intermediate_size",
        ] {
            assert!(err.0.contains(key), "{err}");
        }
        let mut big = llama();
        big["num_hidden_layers"] = serde_json::json!(100_000);
        assert!(config(big).unwrap_err().0.starts_with("num_hidden_layers"));
        let mut fraction = llama();
        fraction["hidden_size"] = serde_json::json!(4096.5);
        assert!(config(fraction).unwrap_err().0.starts_with("hidden_size"));
        let mut gqa = llama();
        gqa["num_key_value_heads"] = serde_json::json!(5);
        assert!(config(gqa)
            .unwrap_err()
            .0
            .starts_with("num_key_value_heads"));
    }

    #[test]
    fn grouped_query_attention_in_fp32_or_eager_keeps_the_n_by_n_probabilities() {
        let mut gqa = llama();
        gqa["num_key_value_heads"] = serde_json::json!(8);
        let at = |precision, kernel| {
            build(config(gqa.clone()).unwrap(), 1024, precision, kernel)
                .unwrap()
                .activations(precision)
                .per_block
        };
        let flash = at(Precision::Bf16, AttentionKernel::Auto);
        let eager = at(Precision::Bf16, AttentionKernel::Eager);
        // 32 heads x 1024 x 1024 probabilities in 16 bits, per sample.
        assert!(
            eager - flash > 32.0 * 1024.0 * 1024.0 * 2.0,
            "{flash} {eager}"
        );
        let model = build(
            config(gqa).unwrap(),
            1024,
            Precision::Fp32,
            AttentionKernel::Auto,
        )
        .unwrap();
        assert!(model.math_attention);
        assert!(model.warnings.iter().any(|w| w.contains("math path")));
    }

    /// BERT-large in fp32 on the math path, as transformers 4.x trained it: a trace of its
    /// step (saved-tensor hooks, one block at 512 tokens) holds three 16 x 512 x 512 fp32
    /// tensors a block (probabilities, dropout's noise, the dropped probabilities the second
    /// matmul reads); a GPU's dropout keeps a one-byte mask for the noise.
    #[test]
    fn eager_attention_with_dropout_keeps_the_dropped_probabilities_too() {
        let bert = |dropout: f64| {
            config(serde_json::json!({
                "model_type": "bert", "hidden_size": 1024, "intermediate_size": 4096,
                "num_hidden_layers": 24, "num_attention_heads": 16, "vocab_size": 30522,
                "attention_probs_dropout_prob": dropout
            }))
            .unwrap()
        };
        let per_block = |dropout, precision| {
            build(bert(dropout), 512, precision, AttentionKernel::Eager)
                .unwrap()
                .activations(precision)
                .per_block
        };
        let nn = 16.0 * 512.0 * 512.0;
        let fp32 = per_block(0.1, Precision::Fp32) - per_block(0.0, Precision::Fp32);
        assert_eq!(fp32, nn * (4.0 + 1.0), "the dropped fp32 copy and its mask");
        // Without dropout, autocast still casts the fp32 probabilities to 16 bits for the
        // matmul; the cast dropped probabilities replace that copy.
        let amp = per_block(0.1, Precision::AmpFp16) - per_block(0.0, Precision::AmpFp16);
        assert_eq!(amp, nn * 1.0, "the mask");
    }

    #[test]
    fn the_largest_accepted_sizes_do_not_overflow() {
        let huge = serde_json::json!({
            "model_type": "mixtral", "hidden_size": 65536, "intermediate_size": 262144,
            "num_hidden_layers": 2, "num_attention_heads": 4096, "vocab_size": 1048576,
            "num_local_experts": 512, "num_experts_per_tok": 512
        });
        let model = build(
            config(huge).unwrap(),
            1_000_000,
            Precision::Fp32,
            AttentionKernel::Eager,
        )
        .unwrap();
        assert!(model.activations(Precision::Fp32).per_block.is_finite());
    }
}
