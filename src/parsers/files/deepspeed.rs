//! A DeepSpeed config: the ZeRO stage, offload, the micro-batch and accumulation, bf16/fp16
//! and its optimizer. `"auto"` values are resolved from the Trainer's arguments as
//! transformers' `HfTrainerDeepSpeedConfig` does: the micro-batch from
//! `per_device_train_batch_size`, the accumulation from `gradient_accumulation_steps`,
//! `bf16.enabled` from `bf16 or bf16_full_eval`, `fp16.enabled` from `fp16 or fp16_full_eval`;
//! a number the arguments contradict is refused, as the Trainer refuses it. ZeRO's buffer
//! sizes are read too; the three `"auto"` ones are resolved from the model's hidden size as
//! transformers' `trainer_config_finalize` does: `reduce_bucket_size` hidden², under stage 3
//! `stage3_prefetch_bucket_size` 0.9 hidden² and `stage3_param_persistence_threshold`
//! 10 hidden.

use serde_json::{Map, Value};

use super::{count, keyword, number, place, present, shown, FileError, Read, TrainingArguments};
use crate::job::setup::{
    Optimizer, OptimizerImplementation, Precision, Strategy, MAX_ZERO_ELEMENTS,
};

/// What a DeepSpeed config states.
#[derive(Debug, Clone)]
pub struct DeepSpeed {
    /// Where the config was read (`deepspeed`, `training_arguments.deepspeed`).
    pub prefix: String,
    pub stage: Read<Strategy>,
    pub micro_batch: Option<Read<u64>>,
    pub accumulation: Option<Read<u64>>,
    /// `bf16` or `fp16` enabled: the engine's 16-bit weights (with fp32 master weights).
    pub half: Option<Read<Precision>>,
    pub offload_optimizer: Option<Read<bool>>,
    pub offload_parameters: Option<Read<bool>>,
    /// Its `optimizer` section: DeepSpeed's FusedAdam (CPU Adam when offloaded).
    pub optimizer: Option<(Read<Optimizer>, Option<Read<OptimizerImplementation>>)>,
    /// `zero_optimization`'s buffer sizes, those it states.
    pub buffers: ZeroBuffersRead,
}

/// ZeRO's buffer settings a config states, elements (`None`: DeepSpeed's default).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ZeroBuffersRead {
    pub reduce_bucket_size: Option<Read<u64>>,
    pub prefetch_bucket_size: Option<Read<u64>>,
    pub max_live_parameters: Option<Read<u64>>,
    pub max_reuse_distance: Option<Read<u64>>,
    pub param_persistence_threshold: Option<Read<u64>>,
    pub sub_group_size: Option<Read<u64>>,
}

impl DeepSpeed {
    /// `hidden_size` is the model's (its config.json), for the `"auto"` buffer sizes.
    pub fn read(
        map: &Map<String, Value>,
        prefix: &str,
        args: Option<&TrainingArguments<'_>>,
        hidden_size: Option<u64>,
    ) -> Result<DeepSpeed, FileError> {
        let zero = section(map, prefix, "zero_optimization")?;
        let zero_at = place(prefix, "zero_optimization");
        let stage_at = place(&zero_at, "stage");
        let stage = match zero.and_then(|z| present(z, "stage")) {
            None => 0,
            Some(value) => value.as_u64().filter(|s| *s <= 3).ok_or_else(|| {
                FileError::new(
                    stage_at.clone(),
                    format!("expected 0, 1, 2 or 3, got {}", shown(value)),
                )
            })?,
        };
        let strategy = match stage {
            0 => Strategy::Ddp,
            1 => Strategy::Zero1,
            2 => Strategy::Zero2,
            _ => Strategy::Zero3,
        };
        let offload = |key: &str| -> Result<Option<Read<bool>>, FileError> {
            let Some(zero) = zero else { return Ok(None) };
            let at = place(&zero_at, key);
            let Some(section) = section(zero, &zero_at, key)? else {
                return Ok(None);
            };
            let device = keyword(
                section,
                &at,
                "device",
                &["none", "cpu", "nvme"],
                "is not a device DeepSpeed offloads to",
            )?;
            Ok(device
                .filter(|d| *d != "none")
                .map(|_| Read::new(true, place(&at, "device"))))
        };
        let offload_optimizer = offload("offload_optimizer")?;
        let offload_parameters = offload("offload_param")?;

        let from_args = |name: &str| {
            args.map(|a| match name {
                "micro" => a.micro_batch_size.clone(),
                _ => a.accumulation.clone(),
            })
        };
        let micro_batch = resolved_count(
            map,
            prefix,
            "train_micro_batch_size_per_gpu",
            from_args("micro").flatten(),
            "per_device_train_batch_size",
        )?;
        let accumulation = resolved_count(
            map,
            prefix,
            "gradient_accumulation_steps",
            from_args("accumulation").flatten(),
            "gradient_accumulation_steps",
        )?;
        // Only flags the arguments state resolve or contradict (a bare dict may leave them out).
        let flags = args.filter(|a| a.states_precision);
        let bf16 = enabled(
            map,
            prefix,
            "bf16",
            flags.map(|a| (a.bf16, "bf16|bf16_full_eval")),
        )?
        .or(enabled(
            map,
            prefix,
            "bfloat16",
            flags.map(|a| (a.bf16, "bf16")),
        )?);
        let fp16 = enabled(
            map,
            prefix,
            "fp16",
            flags.map(|a| (a.fp16, "fp16|fp16_full_eval")),
        )?;
        let half = match (bf16, fp16) {
            (Some((true, from)), Some((true, other))) => {
                return Err(FileError::new(
                    from,
                    format!("and {other} are both enabled"),
                ))
            }
            (Some((true, from)), _) => Some(Read::new(Precision::Bf16, from)),
            (_, Some((true, from))) => Some(Read::new(Precision::Fp16, from)),
            _ => None,
        };
        let optimizer = match section(map, prefix, "optimizer")? {
            None => None,
            Some(optimizer) => {
                let at = place(&place(prefix, "optimizer"), "type");
                let kind = keyword(
                    optimizer,
                    &place(prefix, "optimizer"),
                    "type",
                    &["Adam", "AdamW"],
                    "is not an optimizer the service models",
                )?;
                let read = match kind {
                    Some("Adam") => Optimizer::Adam,
                    Some(_) => Optimizer::AdamW,
                    None => return Err(FileError::new(at, "not given (known: Adam, AdamW)")),
                };
                // FusedAdam on the GPU; offloaded, DeepSpeedCPUAdam steps on the CPU.
                let implementation = offload_optimizer
                    .is_none()
                    .then(|| Read::new(OptimizerImplementation::Fused, at.clone()));
                Some((Read::new(read, at), implementation))
            }
        };
        let buffers = match zero {
            Some(zero) if stage >= 1 => buffers(zero, &zero_at, stage, hidden_size)?,
            _ => ZeroBuffersRead::default(),
        };
        Ok(DeepSpeed {
            buffers,
            prefix: prefix.to_string(),
            stage: Read::new(strategy, stage_at),
            micro_batch,
            accumulation,
            half,
            offload_optimizer,
            offload_parameters,
            optimizer,
        })
    }
}

/// ZeRO's buffer sizes in `zero_optimization`. Under stages 1 and 2 only the reduce bucket
/// is read (the rest are stage 3's).
fn buffers(
    zero: &Map<String, Value>,
    at: &str,
    stage: u64,
    hidden_size: Option<u64>,
) -> Result<ZeroBuffersRead, FileError> {
    // transformers' `trainer_config_finalize` (and accelerate's `_prepare_deepspeed`).
    let hidden = hidden_size.map(|h| h as f64);
    let square = hidden.map(|h| h * h);
    let read = |key: &str, auto: Option<f64>| -> Result<Option<Read<u64>>, FileError> {
        let place = place(at, key);
        match present(zero, key) {
            None => Ok(None),
            Some(value) if is_auto(value) => match auto {
                Some(n) => Ok(Some(Read::new(
                    (n.floor() as u64).min(MAX_ZERO_ELEMENTS),
                    format!("{place} (auto: the model's hidden size)"),
                ))),
                None => Err(FileError::new(
                    place,
                    "'auto' is resolved from the model's hidden_size: give transformer_config \
                     or a number",
                )),
            },
            // DeepSpeed reads these as int(): 5e8 is a whole number written as a float.
            Some(_) => {
                let n = number(zero, at, key, MAX_ZERO_ELEMENTS as f64)?.expect("present");
                Ok(Some(Read::new(n.floor() as u64, place)))
            }
        }
    };
    let stage3 = stage == 3;
    let only3 = |key: &str, auto: Option<f64>| {
        if stage3 {
            read(key, auto)
        } else {
            Ok(None)
        }
    };
    // Refused where DeepSpeed itself would refuse: no `"auto"` for the other three.
    Ok(ZeroBuffersRead {
        reduce_bucket_size: read("reduce_bucket_size", square)?.map(|r| Read {
            value: r.value.max(1),
            from: r.from,
        }),
        prefetch_bucket_size: only3("stage3_prefetch_bucket_size", square.map(|s| 0.9 * s))?,
        param_persistence_threshold: only3(
            "stage3_param_persistence_threshold",
            hidden.map(|h| 10.0 * h),
        )?,
        max_live_parameters: only3("stage3_max_live_parameters", None)?,
        max_reuse_distance: only3("stage3_max_reuse_distance", None)?,
        sub_group_size: only3("sub_group_size", None)?.map(|r| Read {
            value: r.value.max(1),
            from: r.from,
        }),
    })
}

/// A section of the config (an object), if there.
fn section<'a>(
    map: &'a Map<String, Value>,
    prefix: &str,
    key: &str,
) -> Result<Option<&'a Map<String, Value>>, FileError> {
    match present(map, key) {
        None => Ok(None),
        Some(Value::Object(inner)) => Ok(Some(inner)),
        Some(other) => Err(FileError::new(
            place(prefix, key),
            format!("expected an object, got {}", shown(other)),
        )),
    }
}

fn is_auto(value: &Value) -> bool {
    value
        .as_str()
        .is_some_and(|s| s.eq_ignore_ascii_case("auto"))
}

/// A count that may be `"auto"`: taken from the Trainer's arguments then; a number they
/// contradict is refused.
fn resolved_count(
    map: &Map<String, Value>,
    prefix: &str,
    key: &str,
    from_args: Option<Read<u64>>,
    args_key: &str,
) -> Result<Option<Read<u64>>, FileError> {
    let at = place(prefix, key);
    match present(map, key) {
        None => Ok(None),
        Some(value) if is_auto(value) => match from_args {
            Some(read) => Ok(Some(Read::new(
                read.value,
                format!("{at} (auto: {})", read.from),
            ))),
            None => Err(FileError::new(
                at,
                format!(
                    "'auto' is resolved from the training arguments' {args_key}: give \
                     training_arguments or a number"
                ),
            )),
        },
        Some(_) => {
            let n = count(map, prefix, key, super::MAX_MICRO_BATCH)?.expect("present");
            match from_args {
                Some(read) if read.value != n => Err(FileError::new(
                    at,
                    format!("{n} differs from {} ({})", read.from, read.value),
                )),
                _ => Ok(Some(Read::new(n, at))),
            }
        }
    }
}

/// `bf16.enabled` / `fp16.enabled`: true, false or `"auto"` (the Trainer's flag).
fn enabled(
    map: &Map<String, Value>,
    prefix: &str,
    key: &str,
    from_args: Option<(bool, &str)>,
) -> Result<Option<(bool, String)>, FileError> {
    let Some(section) = section(map, prefix, key)? else {
        return Ok(None);
    };
    let at = place(&place(prefix, key), "enabled");
    match present(section, "enabled") {
        None => Ok(Some((false, at))),
        Some(Value::Bool(b)) => {
            if let Some((flag, name)) = from_args.filter(|(flag, _)| *flag != *b) {
                return Err(FileError::new(
                    at,
                    format!("{b} differs from training_arguments.{name} ({flag})"),
                ));
            }
            Ok(Some((*b, at)))
        }
        Some(value) if is_auto(value) => match from_args {
            Some((flag, name)) => Ok(Some((
                flag,
                format!("{at} (auto: training_arguments.{name})"),
            ))),
            None => Err(FileError::new(
                at,
                "'auto' is resolved from the training arguments' precision flags: give \
                 training_arguments or true/false",
            )),
        },
        Some(other) => Err(FileError::new(
            at,
            format!("expected true, false or 'auto', got {}", shown(other)),
        )),
    }
}
