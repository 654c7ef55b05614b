//! The files users' training tools write, read as they are: Hugging Face `TrainingArguments`
//! (`training_args.json`, `to_dict()`), PEFT's `adapter_config.json`, a DeepSpeed config,
//! accelerate's FSDP options and how `from_pretrained` loaded the model (`torch_dtype`,
//! `quantization_config`).
//!
//! Each file is a big dict: unknown keys are ignored, but every value read is checked (its
//! type, its range, a string's length) and refused with a [`FileError`] naming its place
//! (`training_arguments.optim`). What is read becomes a [`FileSetup`]: the setup fields in the
//! service's vocabulary, each with the place it was read from, which the answer echoes. Where
//! two files state one thing (DeepSpeed's micro-batch and the Trainer's), they must agree, as
//! the Trainer itself requires.

mod deepspeed;
mod fsdp;
mod load;
pub use load::ATTENTION_KERNELS;
mod peft;
mod training_args;

use serde_json::{Map, Value};

use crate::job::echo;
use crate::job::setup::{
    BaseWeights, Optimizer, OptimizerImplementation, Precision, Strategy, MAX_ACCUMULATION,
    MAX_LORA_RANK, MAX_NAMES, MAX_NAME_CHARS,
};

pub use deepspeed::{DeepSpeed, ZeroBuffersRead};
pub use fsdp::Fsdp;
pub use load::Load;
pub use peft::AdapterLora;
pub use training_args::TrainingArguments;

/// Largest micro-batch a file may state (as the request's `micro_batch_size`).
pub const MAX_MICRO_BATCH: u64 = 1 << 20;

/// A value of a file that cannot be read, or two places that disagree.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{place}: {message}")]
pub struct FileError {
    pub place: String,
    pub message: String,
}

impl FileError {
    pub fn new(place: impl Into<String>, message: impl Into<String>) -> FileError {
        FileError {
            place: place.into(),
            message: message.into(),
        }
    }
}

/// A value read from a file, with where it was read (`deepspeed.zero_optimization.stage`).
#[derive(Debug, Clone, PartialEq)]
pub struct Read<T> {
    pub value: T,
    pub from: String,
}

impl<T> Read<T> {
    pub fn new(value: T, from: impl Into<String>) -> Read<T> {
        Read {
            value,
            from: from.into(),
        }
    }
}

/// The files a request carries, borrowed.
#[derive(Debug, Clone, Copy, Default)]
pub struct Files<'a> {
    pub training_arguments: Option<&'a Map<String, Value>>,
    pub adapter_config: Option<&'a Map<String, Value>>,
    pub deepspeed: Option<&'a Map<String, Value>>,
    /// accelerate's config (or its `fsdp_config`).
    pub fsdp: Option<&'a Map<String, Value>>,
    pub load: Option<&'a Map<String, Value>>,
    /// The model's `config.json`, for `torch_dtype: "auto"`, an unsaid load dtype and PEFT's
    /// default targets.
    pub model_config: Option<&'a Map<String, Value>>,
    /// The request states its precision itself: a load dtype the files leave unsaid is then
    /// not taken from the config (the precision says what the weights are).
    pub precision_stated: bool,
}

impl Files<'_> {
    pub fn is_empty(&self) -> bool {
        self.training_arguments.is_none()
            && self.adapter_config.is_none()
            && self.deepspeed.is_none()
            && self.fsdp.is_none()
            && self.load.is_none()
    }
}

/// The setup the files state, in the service's vocabulary; `None` where they say nothing.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FileSetup {
    /// DeepSpeed's 16-bit mode, the loaded weights' dtype, or the Trainer's flags.
    pub precision: Option<Read<Precision>>,
    /// An fp32 master copy with the optimizer state (DeepSpeed's bf16/fp16 modes).
    pub fp32_master: Option<Read<bool>>,
    /// `optim`, or the DeepSpeed config's `optimizer` (which the Trainer runs instead).
    pub optimizer: Option<Read<Optimizer>>,
    pub implementation: Option<Read<OptimizerImplementation>>,
    /// Samples per GPU per forward/backward.
    pub micro_batch_size: Option<Read<u64>>,
    pub gradient_accumulation_steps: Option<Read<u64>>,
    /// Full activation checkpointing (`gradient_checkpointing`), or none.
    pub checkpointing: Option<Read<bool>>,
    /// The ZeRO stage, or the Trainer's FSDP option.
    pub strategy: Option<Read<Strategy>>,
    /// DeepSpeed's `offload_optimizer`.
    pub offload_optimizer: Option<Read<bool>>,
    /// DeepSpeed's `offload_param`, FSDP's `offload`: the gradients and state go with them.
    pub offload_parameters: Option<Read<bool>>,
    /// accelerate's `num_processes`.
    pub world_size: Option<Read<u64>>,
    pub lora: Option<Read<AdapterLora>>,
    /// From `quantization_config`.
    pub base_weights: Option<Read<BaseWeights>>,
    /// `eager` or `sdpa`, from `attn_implementation`.
    pub attention: Option<Read<&'static str>>,
    /// DeepSpeed ZeRO's buffer sizes.
    pub zero_buffers: ZeroBuffersRead,
    /// The load dtype, left unsaid, taken from the config (transformers 5's default).
    pub assumed_dtype: Option<AssumedDtype>,
    /// What was assumed or not used to read the files.
    pub warnings: Vec<String>,
}

/// A load dtype the files leave unsaid, taken as transformers 5 loads it (the config's 16-bit
/// dtype), and the precision transformers 4's fp32 default would have made instead.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AssumedDtype {
    /// The dtype taken.
    pub dtype: Precision,
    /// The precision under transformers 4; `None`: the files state none (the request's
    /// default).
    pub alternative: Option<Precision>,
}

/// Reads the files into the setup they state.
pub fn read(files: Files<'_>) -> Result<FileSetup, FileError> {
    let args = files
        .training_arguments
        .map(|map| TrainingArguments::read(map, "training_arguments"))
        .transpose()?;
    // The Trainer's own `deepspeed` entry, when it is the config itself (a dict).
    let nested = args.as_ref().and_then(|a| a.deepspeed);
    let ds_map = match (files.deepspeed, nested) {
        (Some(given), Some(inner)) if given != inner => {
            return Err(FileError::new(
                "deepspeed",
                "differs from training_arguments.deepspeed: give one DeepSpeed config",
            ))
        }
        (Some(given), _) => Some((given, "deepspeed")),
        (None, Some(inner)) => Some((inner, "training_arguments.deepspeed")),
        (None, None) => None,
    };
    // What transformers reads as `model.config.hidden_size` (T5's `d_model`, GPT-2's `n_embd`
    // through their attribute maps).
    let hidden_size = files.model_config.and_then(|config| {
        ["hidden_size", "d_model", "n_embd"]
            .iter()
            .find_map(|key| config.get(*key).and_then(Value::as_u64))
    });
    let ds = ds_map
        .map(|(map, place)| DeepSpeed::read(map, place, args.as_ref(), hidden_size))
        .transpose()?;
    let fsdp = files.fsdp.map(|map| Fsdp::read(map, "fsdp")).transpose()?;
    // DeepSpeed casts the model itself: no dtype is taken from the config under it.
    let dtype_from_config = !files.precision_stated && ds.is_none();
    let mut load = files
        .load
        .map(|map| Load::read(map, "load", files.model_config, dtype_from_config))
        .transpose()?;
    if load.is_none() && dtype_from_config && !files.is_empty() {
        load = load::config_dtype(files.model_config, "load").map(|(dtype, warning)| Load {
            dtype,
            base_weights: None,
            attention: None,
            dtype_assumed: true,
            warnings: vec![warning],
        });
    }
    let lora = files
        .adapter_config
        .map(|map| peft::read(map, "adapter_config", files.model_config))
        .transpose()?;

    let mut setup = FileSetup::default();
    if let Some(args) = &args {
        setup.warnings.extend(args.warnings.iter().cloned());
        setup.micro_batch_size = args.micro_batch_size.clone();
        setup.gradient_accumulation_steps = args.accumulation.clone();
        setup.checkpointing = args.checkpointing.clone();
        setup.strategy = args.fsdp.clone();
        setup.offload_parameters = args.fsdp_offload.clone();
        if ds.as_ref().is_some_and(|d| d.optimizer.is_some()) {
            if let Some(optim) = &args.optimizer {
                setup.warnings.push(format!(
                    "{}: not used: the DeepSpeed config names its own optimizer, which the \
                     Trainer runs instead",
                    optim.from
                ));
            }
        } else {
            setup.optimizer = args.optimizer.clone();
            setup.implementation = args.implementation.clone();
        }
    }
    if let Some(fsdp) = &fsdp {
        if let Some(ds) = &ds {
            return Err(FileError::new(
                "fsdp",
                format!(
                    "FSDP and DeepSpeed ({}) both stated: give one",
                    ds.stage.from
                ),
            ));
        }
        setup.strategy = agree(setup.strategy.take(), Some(fsdp.strategy.clone()))?;
        setup.offload_parameters = agree(
            setup.offload_parameters.take(),
            fsdp.offload_parameters.clone(),
        )?;
        setup.world_size = fsdp.world_size.clone();
        // FSDP's own checkpointing wraps each block as the Trainer's does: either turns it on
        // (the Trainer's dict always holds `gradient_checkpointing`, false by default).
        if let Some(on) = fsdp.checkpointing.as_ref().filter(|c| c.value) {
            setup.checkpointing = Some(on.clone());
        }
    }
    if let Some(ds) = &ds {
        if let Some(fsdp) = &setup.strategy {
            return Err(FileError::new(
                fsdp.from.clone(),
                format!(
                    "FSDP and DeepSpeed ({}) both stated: give one",
                    ds.stage.from
                ),
            ));
        }
        setup.micro_batch_size = agree(setup.micro_batch_size.take(), ds.micro_batch.clone())?;
        setup.gradient_accumulation_steps = agree(
            setup.gradient_accumulation_steps.take(),
            ds.accumulation.clone(),
        )?;
        setup.strategy = Some(ds.stage.clone());
        setup.offload_optimizer = ds.offload_optimizer.clone();
        setup.offload_parameters = ds.offload_parameters.clone();
        setup.zero_buffers = ds.buffers.clone();
        if let Some((optimizer, implementation)) = &ds.optimizer {
            setup.optimizer = Some(optimizer.clone());
            setup.implementation = implementation.clone();
        }
    }
    setup.lora = lora;
    if let Some(load) = &load {
        setup.warnings.extend(load.warnings.iter().cloned());
        setup.base_weights = load.base_weights.clone();
        setup.attention = load.attention.clone();
    }
    // accelerate's mixed_precision is autocast, as the Trainer's flags: they must agree.
    let autocast = agree(
        args.as_ref().and_then(|a| a.autocast.clone()),
        fsdp.as_ref().and_then(|f| f.autocast.clone()),
    )?;
    let (made, master) = precision(
        args.as_ref(),
        autocast.clone(),
        ds.as_ref(),
        load.as_ref(),
        &mut setup.warnings,
    )?;
    if let Some(assumed) = load.as_ref().filter(|l| l.dtype_assumed) {
        // What transformers 4 would have loaded: fp32 weights from a load block, none from
        // the files where they hold no load block.
        let fp32 = files.load.map(|_| Load {
            dtype: Read::new(Precision::Fp32, assumed.dtype.from.clone()),
            dtype_assumed: false,
            warnings: Vec::new(),
            ..assumed.clone()
        });
        let (alternative, _) = precision(
            args.as_ref(),
            autocast.clone(),
            ds.as_ref(),
            fp32.as_ref(),
            &mut Vec::new(),
        )?;
        setup.assumed_dtype = Some(AssumedDtype {
            dtype: assumed.dtype.value,
            alternative: alternative.map(|p| p.value),
        });
    }
    setup.precision = made;
    setup.fp32_master = master;
    Ok(setup)
}

/// A precision read, and whether an fp32 master copy goes with it.
type PrecisionRead = (Option<Read<Precision>>, Option<Read<bool>>);

/// The precision the files make: DeepSpeed's engine, else the loaded weights' dtype (16-bit
/// weights train as pure 16-bit whatever autocast does), else the Trainer's flags (autocast
/// over fp32 weights: `bf16=True` is `amp_bf16`).
fn precision(
    args: Option<&TrainingArguments>,
    autocast: Option<Read<Precision>>,
    ds: Option<&DeepSpeed>,
    load: Option<&Load>,
    warnings: &mut Vec<String>,
) -> Result<PrecisionRead, FileError> {
    if let Some(ds) = ds {
        // DeepSpeed casts the model itself and keeps fp32 master weights: no autocast.
        return Ok(match &ds.half {
            Some(half) => (Some(half.clone()), Some(Read::new(true, half.from.clone()))),
            None => {
                let neither = format!("{0}.bf16.enabled and {0}.fp16.enabled false", ds.prefix);
                (Some(Read::new(Precision::Fp32, neither)), None)
            }
        });
    }
    if let Some(dtype) = load.map(|l| &l.dtype) {
        if dtype.value != Precision::Fp32 {
            if let Some(amp) = &autocast {
                let same = matches!(
                    (amp.value, dtype.value),
                    (Precision::AmpBf16, Precision::Bf16) | (Precision::AmpFp16, Precision::Fp16)
                );
                if !same {
                    // Both are 2 bytes: the weights' type is stated, and the mix said.
                    warnings.push(format!(
                        "{}: autocasts to the other 16-bit type than the {} weights {} \
                         loads; counted as pure {} (the same bytes)",
                        amp.from,
                        dtype.value.as_str(),
                        dtype.from,
                        dtype.value.as_str()
                    ));
                }
            }
            return Ok((Some(dtype.clone()), None));
        }
        if autocast.is_none() && args.and_then(|a| a.plain_precision.as_ref()).is_none() {
            return Ok((Some(dtype.clone()), None));
        }
    }
    Ok((
        autocast.or_else(|| args.and_then(|a| a.plain_precision.clone())),
        None,
    ))
}

/// One value stated by two files: they must be the same (as the Trainer checks DeepSpeed's).
fn agree<T: PartialEq + std::fmt::Display>(
    first: Option<Read<T>>,
    second: Option<Read<T>>,
) -> Result<Option<Read<T>>, FileError> {
    match (first, second) {
        (Some(a), Some(b)) if a.value != b.value => Err(FileError::new(
            b.from.clone(),
            format!("{} differs from {} ({})", b.value, a.from, a.value),
        )),
        (Some(a), _) => Ok(Some(a)),
        (None, b) => Ok(b),
    }
}

// Readers of one value: absent and null are "not stated"; anything else is checked.

fn place(prefix: &str, key: &str) -> String {
    format!("{prefix}.{key}")
}

fn present<'a>(map: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    map.get(key).filter(|v| !v.is_null())
}

fn boolean(map: &Map<String, Value>, prefix: &str, key: &str) -> Result<Option<bool>, FileError> {
    match present(map, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(FileError::new(
            place(prefix, key),
            format!("expected true or false, got {}", shown(other)),
        )),
    }
}

/// A whole number in `1..=max`.
fn count(
    map: &Map<String, Value>,
    prefix: &str,
    key: &str,
    max: u64,
) -> Result<Option<u64>, FileError> {
    bounded(
        map,
        prefix,
        key,
        &format!("a whole number from 1 to {max}"),
        |v| v.as_u64().filter(|n| (1..=max).contains(n)),
    )
}

/// A finite number in `0..=max`.
fn number(
    map: &Map<String, Value>,
    prefix: &str,
    key: &str,
    max: f64,
) -> Result<Option<f64>, FileError> {
    bounded(
        map,
        prefix,
        key,
        &format!("a number from 0 to {max}"),
        |v| {
            v.as_f64()
                .filter(|x| x.is_finite() && (0.0..=max).contains(x))
        },
    )
}

/// A value `read` accepts, else refused as not `what` was expected.
fn bounded<T>(
    map: &Map<String, Value>,
    prefix: &str,
    key: &str,
    what: &str,
    read: impl Fn(&Value) -> Option<T>,
) -> Result<Option<T>, FileError> {
    present(map, key)
        .map(|value| {
            read(value).ok_or_else(|| {
                FileError::new(
                    place(prefix, key),
                    format!("expected {what}, got {}", shown(value)),
                )
            })
        })
        .transpose()
}

/// One of the `known` words (any case), or `None` when not given; another word is refused as
/// `refusal` says, listing them.
fn keyword<'k>(
    map: &Map<String, Value>,
    prefix: &str,
    key: &str,
    known: &[&'k str],
    refusal: &str,
) -> Result<Option<&'k str>, FileError> {
    let Some(raw) = text(map, prefix, key)? else {
        return Ok(None);
    };
    match known.iter().find(|k| k.eq_ignore_ascii_case(raw.trim())) {
        Some(word) => Ok(Some(word)),
        None => Err(FileError::new(
            place(prefix, key),
            format!("'{}' {refusal} (known: {})", echo(raw), known.join(", ")),
        )),
    }
}

/// A string of at most [`MAX_NAME_CHARS`] characters.
fn text<'a>(
    map: &'a Map<String, Value>,
    prefix: &str,
    key: &str,
) -> Result<Option<&'a str>, FileError> {
    match present(map, key) {
        None => Ok(None),
        Some(Value::String(s)) if s.chars().count() <= MAX_NAME_CHARS => Ok(Some(s)),
        Some(other) => Err(FileError::new(
            place(prefix, key),
            format!(
                "expected a string of at most {MAX_NAME_CHARS} characters, got {}",
                shown(other)
            ),
        )),
    }
}

/// A list of module names, bounded as the request's lists are.
fn names(value: &Value, at: &str) -> Result<Vec<String>, FileError> {
    let Value::Array(items) = value else {
        return Err(FileError::new(
            at,
            format!("expected a list of names, got {}", shown(value)),
        ));
    };
    if items.len() > MAX_NAMES {
        return Err(FileError::new(
            at,
            format!("at most {MAX_NAMES} names, got {}", items.len()),
        ));
    }
    items
        .iter()
        .map(|item| match item {
            Value::String(s) if !s.trim().is_empty() && s.chars().count() <= MAX_NAME_CHARS => {
                Ok(s.trim().to_string())
            }
            other => Err(FileError::new(
                at,
                format!(
                    "each name must be a string of 1 to {MAX_NAME_CHARS} characters, got {}",
                    shown(other)
                ),
            )),
        })
        .collect()
}

/// A value as an error message shows it: short, whatever the caller sent.
fn shown(value: &Value) -> String {
    match value {
        Value::String(s) => format!("'{}'", echo(s)),
        Value::Array(a) => format!("a list of {}", a.len()),
        Value::Object(_) => "an object".into(),
        other => echo(&other.to_string()),
    }
}

/// Bounds shared with the request's own fields.
const _: () = assert!(MAX_ACCUMULATION == MAX_MICRO_BATCH && MAX_LORA_RANK <= MAX_MICRO_BATCH);

#[cfg(test)]
mod tests;
