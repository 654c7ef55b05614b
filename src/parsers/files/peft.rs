//! PEFT's `adapter_config.json` (`peft_type` LORA) as the job's adapters: `r`, `lora_alpha`,
//! `lora_dropout`, `target_modules` (a list, `all-linear`, or none: PEFT's default for the
//! model type), `modules_to_save`. What changes memory and is not modelled (DoRA, trained
//! biases, adapters on some layers only, per-module ranks) is refused, never dropped.

use serde_json::{Map, Value};

use super::{boolean, count, keyword, names, number, place, present, FileError, Read};
use crate::job::echo;
use crate::job::setup::MAX_LORA_RANK;

/// The adapters an adapter config states.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterLora {
    pub rank: u64,
    pub alpha: f64,
    pub dropout: f64,
    /// `None`: `all-linear`.
    pub targets: Option<Vec<String>>,
    pub modules_to_save: Option<Vec<String>>,
}

/// PEFT's default targets (`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`) for the model
/// types the service builds.
const DEFAULT_TARGETS: &[(&str, &[&str])] = &[
    ("llama", &["q_proj", "v_proj"]),
    ("mistral", &["q_proj", "v_proj"]),
    ("mixtral", &["q_proj", "v_proj"]),
    ("qwen2", &["q_proj", "v_proj"]),
    ("gemma", &["q_proj", "v_proj"]),
    ("gemma2", &["q_proj", "v_proj"]),
    ("phi3", &["qkv_proj"]),
    ("gpt2", &["c_attn"]),
    ("gpt_neox", &["query_key_value"]),
    ("chatglm", &["query_key_value"]),
    ("bert", &["query", "value"]),
    ("t5", &["q", "v"]),
];

pub fn read(
    map: &Map<String, Value>,
    prefix: &str,
    model_config: Option<&Map<String, Value>>,
) -> Result<Read<AdapterLora>, FileError> {
    let at = |key: &str| place(prefix, key);
    if keyword(
        map,
        prefix,
        "peft_type",
        &["LORA"],
        "is not an adapter the service models",
    )?
    .is_none()
    {
        return Err(FileError::new(
            at("peft_type"),
            "not given: PEFT writes it (known: LORA)",
        ));
    }
    let rank = count(map, prefix, "r", MAX_LORA_RANK)?.unwrap_or(8);
    let alpha =
        number(map, prefix, "lora_alpha", 1e6)?.unwrap_or(crate::job::setup::PEFT_DEFAULT_ALPHA);
    let dropout = number(map, prefix, "lora_dropout", 1.0)?.unwrap_or(0.0);
    let targets = match present(map, "target_modules") {
        Some(Value::String(s)) if s.eq_ignore_ascii_case("all-linear") => None,
        Some(Value::String(s)) => {
            return Err(FileError::new(
                at("target_modules"),
                format!(
                    "'{}' is a regular expression, which the service does not match: give \
                     the list of module names",
                    echo(s)
                ),
            ))
        }
        Some(list) => Some(names(list, &at("target_modules"))?),
        None => {
            let model_type = model_config.and_then(|c| c.get("model_type")?.as_str());
            let defaults = model_type
                .and_then(|t| DEFAULT_TARGETS.iter().find(|(name, _)| *name == t))
                .map(|(_, names)| names.iter().map(|n| n.to_string()).collect());
            match defaults {
                Some(list) => Some(list),
                None => {
                    return Err(FileError::new(
                        at("target_modules"),
                        format!(
                            "not given, and PEFT's default for model type '{}' is not known \
                             here: give the list",
                            echo(model_type.unwrap_or("none"))
                        ),
                    ))
                }
            }
        }
    };
    let modules_to_save = present(map, "modules_to_save")
        .map(|list| names(list, &at("modules_to_save")))
        .transpose()?
        .filter(|list| !list.is_empty());
    keyword(
        map,
        prefix,
        "bias",
        &["none"],
        "trains biases, which the service does not model",
    )?;
    if boolean(map, prefix, "use_dora")? == Some(true) {
        return Err(FileError::new(
            at("use_dora"),
            "DoRA's magnitude vectors and norms are not modelled",
        ));
    }
    for key in ["layers_to_transform", "rank_pattern", "alpha_pattern"] {
        let stated = match present(map, key) {
            None => false,
            Some(Value::Object(o)) => !o.is_empty(),
            Some(Value::Array(a)) => !a.is_empty(),
            Some(_) => true,
        };
        if stated {
            return Err(FileError::new(
                at(key),
                "adapters of other ranks or on some layers only are not modelled",
            ));
        }
    }
    Ok(Read::new(
        AdapterLora {
            rank,
            alpha,
            dropout,
            targets,
            modules_to_save,
        },
        prefix,
    ))
}
