//! Reading a Hugging Face `config.json`: the keys of each architecture, every number bounded,
//! missing essentials named, unknown keys ignored.

use serde_json::{Map, Value};

use crate::job::echo;
use crate::job::validated::MAX_LAYERS;

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
    /// The names `attention` takes, the vocabulary lists (`auto` and `flash_attention_2` are
    /// read too, as `sdpa` and `flash`).
    pub const NAMES: [&'static str; 5] = ["sdpa", "flash", "efficient", "eager", "math"];

    pub fn parse(raw: Option<&str>) -> Result<AttentionKernel, ConfigError> {
        match raw.map(str::to_ascii_lowercase).as_deref() {
            None | Some("sdpa" | "flash" | "flash_attention_2" | "efficient" | "auto") => {
                Ok(AttentionKernel::Auto)
            }
            Some("eager" | "math") => Ok(AttentionKernel::Eager),
            Some(other) => Err(ConfigError(format!(
                "attention: unknown kernel '{}' (known: {})",
                echo(other),
                AttentionKernel::NAMES.join(", ")
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
    /// ChatGLM2/3, GLM-4 (THUDM's remote code): fused query_key_value and SwiGLU projections.
    ChatGlm,
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
            Architecture::ChatGlm => "chatglm",
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
    /// LayerNorm where the family's default is RMSNorm (ChatGLM's `rmsnorm: false`).
    pub layer_norm: bool,
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

/// A configuration's sizes, read and checked.
struct Sizes {
    hidden: u64,
    layers: u64,
    decoder_layers: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    intermediate: u64,
    vocab: u64,
    experts: u64,
    experts_per_token: u64,
}

/// The config a `transformer_config` is built from, and whether it is a multimodal config's
/// language model: a multimodal config (Gemma 3, LLaVA, Qwen2-VL, ...) without sizes of its
/// own holds its language model under `text_config`, and that is what is built. One rule for
/// the request's price and for what is built, so that a wrapper cannot be priced as one model
/// and built as another.
pub fn language_model(config: &Map<String, Value>) -> (&Map<String, Value>, bool) {
    let multimodal = !config.contains_key("hidden_size")
        && !config.contains_key("d_model")
        && !config.contains_key("n_embd");
    match config.get("text_config") {
        Some(Value::Object(text)) if multimodal => (text, true),
        _ => (config, false),
    }
}

impl TransformerConfig {
    /// About how many modules the built model lists: a decoder's 11 a block and the few around
    /// them (other layouts differ by a few), never more than a job may hold plus one. What the
    /// builder reserves, and what the engine prices a request at before it is built.
    pub fn modules_hint(&self) -> usize {
        (self.layers.saturating_add(self.decoder_layers) as usize)
            .saturating_mul(11)
            .saturating_add(4)
            .min(MAX_LAYERS + 1)
    }

    /// The model type (declared, else told from the keys) and the layout it is built as;
    /// with the first of `architectures`, lower case.
    fn architecture_of(
        config: &Map<String, Value>,
        notes: &mut Vec<String>,
    ) -> (String, Architecture, String) {
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
            "chatglm" => Architecture::ChatGlm,
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
        (model_type, architecture, architectures)
    }

    /// The sizes the configuration states, each bounded, the essentials named when missing.
    fn sizes(
        config: &Map<String, Value>,
        architecture: Architecture,
        model_type: &str,
    ) -> Result<Sizes, ConfigError> {
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
        // ChatGLM's embedding and output layer are of the padded vocabulary.
        let vocab = whole(config, &["padded_vocab_size", "vocab_size"], 1, MAX_VOCAB)?;
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
            &[
                "intermediate_size",
                "n_inner",
                "d_ff",
                "ffn_dim",
                "ffn_hidden_size",
            ],
            1,
            MAX_INTERMEDIATE,
        )?;
        if intermediate.is_none() && architecture == Architecture::Decoder {
            missing.push("intermediate_size");
        }
        if intermediate.is_none() && architecture == Architecture::ChatGlm {
            // The first ChatGLM-6B (GLM layout, 2D positions) names neither.
            missing.push("ffn_hidden_size (ChatGLM2 and later)");
        }
        if !missing.is_empty() {
            return Err(ConfigError(format!(
                "missing {} (model_type {})",
                missing.join(", "),
                echo(model_type)
            )));
        }
        let (hidden, layers, heads, vocab) = (
            hidden.unwrap_or(1),
            layers.unwrap_or(1),
            heads.unwrap_or(1),
            vocab.unwrap_or(1),
        );
        let intermediate = intermediate.unwrap_or(4 * hidden);
        let head_dim = match whole(config, &["head_dim", "d_kv", "kv_channels"], 1, MAX_HIDDEN)? {
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
        // ChatGLM's groups count only under `multi_query_attention`.
        let kv_keys: &[&str] = if architecture == Architecture::ChatGlm {
            if flag(config, "multi_query_attention")?.unwrap_or(false) {
                &["multi_query_group_num"]
            } else {
                &[]
            }
        } else {
            &["num_key_value_heads", "multi_query_group_num"]
        };
        let kv_heads = whole(config, kv_keys, 1, heads)?.unwrap_or(heads);
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
        Ok(Sizes {
            hidden,
            layers,
            decoder_layers,
            heads,
            kv_heads,
            head_dim,
            intermediate,
            vocab,
            experts,
            experts_per_token,
        })
    }

    /// Reads a `config.json` object. Unknown keys are ignored; missing essentials are named.
    pub fn parse(config: &Map<String, Value>) -> Result<TransformerConfig, ConfigError> {
        let mut notes = Vec::new();
        let (model_type, architecture, architectures) = Self::architecture_of(config, &mut notes);
        let Sizes {
            hidden,
            layers,
            decoder_layers,
            heads,
            kv_heads,
            head_dim,
            intermediate,
            vocab,
            experts,
            experts_per_token,
        } = Self::sizes(config, architecture, &model_type)?;
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
            Architecture::Decoder | Architecture::ChatGlm => "silu",
            Architecture::Gpt2 | Architecture::Phi => "gelu_new",
            Architecture::T5 => "relu",
            _ => "gelu",
        })
        .to_ascii_lowercase();
        let gated = match architecture {
            Architecture::Decoder | Architecture::ChatGlm => true,
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
            &["n_positions", "max_position_embeddings", "seq_length"],
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
        let chatglm = architecture == Architecture::ChatGlm;
        Ok(TransformerConfig {
            fused: model_type == "phi3",
            layer_norm: chatglm && !flag(config, "rmsnorm")?.unwrap_or(true),
            qkv_bias: model_type == "qwen2"
                || model_type == "qwen2_moe"
                || flag(config, "attention_bias")?.unwrap_or(false)
                || (chatglm && flag(config, "add_qkv_bias")?.unwrap_or(false)),
            mlp_bias: flag(config, "mlp_bias")?.unwrap_or(false)
                || (chatglm && flag(config, "add_bias_linear")?.unwrap_or(false)),
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
