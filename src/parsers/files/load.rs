//! How `from_pretrained` loaded the model: `torch_dtype` (or `dtype`) and
//! `quantization_config` (bitsandbytes 4/8-bit, GPTQ, AWQ), onto the job's precision and
//! `lora.base_weights`. A dtype left unsaid is transformers 5's default, `"auto"`: the config's
//! `torch_dtype` (huggingface/transformers#42805), where the job carries a config with a
//! 16-bit one; transformers 4's fp32 is then the alternative the answer lists. Without such a
//! config, transformers 4's defaults stand: fp32 weights, and fp16 for a quantised model (its
//! quantisers' default compute dtype).

use serde_json::{Map, Value};

/// The `attn_implementation` values read (eager keeps the N x N probabilities; the others are
/// read as `sdpa`).
pub const ATTENTION_KERNELS: [&str; 4] =
    ["eager", "sdpa", "flash_attention_2", "flash_attention_3"];

use super::{boolean, keyword, place, present, shown, text, FileError, Read};
use crate::job::echo;
use crate::job::setup::{BaseWeights, Precision};

#[derive(Debug, Clone)]
pub struct Load {
    /// The dtype of the weights that are not quantised.
    pub dtype: Read<Precision>,
    pub base_weights: Option<Read<BaseWeights>>,
    /// `attn_implementation`: `eager` keeps the N x N probabilities, the others (`sdpa`,
    /// flash attention) do not: the request's `attention` words.
    pub attention: Option<Read<&'static str>>,
    /// Whether `dtype` is transformers 5's default (the config's 16-bit dtype) for a dtype
    /// left unsaid: transformers 4 would load fp32.
    pub dtype_assumed: bool,
    pub warnings: Vec<String>,
}

/// Where an unsaid load dtype is read from under transformers 5's default.
const CONFIG_DTYPE: &str = "transformer_config.torch_dtype";

/// transformers 5's dtype for weights loaded without one: the config's `torch_dtype` (or
/// `dtype`) when it names a 16-bit type, with the warning that says so. `None` where the
/// config names none, or fp32 (transformers 4's default then holds, and nothing moves).
pub fn config_dtype(
    model_config: Option<&Map<String, Value>>,
    prefix: &str,
) -> Option<(Read<Precision>, String)> {
    let name = model_config.and_then(|c| {
        ["torch_dtype", "dtype"]
            .iter()
            .find_map(|k| c.get(*k).and_then(Value::as_str))
    })?;
    let precision = dtype(name, CONFIG_DTYPE).ok()?;
    if precision == Precision::Fp32 {
        return None;
    }
    let word = precision.as_str();
    let warning = format!(
        "{prefix}.torch_dtype: not given; the weights are taken as {word}, the config's \
         torch_dtype, as transformers 5's from_pretrained loads them by default (dtype=\"auto\"); \
         transformers 4 loaded fp32 unless told, listed in memory.uncertainty.assumed: give \
         {prefix}.torch_dtype (or precision) to say which"
    );
    let read = Read::new(
        precision,
        format!("{CONFIG_DTYPE} (load dtype not given: transformers 5's default)"),
    );
    Some((read, warning))
}

impl Load {
    /// `dtype_from_config`: whether an unsaid dtype may follow the config's
    /// ([`config_dtype`]); not where the request states its precision itself.
    pub fn read(
        map: &Map<String, Value>,
        prefix: &str,
        model_config: Option<&Map<String, Value>>,
        dtype_from_config: bool,
    ) -> Result<Load, FileError> {
        let mut warnings = Vec::new();
        let mut dtype_assumed = false;
        let base_weights = match present(map, "quantization_config") {
            None => None,
            Some(Value::Object(q)) => {
                quantisation(q, &place(prefix, "quantization_config"), &mut warnings)?
            }
            Some(other) => {
                return Err(FileError::new(
                    place(prefix, "quantization_config"),
                    format!("expected an object, got {}", shown(other)),
                ))
            }
        };
        let stated = match (
            text(map, prefix, "torch_dtype")?,
            text(map, prefix, "dtype")?,
        ) {
            (Some(a), Some(b)) if !a.eq_ignore_ascii_case(b) => {
                return Err(FileError::new(
                    place(prefix, "dtype"),
                    format!(
                        "'{}' differs from {prefix}.torch_dtype ('{}')",
                        echo(b),
                        echo(a)
                    ),
                ))
            }
            (Some(a), _) => Some((a, place(prefix, "torch_dtype"))),
            (None, Some(b)) => Some((b, place(prefix, "dtype"))),
            (None, None) => None,
        };
        let dtype = match stated {
            Some((name, at)) if name.eq_ignore_ascii_case("auto") => {
                let from_config = model_config.and_then(|c| {
                    ["torch_dtype", "dtype"]
                        .iter()
                        .find_map(|k| c.get(*k).and_then(Value::as_str))
                });
                let Some(config_dtype) = from_config else {
                    return Err(FileError::new(
                        at,
                        "'auto' takes the dtype of the model's config.json: give \
                         transformer_config with its torch_dtype, or the dtype",
                    ));
                };
                let value = dtype(config_dtype, "transformer_config.torch_dtype")?;
                Read::new(
                    value,
                    format!("{at} (auto: transformer_config.torch_dtype)"),
                )
            }
            Some((name, at)) => Read::new(dtype(name, &at)?, at),
            None if base_weights.is_some() => Read::new(
                Precision::Fp16,
                format!(
                    "{prefix}.torch_dtype (not given: transformers' fp16 for a quantised model)"
                ),
            ),
            None => match config_dtype(model_config, prefix).filter(|_| dtype_from_config) {
                Some((read, warning)) => {
                    warnings.push(warning);
                    dtype_assumed = true;
                    read
                }
                None => Read::new(
                    Precision::Fp32,
                    format!("{prefix}.torch_dtype (not given: transformers 4's fp32)"),
                ),
            },
        };
        let attention = keyword(
            map,
            prefix,
            "attn_implementation",
            &ATTENTION_KERNELS,
            "is not an attention kernel the service models",
        )?
        .map(|kernel| {
            let word = if kernel == "eager" { "eager" } else { "sdpa" };
            Read::new(word, place(prefix, "attn_implementation"))
        });
        Ok(Load {
            dtype,
            base_weights,
            attention,
            dtype_assumed,
            warnings,
        })
    }
}

/// A torch dtype's name (`bfloat16`, `torch.bfloat16`) as the precision of weights in it.
fn dtype(name: &str, at: &str) -> Result<Precision, FileError> {
    let lower = name.trim().to_ascii_lowercase();
    match lower.strip_prefix("torch.").unwrap_or(&lower) {
        "bfloat16" | "bf16" => Ok(Precision::Bf16),
        "float16" | "fp16" | "half" => Ok(Precision::Fp16),
        "float32" | "fp32" | "float" => Ok(Precision::Fp32),
        _ => Err(FileError::new(
            at,
            format!(
                "'{}' is not a dtype the service models (known: bfloat16, float16, float32, auto)",
                echo(name)
            ),
        )),
    }
}

/// A `quantization_config` as the base weights it makes.
fn quantisation(
    q: &Map<String, Value>,
    at: &str,
    warnings: &mut Vec<String>,
) -> Result<Option<Read<BaseWeights>>, FileError> {
    let method = keyword(
        q,
        at,
        "quant_method",
        &["bitsandbytes", "gptq", "awq"],
        "is not a quantisation the service models",
    )?;
    let in_4bit = boolean(q, at, "load_in_4bit")?.unwrap_or(false);
    let in_8bit = boolean(q, at, "load_in_8bit")?.unwrap_or(false);
    match method {
        None | Some("bitsandbytes") => {
            if in_4bit && in_8bit {
                return Err(FileError::new(
                    place(at, "load_in_4bit"),
                    "and load_in_8bit are both true: give one",
                ));
            }
            if in_8bit {
                return Ok(Some(Read::new(
                    BaseWeights::Int8,
                    place(at, "load_in_8bit"),
                )));
            }
            if !in_4bit {
                return Ok(None);
            }
            // transformers' default is fp4: the same bits and scales as NF4.
            keyword(
                q,
                at,
                "bnb_4bit_quant_type",
                &["nf4", "fp4"],
                "is not a 4-bit type the service models",
            )?;
            if boolean(q, at, "bnb_4bit_use_double_quant")? != Some(true) {
                warnings.push(format!(
                    "{}: not true; counted with double quantisation (the service's nf4), which \
                     keeps about 0.4 bits a weight fewer than its fp32 block scales",
                    place(at, "bnb_4bit_use_double_quant")
                ));
            }
            Ok(Some(Read::new(BaseWeights::Nf4, place(at, "load_in_4bit"))))
        }
        Some("gptq") => {
            bits(q, at, "bits")?;
            let group_size = group(q, at, "group_size")?;
            Ok(Some(Read::new(BaseWeights::Gptq { group_size }, at)))
        }
        // awq: the last of the known methods.
        Some(_) => {
            let bits_key = if q.contains_key("w_bit") {
                "w_bit"
            } else {
                "bits"
            };
            bits(q, at, bits_key)?;
            let group_key = if q.contains_key("q_group_size") {
                "q_group_size"
            } else {
                "group_size"
            };
            let group_size = group(q, at, group_key)?;
            keyword(
                q,
                at,
                "version",
                &["gemm"],
                "is not a layout the service models",
            )?;
            Ok(Some(Read::new(BaseWeights::Awq { group_size }, at)))
        }
    }
}

fn bits(q: &Map<String, Value>, at: &str, key: &str) -> Result<(), FileError> {
    match present(q, key) {
        None => Ok(()),
        Some(value) if value.as_u64() == Some(4) => Ok(()),
        Some(value) => Err(FileError::new(
            place(at, key),
            format!("4-bit checkpoints only are modelled, got {}", shown(value)),
        )),
    }
}

fn group(q: &Map<String, Value>, at: &str, key: &str) -> Result<u64, FileError> {
    match present(q, key) {
        None => Ok(crate::job::setup::DEFAULT_GROUP_SIZE),
        Some(value) => value
            .as_u64()
            .filter(|g| (1..=65_536).contains(g))
            .ok_or_else(|| {
                FileError::new(
                    place(at, key),
                    format!(
                        "expected a group of 1 to 65536 inputs, got {} (-1, per channel, is not \
                     modelled)",
                        shown(value)
                    ),
                )
            }),
    }
}
