//! Transformer jobs from a Hugging Face `config.json` alone (issue 16): the configuration keys
//! of the common architectures (Llama, Mistral, Qwen2, Gemma, Phi-3, Mixtral-style MoE, GPT-2,
//! GPT-NeoX, BERT, T5) become the layer list `describe` would trace from the model (HF module
//! paths as names, linear shapes, forward FLOPs) and the activations a training step keeps,
//! counted tensor by tensor as autograd saves them with the attention kernel a GPU runs.
//!
//! Untrusted input: every number is bounded, missing essentials are named, unknown keys are
//! ignored, and the layer list stays within [`MAX_LAYERS`] (MoE experts are one fused module
//! each layer, as transformers 5 builds them).

use serde_json::{Map, Value};

use crate::job::echo;
use crate::job::setup::LossImplementation;
use crate::job::validated::{KnownActivations, Layer, LayerKind, Precision, MAX_LAYERS};
use crate::job::LayerDetail;

/// Most layers (blocks) a configuration may have.
pub const MAX_CONFIG_LAYERS: u64 = 512;
/// Widest hidden size, head count x head dimension and intermediate size accepted.
pub const MAX_HIDDEN: u64 = 65_536;
/// Largest intermediate (feed-forward) size accepted.
pub const MAX_INTERMEDIATE: u64 = 262_144;
/// Largest vocabulary accepted.
pub const MAX_VOCAB: u64 = 1_048_576;
/// Most experts accepted.
pub const MAX_EXPERTS: u64 = 512;
/// Most attention heads accepted.
pub const MAX_HEADS: u64 = 4096;
/// Longest position table accepted.
pub const MAX_POSITIONS: u64 = 1 << 21;

/// Why a configuration cannot be read: the message names the key.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("transformer_config: {0}")]
pub struct ConfigError(pub String);

/// The attention kernel asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKernel {
    /// What a GPU picks through `scaled_dot_product_attention`: flash or memory-efficient
    /// (no N x N tensors), the math path only where both refuse (grouped-query attention in
    /// fp32).
    Auto,
    /// `attn_implementation="eager"`: the N x N probabilities are kept.
    Eager,
}

impl AttentionKernel {
    pub fn parse(raw: Option<&str>) -> Result<AttentionKernel, ConfigError> {
        match raw.map(str::to_ascii_lowercase).as_deref() {
            None | Some("sdpa" | "flash" | "flash_attention_2" | "efficient" | "auto") => {
                Ok(AttentionKernel::Auto)
            }
            Some("eager" | "math") => Ok(AttentionKernel::Eager),
            Some(other) => Err(ConfigError(format!(
                "attention: unknown kernel '{}' (known: sdpa, flash, efficient, eager, math)",
                echo(other)
            ))),
        }
    }
}

/// The architecture families whose module layout is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Llama, Mistral, Qwen2, Gemma, Phi-3, Mixtral, ...: pre-RMSNorm decoder, rotary, gated MLP.
    Decoder,
    Gpt2,
    GptNeox,
    /// Phi-1/Phi-2: one LayerNorm read by attention and MLP in parallel, GELU MLP.
    Phi,
    Bert,
    T5,
}

impl Architecture {
    pub fn as_str(self) -> &'static str {
        match self {
            Architecture::Decoder => "decoder",
            Architecture::Gpt2 => "gpt2",
            Architecture::GptNeox => "gpt_neox",
            Architecture::Phi => "phi",
            Architecture::Bert => "bert",
            Architecture::T5 => "t5",
        }
    }
}

/// A configuration read and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct TransformerConfig {
    pub model_type: String,
    pub architecture: Architecture,
    pub hidden: u64,
    pub layers: u64,
    /// T5's decoder layers (0 elsewhere).
    pub decoder_layers: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub intermediate: u64,
    pub vocab: u64,
    pub tied: bool,
    pub positions: u64,
    pub experts: u64,
    pub experts_per_token: u64,
    /// A gated MLP (gate and up projections).
    pub gated: bool,
    /// Phi-3's fused qkv_proj and gate_up_proj.
    pub fused: bool,
    /// Biases on the q/k/v projections (Qwen2, `attention_bias`).
    pub qkv_bias: bool,
    pub mlp_bias: bool,
    /// GPT-2's tanh GELU written out in Python (`gelu_new`): five saved tensors, not two.
    pub python_gelu: bool,
    pub attention_dropout: f64,
    pub hidden_dropout: f64,
    pub type_vocab: u64,
    pub relative_buckets: u64,
    pub parallel_residual: bool,
    /// A sequence-classification head (`...ForSequenceClassification`) with this many labels
    /// instead of the language-model head.
    pub classifier_labels: Option<u64>,
    /// What was assumed to read the configuration.
    pub notes: Vec<String>,
}

fn number(
    config: &Map<String, Value>,
    keys: &[&str],
) -> Result<Option<(String, f64)>, ConfigError> {
    for key in keys {
        match config.get(*key) {
            None | Some(Value::Null) => continue,
            Some(Value::Number(n)) => {
                let v = n.as_f64().unwrap_or(f64::NAN);
                if !v.is_finite() {
                    return Err(ConfigError(format!("{key}: not a finite number")));
                }
                return Ok(Some((key.to_string(), v)));
            }
            Some(_) => return Err(ConfigError(format!("{key}: must be a number"))),
        }
    }
    Ok(None)
}

fn whole(
    config: &Map<String, Value>,
    keys: &[&str],
    min: u64,
    max: u64,
) -> Result<Option<u64>, ConfigError> {
    let Some((key, v)) = number(config, keys)? else {
        return Ok(None);
    };
    if v.fract() != 0.0 || v < min as f64 || v > max as f64 {
        return Err(ConfigError(format!(
            "{key}: must be a whole number from {min} to {max}, got {v}"
        )));
    }
    Ok(Some(v as u64))
}

fn flag(config: &Map<String, Value>, key: &str) -> Result<Option<bool>, ConfigError> {
    match config.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ConfigError(format!("{key}: must be true or false"))),
    }
}

fn text<'a>(config: &'a Map<String, Value>, keys: &[&str]) -> Option<&'a str> {
    keys.iter()
        .find_map(|k| config.get(*k).and_then(Value::as_str))
}

fn probability(
    config: &Map<String, Value>,
    keys: &[&str],
    default: f64,
) -> Result<f64, ConfigError> {
    match number(config, keys)? {
        None => Ok(default),
        Some((_, v)) if (0.0..1.0).contains(&v) => Ok(v),
        Some((key, v)) => Err(ConfigError(format!("{key}: must be in [0, 1), got {v}"))),
    }
}

impl TransformerConfig {
    /// Reads a `config.json` object. Unknown keys are ignored; missing essentials are named.
    pub fn parse(config: &Map<String, Value>) -> Result<TransformerConfig, ConfigError> {
        let mut notes = Vec::new();
        let declared = text(config, &["model_type"]).map(str::to_ascii_lowercase);
        let architectures = config
            .get("architectures")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_ascii_lowercase();
        let model_type = match declared {
            Some(t) => t,
            None if config.contains_key("n_embd") => "gpt2".into(),
            None if config.contains_key("d_model") && config.contains_key("d_ff") => "t5".into(),
            None if architectures.starts_with("bert") || architectures.starts_with("roberta") => {
                "bert".into()
            }
            None => {
                notes.push(
                    "transformer_config.model_type: not given; read as a Llama-style decoder"
                        .into(),
                );
                "llama".into()
            }
        };
        let architecture = match model_type.as_str() {
            "gpt2" => Architecture::Gpt2,
            "gpt_neox" => Architecture::GptNeox,
            "phi" => Architecture::Phi,
            "bert" | "roberta" | "xlm-roberta" | "camembert" => Architecture::Bert,
            "t5" | "mt5" | "umt5" => Architecture::T5,
            "llama" | "mistral" | "qwen2" | "qwen3" | "gemma" | "phi3" | "mixtral"
            | "qwen2_moe" | "qwen3_moe" | "olmo" | "granite" | "yi" | "internlm2" | "codellama" => {
                Architecture::Decoder
            }
            other => {
                notes.push(format!(
                    "transformer_config.model_type: '{}' is not one of the architectures gpucast \
                     builds; read as a Llama-style decoder (pre-RMSNorm, rotary, gated MLP)",
                    echo(other)
                ));
                Architecture::Decoder
            }
        };
        let mut missing: Vec<&str> = Vec::new();
        let hidden = whole(config, &["hidden_size", "n_embd", "d_model"], 1, MAX_HIDDEN)?;
        let layers = whole(
            config,
            &["num_hidden_layers", "n_layer", "num_layers"],
            1,
            MAX_CONFIG_LAYERS,
        )?;
        let heads = whole(
            config,
            &["num_attention_heads", "n_head", "num_heads"],
            1,
            MAX_HEADS,
        )?;
        let vocab = whole(config, &["vocab_size"], 1, MAX_VOCAB)?;
        if hidden.is_none() {
            missing.push("hidden_size (or n_embd, d_model)");
        }
        if layers.is_none() {
            missing.push("num_hidden_layers (or n_layer, num_layers)");
        }
        if heads.is_none() {
            missing.push("num_attention_heads (or n_head, num_heads)");
        }
        if vocab.is_none() {
            missing.push("vocab_size");
        }
        let intermediate = whole(
            config,
            &["intermediate_size", "n_inner", "d_ff", "ffn_dim"],
            1,
            MAX_INTERMEDIATE,
        )?;
        if intermediate.is_none() && architecture == Architecture::Decoder {
            missing.push("intermediate_size");
        }
        if !missing.is_empty() {
            return Err(ConfigError(format!(
                "missing {} (model_type {})",
                missing.join(", "),
                echo(&model_type)
            )));
        }
        let (hidden, layers, heads, vocab) = (
            hidden.unwrap_or(1),
            layers.unwrap_or(1),
            heads.unwrap_or(1),
            vocab.unwrap_or(1),
        );
        let intermediate = intermediate.unwrap_or(4 * hidden);
        let head_dim = match whole(config, &["head_dim", "d_kv"], 1, MAX_HIDDEN)? {
            Some(d) => d,
            None => {
                if hidden % heads != 0 {
                    return Err(ConfigError(format!(
                        "num_attention_heads: {heads} does not divide the hidden size {hidden} \
                         (give head_dim)"
                    )));
                }
                hidden / heads
            }
        };
        if heads * head_dim > MAX_HIDDEN {
            return Err(ConfigError(format!(
                "num_attention_heads x head_dim: must be at most {MAX_HIDDEN}, got {}",
                heads * head_dim
            )));
        }
        let kv_heads = whole(
            config,
            &["num_key_value_heads", "multi_query_group_num"],
            1,
            heads,
        )?
        .unwrap_or(heads);
        if heads % kv_heads != 0 {
            return Err(ConfigError(format!(
                "num_key_value_heads: {kv_heads} does not divide num_attention_heads {heads}"
            )));
        }
        let decoder_layers = if architecture == Architecture::T5 {
            whole(config, &["num_decoder_layers"], 1, MAX_CONFIG_LAYERS)?.unwrap_or(layers)
        } else {
            0
        };
        let experts = whole(
            config,
            &["num_local_experts", "num_experts", "n_routed_experts"],
            0,
            MAX_EXPERTS,
        )?
        .unwrap_or(0);
        let experts_per_token = if experts > 1 {
            whole(
                config,
                &["num_experts_per_tok", "moe_top_k", "top_k"],
                1,
                experts,
            )?
            .unwrap_or(2)
        } else {
            0
        };
        let experts = if experts > 1 { experts } else { 0 };
        let intermediate = if experts > 0 {
            whole(config, &["moe_intermediate_size"], 1, MAX_INTERMEDIATE)?.unwrap_or(intermediate)
        } else {
            intermediate
        };
        let act = text(
            config,
            &[
                "hidden_activation",
                "hidden_act",
                "activation_function",
                "feed_forward_proj",
            ],
        )
        .unwrap_or(match architecture {
            Architecture::Decoder => "silu",
            Architecture::Gpt2 | Architecture::Phi => "gelu_new",
            Architecture::T5 => "relu",
            _ => "gelu",
        })
        .to_ascii_lowercase();
        let gated = match architecture {
            Architecture::Decoder => true,
            Architecture::T5 => act.starts_with("gated"),
            _ => false,
        };
        let python_gelu =
            matches!(architecture, Architecture::Gpt2 | Architecture::Phi) && act == "gelu_new";
        let tied_default = matches!(
            architecture,
            Architecture::Gpt2 | Architecture::Bert | Architecture::T5
        ) || model_type == "gemma";
        let tied = flag(config, "tie_word_embeddings")?.unwrap_or(tied_default);
        let positions = whole(
            config,
            &["n_positions", "max_position_embeddings"],
            1,
            MAX_POSITIONS,
        )?
        .unwrap_or(match architecture {
            Architecture::Gpt2 => 1024,
            _ => 512,
        });
        let (attention_default, hidden_default) = match architecture {
            Architecture::Gpt2 | Architecture::Bert | Architecture::T5 => (0.1, 0.1),
            _ => (0.0, 0.0),
        };
        let attention_dropout = probability(
            config,
            &[
                "attention_dropout",
                "attn_pdrop",
                "attention_probs_dropout_prob",
                "dropout_rate",
            ],
            attention_default,
        )?;
        let hidden_dropout = probability(
            config,
            &[
                "resid_pdrop",
                "hidden_dropout_prob",
                "hidden_dropout",
                "dropout_rate",
            ],
            hidden_default,
        )?;
        Ok(TransformerConfig {
            fused: model_type == "phi3",
            qkv_bias: model_type == "qwen2"
                || model_type == "qwen2_moe"
                || flag(config, "attention_bias")?.unwrap_or(false),
            mlp_bias: flag(config, "mlp_bias")?.unwrap_or(false),
            type_vocab: whole(config, &["type_vocab_size"], 0, 1024)?.unwrap_or(2),
            relative_buckets: whole(config, &["relative_attention_num_buckets"], 1, 4096)?
                .unwrap_or(32),
            parallel_residual: flag(config, "use_parallel_residual")?.unwrap_or(true),
            classifier_labels: if architectures.ends_with("forsequenceclassification") {
                Some(
                    whole(config, &["num_labels"], 1, MAX_VOCAB)?
                        .or_else(|| {
                            config
                                .get("id2label")
                                .and_then(Value::as_object)
                                .map(|m| m.len() as u64)
                                .filter(|&n| n > 0 && n <= MAX_VOCAB)
                        })
                        .unwrap_or(2),
                )
            } else {
                None
            },
            model_type,
            architecture,
            hidden,
            layers,
            decoder_layers,
            heads,
            kv_heads,
            head_dim,
            intermediate,
            vocab,
            tied,
            positions,
            experts,
            experts_per_token,
            gated,
            python_gelu,
            attention_dropout,
            hidden_dropout,
            notes,
        })
    }
}

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
}

impl Builder {
    fn push(&mut self, name: String, kind: LayerKind, params: u64, outputs: u64, flops: u64) {
        self.layers.push(Layer {
            kind,
            output_size: outputs.saturating_mul(self.seq),
            params,
        });
        self.details.push(LayerDetail {
            name: Some(name),
            in_features: None,
            out_features: None,
            flops: Some(flops),
        });
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
        self.details.push(LayerDetail {
            name: Some(name),
            in_features: Some(inputs),
            out_features: Some(outputs),
            flops: Some(flops),
        });
    }
}

/// Builds the model of `config` at `seq_len` tokens per sample with `precision`'s kernels.
pub fn build(
    config: TransformerConfig,
    seq_len: u64,
    precision: Precision,
    kernel: AttentionKernel,
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
    // Room for a decoder's 11 modules a block and the few around them (other layouts grow
    // the lists as needed); never more than a job may hold, however many blocks are asked.
    let expected = ((c.layers + c.decoder_layers) as usize * 11 + 4).min(MAX_LAYERS + 1);
    let mut b = Builder {
        seq,
        layers: Vec::with_capacity(expected),
        details: Vec::with_capacity(expected),
    };
    let mut outside = Saved {
        int64: 1.0,
        ..Default::default()
    };
    let mut blocks = Saved::default();
    let dropout = |p: f64| if p > 0.0 { 1.0 } else { 0.0 };
    // Attention as the kernel keeps it, per token (the o-projection's input included).
    let attention_saved = |kv_width: f64| -> Saved {
        if math {
            // q, k and v (repeated to every head), the probabilities, their dropout mask,
            // the output made contiguous for the o-projection.
            Saved {
                compute: 4.0 * q,
                norm: heads * l,
                mask: dropout(c.attention_dropout) * heads * l,
                ..Default::default()
            }
        } else {
            Saved {
                compute: 2.0 * q + 2.0 * kv_width,
                fp32: heads,
                ..Default::default()
            }
        }
    };
    // Pre-norm RMSNorm: its input, the inverse RMS, the normalised output, the matmul's copy.
    let rms = Saved {
        norm: 2.0 * h,
        fp32: 1.0,
        compute: h,
        ..Default::default()
    };
    // LayerNorm: its input, mean and inverse deviation, the matmul's copy of the output.
    let layer_norm = Saved {
        norm: h,
        fp32: 2.0,
        compute: h,
        ..Default::default()
    };
    let lm_loss = Saved {
        fp32: v,
        ..Default::default()
    };
    let head_params = !c.tied;
    let block_count;
    // The language-model head each architecture ends with, added after the match (BERT adds
    // its own prediction head).
    let head: Option<(&str, bool)>;
    match c.architecture {
        Architecture::Decoder => {
            b.push(
                "model.embed_tokens".into(),
                LayerKind::Embedding,
                c.vocab * c.hidden,
                c.hidden,
                0,
            );
            for i in 0..c.layers {
                let p = format!("model.layers.{i}");
                b.rms_norm(dotted(&p, "input_layernorm"), c.hidden);
                b.push(
                    dotted(&p, "self_attn"),
                    LayerKind::Attention,
                    0,
                    c.hidden,
                    attention_flops,
                );
                let (qd, kvd) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
                if c.fused {
                    b.linear(
                        dotted(&p, "self_attn.qkv_proj"),
                        c.hidden,
                        qd + 2 * kvd,
                        c.qkv_bias,
                        true,
                    );
                } else {
                    b.linear(
                        dotted(&p, "self_attn.q_proj"),
                        c.hidden,
                        qd,
                        c.qkv_bias,
                        true,
                    );
                    b.linear(
                        dotted(&p, "self_attn.k_proj"),
                        c.hidden,
                        kvd,
                        c.qkv_bias,
                        true,
                    );
                    b.linear(
                        dotted(&p, "self_attn.v_proj"),
                        c.hidden,
                        kvd,
                        c.qkv_bias,
                        true,
                    );
                }
                b.linear(dotted(&p, "self_attn.o_proj"), qd, c.hidden, false, true);
                b.rms_norm(dotted(&p, "post_attention_layernorm"), c.hidden);
                let mut block = rms;
                block.add(attention_saved(if sixteen { kv } else { q }));
                block.add(rms);
                // q, k and v (gate and up) read the same norm output: cast three (two) times.
                if !c.fused {
                    block.autocast_copies += 2.0 * h + if c.experts > 0 { 0.0 } else { h };
                }
                if c.experts > 0 {
                    let (e, k) = (c.experts, c.experts_per_token);
                    b.linear(dotted(&p, "mlp.gate"), c.hidden, e, false, true);
                    let expert_params = e * 3 * c.hidden * c.intermediate;
                    b.push(
                        dotted(&p, "mlp.experts"),
                        LayerKind::Other,
                        expert_params,
                        k * c.hidden,
                        product(&[6, k, c.hidden, c.intermediate, seq]),
                    );
                    b.push(
                        dotted(&p, "mlp.experts.act_fn"),
                        LayerKind::Silu,
                        0,
                        k * c.intermediate,
                        0,
                    );
                    let (e, k) = (e as f64, k as f64);
                    // Router probabilities and weights, the routed copies of each token, the
                    // experts' gate-up outputs, activation and product, their outputs.
                    block.add(Saved {
                        compute: k * (2.0 * h + 4.0 * i_size),
                        fp32: e + 1.0 + 2.0 * k,
                        int64: 4.0 * k,
                        ..Default::default()
                    });
                } else {
                    let act = if c.model_type.starts_with("gemma") {
                        LayerKind::Gelu
                    } else {
                        LayerKind::Silu
                    };
                    if c.fused {
                        b.linear(
                            dotted(&p, "mlp.gate_up_proj"),
                            c.hidden,
                            2 * c.intermediate,
                            c.mlp_bias,
                            true,
                        );
                        b.push(dotted(&p, "mlp.activation_fn"), act, 0, c.intermediate, 0);
                    } else {
                        b.linear(
                            dotted(&p, "mlp.gate_proj"),
                            c.hidden,
                            c.intermediate,
                            c.mlp_bias,
                            true,
                        );
                        b.push(dotted(&p, "mlp.act_fn"), act, 0, c.intermediate, 0);
                        b.linear(
                            dotted(&p, "mlp.up_proj"),
                            c.hidden,
                            c.intermediate,
                            c.mlp_bias,
                            true,
                        );
                    }
                    b.linear(
                        dotted(&p, "mlp.down_proj"),
                        c.intermediate,
                        c.hidden,
                        c.mlp_bias,
                        true,
                    );
                    // Gate output, activation output, up output, their product.
                    block.add(Saved {
                        compute: 4.0 * i_size,
                        ..Default::default()
                    });
                }
                blocks.add(block);
            }
            b.rms_norm("model.norm".into(), c.hidden);
            outside.add(rms);
            head = Some(("lm_head", false));
            block_count = c.layers;
        }
        Architecture::Gpt2 => {
            b.push(
                "transformer.wte".into(),
                LayerKind::Embedding,
                c.vocab * c.hidden,
                c.hidden,
                0,
            );
            b.push(
                "transformer.wpe".into(),
                LayerKind::Embedding,
                c.positions * c.hidden,
                c.hidden,
                0,
            );
            b.push(
                "transformer.drop".into(),
                LayerKind::Dropout,
                0,
                c.hidden,
                0,
            );
            let resid = dropout(c.hidden_dropout);
            outside.mask += resid * h;
            for i in 0..c.layers {
                let p = format!("transformer.h.{i}");
                b.layer_norm(dotted(&p, "ln_1"), c.hidden);
                b.push(
                    dotted(&p, "attn"),
                    LayerKind::Attention,
                    0,
                    c.hidden,
                    attention_flops,
                );
                b.linear(
                    dotted(&p, "attn.c_attn"),
                    c.hidden,
                    3 * c.hidden,
                    true,
                    true,
                );
                b.linear(dotted(&p, "attn.c_proj"), c.hidden, c.hidden, true, true);
                b.push(
                    dotted(&p, "attn.resid_dropout"),
                    LayerKind::Dropout,
                    0,
                    c.hidden,
                    0,
                );
                b.layer_norm(dotted(&p, "ln_2"), c.hidden);
                b.linear(dotted(&p, "mlp.c_fc"), c.hidden, c.intermediate, true, true);
                b.push(dotted(&p, "mlp.act"), LayerKind::Gelu, 0, c.intermediate, 0);
                b.linear(
                    dotted(&p, "mlp.c_proj"),
                    c.intermediate,
                    c.hidden,
                    true,
                    true,
                );
                b.push(
                    dotted(&p, "mlp.dropout"),
                    LayerKind::Dropout,
                    0,
                    c.hidden,
                    0,
                );
                let mut block = layer_norm;
                // The fused qkv output, the kernel's contiguous q, k and v, the output.
                let mut attention = attention_saved(q);
                if !math {
                    attention.compute += 3.0 * h - q;
                }
                block.add(attention);
                block.add(layer_norm);
                block.add(Saved {
                    compute: if c.python_gelu { 5.0 } else { 2.0 } * i_size,
                    mask: 2.0 * resid * h,
                    ..Default::default()
                });
                blocks.add(block);
            }
            b.layer_norm("transformer.ln_f".into(), c.hidden);
            outside.add(layer_norm);
            head = Some(("lm_head", false));
            block_count = c.layers;
        }
        Architecture::GptNeox => {
            b.push(
                "gpt_neox.embed_in".into(),
                LayerKind::Embedding,
                c.vocab * c.hidden,
                c.hidden,
                0,
            );
            let resid = dropout(c.hidden_dropout);
            outside.mask += resid * h;
            for i in 0..c.layers {
                let p = format!("gpt_neox.layers.{i}");
                b.layer_norm(dotted(&p, "input_layernorm"), c.hidden);
                b.push(
                    dotted(&p, "attention"),
                    LayerKind::Attention,
                    0,
                    c.hidden,
                    attention_flops,
                );
                b.linear(
                    dotted(&p, "attention.query_key_value"),
                    c.hidden,
                    3 * c.hidden,
                    true,
                    true,
                );
                b.linear(
                    dotted(&p, "attention.dense"),
                    c.hidden,
                    c.hidden,
                    true,
                    true,
                );
                b.layer_norm(dotted(&p, "post_attention_layernorm"), c.hidden);
                b.linear(
                    dotted(&p, "mlp.dense_h_to_4h"),
                    c.hidden,
                    c.intermediate,
                    true,
                    true,
                );
                b.push(dotted(&p, "mlp.act"), LayerKind::Gelu, 0, c.intermediate, 0);
                b.linear(
                    dotted(&p, "mlp.dense_4h_to_h"),
                    c.intermediate,
                    c.hidden,
                    true,
                    true,
                );
                let mut block = layer_norm;
                block.add(attention_saved(q));
                if c.parallel_residual {
                    // The second norm reads the same input.
                    block.add(Saved {
                        fp32: 2.0,
                        compute: h,
                        ..Default::default()
                    });
                } else {
                    block.add(layer_norm);
                }
                block.add(Saved {
                    compute: 2.0 * i_size,
                    mask: 2.0 * resid * h,
                    ..Default::default()
                });
                blocks.add(block);
            }
            b.layer_norm("gpt_neox.final_layer_norm".into(), c.hidden);
            outside.add(layer_norm);
            head = Some(("embed_out", false));
            block_count = c.layers;
        }
        Architecture::Phi => {
            b.push(
                "model.embed_tokens".into(),
                LayerKind::Embedding,
                c.vocab * c.hidden,
                c.hidden,
                0,
            );
            let resid = dropout(c.hidden_dropout);
            outside.mask += resid * h;
            for i in 0..c.layers {
                let p = format!("model.layers.{i}");
                b.layer_norm(dotted(&p, "input_layernorm"), c.hidden);
                b.push(
                    dotted(&p, "self_attn"),
                    LayerKind::Attention,
                    0,
                    c.hidden,
                    attention_flops,
                );
                let (qd, kvd) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
                b.linear(dotted(&p, "self_attn.q_proj"), c.hidden, qd, true, true);
                b.linear(dotted(&p, "self_attn.k_proj"), c.hidden, kvd, true, true);
                b.linear(dotted(&p, "self_attn.v_proj"), c.hidden, kvd, true, true);
                b.linear(dotted(&p, "self_attn.dense"), qd, c.hidden, true, true);
                b.linear(dotted(&p, "mlp.fc1"), c.hidden, c.intermediate, true, true);
                b.push(
                    dotted(&p, "mlp.activation_fn"),
                    LayerKind::Gelu,
                    0,
                    c.intermediate,
                    0,
                );
                b.linear(dotted(&p, "mlp.fc2"), c.intermediate, c.hidden, true, true);
                let mut block = layer_norm;
                block.autocast_copies += 3.0 * h;
                block.add(attention_saved(if sixteen { kv } else { q }));
                block.add(Saved {
                    compute: if c.python_gelu { 5.0 } else { 2.0 } * i_size,
                    mask: resid * h,
                    ..Default::default()
                });
                blocks.add(block);
            }
            b.layer_norm("model.final_layernorm".into(), c.hidden);
            outside.add(layer_norm);
            head = Some(("lm_head", true));
            block_count = c.layers;
        }
        Architecture::Bert => {
            b.push(
                "bert.embeddings.word_embeddings".into(),
                LayerKind::Embedding,
                c.vocab * c.hidden,
                c.hidden,
                0,
            );
            b.push(
                "bert.embeddings.position_embeddings".into(),
                LayerKind::Embedding,
                c.positions * c.hidden,
                c.hidden,
                0,
            );
            b.push(
                "bert.embeddings.token_type_embeddings".into(),
                LayerKind::Embedding,
                c.type_vocab * c.hidden,
                c.hidden,
                0,
            );
            b.layer_norm("bert.embeddings.LayerNorm".into(), c.hidden);
            b.push(
                "bert.embeddings.dropout".into(),
                LayerKind::Dropout,
                0,
                c.hidden,
                0,
            );
            let resid = dropout(c.hidden_dropout);
            // Post-norm: each norm's input is a fresh sum; its output feeds the next matmuls.
            let post_norm = Saved {
                norm: h,
                fp32: 2.0,
                compute: h,
                mask: resid * h,
                ..Default::default()
            };
            outside.add(post_norm);
            for i in 0..c.layers {
                let p = format!("bert.encoder.layer.{i}");
                b.push(
                    dotted(&p, "attention.self"),
                    LayerKind::Attention,
                    0,
                    c.hidden,
                    attention_flops,
                );
                b.linear(
                    dotted(&p, "attention.self.query"),
                    c.hidden,
                    c.hidden,
                    true,
                    true,
                );
                b.linear(
                    dotted(&p, "attention.self.key"),
                    c.hidden,
                    c.hidden,
                    true,
                    true,
                );
                b.linear(
                    dotted(&p, "attention.self.value"),
                    c.hidden,
                    c.hidden,
                    true,
                    true,
                );
                b.linear(
                    dotted(&p, "attention.output.dense"),
                    c.hidden,
                    c.hidden,
                    true,
                    true,
                );
                b.layer_norm(dotted(&p, "attention.output.LayerNorm"), c.hidden);
                b.linear(
                    dotted(&p, "intermediate.dense"),
                    c.hidden,
                    c.intermediate,
                    true,
                    true,
                );
                b.push(
                    dotted(&p, "intermediate.intermediate_act_fn"),
                    LayerKind::Gelu,
                    0,
                    c.intermediate,
                    0,
                );
                b.linear(
                    dotted(&p, "output.dense"),
                    c.intermediate,
                    c.hidden,
                    true,
                    true,
                );
                b.layer_norm(dotted(&p, "output.LayerNorm"), c.hidden);
                let mut block = attention_saved(q);
                block.autocast_copies += 2.0 * h;
                block.add(post_norm);
                block.add(Saved {
                    compute: 2.0 * i_size,
                    ..Default::default()
                });
                block.add(post_norm);
                blocks.add(block);
            }
            if let Some(labels) = c.classifier_labels {
                // The pooler reads the first token only; the loss is over a few labels.
                b.linear("bert.pooler.dense".into(), c.hidden, c.hidden, true, true);
                b.push(
                    "bert.pooler.activation".into(),
                    LayerKind::Tanh,
                    0,
                    c.hidden,
                    0,
                );
                b.linear("classifier".into(), c.hidden, labels, true, true);
                let first = b.layers.len() - 3;
                for layer in &mut b.layers[first..] {
                    layer.output_size /= seq.max(1);
                }
                let block_count = c.layers;
                return finish(
                    b,
                    config,
                    seq_len,
                    outside,
                    blocks,
                    block_count,
                    math,
                    warnings,
                    0.0,
                );
            }
            b.linear(
                "cls.predictions.transform.dense".into(),
                c.hidden,
                c.hidden,
                true,
                true,
            );
            b.push(
                "cls.predictions.transform.transform_act_fn".into(),
                LayerKind::Gelu,
                0,
                c.hidden,
                0,
            );
            b.layer_norm("cls.predictions.transform.LayerNorm".into(), c.hidden);
            // The decoder's bias is its own even when the weight is tied.
            let decoder_params = if head_params { c.hidden * c.vocab } else { 0 } + c.vocab;
            b.push(
                "cls.predictions.decoder".into(),
                LayerKind::Linear,
                decoder_params,
                c.vocab,
                product(&[2, c.hidden, c.vocab, seq]),
            );
            if let Some(d) = b.details.last_mut() {
                d.in_features = Some(c.hidden);
                d.out_features = Some(c.vocab);
            }
            outside.add(Saved {
                compute: h,
                ..Default::default()
            });
            outside.add(layer_norm);
            outside.add(lm_loss);
            head = None;
            block_count = c.layers;
        }
        Architecture::T5 => {
            b.push(
                "shared".into(),
                LayerKind::Embedding,
                c.vocab * c.hidden,
                c.hidden,
                0,
            );
            let resid = dropout(c.hidden_dropout);
            let t5_norm = Saved {
                norm: 2.0 * h,
                fp32: 1.0,
                compute: h,
                ..Default::default()
            };
            // T5 attention: the relative-position bias, expanded to the batch, is an additive
            // mask the kernel keeps (once per stack: every layer reads the same tensor).
            let bias = Saved {
                norm: heads * l,
                ..Default::default()
            };
            let ffn = Saved {
                compute: if c.gated { 4.0 } else { 2.0 } * i_size,
                mask: resid * (i_size + h),
                ..Default::default()
            };
            let mut attention = attention_saved(q);
            attention.mask += resid * h;
            let (qd, ff) = (c.heads * c.head_dim, c.intermediate);
            let stack = |b: &mut Builder, stack: &str, count: u64, cross: bool| {
                for i in 0..count {
                    let p = format!("{stack}.block.{i}.layer");
                    b.rms_norm(dotted(&p, "0.layer_norm"), c.hidden);
                    b.push(
                        dotted(&p, "0.SelfAttention"),
                        LayerKind::Attention,
                        0,
                        c.hidden,
                        attention_flops,
                    );
                    for proj in [
                        "0.SelfAttention.q",
                        "0.SelfAttention.k",
                        "0.SelfAttention.v",
                    ] {
                        b.linear(dotted(&p, proj), c.hidden, qd, false, true);
                    }
                    if i == 0 {
                        b.push(
                            dotted(&p, "0.SelfAttention.relative_attention_bias"),
                            LayerKind::Embedding,
                            c.relative_buckets * c.heads,
                            c.heads * seq,
                            0,
                        );
                    }
                    b.linear(dotted(&p, "0.SelfAttention.o"), qd, c.hidden, false, true);
                    // The feed-forward sublayer follows the attention sublayers.
                    let ffn = dotted(&p, if cross { "2" } else { "1" });
                    if cross {
                        b.rms_norm(dotted(&p, "1.layer_norm"), c.hidden);
                        b.push(
                            dotted(&p, "1.EncDecAttention"),
                            LayerKind::Attention,
                            0,
                            c.hidden,
                            attention_flops,
                        );
                        for proj in [
                            "1.EncDecAttention.q",
                            "1.EncDecAttention.k",
                            "1.EncDecAttention.v",
                        ] {
                            b.linear(dotted(&p, proj), c.hidden, qd, false, true);
                        }
                        b.linear(dotted(&p, "1.EncDecAttention.o"), qd, c.hidden, false, true);
                    }
                    b.rms_norm(dotted(&ffn, "layer_norm"), c.hidden);
                    if c.gated {
                        b.linear(
                            dotted(&ffn, "DenseReluDense.wi_0"),
                            c.hidden,
                            ff,
                            false,
                            true,
                        );
                        b.linear(
                            dotted(&ffn, "DenseReluDense.wi_1"),
                            c.hidden,
                            ff,
                            false,
                            true,
                        );
                    } else {
                        b.linear(dotted(&ffn, "DenseReluDense.wi"), c.hidden, ff, false, true);
                    }
                    b.push(
                        dotted(&ffn, "DenseReluDense.act"),
                        LayerKind::Relu,
                        0,
                        ff,
                        0,
                    );
                    b.linear(dotted(&ffn, "DenseReluDense.wo"), ff, c.hidden, false, true);
                }
                b.rms_norm(dotted(stack, "final_layer_norm"), c.hidden);
            };
            stack(&mut b, "encoder", c.layers, false);
            stack(&mut b, "decoder", c.decoder_layers, true);
            let mut encoder_block = t5_norm;
            encoder_block.autocast_copies += 2.0 * h;
            encoder_block.add(attention);
            encoder_block.add(t5_norm);
            encoder_block.add(ffn);
            let mut decoder_block = encoder_block;
            // Cross-attention: its norm, the encoder output's copy for k and v, the kernel.
            decoder_block.add(t5_norm);
            decoder_block.add(Saved {
                compute: h,
                autocast_copies: 3.0 * h,
                ..Default::default()
            });
            decoder_block.add(attention);
            blocks.add(encoder_block.scaled(c.layers as f64));
            blocks.add(decoder_block.scaled(c.decoder_layers as f64));
            // Embedding dropout of both stacks, the two biases (self and cross), the final
            // norms with their dropout, the head's input copy, the loss.
            outside.add(Saved {
                mask: 4.0 * resid * h,
                norm: 4.0 * h + 2.0 * heads * l,
                fp32: 2.0,
                compute: h,
                ..Default::default()
            });
            let _ = bias;
            head = Some(("lm_head", false));
            block_count = c.layers + c.decoder_layers;
        }
    }
    // The head: the language model's over the vocabulary, or a reward or value model's
    // (`...ForSequenceClassification`): a score over every position, pooled at the last token
    // (T5: a two-layer head on the end-of-sequence token), with its loss over a few labels (a
    // reward model's pairwise loss over one score per sequence).
    let loss_classes = match c.classifier_labels {
        Some(labels) if c.architecture == Architecture::T5 => {
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
        Some(labels) => {
            b.linear("score".into(), c.hidden, labels, false, true);
            labels as f64
        }
        None => {
            if let Some((name, bias)) = head {
                b.linear(name.into(), c.hidden, c.vocab, bias, head_params);
                outside.add(lm_loss);
            }
            v
        }
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
        Some(other) => Err(ConfigError(format!(
            "loss_implementation: unknown '{}' (known: {})",
            echo(other),
            LossImplementation::NAMES
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
        let loss = match loss_implementation {
            LossImplementation::Fused => 0.0,
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
            // the logits' own gradient beside them.
            backward_temporaries: match loss_implementation {
                LossImplementation::UpcastFp32 => {
                    classes * if compute == 4.0 { 8.0 } else { 10.0 } * l
                }
                // One chunk's gradients at a time: small beside the rest.
                LossImplementation::Chunked | LossImplementation::Fused => 0.0,
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
